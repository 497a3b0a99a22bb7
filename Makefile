# Two commands, each usable on a fresh clone with only Python 3.10+ installed:
#   make tour   set up .venv and run the chapter tour (writes ./selfattn-report)
#   make test   set up .venv with the dev extras and run the test suite
# and, for contributors: make docs (API reference + guide in ./site, warnings are errors),
# make lint (ruff check, ruff format --check, mypy --strict: what make test runs before the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned here (users of the library bring their own; pyproject's floor is this release).
TORCH := torch==2.13.0

.PHONY: tour test bench docs lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.tour-installed: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e '.[cli]'
	touch $@

$(VENV)/.dev-installed: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e '.[dev]'
	touch $@

tour: $(VENV)/.tour-installed
	$(VENV)/bin/selfattn tour

# tests/test_report_browser.py opens the tour's HTML in headless Chromium. Outside CI a missing
# browser only skips that test (say so, install nothing); under CI=true it is a failure, so CI
# installs the Debian package `chromium` first (as root).
test: $(VENV)/.dev-installed
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
		|| command -v google-chrome >/dev/null 2>&1 || command -v google-chrome-stable >/dev/null 2>&1; then :; \
	elif [ "$$CI" = "true" ]; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	else \
		echo "note: no Chromium found; tests/test_report_browser.py will skip (install chromium to run it)"; \
	fi
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m mypy --strict src/selfattn
	$(PY) -m pytest -n 2

bench: $(VENV)/.dev-installed
	$(PY) benchmarks/attention.py

# The guide's figures are drawn by the installed selfattn while the site builds (docs/hooks/figures.py).
docs: $(VENV)/.dev-installed
	$(PY) -m mkdocs build --strict

lint: $(VENV)/.dev-installed
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m mypy --strict src/selfattn

clean:
	rm -rf $(VENV) selfattn-report .pytest_cache site dist

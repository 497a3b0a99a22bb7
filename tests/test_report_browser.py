"""The tour's report opened in a real browser: headless Chromium loads it, every image loads,
and a screenshot of it is not blank.

Chromium is installed by ``make test`` when missing (Debian package ``chromium``). Without it
this test skips, except under ``CI=true``, where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from selfattn.tour.runner import run_tour

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

# Appended to a copy of the page: once everything has loaded, record each image's state in the DOM.
IMAGE_PROBE = """<script>
window.addEventListener("load", function () {
  var status = Array.prototype.map.call(document.images, function (img) {
    return (img.complete && img.naturalWidth > 0 ? "ok " : "broken ") + img.getAttribute("src");
  });
  document.body.setAttribute("data-image-status", JSON.stringify(status));
});
</script>"""


@pytest.fixture(scope="module")
def browser():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    message = "headless Chromium is not installed (make test installs it: apt-get install chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("browser") / "report"
    run_tour(out, quick=True, progress=False)
    return out


def run_browser(browser, tmp_path, *args):
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    done = subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={profile}", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def image_status(browser, tmp_path, page):
    """``[("ok" | "broken", src), ...]`` for every <img> of ``page`` after it loaded."""
    probe = page.with_name(f"probe-{page.name}")
    probe.write_text(page.read_text().replace("</body>", IMAGE_PROBE + "</body>"))
    dom = run_browser(browser, tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    found = re.search(r'data-image-status="([^"]*)"', dom)
    assert found, "the page never finished loading"
    entries = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return [tuple(entry.split(" ", 1)) for entry in entries]


def screenshot(browser, tmp_path, page, name):
    shot = tmp_path / name
    run_browser(
        browser, tmp_path, "--window-size=1280,2000", "--hide-scrollbars", f"--screenshot={shot}", page.as_uri()
    )
    import matplotlib.image

    return matplotlib.image.imread(shot)[..., :3]  # (height, width, rgb) floats in [0, 1]


def looks_blank(pixels: np.ndarray) -> bool:
    """Blank: (almost) one colour everywhere, or no coloured pixel at all (figures are coloured)."""
    inked = np.abs(pixels - pixels[0, 0]).max(axis=-1) > 0.1
    coloured = (pixels.max(axis=-1) - pixels.min(axis=-1)) > 0.25
    return inked.mean() < 0.02 or coloured.mean() < 0.005


def test_every_image_of_the_report_loads(browser, report, tmp_path):
    statuses = image_status(browser, tmp_path, report / "report.html")
    assert statuses, "the report has no images"
    assert [src for state, src in statuses if state != "ok"] == []
    assert {src for _, src in statuses} == {f"figures/{p.name}" for p in (report / "figures").glob("*.png")}


def test_a_missing_image_would_be_caught(browser, report, tmp_path):
    page = report / "control.html"
    page.write_text('<html><body><img src="figures/depth.png"><img src="figures/not-there.png"></body></html>')
    assert image_status(browser, tmp_path, page) == [("ok", "figures/depth.png"), ("broken", "figures/not-there.png")]


def test_screenshot_of_the_report_is_not_blank(browser, report, tmp_path):
    pixels = screenshot(browser, tmp_path, report / "report.html", "report.png")
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1000
    assert not looks_blank(pixels)


def test_a_blank_page_would_be_caught(browser, report, tmp_path):
    page = report / "blank.html"
    page.write_text("<html><body></body></html>")
    assert looks_blank(screenshot(browser, tmp_path, page, "blank.png"))

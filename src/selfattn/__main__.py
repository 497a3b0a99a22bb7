"""``python -m selfattn``: the command-line interface."""

from selfattn.cli.main import run

run()

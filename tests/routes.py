"""Test helpers around the dispatcher: run a module with some routes left out, and read the chosen route."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from selfattn.core import dispatch

WINDOW_ROUTES = ("band only", "banded")


@contextlib.contextmanager
def without_routes(*names: str) -> Iterator[None]:
    """Within the block the dispatcher does not consider the routes ``names`` (the same call, another route)."""
    kept = tuple(route for route in dispatch.ROUTES if route.name not in names)
    with mock.patch.object(dispatch, "ROUTES", kept):
        yield

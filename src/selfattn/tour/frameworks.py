"""The MXNet, TensorFlow and Paddle versions of the chapter's ``PositionalEncoding``, measured.

Each page builds P with its own recipe. The recipes are re-run here with NumPy (MXNet,
TensorFlow) or PyTorch (PyTorch, Paddle, whose tensor calls map one to one) in the dtypes each
page uses, since those frameworks are not installed:

* PyTorch and Paddle (the chapter and the frameworks page): angles ``i / 10000^(2j/d)``
  formed in float32, table in float32;
* TensorFlow (frameworks page): angles formed in float32 (``np.arange(..., dtype=np.float32)``),
  stored into a float64 NumPy table;
* MXNet (frameworks page): float32 throughout (MXNet's NumPy default), ``np.cos(X)`` into the
  odd columns like the others;
* the English summary page's MXNet code: as MXNet, but the cosine columns take
  ``X[:, :num_hiddens // 2]``, a slice no other page has, so an odd ``num_hiddens`` works there
  and fails everywhere else.

Each recipe's largest error against the float64 formula is measured at several lengths, and
each is run with an odd d to see whether it builds a table at all.

Shape legend: n positions, d columns.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from selfattn.functional import sinusoidal_table

__all__ = ["FRAMEWORKS_PAGE", "RECIPES", "framework_precision", "odd_width", "tabs_agree"]


def _torch_recipe(n: int, d: int) -> np.ndarray:
    P = torch.zeros((1, n, d))
    X = torch.arange(n, dtype=torch.float32).reshape(-1, 1) / torch.pow(
        10000, torch.arange(0, d, 2, dtype=torch.float32) / d
    )
    P[:, :, 0::2] = torch.sin(X)
    P[:, :, 1::2] = torch.cos(X)
    return P[0].double().numpy()


def _paddle_recipe(n: int, d: int) -> np.ndarray:
    P = torch.zeros((1, n, d))
    X = torch.arange(n, dtype=torch.float32).reshape((-1, 1)) / torch.pow(
        torch.tensor([10000.0]), torch.arange(0, d, 2, dtype=torch.float32) / d
    )
    P[:, :, 0::2] = torch.sin(X)
    P[:, :, 1::2] = torch.cos(X)
    return P[0].double().numpy()


def _tensorflow_recipe(n: int, d: int) -> np.ndarray:
    P = np.zeros((1, n, d))
    X = np.arange(n, dtype=np.float32).reshape(-1, 1) / np.power(10000, np.arange(0, d, 2, dtype=np.float32) / d)
    P[:, :, 0::2] = np.sin(X)
    P[:, :, 1::2] = np.cos(X)
    table: np.ndarray = P[0]
    return table


def _mxnet_angles(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    P = np.zeros((1, n, d), dtype=np.float32)
    X = np.arange(n, dtype=np.float32).reshape(-1, 1) / np.power(
        np.float32(10000), np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    )
    return P, X


def _mxnet_recipe(n: int, d: int) -> np.ndarray:
    P, X = _mxnet_angles(n, d)
    P[:, :, 0::2] = np.sin(X)
    P[:, :, 1::2] = np.cos(X)
    table: np.ndarray = P[0].astype(np.float64)
    return table


def _summary_recipe(n: int, d: int) -> np.ndarray:
    P, X = _mxnet_angles(n, d)
    P[:, :, 0::2] = np.sin(X)
    P[:, :, 1::2] = np.cos(X[:, : d // 2])  # the summary page's slice
    table: np.ndarray = P[0].astype(np.float64)
    return table


#: Each page's recipe, ``(n, d) -> P`` as float64 NumPy.
RECIPES: dict[str, Callable[[int, int], np.ndarray]] = {
    "pytorch": _torch_recipe,
    "mxnet": _mxnet_recipe,
    "tensorflow": _tensorflow_recipe,
    "paddle": _paddle_recipe,
    "summary page (mxnet)": _summary_recipe,
}


#: The four code tabs of the frameworks page (the summary page's recipe is its own page's).
FRAMEWORKS_PAGE = ("mxnet", "pytorch", "tensorflow", "paddle")


def tabs_agree(num_hiddens: int = 32, lengths: tuple[int, ...] = (60, 10000)) -> dict[str, object]:
    """Largest difference between any two of the frameworks page's tabs' tables, at each length."""
    gaps = []
    for n in lengths:
        tables = [RECIPES[name](n, num_hiddens) for name in FRAMEWORKS_PAGE]
        gaps.append(max(float(np.abs(a - b).max()) for a in tables for b in tables))
    return {"num_hiddens": num_hiddens, "lengths": list(lengths), "max_difference": gaps}


def framework_precision(num_hiddens: int = 32, lengths: tuple[int, ...] = (60, 1000, 10000)) -> dict[str, object]:
    """Largest ``|P - P_exact|`` of each recipe at each length (exact: float64 angles)."""
    errors: dict[str, list[float]] = {name: [] for name in RECIPES}
    for n in lengths:
        exact = sinusoidal_table(n, num_hiddens, dtype=torch.float64).numpy()
        for name, recipe in RECIPES.items():
            errors[name].append(float(np.abs(recipe(n, num_hiddens) - exact).max()))
    ours = [
        float(
            np.abs(
                sinusoidal_table(n, num_hiddens).double().numpy()
                - sinusoidal_table(n, num_hiddens, dtype=torch.float64).numpy()
            ).max()
        )
        for n in lengths
    ]
    return {"num_hiddens": num_hiddens, "lengths": list(lengths), "errors": errors, "selfattn": ours}


def odd_width(num_hiddens: int = 33, num_positions: int = 60) -> dict[str, dict[str, object]]:
    """Run every recipe with an odd d: which build a table, and how far it is from selfattn's."""
    if num_hiddens % 2 == 0:
        raise ValueError(f"num_hiddens must be odd for this check, got {num_hiddens}")
    exact = sinusoidal_table(num_positions, num_hiddens, dtype=torch.float64).numpy()
    outcome: dict[str, dict[str, object]] = {}
    for name, recipe in RECIPES.items():
        try:
            table = recipe(num_positions, num_hiddens)
        except (RuntimeError, ValueError) as error:
            outcome[name] = {"builds": False, "error": str(error).splitlines()[0][:160]}
        else:
            outcome[name] = {"builds": True, "max_error": float(np.abs(table - exact).max())}
    return outcome

"""TorchScript is not supported: selfattn's modules say so, and name what works instead."""

from __future__ import annotations

from typing import NoReturn

__all__ = ["NotScriptable"]


class NotScriptable:
    """Mixin of selfattn's modules: ``torch.jit.script`` stops with one clear error, not a TorchScript traceback.

    TorchScript (deprecated since torch 2.5) cannot type these modules' forwards: keyword
    options of Python types, encodings chosen at run time, ``torch.func`` calls. Before it
    compiles anything, ``torch.jit.script`` calls ``__prepare_scriptable__`` on the module and on
    each of its submodules, so a user's model holding one of these modules gets the error too.
    ``torch.compile`` and ``torch.export`` take them (``tests/test_dynamic_shapes.py``).
    """

    def __prepare_scriptable__(self) -> NoReturn:
        raise NotImplementedError(
            f"torch.jit.script does not support selfattn's {type(self).__name__}: TorchScript is deprecated "
            "and cannot type its forward. Use torch.compile(module) to compile it, or "
            "torch.export.export(module, args) for a graph to save and deploy."
        )

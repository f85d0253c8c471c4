"""treespec: lossless multi-draft token-tree speculative decoding on PyTorch + Hugging Face.

The public names load on first use (PEP 562): ``import treespec`` imports no torch, so that
``python -m treespec --help`` answers at once; ``treespec.generate``, ``treespec.TokenTree`` etc. import
their module when first read.
"""

from __future__ import annotations

import importlib
import sys
import types

#: public name -> the module (relative to this package) that defines it
_HOMES = {
    "Draft": ".drafting.base", "Drafter": ".drafting.base", "DraftState": ".drafting.base",
    "NoDrafter": ".drafting.base", "NgramConfig": ".drafting.ngram", "NgramDrafter": ".drafting.ngram",
    "GenerationConfig": ".generate", "GenerationResult": ".generate", "generate": ".generate",
    "SamplingConfig": ".sampling", "TokenTree": ".tree", "ShapeDrafter": ".trees.grow",
    "TreeShape": ".trees.shape", "VERIFIERS": ".verify", "VerifyResult": ".verify",
}

__all__ = [
    "Draft", "Drafter", "DraftState", "NoDrafter", "ShapeDrafter", "TreeShape", "NgramConfig",
    "NgramDrafter", "GenerationConfig", "GenerationResult", "generate", "SamplingConfig", "TokenTree",
    "VERIFIERS", "VerifyResult",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package module: importing the submodule ``treespec.generate`` binds it on the package, where the
    public name ``treespec.generate`` is the function (as when this package imported it eagerly)."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.generate":
            value = value.generate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

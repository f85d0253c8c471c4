"""treespec: lossless multi-draft token-tree speculative decoding on PyTorch + Hugging Face."""

from .drafting.base import Draft, Drafter, DraftState, NoDrafter
from .trees.static import ModelDrafter, StaticTreeShape
from .drafting.ngram import NgramConfig, NgramDrafter
from .generate import GenerationConfig, GenerationResult, generate
from .sampling import SamplingConfig
from .tree import TokenTree
from .verify import VERIFIERS, VerifyResult

__all__ = [
    "Draft", "Drafter", "DraftState", "NoDrafter", "ModelDrafter", "StaticTreeShape", "NgramConfig",
    "NgramDrafter", "GenerationConfig", "GenerationResult", "generate", "SamplingConfig", "TokenTree",
    "VERIFIERS", "VerifyResult",
]
__version__ = "0.1.0"

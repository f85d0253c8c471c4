"""treespec: lossless multi-draft token-tree speculative decoding on PyTorch + Hugging Face."""

from .drafting.base import Draft, Drafter, DraftState, NoDrafter
from .drafting.ngram import NgramConfig, NgramDrafter
from .generate import GenerationConfig, GenerationResult, generate
from .sampling import SamplingConfig
from .tree import TokenTree
from .trees.grow import ShapeDrafter
from .trees.shape import TreeShape
from .verify import VERIFIERS, VerifyResult

__all__ = [
    "Draft", "Drafter", "DraftState", "NoDrafter", "ShapeDrafter", "TreeShape", "NgramConfig",
    "NgramDrafter", "GenerationConfig", "GenerationResult", "generate", "SamplingConfig", "TokenTree",
    "VERIFIERS", "VerifyResult",
]
__version__ = "0.1.0"

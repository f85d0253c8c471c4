"""Distilling EAGLE-style draft heads from a target: corpus building, training, evaluation.

CLI: ``python -m treespec.distill {build-corpus, train, evaluate} ...`` (see :mod:`treespec.distill.cli`).
"""

from .corpus import CorpusOptions, build_corpus
from .train import TrainConfig, train

__all__ = ["CorpusOptions", "build_corpus", "TrainConfig", "train"]

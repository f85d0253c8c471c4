"""Distilling draft components from a target: corpus building, EAGLE-style head training, Medusa-style
decoding heads, evaluation.

CLI: ``python -m treespec.distill {build-corpus, train, medusa, evaluate, export} ...``
(see :mod:`treespec.distill.cli`).
"""

from .corpus import CorpusOptions, build_corpus
from .medusa import MedusaTrainConfig, train_medusa
from .train import TrainConfig, train

__all__ = ["CorpusOptions", "build_corpus", "MedusaTrainConfig", "TrainConfig", "train", "train_medusa"]

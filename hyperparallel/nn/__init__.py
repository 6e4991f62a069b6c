"""Drop-in fused modules for HuggingFace Qwen3 and Qwen3-MoE (see ``modules``)."""

from hyperparallel.nn import modules

__all__ = ["modules"]

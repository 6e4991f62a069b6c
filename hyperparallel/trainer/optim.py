"""Optimizers and the learning-rate schedule of a training run."""

from __future__ import annotations

import math

import torch
from torch import nn

from hyperparallel.trainer.config import Config


def build(model: nn.Module, cfg: Config) -> dict[str, torch.optim.Optimizer]:
    """``{"muon": ..., "adamw": ...}`` (``optim.name: muon``) or ``{"adamw": ...}`` (``adamw``).

    Muon takes the hidden weight matrices and expert stacks, AdamW the embeddings,
    the output head, norms and biases (:func:`hyperparallel.optim.muon_with_adamw`).
    """
    o = cfg.optim
    betas = (o.betas[0], o.betas[1])
    if o.name == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return {"adamw": torch.optim.AdamW(params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)}
    from hyperparallel.optim import muon_with_adamw

    muon, adamw = muon_with_adamw(
        model, lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum, nesterov=o.nesterov,
        ns_steps=o.ns_steps, betas=betas, adamw_eps=o.eps,
    )
    return {"muon": muon, "adamw": adamw}


def lr_at(cfg: Config, step: int) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up, then cosine to ``lr * min_lr_ratio``."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total - o.warmup_steps - 1)
    progress = min(1.0, (step - o.warmup_steps) / span)
    floor = o.lr * o.min_lr_ratio
    return floor + (o.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizers: dict[str, torch.optim.Optimizer], lr: float) -> None:
    """Give every parameter group of every optimizer the learning rate ``lr``."""
    for optimizer in optimizers.values():
        for group in optimizer.param_groups:
            group["lr"] = lr


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """The global gradient norm over all ranks, clipped to ``max_norm`` (0: measure only)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)

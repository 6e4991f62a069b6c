"""The optimizers of the side-by-side benchmark: the protocol's settings and the Muon / AdamW split.

Both systems and the single-process reference split the model with the package's own rule,
``hp.optim.muon_param_split`` (Muon for the hidden weight matrices, 2-D and 3-D expert stacks;
AdamW for embeddings, the output head and vectors), and run torch's AdamW on the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

from hyperparallel.optim import muon_param_split


@dataclass(frozen=True)
class OptimHparams:
    """The protocol's optimizer settings; NS coefficients and eps are ``torch.optim.Muon``'s."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    eps: float = EPS
    adjust_lr_fn: str = "match_rms_adamw"
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 10

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup_steps`` optimizer steps (0-based ``step``), then constant."""
        return self.lr * min(1.0, (step + 1) / self.warmup_steps)

    def muon_defaults(self) -> dict[str, Any]:
        """Keyword arguments in ``torch.optim.Muon``'s spelling."""
        return {
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "ns_coefficients": self.ns_coefficients,
            "eps": self.eps,
            "ns_steps": self.ns_steps,
            "adjust_lr_fn": self.adjust_lr_fn,
        }


def optimizers(
    model: nn.Module, hparams: OptimHparams, make_muon: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> tuple[torch.optim.Optimizer, torch.optim.AdamW]:
    """``(make_muon(muon_params), AdamW(adamw_params))`` by ``hp.optim.muon_param_split``'s rule."""
    muon_params, adamw_params = muon_param_split(model)
    adamw = torch.optim.AdamW(
        adamw_params, lr=hparams.lr, betas=hparams.adamw_betas, weight_decay=hparams.weight_decay
    )
    return make_muon(muon_params), adamw


def as_matrices(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensor``'s matrices: one for ``(A, B)``, ``E`` for ``(E, A, B)``.

    They are views (so in-place updates reach ``tensor``) when ``tensor`` is contiguous, which
    parameters and optimizer buffers are; a non-contiguous gradient is only read, so a copy is
    fine there.
    """
    return tensor.reshape(-1, *tensor.shape[-2:]).unbind(0)


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr

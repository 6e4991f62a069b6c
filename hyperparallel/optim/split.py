"""The usual split of a model between Muon and AdamW."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hyperparallel.optim.muon import Muon

# Parameter-name fragments that stay with AdamW even when they are matrices:
# the input embedding and the output head (HF names).
DEFAULT_ADAMW_NAMES = ("embed_tokens", "lm_head")


def muon_param_split(
    model: nn.Module, adamw_names: Sequence[str] = DEFAULT_ADAMW_NAMES
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon parameters, AdamW parameters) of ``model``.

    Muon gets the hidden weight matrices: 2-D parameters, and 3-D stacks of
    expert matrices. AdamW gets the rest: embeddings (any ``nn.Embedding``,
    and names containing one of ``adamw_names``, so the output head too),
    norms and biases. Parameters that do not require grad are left out.

    Example::

        muon_params, adamw_params = muon_param_split(model)
        opts = [Muon(muon_params, lr=2e-3), torch.optim.AdamW(adamw_params, lr=2e-3)]
    """
    embeddings = {
        id(p)
        for module in model.modules()
        if isinstance(module, nn.Embedding)
        for p in module.parameters(False)
    }
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden = id(p) not in embeddings and not any(fragment in name for fragment in adamw_names)
        (muon if hidden and p.ndim in (2, 3) else adamw).append(p)
    return muon, adamw


def muon_with_adamw(
    model: nn.Module,
    *,
    lr: float = 2e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = "match_rms_adamw",
    betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_names: Sequence[str] = DEFAULT_ADAMW_NAMES,
) -> tuple[Muon, torch.optim.AdamW]:
    """Muon for the hidden matrices and AdamW for the rest (:func:`muon_param_split`), both
    with ``lr`` and ``weight_decay``; the defaults are the benchmark protocol's
    (``match_rms_adamw`` lets Muon reuse AdamW's learning rate).

    Example::

        muon, adamw = muon_with_adamw(model, lr=2e-3)
        loss.backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    """
    muon_params, adamw_params = muon_param_split(model, adamw_names)
    muon = Muon(
        muon_params,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
    adamw = torch.optim.AdamW(adamw_params, lr=lr, betas=betas, eps=adamw_eps, weight_decay=weight_decay)
    return muon, adamw

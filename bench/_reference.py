"""The single-process reference run that both systems' losses are checked against.

Full tensors, no sharding: ``torch.optim.Muon``'s own functional update on every matrix (each
expert of a 3-D stack as its own matrix) and ``torch.optim.AdamW``, on the same initial weights
and tokens as the distributed runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from _optim import OptimHparams, as_matrices, optimizers
from _spec import RunSpec, SyntheticTokens, build_model, spawn_ranks, weights_fingerprint
from _timing import RankResult, StepTimer, peak_rss_bytes, summarize, train_steps
from torch import nn
from torch.optim._muon import muon


class MatrixMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` on full (unsharded) tensors, extended to stacks of matrices.

    ``torch.optim.Muon`` rejects anything but 2-D parameters, while Qwen3-MoE in transformers 5
    stores each layer's experts as 3-D tensors. This hands every expert matrix, as a view into
    the parameter, its gradient and its momentum buffer, to torch's own functional ``muon`` --
    the function ``torch.optim.Muon.step`` calls -- so a 2-D parameter gets bit-for-bit the
    ``torch.optim.Muon`` update and each expert gets the update it would get as a separate
    parameter (including ``adjust_lr_fn`` seeing the expert's own shape).
    """

    def __init__(self, params: Iterable[nn.Parameter], hparams: OptimHparams) -> None:
        super().__init__(params, hparams.muon_defaults())

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                if not param.is_contiguous():
                    raise ValueError("MatrixMuon updates matrices in place: needs contiguous params")
                params.extend(as_matrices(param))
                grads.extend(as_matrices(param.grad))
                bufs.extend(as_matrices(state["momentum_buffer"]))
            muon(
                params,
                grads,
                bufs,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                ns_coefficients=group["ns_coefficients"],
                eps=group["eps"],
                ns_steps=group["ns_steps"],
                adjust_lr_fn=group["adjust_lr_fn"],
                has_complex=False,
            )


REFERENCE_SYSTEM = "reference-single-process"


def _reference_rank(
    rank: int, world_size: int, spec: RunSpec, hparams: OptimHparams, split_like_ranks: bool
) -> RankResult:
    model = build_model(spec.config_path, spec.seed)
    fingerprint = weights_fingerprint(model)
    muon_optimizer, adamw_optimizer = optimizers(model, hparams, lambda params: MatrixMuon(params, hparams))
    tokens = SyntheticTokens(model.config.vocab_size, spec.seq_len, spec.seed)

    def micro_batches(step: int) -> list[torch.Tensor]:
        if split_like_ranks:
            return [tokens.batch(step, spec, dp_rank) for dp_rank in range(spec.nproc)]
        return [tokens.global_batch(step, spec)]

    records = train_steps(
        model,
        muon_optimizer,
        adamw_optimizer,
        micro_batches,
        spec.steps,
        hparams,
        StepTimer(),
    )
    return RankResult(records, peak_rss_bytes(), fingerprint)


def run_reference(
    spec: RunSpec, hparams: OptimHparams | None = None, *, split_like_ranks: bool = True
) -> dict[str, Any]:
    """Train the same model on the same global batches in one process, without any sharding.

    Initial weights, tokens and optimizer math are those of the distributed runs (full-tensor
    ``torch.optim.Muon`` per matrix, ``torch.optim.AdamW``). With ``split_like_ranks`` the step
    runs forward/backward once per data-parallel rank's micro-batch and accumulates, which gives
    a data-parallel run's gradients exactly, so its losses should match to the last bits. Without
    it the step is one forward over the concatenated global batch: mathematically the same, but
    reductions over 8 instead of 4 sequences round differently, and Muon's bf16 Newton-Schulz
    amplifies that step after step -- the size of ordinary floating-point noise between two
    correct implementations. The timings are one core doing all ranks' work; not comparable.
    """
    results = spawn_ranks(_reference_rank, 1, spec, hparams or OptimHparams(), split_like_ranks)
    batching = "per-rank micro-batches" if split_like_ranks else "global batch"
    return summarize(REFERENCE_SYSTEM, spec, results, batching=batching, data_parallel_ranks=spec.nproc)

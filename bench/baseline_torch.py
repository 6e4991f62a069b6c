"""PyTorch FSDP2 + Muon: the baseline of the side-by-side benchmark (``../shared/bench/README.md``).

``fully_shard`` on every decoder layer and on the root, Gloo, stock HF modules, fp32. Muon is
applied the way FSDP2 users do it today: for each Muon parameter every rank gathers the whole
(momentum-corrected) gradient with ``DTensor.full_tensor()``, runs ``torch.optim.Muon``'s
Newton-Schulz on every matrix of it (one per expert for 3-D expert tensors), and applies only the
rows of its own shard. AdamW runs on the sharded DTensors directly.

The strong peer (``--muon owner``, :class:`OwnerMuon`) is the same FSDP2 setup with Muon as its
best users write it: experts whose rows a rank holds whole are orthogonalised there, every other
matrix once by a cost-balanced owner that broadcasts the bf16 result; its losses equal the
baseline's bit for bit. Both count their work per rank (Gloo bytes, Newton-Schulz matrices).

Run ``python bench/baseline_torch.py --config qwen3-moe-small --steps 10 --nproc 2``; it spawns
its own ranks and prints one JSON line. ``--check-single`` also runs the single-process reference
and checks that the per-step losses agree. :func:`run_baseline` is the same run as a function,
for ``bench/headline.py`` to alternate with hyperparallel in one invocation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2 takes custom collectives through the public ``set_custom_all_gather`` /
# ``set_custom_reduce_scatter``; subclassing its default implementations (private) is the least
# intrusive way to time exactly the collective calls and nothing else.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

# isort: split
# bench/ is not a package: its scripts run from it and import their shared helpers directly.
from _optim import OptimHparams, as_matrices, optimizers
from _reference import REFERENCE_SYSTEM, run_reference
from _spec import (
    RunSpec,
    add_run_args,
    build_model,
    run_spec_from_args,
    spawn_ranks,
    weights_fingerprint,
)
from _timing import RankResult, StepTimer, max_abs_diff, summarize, train_rank

SYSTEM = "torch-fsdp2-muon"
STRONG_SYSTEM = "torch-fsdp2-owner-muon"
SYSTEMS = {"gathered": SYSTEM, "owner": STRONG_SYSTEM}
# Default loss tolerance for --check-single (the brief's ~1e-5 on fp32 losses around 8).
CHECK_TOL = 1e-5


class _Timed:
    """Charges the time the caller spends in an FSDP2 collective to ``timer``, as ``kind``.

    On CPU FSDP2 issues its collectives synchronously (``async_op=False``; its streams are no-ops
    on CPU), so the time inside the call is the time the rank waits on communication, including
    waiting for the slower rank to arrive.
    """

    kind: str

    def __init__(self, timer: StepTimer) -> None:
        super().__init__()
        self._timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 *args: Any, **kwargs: Any) -> dist.Work | None:
        self._timer.count("gloo_bytes", self.bytes_moved(output_tensor, input_tensor, group.size()))
        with self._timer.comm(self.kind):
            return super().__call__(output_tensor, input_tensor, group, *args, **kwargs)


class TimedAllGather(_Timed, DefaultAllGather):
    """FSDP2's default all-gather, timed."""

    kind = "fsdp_all_gather"

    @staticmethod
    def bytes_moved(output: torch.Tensor, input: torch.Tensor, world: int) -> int:
        return all_gather_bytes(input.nbytes, world)


class TimedReduceScatter(_Timed, DefaultReduceScatter):
    """FSDP2's default gradient reduce-scatter, timed."""

    kind = "fsdp_reduce_scatter"

    @staticmethod
    def bytes_moved(output: torch.Tensor, input: torch.Tensor, world: int) -> int:
        # Sends its partial sums of the peers' rows, receives theirs of its own rows.
        return 2 * (input.nbytes - output.nbytes)


# Gloo's bytes moved, per rank: what the rank sends plus what it receives in the collective's
# direct form (every peer's data straight to where it is needed), independent of Gloo's ring or
# tree. Summed over ranks it counts each transfer twice (once sent, once received).
def all_gather_bytes(shard_bytes: int, world: int) -> int:
    """Sends its shard to each peer, receives each peer's shard."""
    return 2 * (world - 1) * shard_bytes


def broadcast_bytes(full_bytes: int, world: int, is_source: bool) -> int:
    """The source sends the tensor to each peer; every other rank receives it once."""
    return (world - 1) * full_bytes if is_source else full_bytes


def _momentum_update(state: dict, grad: torch.Tensor, group: dict) -> torch.Tensor:
    """torch.optim.Muon's momentum buffer and Nesterov correction, on the rows ``grad`` holds
    (elementwise, so a shard's rows need no gather)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


class GatheredMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for FSDP2-sharded parameters, gathering every update in full.

    Per parameter: the momentum buffer is a DTensor sharded like the parameter (momentum and the
    Nesterov correction are elementwise, so they need no gather and the buffer costs 1/world of
    a full copy); the Nesterov update is gathered with ``full_tensor()``; torch's own
    ``_zeropower_via_newtonschulz`` orthogonalises each of its matrices -- all experts of a 3-D
    tensor, as a generic FSDP2 Muon does, although this rank keeps only its own experts' rows --
    and the rank applies its rows with torch's decoupled weight decay and ``_adjust_lr`` of the
    matrix shape. Numerically this is :class:`_reference.MatrixMuon` on the full tensors.
    """

    def __init__(self, params: Iterable[nn.Parameter], hparams: OptimHparams, timer: StepTimer) -> None:
        super().__init__(params, hparams.muon_defaults())
        self._timer = timer

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr = group["lr"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not isinstance(param, DTensor):
                    raise TypeError("GatheredMuon expects FSDP2-sharded (DTensor) parameters")
                update = _momentum_update(self.state[param], param.grad, group)
                self._timer.count("gloo_bytes", all_gather_bytes(update.to_local().nbytes, dist.get_world_size()))
                with self._timer.comm("muon_gather"):
                    full_update = update.full_tensor()
                # NS returns bf16: keep it so, as torch.optim.Muon adds the bf16 result directly.
                ortho = torch.empty(full_update.shape, dtype=torch.bfloat16)
                for out, matrix in zip(as_matrices(ortho), as_matrices(full_update), strict=True):
                    out.copy_(
                        _zeropower_via_newtonschulz(
                            matrix, group["ns_coefficients"], group["ns_steps"], group["eps"]
                        )
                    )
                    self._timer.count("ns_matrices", 1)
                # src_data_rank=None: every rank holds the whole result, so sharding it is a
                # local slice, not a scatter.
                own_rows = distribute_tensor(ortho, param.device_mesh, param.placements, src_data_rank=None)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(
                    own_rows,
                    alpha=-_adjust_lr(lr, group["adjust_lr_fn"], full_update.shape[-2:]),
                )



def owner_assignment(costs: list[int], world_size: int) -> list[int]:
    """Owner rank of each matrix: greedy longest-processing-time on Newton-Schulz cost.

    Largest cost first (ties by index), each to the least-loaded rank (ties to the lowest rank),
    so every rank computes the same assignment without talking.
    """
    load = [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[index] = min(range(world_size), key=lambda r: (load[r], r))
        load[owners[index]] += costs[index]
    return owners


def ns_cost(shape: torch.Size) -> int:
    """Newton-Schulz cost of one ``(m, n)`` matrix, ~ m*n*min(m, n), times the stack's matrices."""
    m, n = shape[-2:]
    stack = shape[0] if len(shape) == 3 else 1
    return stack * m * n * min(m, n)


class OwnerMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for FSDP2-sharded parameters, each matrix orthogonalised exactly once.

    The strong PyTorch peer (HyperParallel's own Muon, torchtitan's DistMuon): a 3-D expert stack
    whose experts this rank holds whole (``Shard(0)`` with E divisible by the world size) is
    orthogonalised on this rank's rows, with no communication; every other Muon parameter has one
    owner rank (:func:`owner_assignment`), which gathers the full update, runs Newton-Schulz and
    broadcasts the bf16 result, of which every rank keeps its rows. Momentum, weight decay and
    ``_adjust_lr`` are :class:`GatheredMuon`'s, and Newton-Schulz of the same full matrix is
    deterministic, so the losses equal GatheredMuon's bit for bit. Its work (Gloo bytes,
    Newton-Schulz matrices) is counted on ``timer``.
    """

    def __init__(self, params: Iterable[nn.Parameter], hparams: OptimHparams, timer: StepTimer) -> None:
        super().__init__(params, hparams.muon_defaults())
        self._timer = timer
        world = dist.get_world_size()
        self._local: set[int] = set()
        shared = []
        for group in self.param_groups:
            for param in group["params"]:
                if _experts_local(param, world):
                    self._local.add(id(param))
                else:
                    shared.append(param)
        owners = owner_assignment([ns_cost(p.shape) for p in shared], world)
        self._owner = {id(p): owner for p, owner in zip(shared, owners, strict=True)}

    def _orthogonalise(self, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        # NS returns bf16: kept so, as torch.optim.Muon adds the bf16 result directly.
        ortho = torch.empty(update.shape, dtype=torch.bfloat16)
        for out, matrix in zip(as_matrices(ortho), as_matrices(update), strict=True):
            out.copy_(_zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"]))
            self._timer.count("ns_matrices", 1)
        return ortho

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        rank, world = dist.get_rank(), dist.get_world_size()
        for group in self.param_groups:
            lr = group["lr"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = _momentum_update(self.state[param], param.grad, group)
                if id(param) in self._local:
                    own_rows = self._orthogonalise(update.to_local(), group)
                else:
                    owner = self._owner[id(param)]
                    # full_tensor() is an all-gather, more than the owner needs; Gloo's gather
                    # wants equal shard sizes, which torch.chunk's uneven rows do not give.
                    self._timer.count("gloo_bytes", all_gather_bytes(update.to_local().nbytes, world))
                    with self._timer.comm("muon_gather"):
                        full_update = update.full_tensor()
                    if rank == owner:
                        ortho = self._orthogonalise(full_update, group)
                    else:
                        ortho = torch.empty(full_update.shape, dtype=torch.bfloat16)
                    self._timer.count("gloo_bytes", broadcast_bytes(ortho.nbytes, world, rank == owner))
                    with self._timer.comm("muon_broadcast"):
                        dist.broadcast(ortho, src=owner)
                    own_rows = distribute_tensor(
                        ortho, param.device_mesh, param.placements, src_data_rank=None
                    ).to_local()
                param.to_local().mul_(1 - lr * group["weight_decay"])
                param.to_local().add_(own_rows, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape[-2:]))


def _experts_local(param: nn.Parameter, world_size: int) -> bool:
    """Whether this rank holds whole experts of a 3-D stack (Shard(0), E divisible by world)."""
    return (
        isinstance(param, DTensor)
        and param.ndim == 3
        and param.shape[0] % world_size == 0
        and all(p == Shard(0) for p in param.placements)
    )


MUONS = {"gathered": GatheredMuon, "owner": OwnerMuon}


def _shard(model: nn.Module, world_size: int, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy) -> None:
    """``fully_shard`` every decoder layer, then the root (embedding, final norm, lm_head)."""
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)


def _time_fsdp_collectives(model: nn.Module, timer: StepTimer) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(TimedAllGather(timer))
            module.set_custom_reduce_scatter(TimedReduceScatter(timer))


def _baseline_rank(
    rank: int,
    world_size: int,
    spec: RunSpec,
    hparams: OptimHparams,
    reshard_after_forward: bool,
    muon: str,
    splits: int,
) -> RankResult:
    dist.init_process_group("gloo")
    try:
        model = build_model(spec.config_path, spec.seed)
        fingerprint = weights_fingerprint(model)
        fingerprints: list[str | None] = [None] * world_size
        dist.all_gather_object(fingerprints, fingerprint)
        if len(set(fingerprints)) != 1:
            raise RuntimeError(f"rank {rank}: seeded init differs across ranks: {fingerprints}")

        _shard(model, world_size, reshard_after_forward, spec.mp_policy())
        timer = StepTimer()
        _time_fsdp_collectives(model, timer)
        muon_opt, adamw = optimizers(model, hparams, lambda params: MUONS[muon](params, hparams, timer))
        return train_rank(model, muon_opt, adamw, spec, hparams, timer, fingerprint, splits)
    finally:
        dist.destroy_process_group()


def run_baseline(
    spec: RunSpec,
    reshard_after_forward: bool = True,
    hparams: OptimHparams | None = None,
    muon: str = "gathered",
    splits: int = 1,
) -> dict[str, Any]:
    """One FSDP2 + Muon run over ``spec.nproc`` freshly spawned ranks; the protocol's report.

    ``muon``: ``"gathered"`` (:class:`GatheredMuon`, the baseline) or ``"owner"``
    (:class:`OwnerMuon`, the strong peer). ``splits``: see :func:`_timing.train_rank` (only
    ``bench/loss_gap.py`` changes it).
    """
    results = spawn_ranks(
        _baseline_rank, spec.nproc, spec, hparams or OptimHparams(), reshard_after_forward, muon, splits
    )
    return summarize(SYSTEMS[muon], spec, results, reshard_after_forward=reshard_after_forward)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(parser)
    parser.add_argument(
        "--reshard-after-forward",
        type=_parse_bool,
        default=True,
        metavar="{true,false}",
        help="FSDP2 reshard_after_forward for the layers and the root (default: true)",
    )
    parser.add_argument(
        "--muon", choices=sorted(MUONS), default="gathered",
        help="gathered: every rank orthogonalises every matrix (the baseline); owner: each once (the strong peer)",
    )
    parser.add_argument(
        "--check-single",
        action="store_true",
        help="also train the single-process full-tensor reference (per-rank micro-batches and "
        "global batch) and check the per-step losses against the former",
    )
    parser.add_argument(
        "--tol", type=float, default=CHECK_TOL, help="max |loss diff| allowed by --check-single"
    )
    args = parser.parse_args(argv)
    spec = run_spec_from_args(args)

    report = run_baseline(spec, args.reshard_after_forward, muon=args.muon)
    print(json.dumps(report), flush=True)
    if not args.check_single:
        return 0

    # The per-rank form must agree to the last bits; the global-batch form shows how far two
    # correct implementations drift apart through reassociation alone (reported, not checked).
    exact = run_reference(spec, split_like_ranks=True)
    global_batch = run_reference(spec, split_like_ranks=False)
    for reference in (exact, global_batch):
        print(json.dumps(reference), flush=True)
    diff = max_abs_diff(report["losses"], exact["losses"])
    same_init = report["weights_fingerprint"] == exact["weights_fingerprint"]
    ok = same_init and diff <= args.tol
    print(
        json.dumps(
            {
                "check": f"{report['system']} vs {REFERENCE_SYSTEM}",
                "same_initial_weights": same_init,
                "max_abs_loss_diff": diff,
                "tol": args.tol,
                "ok": ok,
                "global_batch_max_abs_loss_diff": max_abs_diff(report["losses"], global_batch["losses"]),
            }
        ),
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

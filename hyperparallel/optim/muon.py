"""hp.optim.Muon: torch.optim.Muon's numerics, each matrix orthogonalised once per job.

The class holds torch's optimizer state (``state[p]["momentum_buffer"]``, a
DTensor shard for a DTensor parameter) and hands each step to one C++ call;
csrc/optim/muon.cpp has the plan, the shared buffer and the math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import ParamsT

import hyperparallel.comm as hp_comm
from hyperparallel import _C

_ADJUST_LR = {
    None: _C.AdjustLr.ORIGINAL,
    "original": _C.AdjustLr.ORIGINAL,
    "match_rms_adamw": _C.AdjustLr.MATCH_RMS_ADAMW,
}


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon with the same arguments and numerics, distributed without duplicated work.

    Takes matrices (2-D) and stacks of expert matrices (3-D, one matrix per
    expert: each gets Newton–Schulz and the learning-rate adjustment of its
    own shape). Plain tensors are updated in this process, exactly as
    torch.optim.Muon updates them (bit for bit on the same machine).
    DTensor parameters sharded by FSDP (``Shard(0)`` on a 1-D mesh) or HSDP
    (``(Replicate(), Shard(0))`` on a 2-D mesh) keep their momentum sharded,
    and each matrix's Newton–Schulz runs on exactly one rank of the whole
    job: a cost-balanced owner reads the full momentum-updated matrix from
    node-shared memory, and every rank applies its own rows of the result.
    Needs ``hp.comm`` (started on first use) and the same calls, in the same
    order, on every rank.

    Example::

        import hyperparallel.optim
        opt = hyperparallel.optim.Muon(model.layers.parameters(), lr=2e-3, adjust_lr_fn="match_rms_adamw")
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        # torch.optim.Muon checks its options before its parameters: the same bad
        # input raises the same exception type as there.
        _check_options(defaults)
        super().__init__(params, defaults)  # checks each group through add_param_group
        self._reset_plan()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and pickle carry torch's state (param groups, momentum), not
        # the C++ plan: the copy builds its own at its first step.
        super().__setstate__(state)
        self._reset_plan()

    def _reset_plan(self) -> None:
        self._plan: _C.Muon | None = None
        self._plan_key: tuple = ()  # ids of the planned parameters, with their Newton–Schulz options
        self._plan_params: list[torch.Tensor] = []  # held, so that no other tensor takes one of those ids

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # fills in the defaults the checks read
        try:
            _check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step for every parameter that has a gradient; collective over the job's ranks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, grads, buffers, options, ns = [], [], [], [], []
        for group in self.param_groups:
            step_options = _C.MuonStepOptions(
                lr=float(group["lr"]),
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                adjust_lr=_ADJUST_LR[group["adjust_lr_fn"]],
            )
            group_ns = (*group["ns_coefficients"], group["ns_steps"], group["eps"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError("hp.optim.Muon does not support complex parameters")
                if p.grad.is_sparse:
                    raise RuntimeError("hp.optim.Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                if p.numel() == 0:
                    continue  # nothing to update, as with torch (which divides by zero on an empty column)
                params.append(p)
                grads.append(p.grad)
                buffers.append(state["momentum_buffer"])
                options.append(step_options)
                ns.append(group_ns)
        if params:
            plan = self._plan_for(params, ns)
            plan.step(
                [_local(p) for p in params], [_local(g) for g in grads], [_local(b) for b in buffers], options
            )
        return loss

    @property
    def balance(self) -> float:
        """Largest over mean Newton–Schulz cost (m·n·min(m, n)) per rank of the last step's plan."""
        return self._built_plan().balance

    def owned(self) -> list[tuple[int, int]]:
        """(parameter, expert) of the matrices this rank orthogonalises, parameters numbered in
        param-group order among those that had a gradient at the last step."""
        return self._built_plan().owned()

    def _built_plan(self) -> _C.Muon:
        if self._plan is None:
            raise RuntimeError("hp.optim.Muon: the plan is built by the first step(); call step() first")
        return self._plan

    def _plan_for(self, params: list[torch.Tensor], ns: list[tuple]) -> _C.Muon:
        """The C++ plan for this set of parameters, rebuilt (collectively) when the set changes."""
        key = tuple((id(p), n) for p, n in zip(params, ns))
        if self._plan is not None and key == self._plan_key:
            return self._plan
        sharded = [isinstance(p, DTensor) for p in params]
        comm, mesh, counterparts = None, _C.MeshLayout(shard=[], replica=[]), None
        if any(sharded):
            comm = hp_comm.init()
            mesh = _mesh_layout([p for p, s in zip(params, sharded) if s])
            counterparts = hp_comm.cross_node_group()
        specs = [
            _C.MuonParam(shape=list(p.shape), sharded=s, ns=_C.NsOptions(a=a, b=b, c=c, steps=steps, eps=eps))
            for p, s, (a, b, c, steps, eps) in zip(params, sharded, ns)
        ]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"hp.optim.Muon: parameters on several devices {sorted(map(str, devices))}; "
                             "use one optimizer per device")
        device = next(iter(devices))
        self._plan = None  # frees the old plan's buffers first
        if device.type == "cuda":
            # The plan's peer-mapped buffer is allocated outside torch's caching allocator, after
            # forward and backward have filled its cache: give the cache's free blocks back first.
            torch.cuda.empty_cache()
        self._plan = _C.Muon(specs, comm, mesh, counterparts, device)
        self._plan_key, self._plan_params = key, params
        return self._plan


def stats() -> dict[str, int]:
    """Muon's work in this process since the last reset: Newton–Schulz's batched calls
    (``ns_calls``) and the matrices they orthogonalised (``ns_matrices``), and the bytes of bf16
    rows read from the node's other ranks (``muon_peer_bytes``: an owner's matrices' rows that others
    hold, and this rank's rows of the results that others computed)."""
    return _C.optim_stats()


def reset_stats() -> None:
    _C.reset_optim_stats()


def _check_group(group: dict[str, Any]) -> None:
    """torch.optim.Muon's argument checks, for every group (add_param_group included)."""
    _check_options(group)
    for p in group["params"]:
        if p.ndim not in (2, 3):
            raise ValueError(
                f"hp.optim.Muon takes matrices (2-D) and stacks of expert matrices (3-D), got a parameter of "
                f"size {tuple(p.shape)}; give biases, norms and embeddings to AdamW "
                "(hp.optim.muon_param_split does the usual split)"
            )


def _check_options(group: dict[str, Any]) -> None:
    """A group's option checks, in torch.optim.Muon's order (lr, momentum, weight_decay, adjust_lr_fn)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"hp.optim.Muon: a tensor lr must have one element, got shape {tuple(lr.shape)}")
    for name in ("lr", "momentum", "weight_decay"):
        if not group[name] >= 0:
            raise ValueError(f"hp.optim.Muon: {name} must be >= 0, got {group[name]}")
    if group["adjust_lr_fn"] not in _ADJUST_LR:
        raise ValueError(
            f"hp.optim.Muon: adjust_lr_fn {group['adjust_lr_fn']!r} is not supported; "
            "use None, 'original' or 'match_rms_adamw'"
        )
    if not 0 <= group["ns_steps"] < 100:
        raise ValueError(f"hp.optim.Muon: ns_steps must be in [0, 100), got {group['ns_steps']}; 5 is usual")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(
            f"hp.optim.Muon: ns_coefficients must be three numbers (a, b, c), got {group['ns_coefficients']}"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _mesh_layout(params: list[DTensor]) -> _C.MeshLayout:
    """Each global rank's (shard, replica) coordinates on the parameters' one mesh."""
    mesh = params[0].device_mesh
    for p in params:
        if p.device_mesh.mesh.tolist() != mesh.mesh.tolist():
            raise ValueError(
                "hp.optim.Muon: the parameters are sharded over different device meshes; "
                "use one optimizer per mesh"
            )
        expected = (Shard(0),) if p.device_mesh.ndim == 1 else (Replicate(), Shard(0))
        if p.device_mesh.ndim > 2 or tuple(p.placements) != expected:
            raise ValueError(
                f"hp.optim.Muon: a parameter has placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D "
                "mesh; expected FSDP's (Shard(0),) on a 1-D mesh or HSDP's (Replicate(), Shard(0)) on a 2-D mesh"
            )
    if mesh.device_type not in ("cpu", "cuda"):
        raise ValueError(f"hp.optim.Muon: the mesh is on {mesh.device_type}; hyperparallel shards CPU and CUDA")
    world = dist.get_world_size()
    if mesh.mesh.numel() != world:
        raise ValueError(
            f"hp.optim.Muon: the parameters' mesh holds {mesh.mesh.numel()} of the job's {world} ranks; "
            "shard them over a mesh of every rank"
        )
    shard, replica = [0] * world, [0] * world
    for r, row in enumerate(mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()):
        for s, rank in enumerate(row):
            shard[rank], replica[rank] = s, r
    return _C.MeshLayout(shard=shard, replica=replica)

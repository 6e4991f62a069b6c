"""Per-group FSDP state and the hooks that drive it; the work happens in C++ (_C.ParamGroup)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyperparallel import _C

# Seconds the main thread spent blocked on other ranks (unshard waits, waits for
# reductions at the end of backward), for benchmarks: see comm_wait_seconds().
_comm_wait = [0.0]


def comm_wait_seconds(reset: bool = False) -> float:
    """Seconds this rank's main thread has waited on communication (since the last reset)."""
    seconds = _comm_wait[0]
    if reset:
        _comm_wait[0] = 0.0
    return seconds


@dataclass
class _ParamRef:
    """One parameter of a group: its two faces and every place it is registered."""

    sharded: nn.Parameter  # DTensor over this rank's rows in shared memory
    unsharded: nn.Parameter  # plain tensor over the node-shared full parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's gradients exist."""

    @staticmethod
    def forward(ctx, group: GroupState, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.group.post_backward()
        return (None, *grads)


class GroupState:
    """The state of one fully_shard call: which parameters, their faces, the C++ group."""

    def __init__(
        self,
        modules: list[nn.Module],
        params: list[nn.Parameter],
        cgroup: _C.ParamGroup | None,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.cgroup = cgroup
        self.mesh = mesh
        self.placements = placements
        self.auto_reshard = reshard_after_forward is None
        self.reshard_after_forward = True if reshard_after_forward is None else bool(reshard_after_forward)
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.mp_policy = mp_policy
        self.refs: list[_ParamRef] = []
        # cgroup is None for a module with no parameters of its own: it only drives the hooks.
        for param, shard, full in zip(params, cgroup.shards if cgroup else [], cgroup.full if cgroup else []):
            local = DTensor.from_local(
                shard, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
            )
            self.refs.append(
                _ParamRef(
                    sharded=nn.Parameter(local, requires_grad=param.requires_grad),
                    unsharded=nn.Parameter(full, requires_grad=param.requires_grad),
                )
            )
        self.unsharded = False
        self.forward_calls = 0  # this iteration: forward calls, minus post-backwards run
        self.reduce_pending = False

    # -- registration ---------------------------------------------------------------------------
    def find_owners(self, root: nn.Module, originals: list[nn.Parameter]) -> None:
        """Every (module, name) under root that holds one of our parameters (ties included)."""
        by_id = {id(original): ref for original, ref in zip(originals, self.refs)}
        by_id.update({id(ref.sharded): ref for ref in self.refs})
        for ref in self.refs:
            ref.owners.clear()
        for module in root.modules():
            for name, param in module._parameters.items():
                ref = by_id.get(id(param))
                if ref is not None:
                    ref.owners.append((module, name))

    def register(self, unsharded: bool) -> None:
        """Make the full (or the sharded) parameters the ones every owner module holds."""
        for ref in self.refs:
            param = ref.unsharded if unsharded else ref.sharded
            for module, name in ref.owners:
                module._parameters[name] = param
        self.unsharded = unsharded

    # -- forward --------------------------------------------------------------------------------
    def unshard(self) -> None:
        if self.unsharded or self.cgroup is None:
            return
        start = time.perf_counter()
        self.cgroup.wait_unshard()
        _comm_wait[0] += time.perf_counter() - start
        self.register(unsharded=True)

    def reshard(self) -> None:
        if self.unsharded:
            self.register(unsharded=False)

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.unshard()
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled():
            self.forward_calls += 1
            args, kwargs = self._hook_inputs(args, kwargs)
        return args, kwargs

    def post_forward(self, output):
        if self.reshard_after_forward:
            self.reshard()
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _hook_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
        if positions:
            hooked = _PostBackward.apply(self, *(leaves[i] for i in positions))
            for i, tensor in zip(positions, hooked):
                leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    # -- backward -------------------------------------------------------------------------------
    def post_backward(self) -> None:
        """This module's gradients are complete (after its last use in forward)."""
        self.forward_calls -= 1
        if self.forward_calls > 0:
            return  # used again earlier in forward: wait for that use's backward
        self.forward_calls = 0
        if self.requires_gradient_sync:
            grads = []
            for ref in self.refs:
                grads.append(ref.unsharded.grad)
                ref.unsharded.grad = None
            if any(grad is not None for grad in grads):
                fresh = any(ref.sharded.grad is not None for ref in self.refs)
                self.cgroup.reduce(grads, fresh)
                self.reduce_pending = True
        if self.reshard_after_backward:
            self.reshard()

    def finish_backward(self) -> None:
        """End of backward: flush a group whose post-backward never ran, collect sharded grads."""
        if self.forward_calls > 0 or (
            self.requires_gradient_sync and any(ref.unsharded.grad is not None for ref in self.refs)
        ):
            self.forward_calls = 1
            self.post_backward()
        if self.reduce_pending:
            self.reduce_pending = False
            start = time.perf_counter()
            grads = self.cgroup.sharded_grads()
            _comm_wait[0] += time.perf_counter() - start
            for ref, grad in zip(self.refs, grads):
                if grad is None:
                    continue
                sharded = DTensor.from_local(
                    grad, self.mesh, self.placements, run_check=False,
                    shape=ref.sharded.shape, stride=ref.sharded.stride(),
                )
                if ref.sharded.grad is None:
                    ref.sharded.grad = sharded
                else:
                    ref.sharded.grad += sharded
        if self.reshard_after_backward:
            self.reshard()


class RootState:
    """The module whose forward starts an iteration: it posts every group's rows at once."""

    active: RootState | None = None  # the root whose forward is running

    def __init__(self, module: nn.Module, groups: list[GroupState]) -> None:
        self.module = module
        self.groups = groups
        self.callback_queued = False

    def pre_forward(self) -> None:
        RootState.active = self
        for group in self.groups:
            if not group.unsharded and group.cgroup is not None:
                group.cgroup.begin_unshard()  # never blocks: the real wait is per group

    def post_forward(self, output):
        RootState.active = None
        if torch.is_grad_enabled():
            self.callback_queued = False
            leaves, _ = tree_flatten(output)
            for tensor in leaves:
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(self._queue_final_callback)
        else:
            # No backward will release the parameters: do it now, so the
            # optimizer may write them.
            for group in self.groups:
                if group.cgroup is not None:
                    group.cgroup.release()
        return output

    def _queue_final_callback(self, grad):
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        return grad

    def _finish_backward(self) -> None:
        for group in reversed(self.groups):
            group.finish_backward()


def _cast_floats(tree, dtype: torch.dtype):
    leaves, spec = tree_flatten(tree)
    leaves = [x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in leaves]
    return tree_unflatten(leaves, spec)

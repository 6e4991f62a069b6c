"""FSDP state and the hooks that drive it; the work happens in C++ (``_C.ParamGroup``).

Two objects, as in FSDP2: a :class:`GroupState` per ``fully_shard`` call (its parameters'
two faces and the C++ group that owns their memory) and a :class:`RootContext` per root module
(the groups one forward drives, in the order they ran, and the end of backward). Each group
moves through an explicit :class:`TrainingState` per iteration.

The state stays in Python because every transition happens in a module hook that torch calls
in Python (forward pre/post hooks, autograd hooks, the engine's final callback), and the
parameters' registration is Python attribute surgery; everything that touches memory or waits
on another rank is one call into C++, which also serves a C++ program without these hooks.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyperparallel import _C


class TrainingState(enum.Enum):
    """Where a group is in the current iteration (FSDP2's states)."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()  # gradients flow through the module's outputs
    POST_BACKWARD = enum.auto()  # the module's gradients are complete and handed to the reducer


@dataclass
class _ParamRef:
    """One parameter of a group: its two faces and every place it is registered."""

    sharded: nn.Parameter  # DTensor over this rank's rows
    unsharded: nn.Parameter  # plain tensor over the full parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    # Gradients of backwards without reduction, in the reduce dtype where it is wider than
    # the compute dtype (mixed precision), as torch sums them: bf16 sums would lose them.
    accumulated: torch.Tensor | None = None


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
    """The state of one fully_shard call: which parameters, their faces, the C++ group.

    ``core`` is None for a module none of whose parameters are left to it (a root whose
    children own everything): it still drives the iteration as a root.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        params: list[nn.Parameter],
        core: _C.ParamGroup | None,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.core = core
        self.mesh = mesh
        self.placements = placements
        # On a device the full parameters are this rank's own memory, freed on reshard and
        # pulled again for backward; on the CPU they are node-shared memory that stays.
        self.on_device = mesh.device_type != "cpu"
        self.auto_reshard = reshard_after_forward is None
        self.reshard_after_forward = True if reshard_after_forward is None else bool(reshard_after_forward)
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.mp_policy = mp_policy
        self.refs: list[_ParamRef] = []
        if core is not None:
            for param, shard, full in zip(params, core.shards, core.full):
                local = DTensor.from_local(
                    shard, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
                )
                self.refs.append(
                    _ParamRef(
                        sharded=nn.Parameter(local, requires_grad=param.requires_grad),
                        unsharded=nn.Parameter(full, requires_grad=param.requires_grad),
                    )
                )
        self.training_state = TrainingState.IDLE
        self.unsharded = False  # which face is registered
        # CPU: this iteration's full parameters are in place (waited for once per iteration;
        # nothing writes them before the optimizer, after backward).
        self.gathered = False
        self.pending_backwards = 0  # forward calls this iteration whose backward has not reached us
        self.reduced = False  # a reduction was handed to C++ this backward
        # FSDP2's all-reduce hook: called on the flat reduced gradients before they are handed
        # out (after the nodes' all-reduce with HSDP), on ``all_reduce_hook_stream`` if set.
        self.all_reduce_hook = None
        self.all_reduce_hook_stream = None
        self.root: RootContext | None = None  # the root that drives this group, once it ran

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

    # -- unshard and reshard --------------------------------------------------------------------
    def unshard(self) -> None:
        """Make the full parameters current and registered. On the CPU the first call of an
        iteration waits for every rank's rows and later ones only register; on a device
        each waits for this iteration's pull."""
        if self.core is None:
            return
        if self.on_device or not self.gathered:
            self.core.wait_unshard()
            self.gathered = True
        if not self.unsharded:
            self.register(unsharded=True)

    def prefetch(self) -> None:
        """Start this group's unshard without waiting (a device pulls on its own stream)."""
        if self.core is not None and self.on_device:
            self.core.begin_unshard()

    def reshard(self) -> None:
        if self.unsharded:
            self.register(unsharded=False)
        if self.core is not None:
            self.core.reshard()  # a device gives the full parameters' memory back

    # -- forward --------------------------------------------------------------------------------
    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        recompute = self.training_state == TrainingState.PRE_BACKWARD
        if not recompute:
            self.training_state = TrainingState.FORWARD
        self.unshard()
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if recompute:
            # Activation checkpointing runs forward again inside this module's backward:
            # the parameters are there, and the first forward's hooks see the backward.
            return args, kwargs
        if self.root is not None:
            self.root.prefetch_after(self)
        if torch.is_grad_enabled() and self.refs:
            self.pending_backwards += 1
            args, kwargs = self._hook_inputs(args, kwargs)
        return args, kwargs

    def post_forward(self, output):
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if self.training_state == TrainingState.PRE_BACKWARD:
            return output  # a recomputation (see pre_forward): backward goes on
        if self.reshard_after_forward:
            self.reshard()
        # The full parameters must be registered (on a device: pulled) again before this
        # module's backward, which may also run its forward again (activation checkpointing).
        if torch.is_grad_enabled() and self.refs:
            self._hook_outputs(output)
        self.training_state = TrainingState.IDLE
        return output

    def _hook_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
        if positions:
            hooked = _PostBackward.apply(self, *(leaves[i] for i in positions))
            for i, tensor in zip(positions, hooked):
                leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _hook_outputs(self, output) -> None:
        for tensor in _grad_tensors(output):
            tensor.register_hook(self._pre_backward_hook)

    # -- backward -------------------------------------------------------------------------------
    def _pre_backward_hook(self, grad):
        if self.training_state != TrainingState.PRE_BACKWARD:
            self.pre_backward()
        return grad

    def pre_backward(self) -> None:
        """Gradients reached this module's outputs: its full parameters must be back."""
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        if self.root is not None:
            self.root.queue_final_callback()
            self.root.prefetch_before(self)

    def post_backward(self) -> None:
        """This module's gradients are complete (after its last use in forward)."""
        self.pending_backwards -= 1
        if self.pending_backwards > 0:
            return  # used again earlier in forward: wait for that use's backward
        self.pending_backwards = 0
        self.training_state = TrainingState.POST_BACKWARD
        self._accumulate()
        if self.requires_gradient_sync:
            grads = []
            for ref in self.refs:
                grads.append(ref.accumulated if ref.accumulated is not None else ref.unsharded.grad)
                ref.unsharded.grad = ref.accumulated = None
            # Every rank reduces a group whose parameters train, with or without local
            # gradients (zeros then), so that a rank whose inputs skipped a module does not
            # leave its peers waiting in the reduction.
            if any(ref.unsharded.requires_grad for ref in self.refs):
                self.core.reduce(grads)
                self.reduced = True
        if self.reshard_after_backward:
            self.reshard()

    def _accumulate(self) -> None:
        """Moves this backward's full gradients into the wider accumulated ones, where
        there are (or, in a backward without reduction, should be) any."""
        reduce_dtype = self.mp_policy.reduce_dtype
        for ref in self.refs:
            grad = ref.unsharded.grad
            if grad is None:
                continue
            if ref.accumulated is not None:
                ref.accumulated += grad
            elif not self.requires_gradient_sync and reduce_dtype is not None and grad.dtype != reduce_dtype:
                ref.accumulated = grad.to(reduce_dtype)
            else:
                continue
            ref.unsharded.grad = None

    def finish_backward(self) -> None:
        """End of backward: flush a group whose post-backward never ran, collect sharded grads."""
        if self.pending_backwards > 0 or (
            self.requires_gradient_sync
            and any(ref.unsharded.grad is not None or ref.accumulated is not None for ref in self.refs)
        ):
            self.pending_backwards = 1
            self.post_backward()
        if self.reduced:
            self.reduced = False
            grads = self.core.sharded_grads()
            if self.all_reduce_hook is not None and any(grad is not None for grad in grads):
                self._run_all_reduce_hook(self.core.sharded_grad_buffer())
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
        if self.on_device and self.core is not None:
            self.core.release()  # peers' pulls of our rows are done before the optimizer writes them
        self.training_state = TrainingState.IDLE

    def _run_all_reduce_hook(self, flat: torch.Tensor) -> None:
        stream = self.all_reduce_hook_stream
        if stream is None:
            self.all_reduce_hook(flat)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.all_reduce_hook(flat)
        torch.cuda.current_stream().wait_stream(stream)

    def abort_iteration(self) -> None:
        """An exception ended this iteration: throw its gradients away (the reductions handed
        out, the held HSDP sum, the full gradients not reduced yet, a no_sync accumulation)
        and leave the group idle with its sharded parameters registered and its peers' rows
        released, as at the end of a forward without backward."""
        for ref in self.refs:
            ref.unsharded.grad = ref.accumulated = None
        self.pending_backwards = 0
        self.reduced = False
        self.training_state = TrainingState.IDLE
        if self.core is not None:
            self.core.discard_held()
        self.reshard()
        if self.core is not None:
            self.core.release()


class RootContext:
    """What one root module's forward drives: every group under it, the order they ran in
    (to prefetch the next one's parameters), and the end of backward."""

    def __init__(self, module: nn.Module, groups: list[GroupState]) -> None:
        self.module = module
        self.groups = groups
        self.order: list[GroupState] = []  # forward order, recorded by the first iteration
        self.recording = True
        self.callback_queued = False
        for group in groups:
            group.root = self

    def pre_forward(self) -> None:
        for group in self.groups:
            # Every iteration, whichever face is registered: the wait that follows is what
            # orders this rank's reads after the peers' writes (the optimizer's, a load's).
            if group.core is not None:
                group.core.publish()  # never blocks: each group's wait is in its own pre-forward
                group.gathered = False

    def post_forward(self, output):
        self.recording = False
        if torch.is_grad_enabled():
            self.callback_queued = False
            for tensor in _grad_tensors(output):
                tensor.register_hook(self._queue_final_callback)
        else:
            # No backward follows: the sharded parameters are the module's again (as
            # torch's, so that an optimizer or a state dict made now sees them), and
            # the optimizer may write them.
            for group in self.groups:
                if group.unsharded:
                    group.reshard()
                if group.core is not None:
                    group.core.release()
        return output

    def prefetch_after(self, group: GroupState) -> None:
        """``group`` starts its forward: record the order, and start pulling the next group."""
        if self.recording:
            if group not in self.order:
                self.order.append(group)
            return
        if group in self.order:
            index = self.order.index(group)
            if index + 1 < len(self.order):
                self.order[index + 1].prefetch()

    def prefetch_before(self, group: GroupState) -> None:
        """``group`` starts its backward: start pulling the group before it in forward order."""
        if group in self.order:
            index = self.order.index(group)
            if index > 0 and self.order[index - 1].reshard_after_forward:
                self.order[index - 1].prefetch()

    def queue_final_callback(self) -> None:
        """Once per backward, from the first hook that sees it: the end of backward."""
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _queue_final_callback(self, grad):
        self.queue_final_callback()
        return grad

    def reset(self) -> None:
        """After an exception aborted a forward or backward: every group back to the state
        between iterations, the iteration's gradients thrown away (FSDP2's reset_iter_state)."""
        for group in reversed(self.groups):
            group.abort_iteration()
        self.callback_queued = False

    def _finish_backward(self) -> None:
        for group in reversed(self.groups):
            group.finish_backward()


def _grad_tensors(tree) -> list[torch.Tensor]:
    """The tensors that require grad in a module's output: pytree containers (HF's
    ModelOutput among them) and dataclasses, as torch's FSDP2 finds them."""
    found = []
    leaves, _ = tree_flatten(tree)
    for leaf in leaves:
        if torch.is_tensor(leaf):
            if leaf.requires_grad:
                found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _grad_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


def _cast_floats(tree, dtype: torch.dtype):
    leaves, spec = tree_flatten(tree)
    leaves = [x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in leaves]
    return tree_unflatten(leaves, spec)

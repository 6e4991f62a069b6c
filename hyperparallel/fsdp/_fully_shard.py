"""``hp.fully_shard``: FSDP2's interface over the node's shared-memory fabric."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hyperparallel import _C
from hyperparallel import comm as hp_comm
from hyperparallel.fsdp._state import GroupState, RootContext

# torch's defaults, as module-level singletons (one object shared by all calls).
_DEFAULT_MP_POLICY = MixedPrecisionPolicy()
_DEFAULT_OFFLOAD_POLICY = OffloadPolicy()


def _context() -> _C.FSDPContext:
    """What every group of this process shares (the reducer thread, gradient windows, a
    device's streams): made with the first group, after hp.comm.init()."""
    global _shared_context
    if _shared_context is None:
        _shared_context = _C.FSDPContext(hp_comm.get())
        hp_comm._on_shutdown(_stop_context)
    return _shared_context


def comm_wait_seconds(reset: bool = False) -> float:
    """Seconds this rank has waited on other ranks in hp.fully_shard's groups (unshard waits,
    the end of each reduction), since the last reset; measured in C++ where the waits happen."""
    return _shared_context.wait_seconds(reset) if _shared_context is not None else 0.0


def _stop_context() -> None:
    """hp.comm.shutdown(): the pending reductions run, the reducer thread is joined; a later
    fully_shard makes a new context."""
    global _shared_context
    if _shared_context is not None:
        _shared_context.stop()
    _shared_context = None


_shared_context: _C.FSDPContext | None = None


class FSDPModule:
    """Methods a module gains from :func:`fully_shard` (those of torch's ``FSDPModule``)."""

    _hp_state: GroupState

    def unshard(self, async_op: bool = False):
        """Make the full parameters this module's parameters (on the CPU a wait: nothing is
        copied; on a GPU a pull of the peers' rows on the all-gather stream)."""
        self._hp_state.prefetch()
        if async_op:
            return _UnshardHandle(self._hp_state)
        self._hp_state.unshard()
        return None

    def reshard(self) -> None:
        """Register the sharded (DTensor) parameters again."""
        self._hp_state.reshard()

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``to_empty``, ``to``, ``float`` ...) on a sharded module. The
        parameters hp shards live in node memory and stay there: a call that leaves their dtype
        and device as they are (``to_empty`` on their device, after a meta-device init) passes
        them by; one that would change them is refused, since it would cut them off from that
        memory. Buffers and unsharded parameters are converted as usual."""
        held = []
        for state in _states(self, recurse=True):
            for ref in state.refs:
                probe = fn(torch.empty(0, dtype=ref.sharded.dtype, device=ref.sharded.device))
                if probe.dtype != ref.sharded.dtype or probe.device != ref.sharded.device:
                    raise TypeError(
                        f"hp.fully_shard: the sharded parameters are {ref.sharded.dtype} on {ref.sharded.device} "
                        f"in the node's shared memory and cannot become {probe.dtype} on {probe.device}; "
                        "convert the module before fully_shard"
                    )
                for module, name in ref.owners:
                    if module._parameters.get(name) is not None:  # None keeps the order of the names
                        held.append((module, name, module._parameters[name]))
                        module._parameters[name] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            for module, name, param in held:
                module._parameters[name] = param

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates full gradients locally without reducing (gradient accumulation)."""
        for state in _states(self, recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduces each backward's gradients within the node only and sums them, held
        and sharded, without handing any out; the next backward with True all-reduces the sum
        across nodes and hands it out (gradient accumulation without cross-node traffic until
        the last micro-batch), as torch's. No effect on a 1-D mesh."""
        for state in _states(self, recurse):
            if state.core is not None:
                state.core.set_requires_all_reduce(bool(requires_all_reduce))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for state in _states(self, recurse):
            state.reshard_after_forward = bool(reshard_after_forward)
            state.auto_reshard = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in _states(self, recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's gradients become the sum over all ranks divided by ``factor``, instead
        of their average (``factor=1.0``: the sum), as torch's. Not recursive, as torch's."""
        if self._hp_state.core is not None:
            self._hp_state.core.set_gradient_divide_factor(float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility (pipeline schedules call it): hp ends every backward as
        torch ends the last one, waiting for its reductions and handing the gradients out."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted for compatibility: the full parameters are back for every backward (on the
        CPU a wait on memory that stayed; on a GPU a pull), which is never wrong."""

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for compatibility: hp always reduces every parameter, with zeros from the
        ranks without a gradient, so ranks whose inputs take different branches never mismatch."""

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward, on the root module of every rank
        (each rank raised alike, or the job cannot go on): waits for the reductions handed
        out, throws the iteration's gradients away (reduced or not, an HSDP held sum, a no_sync
        accumulation) and leaves every group as between iterations, so that the next one runs
        normally, as torch's. Call ``optimizer.zero_grad()`` too: as with torch, a shard's
        gradient from an earlier backward stays.

        Example::

            try:
                loss = model(batch).loss
                loss.backward()
            except torch.OutOfMemoryError:
                model.reset_iter_state()
                optimizer.zero_grad()
        """
        root = self._hp_state.root
        if root is None:
            return  # no forward ran: nothing to reset
        if root.module is not self:
            raise RuntimeError(f"reset_iter_state must be called on the root module ({type(root.module).__name__}), "
                               f"which drove the aborted forward, not on {type(self).__name__}")
        root.reset()

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """``hook(reduce_output)`` runs on this module's reduced gradients before they are
        handed out, as torch's: after the reduce-scatter, or with HSDP after the all-reduce
        across nodes (e.g. to all-reduce them over another mesh dimension). ``reduce_output``
        is the flat buffer the sharded gradients are views of, in the parameters' dtype (torch
        passes its reduce dtype), averaged over the ranks; the hook may change it in place. On a
        GPU, ``stream`` runs it on that stream, ordered after the reduction and before the
        gradients' use (not with HSDP, as torch's). Not recursive, as torch's."""
        state = self._hp_state
        if stream is not None:
            if not state.on_device:
                raise ValueError("set_all_reduce_hook: a stream is for CUDA parameters; these are on the CPU")
            if state.mesh.ndim == 2:
                raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP (as torch's)")
        state.all_reduce_hook = hook
        state.all_reduce_hook_stream = stream

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for compatibility: hp's reductions are sums already, scaled once in the
        reducing kernel (across nodes, an all-reduce with ``SUM``)."""

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for compatibility: within a node hp communicates through the fabric's own
        symmetric buffers, not staging buffers of a process group's."""

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for compatibility: hp's all-gather within a node is symmetric memory already
        (shared memory on the CPU; peer-mapped device memory and copy-engine pulls on a GPU)."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted for compatibility: hp has no copy-in buffers; each group's gradients go into
        one of two gradient windows per process, which bound what is in flight."""

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted for compatibility: hp's reduce-scatter runs on its reducer thread (on a GPU,
        its own stream) and overlaps the unshards already."""

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Accepted for compatibility: the next forward's unshards start after the optimizer
        step as they always do (on a GPU, ordered after the current stream's work when the root's
        forward starts, which includes the step)."""

    def set_custom_all_gather(self, comm) -> None:
        """Refused: hp's all-gather is the fabric's (a wait on shared memory, or copy-engine
        pulls on a GPU), which a torch ``AllGather`` cannot replace."""
        raise NotImplementedError(
            "hp.fully_shard: set_custom_all_gather is not supported; hp's all-gather is the fabric's own. "
            "Shard this module with torch's fully_shard to use a custom all-gather")

    def set_custom_reduce_scatter(self, comm) -> None:
        """Refused: hp's reduce-scatter is one pass over the node's gradient windows, which a
        torch ``ReduceScatter`` cannot replace."""
        raise NotImplementedError(
            "hp.fully_shard: set_custom_reduce_scatter is not supported; hp's reduce-scatter is the fabric's "
            "own. Shard this module with torch's fully_shard to use a custom reduce-scatter")

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Accepted for compatibility. On the CPU every group's rows are posted when the root's
        forward starts, so each unshard is a wait on data that is there; on a GPU each group
        pulls the next one's parameters (in the order the first forward ran them) while it
        computes."""
        _check_fsdp_modules(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Accepted for compatibility. On the CPU the full parameters stay in shared memory
        through backward; on a GPU each group's backward pulls the previous group's."""
        _check_fsdp_modules(modules)


class _UnshardHandle:
    def __init__(self, state: GroupState) -> None:
        self._state = state

    def wait(self) -> None:
        self._state.unshard()


def _states(module: nn.Module, recurse: bool) -> list[GroupState]:
    modules = module.modules() if recurse else [module]
    return [m._hp_state for m in modules if isinstance(m, FSDPModule)]


def _check_fsdp_modules(modules: list) -> None:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"expected modules sharded with hp.fully_shard, got {type(module).__name__}")


def _default_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _validate_mesh(mesh: DeviceMesh, topology) -> dist.ProcessGroup | None:
    """Returns the replicate group for HSDP, None for plain FSDP; raises for layouts we don't shard."""
    world, per_node, nodes = topology.world_size, topology.local_world_size, topology.num_nodes
    if mesh.device_type not in ("cpu", "cuda"):
        raise ValueError(f"hp.fully_shard: mesh on {mesh.device_type!r}; hyperparallel shards CPU and CUDA tensors")
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(world)):
        raise ValueError(
            f"hp.fully_shard: the mesh holds ranks {ranks} but the job has {world} ranks (0..{world - 1}); "
            "build it with init_device_mesh over the whole world"
        )
    if mesh.ndim == 1:
        if nodes > 1:
            raise ValueError(
                f"hp.fully_shard: a 1-D mesh over {nodes} nodes; hyperparallel shards within a node and "
                f"replicates across nodes: use a 2-D mesh, init_device_mesh({mesh.device_type!r}, "
                f"({nodes}, {per_node}), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        return None
    if mesh.ndim == 2 and tuple(mesh.mesh.shape) == (nodes, per_node):
        return mesh.get_group(0) if nodes > 1 else None
    raise ValueError(
        f"hp.fully_shard: mesh of shape {tuple(mesh.mesh.shape)}; expected ({world},) or (nodes, ranks per node) = "
        f"({nodes}, {per_node}) for HSDP"
    )


def _managed_params(module: nn.Module, ignored: set[nn.Parameter]) -> list[nn.Parameter]:
    """module's parameters, without duplicates, those of nested fully_shard calls and ignored ones."""
    taken = {id(p) for p in ignored}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            taken.update(id(ref.sharded) for ref in sub._hp_state.refs)
    params, seen = [], set()
    for param in module.parameters():
        if id(param) not in taken and id(param) not in seen:
            seen.add(id(param))
            params.append(param)
    return params


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = _DEFAULT_MP_POLICY,
    offload_policy: OffloadPolicy = _DEFAULT_OFFLOAD_POLICY,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims=None,
):
    """Shard ``module``'s parameters over the data-parallel ranks, FSDP2-style, in shared memory.

    The arguments, defaults and meaning are those of ``torch.distributed.fsdp.fully_shard``:
    call it bottom-up (each decoder layer, then the root); each call makes one parameter group.
    Parameters become ``DTensor``s with ``Shard(0)`` (torch.chunk rows, as FSDP2), whose local
    tensors are views into the node's shared memory, so torch optimizers, ``clip_grad_norm_``
    and ``state_dict`` work unchanged. Differences that follow from the shared memory:

    - unsharding is a wait, not an all-gather: the optimizer updated every rank's rows in place;
    - ``reshard_after_forward`` only chooses which parameters are registered after forward (the
      full parameters stay in shared memory, once per node); an ``int`` acts as ``True``;
    - a 1-D mesh must lie within one node; across nodes use a 2-D ``(replicate, shard)`` mesh
      (HSDP): shards within the node, all-reduce of shards across nodes over c10d;
    - ``offload_policy`` is accepted; on the CPU there is nothing to offload to.

    As with torch, a module with no parameters left to shard (all in nested groups, ignored, or
    none at all) is accepted: it makes no group and only drives the hooks (the usual root).

    Example::

        hp.comm.init()
        for layer in model.model.layers:
            hp.fully_shard(layer)
        hp.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(input_ids, labels=labels).loss.backward()
        opt.step()
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError("hp.fully_shard: dp_mesh_dims is not supported; pass the data-parallel mesh")
    modules = list(module) if isinstance(module, list) else [module]
    for m in modules:
        if isinstance(m, FSDPModule):
            raise TypeError(f"hp.fully_shard: {type(m).__name__} is already sharded by hp.fully_shard")
        if isinstance(m, TorchFSDPModule):
            raise TypeError(f"hp.fully_shard: {type(m).__name__} is already sharded by torch's fully_shard")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"hp.fully_shard: offload_policy must be an OffloadPolicy, got {offload_policy!r}")
    communicator = hp_comm.init()

    ignored = set(ignored_params or ())
    params = []
    for m in modules:
        params += [p for p in _managed_params(m, ignored) if all(p is not q for q in params)]
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"hp.fully_shard: parameters on several devices {devices}; move the module to one first")
    device = params[0].device if params else _mesh_or_default_device(mesh)
    # A module built on the meta device (too large to build whole): its shards get memory here,
    # uninitialised, for an init or a load after to_empty() to fill, as with torch's FSDP2.
    on_meta = device.type == "meta"
    if on_meta:
        device = _mesh_or_default_device(mesh)
    mesh = mesh if mesh is not None else _default_mesh(device)
    replicate = _validate_mesh(mesh, communicator.topology)
    if params and device.type != mesh.device_type:
        raise ValueError(
            f"hp.fully_shard: the parameters are on {device} but the mesh is a {mesh.device_type!r} mesh; "
            f"move the module with .to({mesh.device_type!r}) or build the mesh on {device.type!r}"
        )
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    for param in params:
        if isinstance(param, torch.distributed.tensor.DTensor):
            raise TypeError("hp.fully_shard: a parameter is already a DTensor; shard plain parameters")
        if shard_placement_fn is not None:
            placement = shard_placement_fn(param)
            if placement is not None and placement != Shard(0):
                raise ValueError(f"hp.fully_shard: shard_placement_fn returned {placement}; only Shard(0) is supported")

    # A module whose parameters all belong to groups below it (the usual root) gets no group
    # of its own, as in torch: its state still drives the iteration.
    core = None
    if params:
        # On the meta device: untouched memory of the full shape, of which each rank reads only
        # its own rows (on the CPU, pages no one touches cost nothing).
        sources = [torch.empty(p.shape, dtype=p.dtype, device=device) if on_meta else p.detach() for p in params]
        core = _C.ParamGroup(_context(), sources, mp_policy.param_dtype, mp_policy.reduce_dtype, replicate)
    state = GroupState(modules, params, core, mesh, placements,
                       None if reshard_after_forward is None else bool(reshard_after_forward), mp_policy)
    for m in modules:
        state.find_owners(m, params)
    state.register(unsharded=False)  # the DTensor parameters replace the originals
    for m in modules:
        m._hp_state = state
        m.register_forward_pre_hook(_pre_forward, with_kwargs=True)
        m.register_forward_hook(_post_forward)
        m.register_load_state_dict_post_hook(_keep_shards_after_assign)
        m.__class__ = _fsdp_class(type(m))
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run as a forward does: the full parameters are registered
    before it and the hooks' after-forward work runs after it, as torch's
    ``register_fsdp_forward_method``. For a method that reads parameters itself, outside
    ``forward`` (one that only calls the module, like HF's ``generate``, needs nothing). A module
    :func:`fully_shard` did not shard is left as it is, as with torch.

    Example::

        hp.fully_shard(model)
        hp.fsdp.register_fsdp_forward_method(model, "score")  # score() reads model.lm_head.weight
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def as_forward(self, *args, **kwargs):
        args, kwargs = _pre_forward(self, args, kwargs)
        return _post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, as_forward.__get__(module, type(module)))


def _keep_shards_after_assign(module: nn.Module, incompatible_keys) -> None:
    """``load_state_dict(..., assign=True)`` put the loaded tensors in place of the parameters:
    their values go into the shards in node memory instead, and the group's parameters return."""
    state = module._hp_state
    for ref in state.refs:
        current = ref.unsharded if state.unsharded else ref.sharded
        for owner, name in ref.owners:
            loaded = owner._parameters.get(name)
            if loaded is None or loaded is ref.sharded or loaded is ref.unsharded:
                continue
            with torch.no_grad():
                if not isinstance(loaded, torch.distributed.tensor.DTensor):
                    loaded = distribute_tensor(loaded.detach(), state.mesh, state.placements)
                ref.sharded.to_local().copy_(loaded.to_local())
            owner._parameters[name] = current


def _mesh_or_default_device(mesh: DeviceMesh | None) -> torch.device:
    if mesh is not None:
        return torch.device(mesh.device_type)
    return torch.device("cpu")


# One HP<Module> class per module type, as FSDP2 caches its FSDP<Module> classes.
_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"HP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _root_of(module: nn.Module) -> RootContext:
    """The root context a module's forward runs under; a module no root has claimed yet
    becomes a root itself (the first forward of the outermost sharded module)."""
    own = module._hp_state
    if own.root is None:
        groups, seen = [], set()
        for sub in module.modules():
            if isinstance(sub, FSDPModule) and id(sub._hp_state) not in seen:
                seen.add(id(sub._hp_state))
                groups.append(sub._hp_state)
        if own.auto_reshard:
            own.reshard_after_forward = False  # backward starts with the root's parameters
        for group in groups:
            originals = [ref.sharded for ref in group.refs]
            group.find_owners(module, originals)
        RootContext(module, groups)
    return own.root


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict):
    root = _root_of(module)
    if root.module is module:
        root.pre_forward()
    return module._hp_state.pre_forward(args, kwargs)


def _post_forward(module: nn.Module, args: tuple, output):
    output = module._hp_state.post_forward(output)
    root = module._hp_state.root
    if root is not None and root.module is module:
        output = root.post_forward(output)
    return output

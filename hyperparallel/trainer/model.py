"""Build the model a config asks for: HF config or weights, fused modules, activation checkpointing, FSDP."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint

from hyperparallel.trainer.config import Config, ConfigError


def hf_config(cfg: Config):
    """The model's ``transformers`` config, set up for training (no KV cache)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    key, source = ("model.pretrained", cfg.model.pretrained) if cfg.model.pretrained is not None else (
        "model.config", cfg.model.config)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"{key}: {source} is not a transformers model config ({str(error).splitlines()[0]}); "
            "give a config.json with a model_type, e.g. examples/tiny-moe.config.json"
        ) from None
    if cfg.model.patch:
        from hyperparallel.nn.modules import SUPPORTED_MODELS

        fused = sorted({cls.config_class.model_type for cls in SUPPORTED_MODELS})
        if config.model_type not in fused:
            raise ConfigError(
                f"model.patch: hp.nn.patch has fused modules for {', '.join(fused)}, not {config.model_type}; "
                "set model.patch=false to train it with transformers' own modules"
            )
    config.use_cache = False
    return config


def build(
    cfg: Config, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, weights: bool = True
) -> nn.Module:
    """The causal LM, unsharded: fresh weights from ``model.seed`` (:func:`init_weights`), or
    ``model.pretrained``'s; patched with the fused modules if ``model.patch``.

    ``device="meta"`` or ``weights=False`` builds shapes only, without reading
    ``model.pretrained`` (the dry-run estimate); ``dtype`` is for such shape-only
    models too (training keeps fp32 weights). The weights are those :func:`build_sharded`
    gives the same config at any world size.
    """
    if str(device) == "meta" or not weights:
        return _skeleton(cfg, dtype, device)
    model = _skeleton(cfg, dtype, "meta")
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor where two shared one
    _fill(model, cfg)
    return model


def build_sharded(cfg: Config, mesh, device: torch.device) -> nn.Module:
    """The causal LM as the trainer runs it: built on the meta device, activation checkpointing
    if asked, :func:`shard`, then each rank fills only its own rows (:func:`init_weights`, or
    ``model.pretrained``'s rows read from its files). No rank ever holds the whole model, so the
    model may be as large as the job's memory, not one rank's."""
    model = _skeleton(cfg, torch.float32, "meta")
    if cfg.model.activation_checkpointing:
        checkpoint_layers(model)
    shard(model, cfg, mesh)
    model.to_empty(device=device)  # the buffers; the shards already have their memory
    _fill(model, cfg)
    return model


def _skeleton(cfg: Config, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """The model with transformers' constructors' weights (none on the meta device), patched if
    ``model.patch``, in training mode."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa", dtype=dtype)
    if cfg.model.patch:
        import hyperparallel.nn as hpnn

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unpatched modules are listed by the plan instead
            hpnn.patch(model)
    return model.train()


def _fill(model: nn.Module, cfg: Config) -> None:
    """Fresh weights from ``model.seed``, or ``model.pretrained``'s (:func:`load_weights`)."""
    if cfg.model.pretrained is None:
        init_weights(model, cfg.model.seed)
    else:
        load_weights(model, cfg.model.pretrained, cfg.model.seed)


def load_weights(model: nn.Module, directory: str | Path, seed: int = 0) -> None:
    """HF directory ``directory``'s weights into ``model`` (whole, or sharded: each rank reads its
    rows), after what no checkpoint holds is initialised (:func:`init_weights` from ``seed``):
    the non-persistent buffers (RoPE's frequencies), which ``to_empty`` left as garbage."""
    import hyperparallel.nn as hpnn

    init_weights(model, seed, parameters=False)
    hpnn.load_pretrained(model, directory)


def init_weights(model: nn.Module, seed: int, *, parameters: bool = True) -> None:
    """HF's initialisation of ``model`` (its ``_init_weights``, module by module in HF's order:
    children first), drawn from ``seed``; the values do not depend on the world size.

    The parameters of each ``hp.fully_shard`` group (a decoder layer, the root's own) are drawn
    whole while HF initialises the group's modules, then each rank keeps its rows: no rank holds
    more than the root's group and one layer's at a time. Tied weights are drawn once, as their
    source (HF ties after initialising). Every floating-point tensor is NaN until initialised;
    one still NaN afterwards, or a group's parameter written after its group was done (by a
    parent's ``_init_weights``), is an error rather than garbage or rank-dependent values. The
    global random state is left as it was.
    ``parameters=False`` initialises only the non-persistent buffers, which no checkpoint holds
    (and, for them, the modules above theirs).
    """
    from transformers import PreTrainedModel

    import hyperparallel as hp

    persistent = set(model.state_dict(keep_vars=True))
    volatile = {name for name, _ in model.named_buffers() if name not in persistent}
    # parameters=False: the modules holding such buffers, and those above them.
    chosen = None if parameters else {
        ".".join(parts[:i]) for parts in (name.split(".") for name in volatile) for i in range(len(parts))}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    # The plain tensors to check: every one, or the non-persistent buffers.
    plain = {name: t for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
             if not isinstance(t, DTensor) and t.is_floating_point() and (parameters or name in volatile)}
    done = {}  # id -> (name, sharded parameter, its version) of the groups done

    def swap_in(unit: nn.Module, prefix: str) -> dict:
        """The unit's group's sharded parameters replaced by whole NaN tensors (nested groups keep
        theirs): id -> (name, sharded parameter, whole tensor, its owners)."""
        drawn = {}
        stack = [(unit, prefix)]
        while stack:
            module, at = stack.pop()
            for name, param in module._parameters.items():
                if isinstance(param, DTensor):
                    if id(param) not in drawn:
                        whole = torch.full(param.shape, float("nan"), dtype=param.dtype, device=param.to_local().device)
                        drawn[id(param)] = (at + name, param, whole, [])
                    drawn[id(param)][3].append((module, name))
                    module._parameters[name] = drawn[id(param)][2]
            stack += [(child, f"{at}{n}.") for n, child in module.named_children()
                      if not isinstance(child, hp.FSDPModule)]
        return drawn

    def unset(owner: nn.Module, name: str) -> ConfigError:
        if name in volatile:
            return ConfigError(f"{type(owner).__name__}._init_weights leaves {name} unset, which no checkpoint "
                               "holds (a non-persistent buffer): the trainer cannot build this model")
        return ConfigError(f"{type(owner).__name__}._init_weights leaves {name} unset; the trainer cannot draw "
                           "fresh weights for this model: start from weights (model.pretrained)")

    def swap_out(drawn: dict, owner: nn.Module) -> None:
        """Each rank keeps its rows of the whole tensors; the sharded parameters go back."""
        for name, param, whole, owners in drawn.values():
            if whole.is_floating_point() and whole.isnan().any():
                raise unset(owner, name)
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            param.to_local().copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
            for module, attr in owners:
                module._parameters[attr] = param
            done[id(param)] = (name, param, param._version)

    def visit(module: nn.Module, prefix: str, owner: PreTrainedModel) -> None:
        drawn = swap_in(module, prefix) if parameters and isinstance(module, hp.FSDPModule) else None
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", child if isinstance(child, PreTrainedModel) else owner)
        if chosen is None or prefix.rstrip(".") in chosen:
            # A tied weight's target (lm_head.weight) is left to its source, as HF's init does.
            skipped = [t for n, t in module._parameters.items()
                       if t is not None and prefix + n in tied and not hasattr(t, "_is_hf_initialized")]
            for tensor in skipped:
                tensor._is_hf_initialized = True
            owner._init_weights(module)
            for tensor in skipped:
                del tensor._is_hf_initialized
        if drawn is not None:
            swap_out(drawn, owner)

    # The draws come from the global generators, seeded here and given back as they were: the
    # caller's random stream (HF Trainer's data order) is the same with or without this call.
    cuda = sorted({t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        torch.manual_seed(seed)
        for tensor in plain.values():
            tensor.fill_(float("nan"))
        visit(model, "", model)
    for name, tensor in plain.items():
        if tensor.isnan().any():
            raise unset(model, name)
    for name, param, version in done.values():
        if param._version != version:
            raise ConfigError(f"{type(model).__name__}._init_weights writes {name} from a module above its "
                              "hp.fully_shard group; the trainer cannot draw it the same at every world size: "
                              "start from weights (model.pretrained)")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (each becomes one FSDP group): ``model.model.layers`` in HF causal LMs."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers: the trainer shards HF decoder-only models")
    return list(layers)


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing: each decoder layer keeps only its inputs and recomputes in backward.

    The layer's ``forward`` is wrapped, not ``__call__``: FSDP's hooks run once per
    forward, and the recomputation reads the full parameters the layer holds until its
    post-backward.
    """
    for layer in decoder_layers(model):
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def mixed_precision(cfg: Config):
    """The ``hp.MixedPrecisionPolicy`` for ``model.mixed_precision``: bf16 compute, fp32 reduction."""
    import hyperparallel as hp

    if cfg.model.mixed_precision == "bfloat16":
        return hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return hp.MixedPrecisionPolicy()


def shard(model: nn.Module, cfg: Config, mesh) -> None:
    """``hp.fully_shard`` on every decoder layer, then the root (one group each)."""
    import hyperparallel as hp

    policy = mixed_precision(cfg)
    # With activation checkpointing the recomputation in backward reads the layer's
    # parameters. On the CPU keep the full ones registered after forward: they live in
    # shared memory once per node either way, so this costs no memory. On a GPU they are
    # this rank's own allocation: free them, and the pre-backward hook pulls them again
    # before the recomputation (as with FSDP2).
    reshard = False if cfg.model.activation_checkpointing and mesh.device_type == "cpu" else None
    for layer in decoder_layers(model):
        hp.fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    hp.fully_shard(model, mesh=mesh, mp_policy=policy)


def rank_device(device_type: str) -> torch.device:
    """The device this rank computes on: the CPU, or its GPU (``hp.comm.device()``), made current."""
    if device_type == "cpu":
        return torch.device("cpu")
    import hyperparallel as hp

    device = hp.comm.device()
    torch.cuda.set_device(device)
    return device


def build_mesh(device_type: str):
    """1-D data-parallel mesh on one node; (nodes, ranks per node) HSDP across nodes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hyperparallel as hp

    topology = hp.comm.init().topology
    if topology.num_nodes > 1:
        return init_device_mesh(
            device_type, (topology.num_nodes, topology.local_world_size), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device_type, (dist.get_world_size(),))


def count_params(model: nn.Module) -> dict[str, int]:
    """Total parameters, and those active per token for a MoE (top-k of the experts)."""
    total = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    experts = getattr(config, "num_experts", 0) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert_params + (expert_params * top_k // experts if experts else 0)
    return {"total": total, "active": active, "experts": expert_params}


def describe_source(cfg: Config) -> str:
    """Where the initial weights come from, in words."""
    if cfg.model.pretrained is not None:
        return f"weights from {Path(cfg.model.pretrained)}"
    return f"fresh weights (seed {cfg.model.seed}) from {Path(cfg.model.config)}"

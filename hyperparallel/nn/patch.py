"""``hp.nn.patch``: swap a HuggingFace Qwen3 / Qwen3-MoE model's modules for fused ones in place."""

from __future__ import annotations

import warnings

import transformers
from torch import nn

from hyperparallel.nn.modules import EXPERTS_IMPLEMENTATION, FUSED, SUPPORTED_MODELS, FusedExperts

# The transformers release whose modeling code the fused modules reproduce.
TRANSFORMERS_VERSION = "5.23.0"


def patch(model: nn.Module) -> dict[str, type[nn.Module]]:
    """Replace the RMSNorms, attention, MLPs and MoE router/experts of ``model`` with fused modules.

    Works in place by changing each module's class to a subclass that
    overrides ``forward``; parameters (names, shapes, objects), state_dict
    keys, hooks and the decoder layers themselves are untouched, so
    ``from_pretrained`` checkpoints and later FSDP wrapping see the same model.
    A module with an option the fused kernels do not implement (sliding-window
    or dropout attention, a non-SiLU MLP, ...) is left as it is, with a warning.
    When experts are fused, the model's experts implementation becomes
    ``"hyperparallel"`` (``model.set_experts_implementation("grouped_mm")``
    goes back to HF's).

    Args:
        model: a ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` or their base
            ``Qwen3Model`` / ``Qwen3MoeModel`` from transformers 5.x.

    Returns:
        ``{qualified module name: the HF class it had}`` for every module
        replaced ("" is the model itself: Qwen3MoeForCausalLM gets its
        load-balancing loss from a fused kernel). Patching twice replaces nothing.

    Raises:
        TypeError: ``model`` is not one of the supported models.

    Example::

        import hyperparallel.nn as hpnn
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained("../shared/bench/qwen3-moe-small.config.json")
        model = AutoModelForCausalLM.from_config(config)
        replaced = hpnn.patch(model)
        print(len(replaced), replaced["model.norm"].__name__)  # ... Qwen3MoeRMSNorm
    """
    if not isinstance(model, SUPPORTED_MODELS):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_MODELS)
        raise TypeError(f"hp.nn.patch supports {names}; got {type(model).__name__}")
    if transformers.__version__ != TRANSFORMERS_VERSION:
        warnings.warn(
            f"hp.nn.patch reproduces transformers {TRANSFORMERS_VERSION}'s Qwen3 numerics; "
            f"found {transformers.__version__}",
            stacklevel=2,
        )
    replaced: dict[str, type[nn.Module]] = {}
    for name, module in model.named_modules():
        fused = FUSED.get(type(module))
        if fused is None:
            continue
        reason = fused.unsupported(module)
        if reason is not None:
            warnings.warn(
                f"hp.nn.patch left {name} ({type(module).__name__}) unpatched: {reason}", stacklevel=2
            )
            continue
        replaced[name] = type(module)
        module.__class__ = fused
    if any(issubclass(FUSED[cls], FusedExperts) for cls in replaced.values()):
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return replaced

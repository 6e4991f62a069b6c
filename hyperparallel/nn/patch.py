"""``hp.nn.patch``: swap a HuggingFace Qwen3 / Qwen3-MoE model's modules for fused ones in place."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import transformers
from torch import nn

from hyperparallel.nn.modules import EXPERTS_IMPLEMENTATION, FUSED, SUPPORTED_MODELS, FusedExperts

# The transformers releases whose Qwen3 / Qwen3-MoE modeling code the fused modules reproduce:
# ours (requirements.txt) and LlamaFactory 0.9.5's newest allowed (requirements-llamafactory.txt),
# whose modules have the same layout (stacked experts, the same router and attention).
TRANSFORMERS_VERSIONS = ("5.23.0", "5.6.0")


@dataclass
class PatchReport:
    """What :func:`patch` did to a model, for code that asserts on it.

    Attributes:
        replaced: ``{qualified module name: the HF class it had}`` for every
            module now fused ("" is the model itself: Qwen3MoeForCausalLM gets
            its load-balancing loss from a fused kernel).
        left: ``{qualified module name: why it stays HF's}`` for every module
            that has a fused counterpart but an option the kernels do not
            implement (``"sliding-window attention"``, ``"hidden_act='gelu'"``, ...).
    """

    replaced: dict[str, type[nn.Module]] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"hp.nn.patch: {len(self.replaced)} modules fused, {len(self.left)} left as HF's"]
        lines += [f"  {name or '<model>'}: {reason}" for name, reason in self.left.items()]
        return "\n".join(lines)


def patch(model: nn.Module) -> PatchReport:
    """Replace the RMSNorms, attention, MLPs, linear layers and MoE router/experts of ``model`` with fused modules.

    Works in place by changing each module's class to a subclass that
    overrides ``forward``; parameters (names, shapes, objects), state_dict
    keys, hooks and the decoder layers themselves are untouched, so
    ``from_pretrained`` checkpoints and later FSDP wrapping see the same model.
    A module with an option the fused kernels do not implement (sliding-window
    or dropout attention, a non-SiLU MLP, ...) is left as it is; the report
    says which and why, and one warning lists them. When experts are fused,
    the model's experts implementation becomes ``"hyperparallel"``
    (``model.set_experts_implementation("grouped_mm")`` goes back to HF's).

    Args:
        model: a ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` or their base
            ``Qwen3Model`` / ``Qwen3MoeModel`` from transformers 5.x.

    Returns:
        A :class:`PatchReport`: the modules replaced and the modules left with
        their reasons. Patching twice replaces nothing.

    Raises:
        TypeError: ``model`` is not one of the supported models.

    Example::

        import hyperparallel.nn as hpnn
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained("../shared/bench/qwen3-moe-small.config.json")
        model = AutoModelForCausalLM.from_config(config)
        report = hpnn.patch(model)
        assert not report.left
        print(len(report.replaced), report.replaced["model.norm"].__name__)  # ... Qwen3MoeRMSNorm
    """
    if not isinstance(model, SUPPORTED_MODELS):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_MODELS)
        raise TypeError(f"hp.nn.patch supports {names}; got {type(model).__name__}")
    if transformers.__version__ not in TRANSFORMERS_VERSIONS:
        warnings.warn(
            f"hp.nn.patch reproduces the Qwen3 numerics of transformers {' and '.join(TRANSFORMERS_VERSIONS)}; "
            f"found {transformers.__version__}",
            stacklevel=2,
        )
    report = PatchReport()
    for name, module in model.named_modules():
        fused = FUSED.get(type(module))
        if fused is None:
            continue
        reason = fused.unsupported(module)
        if reason is not None:
            report.left[name] = reason
            continue
        report.replaced[name] = type(module)
        module.__class__ = fused
    if any(issubclass(FUSED[cls], FusedExperts) for cls in report.replaced.values()):
        _select_fused_experts(model)
    if report.left:
        by_reason: dict[str, list[str]] = {}
        for name, reason in report.left.items():
            by_reason.setdefault(reason, []).append(name)
        listed = "; ".join(f"{reason}: {', '.join(names)}" for reason, names in by_reason.items())
        warnings.warn(f"hp.nn.patch left {len(report.left)} modules as HF's ({listed})", stacklevel=2)
    return report


def _select_fused_experts(model: nn.Module) -> None:
    """Make the model's experts dispatch to the fused kernel (HF's experts read the name from the config)."""
    try:
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    except ValueError:
        # A base Qwen3MoeModel on transformers 5.6, which checks the name against its built-in
        # implementations only (the fused Qwen3MoeForCausalLM accepts it): set the config's.
        model.config._experts_implementation = EXPERTS_IMPLEMENTATION

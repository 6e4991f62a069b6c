"""Fused replacements for the modules of HuggingFace Qwen3 and Qwen3-MoE.

Each fused class subclasses the HF class it replaces and overrides only
``forward``, which calls a ``torch.ops.hyperparallel`` kernel on the module's
own parameters, read at call time (they may be swapped for other tensors, e.g.
by FSDP). :func:`hyperparallel.nn.patch` turns HF modules into these in place by
changing their class, so parameters, buffers, hooks and state_dict keys stay
exactly as they were.

Example::

    import torch
    import hyperparallel.nn as hpnn
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(64)
    norm.__class__ = hpnn.modules.FusedQwen3RMSNorm  # what hp.nn.patch does
    y = norm(torch.randn(2, 64))
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.qwen3 import modeling_qwen3 as qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe
from transformers.utils.generic import can_return_tuple

import hyperparallel._C  # noqa: F401  (registers torch.ops.hyperparallel)

_ops = torch.ops.hyperparallel

# Attention implementations whose masks the fused attention reads: None, or a
# (batch or 1, 1, seq, seq) bool / additive tensor.
SUPPORTED_ATTENTION = ("sdpa", "eager")

# The dtypes the kernels compute in (float32 accumulation for both).
FUSED_DTYPES = (torch.float32, torch.bfloat16)

# The name under which the fused experts are registered with HF's experts
# interface; patch() selects it, model.set_experts_implementation() selects
# another ("eager", "grouped_mm", ...) or this one again.
EXPERTS_IMPLEMENTATION = "hyperparallel"

# ACT2FN names of SiLU, the activation the fused MLP and experts compute.
SILU = ("silu", "swish")

_warned_dtypes: set[frozenset[torch.dtype]] = set()
_warned_devices: set[tuple[str, str]] = set()
_warned_autocast: set[torch.dtype] = set()


try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # older transformers (LlamaFactory's 5.6): its Qwen3MoeForCausalLM slices this way

    def slice_logits_to_keep(hidden_states: Tensor, logits_to_keep: int | Tensor) -> Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


def _config(module: torch.nn.Module):
    return getattr(module, "config", None)


def _attn_implementation(config) -> str:
    # HF's attention runs eager when no implementation is set.
    return (config._attn_implementation if config is not None else None) or "eager"


# Which devices besides the CPU each op has kernels for in this build, read once (a constant
# torch.compile folds while tracing).
_DEVICE_KERNELS = {
    op: frozenset(
        device for device in ("cuda",)
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"hyperparallel::{op}", device.upper())
    )
    for op in ("rms_norm", "attention", "swiglu_mlp", "moe_router", "moe_experts", "moe_aux_loss")
}


def _has_kernel(op: str, device_type: str) -> bool:
    """Whether hyperparallel::<op> has a kernel for this device type in this build."""
    return device_type in ("cpu", "meta") or device_type in _DEVICE_KERNELS[op]


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on this device type, None where it is off (meta tensors have
    no autocast state: torch raises when asked)."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _fusable(op: str, *tensors: Tensor, same_dtype: bool = True) -> bool:
    """Whether the kernel ``op`` takes these tensors: on a device it has a kernel for (the CPU;
    CUDA as the CUDA kernels land), float32 or bfloat16, and one dtype if ``same_dtype``.

    When it does not (an fp16 or float64 model, a GPU op without its CUDA
    kernel yet, float32 weights under autocast to bfloat16), the caller runs
    HF's forward for that call instead; the first
    such call for each set of dtypes or device warns. The check reads only
    dtypes, device types and autocast's state, so torch.compile resolves it
    while tracing.
    """
    device_type = tensors[0].device.type
    if not _has_kernel(op, device_type):
        if (op, device_type) not in _warned_devices and not torch.compiler.is_compiling():
            _warned_devices.add((op, device_type))
            warnings.warn(
                f"hp.nn: hyperparallel::{op} has no {device_type} kernel in this build; these calls run HF's "
                "module instead",
                stacklevel=3,
            )
        return False
    dtypes = frozenset(t.dtype for t in tensors)
    # Autocast casts the inputs of each of HF's ops; the kernels take tensors as they are. Where
    # every tensor already has autocast's dtype there is nothing to cast: fused.
    cast = _autocast_dtype(device_type)
    if cast is not None and dtypes != {cast}:
        if cast not in _warned_autocast and not torch.compiler.is_compiling():
            _warned_autocast.add(cast)
            name = str(cast).removeprefix("torch.")
            warnings.warn(
                f"hp.nn: under torch.autocast({name}) the fused kernels take {name} weights only; calls with "
                f"others run HF's modules, with autocast's casts (for fused {name} compute, cast the model with "
                f".to(torch.{name}) or shard it with hp.MixedPrecisionPolicy(param_dtype=torch.{name}))",
                stacklevel=3,
            )
        return False
    if dtypes <= frozenset(FUSED_DTYPES) and (len(dtypes) == 1 or not same_dtype):
        return True
    if dtypes not in _warned_dtypes and not torch.compiler.is_compiling():
        _warned_dtypes.add(dtypes)
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        warnings.warn(
            f"hp.nn: the fused kernels compute float32 and bfloat16 (one dtype per call); calls with {names} "
            "run HF's modules instead (cast the model with .float() or .bfloat16() to use the fused ones)",
            stacklevel=3,
        )
    return False


class FusedLinear(torch.nn.Linear):
    """``nn.Linear`` on the fused modules' matrix products (``hyperparallel::linear``).

    The attention projections and the LM head are almost half of
    qwen3-moe-bench's forward arithmetic, so on the CPU they run where the
    fused experts and attention do: float32 on hp's AVX-512 kernel where MKL
    would take its AVX2 path (CPUs it does not take for Intel's: half of an
    AMD Zen 5 core), and bfloat16 in float32 where the CPU has no bfloat16
    dot products to run oneDNN's at full rate (Intel's AVX-512 CPUs up to
    Ice Lake: docs/nn.md). Anything else (a GPU; autocast, which casts the
    operands; other dtypes) is ``nn.Linear``'s own forward.
    """

    def forward(self, input: Tensor) -> Tensor:
        tensors = (input, self.weight) if self.bias is None else (input, self.weight, self.bias)
        if (
            not torch.is_autocast_enabled("cpu")
            and all(t.device.type == "cpu" for t in tensors)
            and len({t.dtype for t in tensors}) == 1
            and input.dtype in FUSED_DTYPES
        ):
            return _ops.linear(input, self.weight, self.bias)
        return super().forward(input)

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        return None


class FusedRMSNorm:
    """HF RMSNorm as one pass forward and one backward (``hyperparallel::rms_norm``)."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        if not _fusable("rms_norm", hidden_states, self.weight, same_dtype=False):
            return super().forward(hidden_states)
        return _ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        return None


class FusedAttention:
    """q/k-norm, RoPE and causal GQA attention in one op (``hyperparallel::attention``).

    The projections stay ``nn.Linear`` modules (:class:`FusedLinear` once
    patched). A call takes HF's path
    instead when the kernel cannot serve it: the attention weights are asked
    for (``output_attentions``, as a keyword or in the config), the KV cache
    holds earlier tokens or is a static cache (whose mask spans the whole
    cache), the mask is longer than the sequence, the attention implementation
    was set to one other than sdpa/eager after patching, or the dtypes are not
    float32/bfloat16. Every one of these tests reads only shapes, dtypes,
    config values and Python objects, so ``torch.compile(fullgraph=True)``
    resolves the choice while tracing.
    """

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor | None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        if self._takes_hf_path(hidden_states, attention_mask, past_key_values, kwargs):
            return super().forward(
                hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
            )
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape)
        cos, sin = position_embeddings
        out, k_rope = _ops.attention(
            q,
            k,
            v,
            self.q_norm.weight,
            self.k_norm.weight,
            cos,
            sin,
            attention_mask,
            self.q_norm.variance_epsilon,
            self.k_norm.variance_epsilon,
            self.scaling,
        )
        if past_key_values is not None:
            past_key_values.update(k_rope, v.transpose(1, 2), self.layer_idx)
        return self.o_proj(out.flatten(-2)), None

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        config = _config(module)
        if getattr(module, "sliding_window", None) is not None:
            return "sliding-window attention"
        if config is not None and config.attention_dropout:
            return f"attention_dropout={config.attention_dropout}"
        implementation = _attn_implementation(config)
        if implementation not in SUPPORTED_ATTENTION:
            return f"attn_implementation={implementation!r} (fused attention reads sdpa/eager masks)"
        if module.head_dim % 2:
            return f"odd head_dim={module.head_dim}"
        return None

    def _takes_hf_path(self, hidden_states: Tensor, attention_mask, past_key_values, kwargs: dict) -> bool:
        if kwargs.get("output_attentions", self.config.output_attentions):
            return True  # the kernel keeps no attention weights
        if _attn_implementation(self.config) not in SUPPORTED_ATTENTION:
            return True  # set_attn_implementation() after patching
        seq = hidden_states.shape[-2]
        if attention_mask is not None and (
            not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape[-2:]) != (seq, seq)
        ):
            return True  # a mask the kernel cannot read, or keys beyond this call's tokens
        if past_key_values is not None and (
            # A static cache's length is data (how many slots are filled): never branch on it.
            past_key_values.is_compileable or past_key_values.get_seq_length(self.layer_idx) > 0
        ):
            return True
        return not _fusable("attention", hidden_states, self.q_norm.weight, self.k_norm.weight)


class FusedSwiGLU:
    """HF's gated MLP ``down(silu(gate(x)) * up(x))`` (``hyperparallel::swiglu_mlp``)."""

    def forward(self, x: Tensor) -> Tensor:
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if not _fusable("swiglu_mlp", x, *weights):
            return super().forward(x)
        return _ops.swiglu_mlp(x, *weights)

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        if module.config.hidden_act not in SILU:
            return f"hidden_act={module.config.hidden_act!r}"
        if any(p.bias is not None for p in (module.gate_proj, module.up_proj, module.down_proj)):
            return "biased projections"
        return None


class FusedRouter:
    """Router logits, float32 softmax, top-k and renormalisation (``hyperparallel::moe_router``)."""

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not _fusable("moe_router", hidden_states, self.weight):
            return super().forward(hidden_states)
        flat = hidden_states.reshape(-1, self.hidden_dim)
        return _ops.moe_router(flat, self.weight, self.top_k, self.norm_topk_prob)

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        return None


class FusedExperts:
    """Grouped expert GEMMs on tokens sorted by expert (``hyperparallel::moe_experts``).

    HF's experts dispatch on ``config._experts_implementation``; the kernel is
    registered there as ``"hyperparallel"`` (:func:`experts_forward`), which
    patch() selects. ``model.set_experts_implementation("grouped_mm")`` (or
    ``"eager"``, ...) runs HF's implementation again, and
    ``set_experts_implementation("hyperparallel")`` the kernel.
    """

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        if module.config.hidden_act not in SILU:
            return f"hidden_act={module.config.hidden_act!r}"
        layout = {
            "has_gate": True,
            "has_bias": False,
            "is_transposed": False,
            "is_concatenated": True,
            "has_post_expert_norm": False,
            "_is_expert_parallel": False,
        }
        for name, expected in layout.items():
            if getattr(module, name, expected) != expected:
                return f"experts with {name}={not expected}"
        return None


def experts_forward(
    module: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The experts implementation ``"hyperparallel"``: the fused kernel on patched experts.

    Experts that patch() did not swap (a model built later from a patched
    model's config object) and dtypes other than float32/bfloat16 run HF's
    eager loop over experts, the reference the kernel reproduces.
    """
    if isinstance(module, FusedExperts) and _fusable("moe_experts", hidden_states, module.gate_up_proj, module.down_proj):
        return _ops.moe_experts(
            hidden_states, module.gate_up_proj, module.down_proj, top_k_index, top_k_weights
        )
    if hidden_states.device.type != "cpu" and "grouped_mm" in ALL_EXPERTS_FUNCTIONS:
        # A device without the fused kernel: HF's own default there (sorted tokens, grouped GEMMs),
        # not its eager loop, which syncs with the host once per expert.
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](module, hidden_states, top_k_index, top_k_weights)
    # HF's use_experts_implementation wraps the eager forward in its dispatcher (functools.wraps).
    return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


class FusedQwen3RMSNorm(FusedRMSNorm, qwen3.Qwen3RMSNorm):
    pass


class FusedQwen3Attention(FusedAttention, qwen3.Qwen3Attention):
    pass


class FusedQwen3MLP(FusedSwiGLU, qwen3.Qwen3MLP):
    pass


class FusedQwen3MoeRMSNorm(FusedRMSNorm, qwen3_moe.Qwen3MoeRMSNorm):
    pass


class FusedQwen3MoeAttention(FusedAttention, qwen3_moe.Qwen3MoeAttention):
    pass


class FusedQwen3MoeMLP(FusedSwiGLU, qwen3_moe.Qwen3MoeMLP):
    pass


class FusedQwen3MoeTopKRouter(FusedRouter, qwen3_moe.Qwen3MoeTopKRouter):
    pass


class FusedQwen3MoeExperts(FusedExperts, qwen3_moe.Qwen3MoeExperts):
    pass


class Qwen3MoeForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    """HF's Qwen3MoeForCausalLM with the load-balancing loss in C++ (``hyperparallel::moe_aux_loss``).

    It keeps HF's class name because ``save_pretrained`` records the class name
    as the checkpoint's architecture.
    """

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # HF lets set_experts_implementation() change a model's config only when the model
        # class's source file uses HF's experts decorator (a heuristic on the file's text);
        # this file's experts do dispatch on the config.
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # transformers 5.6 accepts only its built-in names here, though its experts dispatch on
        # any name registered with ALL_EXPERTS_FUNCTIONS (later releases accept those).
        if requested_experts == EXPERTS_IMPLEMENTATION:
            return requested_experts
        return super().get_correct_experts_implementation(requested_experts)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits:
            router_logits = torch.stack(outputs.router_logits)
            # The LM head's weight stands for the model's dtype: under autocast the logits are
            # autocast's whatever the weights are, and HF's loss then takes its casts.
            if _fusable("moe_aux_loss", router_logits, self.lm_head.weight):
                aux_loss = _ops.moe_aux_loss(router_logits, self.num_experts_per_tok, attention_mask)
            else:
                aux_loss = qwen3_moe.load_balancing_loss_func(
                    outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
                )
            if loss is not None:
                loss += self.router_aux_loss_coef * aux_loss.to(loss.device)  # in place, as HF: the sum keeps the LM loss's dtype
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )

    @staticmethod
    def unsupported(module: torch.nn.Module) -> str | None:
        return None


# HF class -> the fused class that replaces it (exact types: a subclass of
# nn.Linear, e.g. a LoRA layer, keeps its own forward).
FUSED: dict[type, type] = {
    torch.nn.Linear: FusedLinear,
    qwen3.Qwen3RMSNorm: FusedQwen3RMSNorm,
    qwen3.Qwen3Attention: FusedQwen3Attention,
    qwen3.Qwen3MLP: FusedQwen3MLP,
    qwen3_moe.Qwen3MoeRMSNorm: FusedQwen3MoeRMSNorm,
    qwen3_moe.Qwen3MoeAttention: FusedQwen3MoeAttention,
    qwen3_moe.Qwen3MoeMLP: FusedQwen3MoeMLP,
    qwen3_moe.Qwen3MoeTopKRouter: FusedQwen3MoeTopKRouter,
    qwen3_moe.Qwen3MoeExperts: FusedQwen3MoeExperts,
    qwen3_moe.Qwen3MoeForCausalLM: Qwen3MoeForCausalLM,
}

# The models patch() accepts.
SUPPORTED_MODELS: tuple[type, ...] = (
    qwen3.Qwen3ForCausalLM,
    qwen3.Qwen3Model,
    qwen3_moe.Qwen3MoeForCausalLM,
    qwen3_moe.Qwen3MoeModel,
)

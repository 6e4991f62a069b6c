"""hp.nn.patch on whole HF models: parity with the unpatched model, and what patching keeps.

Parity: logits, loss (with and without the load-balancing loss) and every
parameter's gradient within 1e-5 absolute in float32, on tiny random configs
that differ in heads, kv heads, head_dim, experts, top-k, norm_topk_prob,
sequence length and dense layers, and on ../shared/bench/qwen3-moe-small.
"""

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.cache_utils import DynamicCache
from transformers.generation.configuration_utils import CompileConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import hyperparallel.nn as hpnn

SHARED_SMALL = Path(__file__).resolve().parents[3] / "shared" / "bench" / "qwen3-moe-small.config.json"
STRICT = {"atol": 1e-5, "rtol": 0}


def moe(heads, kv_heads, head_dim, experts, top_k, norm, seq, **extra) -> dict:
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": norm,
        "seq": seq,
        **extra,
    }


def dense(heads, kv_heads, head_dim, seq, **extra) -> dict:
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "seq": seq, **extra}


MOE_CONFIGS = {
    "h4-kv2-d16-e8-k2-norm": moe(4, 2, 16, 8, 2, True, seq=33),
    "h8-kv1-d8-e4-k1": moe(8, 1, 8, 4, 1, False, seq=17),
    "h2-kv2-d32-e16-k4-norm-dense1": moe(2, 2, 32, 16, 4, True, seq=64, mlp_only_layers=[1]),
    "h6-kv3-d16-e5-k3-step2": moe(6, 3, 16, 5, 3, False, seq=48, decoder_sparse_step=2),
    "h4-kv4-d64-e8-k8-norm": moe(4, 4, 64, 8, 8, True, seq=9),
    "h8-kv2-d16-e12-k2-norm-long": moe(8, 2, 16, 12, 2, True, seq=130, batch=1),
}
# i42: an intermediate size that is no whole number of 16-byte packs (the CUDA kernels' one-element path).
DENSE_CONFIGS = {"h4-kv2-d16": dense(4, 2, 16, seq=31), "h3-kv1-d32-i42": dense(3, 1, 32, seq=70, intermediate_size=42)}


def make_config(kind: str, **values):
    common = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 40,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "initializer_range": 0.1,
        "rms_norm_eps": 1e-6,
    }
    common.update(values)
    return (Qwen3MoeConfig if kind == "moe" else Qwen3Config)(**common)


def build(config, seed: int, patch: bool = True):
    """An HF model with weights far from zero (norm weights around 1) and its patched twin (or None)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    if not patch:
        return model, None
    fused = copy.deepcopy(model)
    hpnn.patch(fused)
    return model, fused


def forward_backward(model, ids, **kwargs):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, **{k: v for k, v in kwargs.items() if v is not None})
    out.loss.backward()
    # A compiled model names its parameters under _orig_mod.
    return out, {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters()}


def assert_model_parity(model, fused, ids, tolerance=STRICT, aux_options=(False, True)):
    for aux in aux_options:
        (ref, ref_grads), (got, got_grads) = (
            forward_backward(m, ids, output_router_logits=aux) for m in (model, fused)
        )
        assert_close(got.logits, ref.logits, **tolerance)
        assert_close(got.loss, ref.loss, **tolerance)
        if aux:
            assert_close(got.aux_loss, ref.aux_loss, **tolerance)
        for name in ref_grads:
            assert_close(
                got_grads[name],
                ref_grads[name],
                **tolerance,
                msg=lambda m, n=f"{name} (aux={aux})": f"{n}: {m}",
            )


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_qwen3_moe_matches_hf(name):
    values = dict(MOE_CONFIGS[name])
    seq, batch = values.pop("seq"), values.pop("batch", 2)
    model, fused = build(make_config("moe", **values), seed=len(name))
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq))
    assert_model_parity(model, fused, ids)


@pytest.mark.parametrize("name", DENSE_CONFIGS)
def test_qwen3_matches_hf(name):
    values = dict(DENSE_CONFIGS[name])
    seq = values.pop("seq")
    model, fused = build(make_config("dense", **values), seed=len(name))
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
    assert_model_parity(model, fused, ids, aux_options=(None,))


def test_shared_small_config_matches_hf():
    config = AutoConfig.from_pretrained(SHARED_SMALL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    fused = copy.deepcopy(model)
    hpnn.patch(fused)
    ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
    assert_model_parity(model, fused, ids)


def test_bfloat16_is_as_close_to_float32_as_hf():
    """bf16 tolerance: the patched bf16 model must be no further from the float32 result than HF's own bf16 model.

    Both bf16 models share weights; the float32 reference runs the same (bf16
    -representable) weights. HF rounds to bf16 after every op, the fused
    kernels only where HF's output dtype demands it (accumulating in float32),
    so their error should be at most HF's; the factor 1.5 plus one bf16 ulp of
    slack absorbs the two errors' different signs.
    """
    config = make_config(
        "moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    model, _ = build(config, seed=3, patch=False)
    model = model.to(torch.bfloat16)
    fused = copy.deepcopy(model)
    hpnn.patch(fused)
    reference = copy.deepcopy(model).float()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    results = [forward_backward(m, ids, output_router_logits=True) for m in (reference, model, fused)]
    (ref, ref_grads), (hf_out, hf_grads), (hp_out, hp_grads) = results

    def error(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()

    pairs = [
        ("logits", hp_out.logits, hf_out.logits, ref.logits),
        ("loss", hp_out.loss, hf_out.loss, ref.loss),
    ]
    pairs += [(n, hp_grads[n], hf_grads[n], ref_grads[n]) for n in ref_grads]
    for name, hp, hf, fp32 in pairs:
        assert error(hp, fp32) <= 1.5 * error(hf, fp32) + 2**-8, (
            f"{name}: hp {error(hp, fp32):.2e} vs HF {error(hf, fp32):.2e}"
        )


def test_patch_keeps_parameters_names_and_state_dict():
    model, _ = build(
        make_config(
            "moe",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        ),
        seed=4,
        patch=False,
    )
    before = dict(model.named_parameters())
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    report = hpnn.patch(model)
    assert dict(model.named_parameters()) == before  # the same Parameter objects under the same names
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    layer = model.model.layers[1]
    replaced = report.replaced
    assert report.left == {}
    assert replaced[""].__name__ == "Qwen3MoeForCausalLM"
    assert replaced["model.layers.0.mlp"].__name__ == "Qwen3MoeMLP"
    assert replaced["model.layers.1.mlp.experts"].__name__ == "Qwen3MoeExperts"
    assert replaced["model.layers.1.mlp.gate"].__name__ == "Qwen3MoeTopKRouter"
    assert replaced["model.layers.1.self_attn"].__name__ == "Qwen3MoeAttention"
    assert replaced["model.norm"].__name__ == "Qwen3MoeRMSNorm"
    assert isinstance(layer.self_attn, replaced["model.layers.1.self_attn"])  # still an HF module
    assert type(layer).__name__ == "Qwen3MoeDecoderLayer"  # decoder layers stay for FSDP
    assert hpnn.patch(model) == hpnn.PatchReport()  # patching twice replaces nothing


def test_unknown_model_raises():
    llama = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
        )
    )
    with pytest.raises(TypeError, match="hp.nn.patch supports"):
        hpnn.patch(llama)


def test_sliding_window_attention_is_left_unpatched_with_a_warning():
    config = make_config(
        "dense",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    model, _ = build(config, seed=5, patch=False)
    fused = copy.deepcopy(model)
    left = r"left 1 modules as HF's \(sliding-window attention: model.layers.1.self_attn\)"
    with pytest.warns(UserWarning, match=left):
        report = hpnn.patch(fused)
    assert "model.layers.0.self_attn" in report.replaced
    assert report.left == {"model.layers.1.self_attn": "sliding-window attention"}
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    assert_model_parity(model, fused, ids, aux_options=(None,))


def test_unsupported_attention_implementation_is_left_unpatched():
    config = make_config("dense", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config._attn_implementation = "flex_attention"
    model = AutoModelForCausalLM.from_config(config)
    with pytest.warns(UserWarning, match="flex_attention"):
        report = hpnn.patch(model)
    assert not any(name.endswith("self_attn") for name in report.replaced)
    reason = "attn_implementation='flex_attention' (fused attention reads sdpa/eager masks)"
    assert report.left == {f"model.layers.{i}.self_attn": reason for i in range(2)}


def test_parameters_replaced_after_patching_are_used():
    """FSDP swaps parameters for other tensors after patching: the fused modules read them at call time."""
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    model, fused = build(config, seed=6)
    torch.manual_seed(7)
    for name, p in list(model.named_parameters()):
        new = torch.nn.Parameter(p.detach() + 0.05 * torch.randn_like(p))
        for m in (model, fused):
            owner = m.get_submodule(name.rpartition(".")[0])
            setattr(owner, name.rpartition(".")[2], torch.nn.Parameter(new.detach().clone()))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    assert_model_parity(model, fused, ids, aux_options=(True,))


def test_generation_with_kv_cache_matches_hf():
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    model, fused = build(config, seed=8)
    prompt = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = [
            m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0) for m in (model, fused)
        ]
    assert torch.equal(tokens[1], tokens[0])


def test_attention_weights_come_from_hf_when_asked_for():
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    config._attn_implementation = "eager"
    model, fused = build(config, seed=11)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref, got = (m(input_ids=ids, output_attentions=True) for m in (model, fused))
    assert len(got.attentions) == len(ref.attentions) == config.num_hidden_layers
    for a, b in zip(got.attentions, ref.attentions):
        assert_close(a, b, **STRICT)
    assert_close(got.logits, ref.logits, **STRICT)


def test_torch_compile_matches_eager():
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    _, fused = build(config, seed=9)
    compiled_model = copy.deepcopy(fused)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(6))
    # HF installs the hooks that collect router logits on first use, under a lock dynamo cannot
    # trace (unpatched models too): one eager call installs them before the fullgraph compile.
    compiled_model(input_ids=ids[:, :2], output_router_logits=True, use_cache=False)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    (eager, eager_grads), (comp, comp_grads) = (
        forward_backward(m, ids, output_router_logits=True, use_cache=False) for m in (fused, compiled)
    )
    assert_close(comp.loss, eager.loss, **STRICT)
    for name in eager_grads:
        assert_close(comp_grads[name], eager_grads[name], **STRICT)


def test_save_and_from_pretrained_round_trip(tmp_path):
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    model, fused = build(config, seed=10)
    fused.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    hpnn.patch(reloaded)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, **STRICT)


def test_attention_weights_come_from_hf_when_the_config_asks():
    """config.output_attentions = True (no keyword) returns HF's attention weights; the keyword still wins."""
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    config._attn_implementation = "eager"
    model, fused = build(config, seed=12)
    for m in (model, fused):
        m.config.output_attentions = True
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref, got = (m(input_ids=ids) for m in (model, fused))
        without = fused(input_ids=ids, output_attentions=False)
    assert got.attentions is not None
    assert len(got.attentions) == len(ref.attentions) == config.num_hidden_layers
    for a, b in zip(got.attentions, ref.attentions):
        assert_close(a, b, **STRICT)
    assert without.attentions is None
    assert_close(without.logits, ref.logits, **STRICT)


STATIC_GREEDY = {"max_new_tokens": 4, "do_sample": False, "cache_implementation": "static", "pad_token_id": 0}


def _graph_recorder(graphs: list):
    """A torch.compile backend that keeps each FX graph's call targets and runs the graph as traced."""

    def backend(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm.forward

    return backend


def test_fullgraph_compile_without_and_with_a_cache():
    """torch.compile(forward, fullgraph=True): no cache, a dynamic cache (prefill + decoding), and HF's
    generate with a static cache and a fullgraph compile config; each matches the eager HF model."""
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    model, fused = build(config, seed=14)
    model.eval(), fused.eval()
    graphs: list = []
    compiled = torch.compile(fused.forward, fullgraph=True, backend=_graph_recorder(graphs))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        assert_close(compiled(input_ids=ids, use_cache=False).logits, model(input_ids=ids).logits, **STRICT)
        assert "hyperparallel.attention" in graphs[-1] and "hyperparallel.moe_experts" in graphs[-1]

        ref_cache, cache = DynamicCache(config=model.config), DynamicCache(config=fused.config)
        step = ids
        for _ in range(3):  # the prefill runs the kernel; decoding steps read the cache with HF's attention
            ref = model(input_ids=step, past_key_values=ref_cache, use_cache=True)
            got = compiled(input_ids=step, past_key_values=cache, use_cache=True)
            assert_close(got.logits, ref.logits, **STRICT)
            step = ref.logits[:, -1:].argmax(-1)
        for a, b in zip(cache.layers, ref_cache.layers):
            assert_close(a.keys, b.keys, **STRICT)

    # HF compiles the forward for static caches on accelerators only, unless asked for every device.
    compile_config = CompileConfig(fullgraph=True, backend=_graph_recorder(graphs), mode=None)
    compile_config._compile_all_devices = True
    prompt = ids[:, :5]
    graphs.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(prompt, **STATIC_GREEDY)
        tokens = fused.generate(prompt, **STATIC_GREEDY, compile_config=compile_config)
    assert graphs and all("hyperparallel.rms_norm" in graph for graph in graphs), "no fused forward compiled"
    assert torch.equal(tokens, expected)


def _ran_kernel(model, ids, op: str) -> tuple[torch.Tensor, bool]:
    """The model's logits, and whether the forward ran torch.ops.hyperparallel.<op> (per the profiler)."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(input_ids=ids).logits
    return logits, any(event.name == f"hyperparallel::{op}" for event in prof.events())


def test_attention_implementation_set_after_patching_runs_hf():
    """An implementation chosen after patch() (here sdpa under another registered name) is HF's to run."""
    calls = []

    def counted_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("counted_sdpa", counted_sdpa)
    AttentionMaskInterface.register("counted_sdpa", sdpa_mask)
    config = make_config("dense", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model, fused = build(config, seed=16)
    fused.set_attn_implementation("counted_sdpa")
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(13))
    got, kernel = _ran_kernel(fused, ids, "attention")
    assert not kernel and len(calls) == config.num_hidden_layers
    assert_close(got, model(input_ids=ids).logits, **STRICT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_dtypes_run_hf_modules_with_one_warning(dtype):
    """A dtype the kernels do not compute runs HF's modules, bit for bit, and warns once; it never raises."""
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    model, _ = build(config, seed=13, patch=False)
    model = model.to(dtype)
    model.set_experts_implementation("eager")  # the experts' fallback is HF's reference loop
    fused = copy.deepcopy(model)
    hpnn.modules._warned_dtypes.clear()  # earlier tests in this process may have warned already
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hpnn.patch(fused)
        (got, got_grads), _ = (forward_backward(fused, ids, output_router_logits=True) for _ in range(2))
        prompt = ids[:, :5]
        tokens = fused.generate(prompt, **STATIC_GREEDY)
    ours = [str(w.message) for w in caught if "hp.nn" in str(w.message)]
    assert len(ours) == 1 and str(dtype).removeprefix("torch.") in ours[0], ours
    ref, ref_grads = forward_backward(model, ids, output_router_logits=True)
    assert got.logits.dtype == dtype
    assert torch.equal(got.logits, ref.logits)
    assert torch.equal(got.loss, ref.loss) and torch.equal(got.aux_loss, ref.aux_loss)
    for name in ref_grads:
        assert torch.equal(got_grads[name], ref_grads[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(prompt, **STATIC_GREEDY)
    assert torch.equal(tokens, expected)


def test_autocast_over_float32_weights_runs_hf_modules_with_one_warning():
    """Under autocast to bf16, float32 weights are HF's to run: autocast casts each op's inputs (the
    fused kernels would compute in float32, and attention would meet bf16 projections), so the
    patched model equals HF's under the same autocast, bit for bit, and warns once. Weights already
    in the autocast dtype keep the fused kernels: autocast changes nothing there."""
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    model, fused = build(config, seed=17)
    for m in (model, fused):
        m.set_experts_implementation("eager")  # the experts' fallback is HF's reference loop
    hpnn.modules._warned_autocast.clear()  # earlier tests in this process may have warned already
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(11))
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got, got_grads), _ = (forward_backward(fused, ids, output_router_logits=True) for _ in range(2))
        ref, ref_grads = forward_backward(model, ids, output_router_logits=True)
    ours = [str(w.message) for w in caught if "hp.nn" in str(w.message)]
    assert len(ours) == 1 and "autocast" in ours[0], ours
    assert got.logits.dtype == ref.logits.dtype == torch.bfloat16
    assert torch.equal(got.logits, ref.logits)
    assert torch.equal(got.loss, ref.loss) and torch.equal(got.aux_loss, ref.aux_loss)
    for name in ref_grads:
        assert torch.equal(got_grads[name], ref_grads[name]), name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, kernel = _ran_kernel(fused.bfloat16(), ids, "rms_norm")
    assert kernel


def test_a_patched_model_runs_on_the_meta_device():
    """Shapes only (planning memory, tracing): forward and backward on meta tensors, which have no
    autocast state to ask about, give HF's shapes."""
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    hpnn.patch(model)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    assert out.logits.shape == (2, 8, 128) and out.logits.device.type == "meta"
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_set_experts_implementation_routes_to_hf_and_back():
    config = make_config(
        "moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2
    )
    model, fused = build(config, seed=15)
    assert fused.config._experts_implementation == hpnn.modules.EXPERTS_IMPLEMENTATION
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(12))
    logits, kernel = _ran_kernel(fused, ids, "moe_experts")
    assert kernel
    for implementation in ("eager", "grouped_mm"):
        for m in (model, fused):
            m.set_experts_implementation(implementation)
        assert fused.config._experts_implementation == implementation
        got, kernel = _ran_kernel(fused, ids, "moe_experts")
        assert not kernel, implementation
        assert_close(got, model(input_ids=ids).logits, **STRICT)
    fused.set_experts_implementation(hpnn.modules.EXPERTS_IMPLEMENTATION)
    got, kernel = _ran_kernel(fused, ids, "moe_experts")
    assert kernel and torch.equal(got, logits)


def test_patch_reports_what_it_left_and_why():
    """Non-SiLU MLPs and experts and sliding-window layers stay HF's; the report names each, with why.
    "swish" is ACT2FN's other name for SiLU, so its MLPs are fused."""
    moe_config = make_config(
        "moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        hidden_act="gelu",
    )
    dense_config = make_config(
        "dense",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="gelu_pytorch_tanh",
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    swish_config = make_config(
        "dense", num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="swish"
    )
    expected = {
        "moe": {
            "model.layers.0.mlp": "hidden_act='gelu'",
            "model.layers.1.mlp.experts": "hidden_act='gelu'",
        },
        "dense": {
            "model.layers.0.mlp": "hidden_act='gelu_pytorch_tanh'",
            "model.layers.1.self_attn": "sliding-window attention",
            "model.layers.1.mlp": "hidden_act='gelu_pytorch_tanh'",
        },
        "swish": {},
    }
    for kind, config in (("moe", moe_config), ("dense", dense_config), ("swish", swish_config)):
        model, _ = build(config, seed=17, patch=False)
        fused = copy.deepcopy(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = hpnn.patch(fused)
        left_warnings = [w for w in caught if "hp.nn.patch left" in str(w.message)]
        assert len(left_warnings) == (1 if expected[kind] else 0)
        assert report.left == expected[kind]
        assert not set(report.left) & set(report.replaced)
        assert "model.layers.1.input_layernorm" in report.replaced and "model.norm" in report.replaced
        assert ("model.layers.0.mlp" in report.replaced) == (kind == "swish")
        for name, reason in report.left.items():
            assert f"{name}: {reason}" in str(report)
        if kind == "moe":  # experts left as HF's keep HF's experts implementation
            assert fused.config._experts_implementation != hpnn.modules.EXPERTS_IMPLEMENTATION
        ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(14))
        aux = (False, True) if kind == "moe" else (None,)
        assert_model_parity(model, fused, ids, aux_options=aux)

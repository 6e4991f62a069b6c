"""The fused modules on CUDA against HF's on the same GPU: the RMSNorm kernels, norm + RoPE around
SDPA, the experts on grouped GEMMs, and whole patched Qwen3 / Qwen3-MoE models (logits, loss, aux
loss, every gradient) in float32 and bfloat16."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_nn_patch import DENSE_CONFIGS, MOE_CONFIGS, _graph_recorder, build, make_config
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

import hyperparallel.nn as hpnn
from hyperparallel.nn.modules import _DEVICE_KERNELS, FUSED, experts_forward

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("rows,n", [(1, 8), (7, 100), (333, 2048), (2048, 4096)])
def test_rms_norm_matches_hf_in_fp32_and_bf16(rows, n):
    generator = torch.Generator().manual_seed(rows + n)
    x32 = torch.randn(rows, n, generator=generator).to(DEVICE)
    w32 = (1 + 0.1 * torch.randn(n, generator=generator)).to(DEVICE)
    dy32 = torch.randn(rows, n, generator=generator).to(DEVICE)
    results = {}  # per dtype: (HF's, ours), each (output, input's gradient, weight's gradient)
    for dtype in (torch.float32, torch.bfloat16):
        hf = Qwen3MoeRMSNorm(n, eps=1e-6).to(DEVICE, dtype)
        hf.weight.data.copy_(w32)
        ours = copy.deepcopy(hf)
        ours.__class__ = FUSED[type(hf)]  # what hp.nn.patch swaps in
        outputs = []
        for module in (hf, ours):
            x = x32.to(dtype, copy=True).requires_grad_(True)
            y = module(x)
            y.backward(dy32.to(dtype))
            outputs.append((y.detach(), x.grad, module.weight.grad))
            module.weight.grad = None
        results[dtype] = outputs
    (hf32, ours32), (hf16, ours16) = results[torch.float32], results[torch.bfloat16]
    assert max(_rel(a, b) for a, b in zip(ours32, hf32)) <= 1e-5
    # bf16: no further from HF's float32 result than HF's own bf16 module is, x 1.5.
    for ours, hf, reference in zip(ours16, hf16, hf32):
        assert _rel(ours, reference) <= 1.5 * _rel(hf, reference) + 2**-8, (_rel(ours, reference), _rel(hf, reference))


def test_patched_moe_model_on_cuda_equals_hf():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    hf = Qwen3MoeForCausalLM(config).to(DEVICE)
    ours = copy.deepcopy(hf)
    report = hpnn.patch(ours)
    assert not report.left
    tokens = torch.randint(0, 101, (2, 24), device=DEVICE)
    results = []
    for model in (hf, ours):
        out = model(tokens, labels=tokens)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (hf_logits, hf_loss, hf_grads), (logits, loss, grads) = results
    assert _rel(logits, hf_logits) <= 1e-5
    assert abs(loss.item() - hf_loss.item()) <= 1e-5
    for name, grad in hf_grads.items():
        assert _rel(grads[name], grad) <= 1e-4, name


def test_every_fused_op_has_its_cuda_kernel():
    """A warning per op and process is easy to miss: the build itself must have them all."""
    assert all("cuda" in devices for devices in _DEVICE_KERNELS.values()), _DEVICE_KERNELS


def test_a_tensor_on_another_device_is_refused():
    """A weight or cos/sin left on the host would be read through a host pointer by the kernel (an
    illegal address that poisons the CUDA context): the op refuses it first."""
    x = torch.randn(1, 3, 2, 8, device=DEVICE)
    weight, cos, sin = torch.ones(8, device=DEVICE), torch.ones(1, 3, 8, device=DEVICE), torch.zeros(1, 3, 8, device=DEVICE)
    for args in ((weight.cpu(), cos, sin), (weight, cos.cpu(), sin), (weight, cos, sin.cpu())):
        with pytest.raises(RuntimeError, match="norm_rope: its tensors are on"):
            torch.ops.hyperparallel.norm_rope(x, *args, 1e-6)
    torch.cuda.synchronize()  # the context is still sound


def _norm_rope64(x, weight, cos, sin, eps):
    """HF's q/k RMSNorm then rotate-half RoPE in float64 (differentiable), to (b, h, s, d)."""
    y = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    half = x.shape[-1] // 2
    rotated = torch.cat([-y[..., half:], y[..., :half]], -1)
    return (y * cos[:, :, None, :] + rotated * sin[:, :, None, :]).transpose(1, 2)


@pytest.mark.parametrize("cos_batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_against_float64(dtype, cos_batch):
    """Enough rows (2 x 701 x 8) that the weight's gradient is summed by several blocks, the last short,
    and cos/sin per batch as well as shared; forward and both gradients against float64 autograd
    on the same (dtype-rounded) inputs."""
    generator = torch.Generator().manual_seed(9)
    b, s, h, d = 2, 701, 8, 128
    x = torch.randn(b, s, h, d, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=generator)).to(dtype)
    angles = torch.rand(cos_batch, s, d // 2, generator=generator) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    grad = torch.randn(b, h, s, d, generator=generator).to(dtype)
    xd, wd = x.to(DEVICE).requires_grad_(True), weight.to(DEVICE).requires_grad_(True)
    out = torch.ops.hyperparallel.norm_rope(xd, wd, cos.to(DEVICE), sin.to(DEVICE), 1e-6)
    out.backward(grad.to(DEVICE))
    x64, w64 = x.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = _norm_rope64(x64, w64, cos.double(), sin.double(), 1e-6)
    ref.backward(grad.double())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(out.detach().cpu(), ref.detach()) <= tolerance
    assert _rel(xd.grad.cpu(), x64.grad) <= tolerance
    assert _rel(wd.grad.cpu(), w64.grad) <= tolerance


def _forward_backward(model, ids, aux):
    """aux: output_router_logits for an MoE model, None for a dense one."""
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, **({} if aux is None else {"output_router_logits": aux}))
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


def _pairs(ours, ref, aux):
    (out, grads), (ref_out, ref_grads) = ours, ref
    pairs = [("logits", out.logits, ref_out.logits), ("loss", out.loss, ref_out.loss)]
    if aux:
        pairs.append(("aux_loss", out.aux_loss, ref_out.aux_loss))
    return pairs + [(name, grads[name], ref_grads[name]) for name in ref_grads]


@pytest.mark.parametrize("name", [*MOE_CONFIGS, *DENSE_CONFIGS])
def test_patched_models_match_hf_on_cuda(name):
    """Five and more random tiny configs: every fused op runs its CUDA kernel (no warning that one
    took HF's path), float32 within 1e-5 of HF's (relative, per tensor), bfloat16 no further from the
    float32 result than HF's own bfloat16 model x 1.5 (plus a bf16 ulp), as on the CPU."""
    kind = "moe" if name in MOE_CONFIGS else "dense"
    values = dict((MOE_CONFIGS if kind == "moe" else DENSE_CONFIGS)[name])
    seq, batch = values.pop("seq"), values.pop("batch", 2)
    hf, _ = build(make_config(kind, **values), seed=len(name), patch=False)
    hf = hf.to(DEVICE)
    ours = copy.deepcopy(hf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not hpnn.patch(ours).left
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq)).to(DEVICE)
        for aux in (False, True) if kind == "moe" else (None,):
            reference = _forward_backward(hf, ids, aux)
            for what, got, expected in _pairs(_forward_backward(ours, ids, aux), reference, aux):
                assert _rel(got, expected) <= 1e-5, f"fp32 {what} (aux={aux}): {_rel(got, expected):.2e}"
        hf16, ours16 = copy.deepcopy(hf).bfloat16(), copy.deepcopy(hf).bfloat16()
        hpnn.patch(ours16)
        aux = True if kind == "moe" else None
        ref = _forward_backward(copy.deepcopy(hf16).float(), ids, aux)
        hf_pairs = _pairs(_forward_backward(hf16, ids, aux), ref, aux)
        hp_pairs = _pairs(_forward_backward(ours16, ids, aux), ref, aux)
    # A fused op without its CUDA kernel would have warned and run HF's module.
    assert not [str(w.message) for w in caught if str(w.message).startswith("hp.nn:")]
    for (what, hf_got, fp32), (_, hp_got, _) in zip(hf_pairs, hp_pairs):
        assert _rel(hp_got, fp32) <= 1.5 * _rel(hf_got, fp32) + 2**-8, (
            f"bf16 {what}: hp {_rel(hp_got, fp32):.2e} vs HF {_rel(hf_got, fp32):.2e}"
        )


def test_a_padded_batch_matches_hf():
    """A left-padded batch: the mask reaches SDPA on top of causality, and the load-balancing loss
    leaves the padded tokens out (its masked kernel). The padded rows' logits are the model's
    business; the real ones, the losses (padding labelled -100) and every gradient must match HF's."""
    values = dict(MOE_CONFIGS["h4-kv2-d16-e8-k2-norm"])
    values.pop("seq")
    hf, _ = build(make_config("moe", **values), seed=5, patch=False)
    hf = hf.to(DEVICE)
    ours = copy.deepcopy(hf)
    hpnn.patch(ours)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    keep = mask.bool()
    labels = ids.masked_fill(~keep, -100)
    results = []
    for model in (hf, ours):
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append([("logits", out.logits[keep]), ("loss", out.loss), ("aux_loss", out.aux_loss), *grads.items()])
    for (what, expected), (_, got) in zip(*results):
        assert _rel(got, expected) <= 1e-5, f"{what}: {_rel(got, expected):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_kernel_matches_hf_grouped_mm_with_idle_experts(dtype):
    """The experts op alone against HF's grouped_mm experts, with experts no token chose (their
    weight gradients must be zeros: bfloat16 runs torch's CUTLASS grouped GEMM, float32 its
    per-group fallback) and a token count that is not a multiple of anything."""
    config = make_config("moe", num_experts=16, num_experts_per_tok=2, moe_intermediate_size=48)
    experts = Qwen3MoeForCausalLM(config).model.layers[0].mlp.experts.to(DEVICE, dtype)
    fused = copy.deepcopy(experts)
    fused.__class__ = FUSED[type(experts)]
    tokens = 37
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, config.hidden_size, generator=generator).to(DEVICE, dtype)
    index = torch.randint(0, 6, (tokens, 2), generator=generator).to(DEVICE)  # experts 6.. idle
    index[:, 1] = (index[:, 0] + 1) % 6
    weights = torch.rand(tokens, 2, generator=generator).to(DEVICE, dtype)

    results = []
    for module, forward in ((experts, ALL_EXPERTS_FUNCTIONS["grouped_mm"]), (fused, experts_forward)):
        xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = forward(module, xi, index, wi)
        out.backward(torch.ones_like(out))
        results.append([out, xi.grad, wi.grad, module.gate_up_proj.grad, module.down_proj.grad])
    for got, expected in zip(results[1], results[0]):
        assert _rel(got, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert results[1][3][6:].abs().max() == 0 and results[1][4][6:].abs().max() == 0


def test_one_compiled_graph_serves_every_sequence_length():
    """torch.compile(dynamic=True, fullgraph=True) of a patched model on CUDA: one graph for three
    sequence lengths, each matching HF's eager logits. On CUDA the attention op's AutogradCUDA
    kernel is what the compiler traces, so it must read sizes symbolically: an int size would
    specialise the graph to the first length and compile again for each new one."""
    values = dict(MOE_CONFIGS["h4-kv2-d16-e8-k2-norm"])
    values.pop("seq")
    hf, _ = build(make_config("moe", **values), seed=15, patch=False)
    hf = hf.to(DEVICE).eval()
    ours = copy.deepcopy(hf)
    hpnn.patch(ours)
    graphs: list = []
    compiled = torch.compile(ours.forward, fullgraph=True, dynamic=True, backend=_graph_recorder(graphs))
    for seq in (9, 13, 17):
        ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq)).to(DEVICE)
        with torch.no_grad():
            got, expected = compiled(input_ids=ids, use_cache=False).logits, hf(input_ids=ids, use_cache=False).logits
        assert _rel(got, expected) <= 1e-5, (seq, _rel(got, expected))
    assert len(graphs) == 1 and "hyperparallel.attention" in graphs[0], [sorted(g) for g in graphs]

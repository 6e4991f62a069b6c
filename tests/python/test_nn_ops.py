"""Each fused op against the HF module it replaces: outputs and every gradient, float32 to 1e-5.

The modules get weights far from HF's near-zero initialisation, so attention
is peaked, routing is decisive and a wrong term would show.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

import hyperparallel.nn as hpnn
from hyperparallel import _C

# float32 with sums in another order: torch's own float32 tolerance (the
# weights below make gradients O(10), where 1e-5 alone is below one ulp).
ATOL = {"atol": 1e-5, "rtol": 1.3e-6}
# A gradient entry is a sum of ~100 products of the tensor's scale; where they
# cancel, float32's error follows the scale, not the entry. HF's own attention
# gradients are 1.6e-5 from float64 where the largest entry is 28.
ATOL_PER_SCALE = 1e-6


def config(**overrides) -> Qwen3MoeConfig:
    values = {
        "hidden_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "intermediate_size": 40,
        "num_hidden_layers": 1,
        "vocab_size": 64,
        "norm_topk_prob": True,
    }
    values.update(overrides)
    cfg = Qwen3MoeConfig(**values)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


def randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("norm.weight") or p.dim() == 1 else 0.0
            p.copy_(base + std * torch.randn(p.shape, generator=gen))
    return module


def fused_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy with every module that has a fused counterpart swapped for it, and the fused experts
    selected as the experts implementation, as hp.nn.patch does."""
    fused = copy.deepcopy(module)
    for sub in fused.modules():
        if type(sub) in hpnn.modules.FUSED:
            sub.__class__ = hpnn.modules.FUSED[type(sub)]
        if isinstance(sub, hpnn.modules.FusedExperts):
            sub.config._experts_implementation = hpnn.modules.EXPERTS_IMPLEMENTATION
    return fused


def run(module, inputs, extra=(), pick=lambda out: out):
    """Output and the gradients of a random projection of it w.r.t. the inputs and parameters."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    module.zero_grad()
    out = pick(module(*inputs, *extra))
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(99))
    (out.float() * weight).sum().backward()
    grads = {f"input{i}": t.grad for i, t in enumerate(inputs) if t.grad is not None}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out, grads


def assert_parity(reference, fused, atol, rtol):
    """Outputs and gradients equal to `rtol`, and to `atol` or ATOL_PER_SCALE of each tensor's largest entry."""
    (out_r, grads_r), (out_f, grads_f) = reference, fused
    assert grads_r.keys() == grads_f.keys()
    for name, got, expected in [("output", out_f, out_r)] + [(n, grads_f[n], grads_r[n]) for n in grads_r]:
        scaled = max(atol, ATOL_PER_SCALE * expected.abs().max().item()) if expected.numel() else atol
        assert_close(got, expected, atol=scaled, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 33), (3, 1, 128)])
def test_rms_norm_matches_hf(shape):
    torch.manual_seed(0)
    norm = randomize(hf.Qwen3MoeRMSNorm(shape[-1], eps=1e-6), seed=1)
    x = torch.randn(shape)
    assert_parity(run(norm, [x]), run(fused_copy(norm), [x]), **ATOL)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,seq",
    [(4, 2, 16, 37), (4, 4, 8, 5), (8, 1, 32, 70), (2, 2, 64, 1), (6, 3, 16, 129)],
)
def test_attention_matches_hf(heads, kv_heads, head_dim, seq):
    torch.manual_seed(heads * 100 + seq)
    cfg = config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    attention = randomize(hf.Qwen3MoeAttention(cfg, layer_idx=0), seed=seq)
    x = torch.randn(2, seq, cfg.hidden_size)
    cos, sin = hf.Qwen3MoeRotaryEmbedding(cfg)(x, torch.arange(seq)[None] + 3)
    extra = ((cos, sin), None)

    def pick(out):
        return out[0]

    assert_parity(run(attention, [x], extra, pick), run(fused_copy(attention), [x], extra, pick), **ATOL)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attention_with_padding_mask_matches_hf(implementation):
    """Left padding: every position that has something to attend to matches HF."""
    torch.manual_seed(1)
    cfg = config()
    cfg._attn_implementation = implementation
    model = randomize(hf.Qwen3MoeModel(cfg), seed=2)
    fused = fused_copy(model)
    seq = 23
    ids = torch.randint(0, cfg.vocab_size, (3, seq))
    padding = torch.ones(3, seq, dtype=torch.long)
    padding[0, :6] = 0
    padding[2, :1] = 0
    valid = padding.bool()
    outputs = [m(input_ids=ids, attention_mask=padding).last_hidden_state for m in (model, fused)]
    assert_close(outputs[1][valid], outputs[0][valid], **ATOL)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(9, 48), (2, 5, 48)])
def test_linear_matches_nn_linear(shape, bias):
    torch.manual_seed(6)
    linear = randomize(torch.nn.Linear(48, 70, bias=bias), seed=7)
    x = torch.randn(shape)
    assert_parity(run(linear, [x]), run(fused_copy(linear), [x]), **ATOL)


def test_linear_sums_as_accurately_as_torch():
    """Over long sums (the weight gradient over 600 tokens, 300 inputs) float32 results differ
    from torch's by more than 1e-5 where terms cancel; both must be as close to float64."""
    torch.manual_seed(12)
    linear = randomize(torch.nn.Linear(300, 70), seed=13, std=1.0)
    x = torch.randn(2, 300, 300)
    exact = run(copy.deepcopy(linear).double(), [x.double()])

    def errors(result):
        out, grads = result
        return [(out.double() - exact[0]).abs().max()] + [
            (grads[name].double() - exact[1][name]).abs().max() for name in exact[1]
        ]

    torch_errors, fused_errors = errors(run(linear, [x])), errors(run(fused_copy(linear), [x]))
    for fused_error, torch_error in zip(fused_errors, torch_errors):
        assert fused_error <= 2 * torch_error + 1e-6


def test_bfloat16_linear_is_as_accurate_as_torchs():
    """bfloat16 forward and gradients no further from float64's than nn.Linear's own bfloat16 ones.

    On CPUs without bfloat16 dot products the fused products run in float32 on
    widened copies (ops/matmul.cpp), in blocks: these shapes take two in each
    product (the forward's of columns, the input gradient's of k, the weight
    gradient's of rows, from a transposed view), and the bias makes the
    forward accumulate. Elsewhere they are torch's own products."""
    torch.manual_seed(14)
    linear = randomize(torch.nn.Linear(512, 4096), seed=15).bfloat16()
    x = torch.randn(2, 1024, 512).bfloat16()
    exact = run(copy.deepcopy(linear).double(), [x.double()])

    def errors(result):
        out, grads = result
        return [((out.double() - exact[0]).norm() / exact[0].norm()).item()] + [
            ((grads[name].double() - exact[1][name]).norm() / exact[1][name].norm()).item() for name in exact[1]
        ]

    torch_errors, fused_errors = errors(run(linear, [x])), errors(run(fused_copy(linear), [x]))
    for name, fused_error, torch_error in zip(["output", *exact[1]], fused_errors, torch_errors):
        assert fused_error <= 1.5 * torch_error, f"{name}: hp {fused_error:.2e} vs torch {torch_error:.2e}"


def test_linear_with_a_frozen_weight_computes_no_weight_gradient():
    """A frozen base weight (LoRA's) gets no gradient; the input and the bias still do."""
    linear = fused_copy(randomize(torch.nn.Linear(16, 24), seed=8))
    linear.weight.requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    linear(x).sum().backward()
    assert linear.weight.grad is None
    assert x.grad is not None and linear.bias.grad is not None


def test_products_do_not_depend_on_the_thread_count():
    """Threads split the float32 products' output, never their sums: one thread and two agree bit for bit.

    On Intel CPUs the products are MKL's (ops/matmul.cpp), which promises no such thing: there this checks
    that these shapes keep it so."""
    torch.manual_seed(9)
    linear = fused_copy(randomize(torch.nn.Linear(256, 512), seed=10))
    mlp = fused_copy(randomize(hf.Qwen3MoeMLP(config(hidden_size=256, intermediate_size=320)), seed=11))
    x = torch.randn(300, 256)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append([run(linear, [x]), run(mlp, [x])])
    finally:
        torch.set_num_threads(threads)
    for (out_1, grads_1), (out_2, grads_2) in zip(*results):
        assert torch.equal(out_1, out_2)
        assert all(torch.equal(grads_1[name], grads_2[name]) for name in grads_1)


@pytest.mark.parametrize("shape", [(9, 48), (2, 5, 48)])
def test_swiglu_mlp_matches_hf(shape):
    torch.manual_seed(2)
    mlp = randomize(hf.Qwen3MoeMLP(config()), seed=3)
    x = torch.randn(shape)
    assert_parity(run(mlp, [x]), run(fused_copy(mlp), [x]), **ATOL)


@pytest.mark.parametrize(
    "experts,top_k,norm", [(8, 2, True), (8, 2, False), (5, 1, True), (16, 4, False), (4, 4, True)]
)
@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_moe_block_matches_hf(experts, top_k, norm, experts_implementation):
    torch.manual_seed(experts * 10 + top_k)
    cfg = config(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
    cfg._experts_implementation = experts_implementation
    block = randomize(hf.Qwen3MoeSparseMoeBlock(cfg), seed=experts + top_k)
    x = torch.randn(3, 11, cfg.hidden_size)
    assert_parity(run(block, [x]), run(fused_copy(block), [x]), **ATOL)


def test_experts_without_tokens_get_zero_gradients():
    torch.manual_seed(6)
    experts = randomize(hf.Qwen3MoeExperts(config(num_experts=6)), seed=6)
    x = torch.randn(5, 48)
    index = torch.tensor([[0, 2], [2, 5], [0, 5], [4, 2], [0, 4]])  # experts 1 and 3 get nothing
    weights = torch.rand(5, 2)
    reference, fused = run(experts, [x, index, weights]), run(fused_copy(experts), [x, index, weights])
    assert_parity(reference, fused, **ATOL)
    assert fused[1]["gate_up_proj"][[1, 3]].abs().max() == 0 and fused[1]["down_proj"][[1, 3]].abs().max() == 0


def test_router_outputs_match_hf():
    torch.manual_seed(3)
    router = randomize(hf.Qwen3MoeTopKRouter(config(num_experts=16, num_experts_per_tok=3)), seed=4)
    x = torch.randn(40, 48)
    outputs = [m(x) for m in (router, fused_copy(router))]
    assert torch.equal(outputs[1][2], outputs[0][2])
    for fused_out, hf_out in zip(outputs[1][:2], outputs[0][:2]):
        assert_close(fused_out, hf_out, **ATOL)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_hf(masked):
    torch.manual_seed(4)
    layers, batch, seq, experts, top_k = 3, 2, 13, 8, 2
    logits = torch.randn(layers, batch * seq, experts, requires_grad=True)
    mask = (torch.rand(batch, seq) > 0.3).long() if masked else None
    expected = hf.load_balancing_loss_func(tuple(logits.unbind(0)), experts, top_k, mask)
    got = torch.ops.hyperparallel.moe_aux_loss(logits, top_k, mask)
    assert_close(got, expected, **ATOL)
    (grad_expected,) = torch.autograd.grad(expected, logits)
    (grad_got,) = torch.autograd.grad(got, logits)
    assert_close(grad_got, grad_expected, atol=1e-7, rtol=0)


def _op_samples():
    gen = torch.Generator().manual_seed(5)

    def rand(*shape, grad=True):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    cos, sin = torch.randn(1, 6, 8, generator=gen), torch.randn(1, 6, 8, generator=gen)
    _, scores, index = torch.ops.hyperparallel.moe_router(
        rand(10, 12, grad=False), rand(4, 12, grad=False), 2, True
    )
    return {
        "rms_norm": (rand(3, 5, 12), rand(12), 1e-6),
        "attention": (
            rand(2, 6, 4, 8),
            rand(2, 6, 2, 8),
            rand(2, 6, 2, 8),
            rand(8),
            rand(8),
            cos,
            sin,
            None,
            1e-6,
            1e-6,
            0.3,
        ),
        "linear": (rand(2, 7, 12), rand(10, 12), rand(10)),
        "swiglu_mlp": (rand(7, 12), rand(10, 12), rand(10, 12), rand(12, 10)),
        "moe_router": (rand(10, 12), rand(4, 12), 2, True),
        "moe_experts": (
            rand(10, 12),
            rand(4, 10, 12),
            rand(4, 12, 5),
            index,
            scores.detach().requires_grad_(),
        ),
        "moe_aux_loss": (rand(2, 10, 4), 2, None),
    }


@pytest.mark.parametrize(
    "name", ["rms_norm", "attention", "linear", "swiglu_mlp", "moe_router", "moe_experts", "moe_aux_loss"]
)
def test_op_registration(name):
    """Schema, fake (meta) kernels and the autograd registration hold up as torch.compile needs them."""
    torch.manual_seed(5)
    op = getattr(torch.ops.hyperparallel, name).default
    torch.library.opcheck(op, _op_samples()[name])


def test_kernels_agree_across_instruction_sets():
    """The AVX-512, AVX2 and baseline builds of the row kernels give the same results."""
    script = """
import sys, torch, hyperparallel
torch.manual_seed(0)
x, k, w = torch.randn(3, 7, 4, 40), torch.randn(3, 7, 2, 40), torch.randn(40)
cos, sin = torch.randn(1, 7, 40), torch.randn(1, 7, 40)
o, kr = torch.ops.hyperparallel.attention(x, k, k, w, w, cos, sin, None, 1e-6, 1e-6, 0.2)
n = torch.ops.hyperparallel.rms_norm(x.bfloat16(), w, 1e-6)
g = torch.randn(21, 66)
l, s, i = torch.ops.hyperparallel.moe_router(g, torch.randn(9, 66), 3, True)
m = torch.ops.hyperparallel.swiglu_mlp(g, torch.randn(33, 66), torch.randn(33, 66), torch.randn(66, 33))
torch.save([o, kr, n, l, s, i, m], sys.argv[1])
"""
    results = {}
    for isa in ("avx512", "avx2", "baseline"):
        path = f"{os.environ.get('TMPDIR', '/tmp')}/hp_nn_isa_{os.getpid()}_{isa}.pt"
        env = dict(os.environ, HP_SIMD=isa)
        subprocess.run([sys.executable, "-c", script, path], env=env, check=True)
        results[isa] = torch.load(path)
        os.remove(path)
    for isa in ("avx2", "baseline"):
        for got, expected in zip(results[isa], results["avx512"]):
            assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_kernels_loops_run_on_torchs_threads():
    """at::parallel_for is inline: without OpenMP in hp's build every kernel's loop would run on one thread."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert _C.parallel_threads() == n
    finally:
        torch.set_num_threads(threads)

"""hp.optim.Muon in one process against torch.optim.Muon (torch 2.13), and its building blocks."""

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.testing import assert_close

import hyperparallel.optim as hpo
from hyperparallel import _C

NS = (3.4445, -4.775, 2.0315)
# Wide, tall and square; several of one shape (a batch); sides that are and
# are not multiples of the symmetric products' 32-column blocks.
SHAPES = [(24, 40), (40, 24), (32, 32), (32, 32), (7, 12), (1, 5), (260, 300), (300, 260)]


def _params(shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator) * 0.1) for shape in shapes]


def _set_grads(step, *param_lists):
    generator = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=generator) for p in param_lists[0]]
    for params in param_lists:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype, copy=True)


def _step_both(steps, theirs, ours, reference, optimizer):
    """Steps both optimizers on the same gradients; the parameters agree within 1e-6 after each step."""
    for step in steps:
        _set_grads(step, theirs, ours)
        reference.step()
        optimizer.step()
        for p, q in zip(theirs, ours):
            assert_close(q, p, rtol=0, atol=1e-6)


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_updates_equal_torch_muon(adjust_lr_fn, nesterov, weight_decay):
    theirs, ours = _params(SHAPES, 0), _params(SHAPES, 0)
    kwargs = {"lr": 2e-3, "weight_decay": weight_decay, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    # Four steps: momentum and Nesterov's look-ahead are in play from the second; more only
    # repeat torch's bf16 Newton-Schulz, slow on a CPU without AVX-512 bf16.
    _step_both(range(4), theirs, ours, torch.optim.Muon(theirs, **kwargs), hpo.Muon(ours, **kwargs))


def test_empty_matrices_are_left_as_torch_muon_leaves_them():
    """A matrix with no rows gets its (empty) momentum and no update, beside the others, as with
    torch; one with no columns too, where torch divides by zero."""
    theirs, ours = _params([(0, 5), *SHAPES[:2]], 0), _params([(0, 5), *SHAPES[:2]], 0)
    _step_both(range(2), theirs, ours, torch.optim.Muon(theirs), hpo.Muon(ours))
    empty = nn.Parameter(torch.zeros(5, 0))
    empty.grad = torch.zeros(5, 0)
    optimizer = hpo.Muon([empty, ours[1]])
    optimizer.step()
    assert optimizer.state[empty]["momentum_buffer"].shape == (5, 0)


def test_bfloat16_parameters_follow_torch_muon():
    # Not fp32: the momentum and the update take ATen's ops instead of the
    # one-pass kernels. Within one bfloat16 ulp of the parameters' size.
    theirs = [nn.Parameter(p.detach().bfloat16()) for p in _params(SHAPES, 5)]
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    reference, optimizer = torch.optim.Muon(theirs, lr=2e-3), hpo.Muon(ours, lr=2e-3)
    for step in range(10):
        _set_grads(step, theirs, ours)
        reference.step()
        optimizer.step()
    for p, q in zip(theirs, ours):
        assert q.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
        assert_close(q.float(), p.float(), rtol=0, atol=2.0**-8 * p.abs().max().item())


def test_an_expert_stack_is_one_matrix_per_expert():
    generator = torch.Generator().manual_seed(3)
    stack = nn.Parameter(torch.randn(4, 12, 20, generator=generator))
    experts = [nn.Parameter(stack.detach()[e].clone()) for e in range(4)]
    optimizer = hpo.Muon([stack], lr=1e-2, adjust_lr_fn="match_rms_adamw")
    reference = torch.optim.Muon(experts, lr=1e-2, adjust_lr_fn="match_rms_adamw")
    for step in range(10):
        grad = torch.randn(stack.shape, generator=generator)
        stack.grad = grad.clone()
        for e, p in enumerate(experts):
            p.grad = grad[e].clone()
        optimizer.step()
        reference.step()
    assert_close(stack.detach(), torch.stack([p.detach() for p in experts]), rtol=0, atol=1e-6)


def test_param_groups_state_dict_and_zero_grad():
    def groups(params):
        return [
            {"params": params[:3]},
            {"params": params[3:], "lr": 5e-3, "momentum": 0.9, "nesterov": False},
        ]

    theirs, ours = _params(SHAPES, 1), _params(SHAPES, 1)
    reference, optimizer = torch.optim.Muon(groups(theirs)), hpo.Muon(groups(ours))
    _step_both(range(5), theirs, ours, reference, optimizer)
    optimizer.zero_grad()
    assert all(p.grad is None for p in ours)

    # The state dict is torch's, so either optimizer can resume from the other's.
    state = optimizer.state_dict()
    assert state["param_groups"][1]["lr"] == 5e-3
    assert torch.equal(
        state["state"][0]["momentum_buffer"], reference.state_dict()["state"][0]["momentum_buffer"]
    )
    resumed = hpo.Muon(groups(ours))
    resumed.load_state_dict(state)
    _step_both(range(5, 10), theirs, ours, reference, resumed)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_as_torch_muon_does(how):
    """deepcopy and pickle carry torch's state (groups, momentum), not the C++ plan: the copy builds its own."""
    theirs, ours = _params(SHAPES, 7), _params(SHAPES, 7)
    reference, optimizer = torch.optim.Muon(theirs, lr=2e-3), hpo.Muon(ours, lr=2e-3)
    _step_both(range(3), theirs, ours, reference, optimizer)
    if how == "deepcopy":
        reference_copy, copied = copy.deepcopy(reference), copy.deepcopy(optimizer)
    else:
        reference_copy, copied = pickle.loads(pickle.dumps(reference)), pickle.loads(pickle.dumps(optimizer))
    theirs_copy, ours_copy = reference_copy.param_groups[0]["params"], copied.param_groups[0]["params"]
    _step_both(range(3, 6), theirs_copy, ours_copy, reference_copy, copied)
    _step_both(range(3, 6), theirs, ours, reference, optimizer)  # the original keeps its plan and steps on


@pytest.mark.parametrize(
    "params,kwargs",
    [
        (None, {"lr": torch.tensor([1e-3, 1e-3])}),
        (None, {"lr": -1.0}),
        (None, {"momentum": -0.5}),
        (None, {"weight_decay": -0.1}),
        (None, {"adjust_lr_fn": "sqrt"}),
        (None, {}),
        ([], {}),
        ([nn.Parameter(torch.zeros(4))], {"lr": -1.0}),
    ],
)
def test_bad_arguments_raise_what_torch_muon_raises(params, kwargs):
    """torch checks the options before the parameters; the same bad input gets the same exception type."""
    with pytest.raises(Exception) as theirs:
        torch.optim.Muon(params, **kwargs)
    with pytest.raises(Exception) as ours:
        hpo.Muon(params, **kwargs)
    assert type(ours.value) is type(theirs.value), f"torch: {theirs.value!r}; hp: {ours.value!r}"


def test_same_shape_matrices_share_one_newton_schulz_call():
    params = _params([(16, 8)] * 3 + [(8, 16)] + [(2, 16, 8)], 2)  # 5 matrices of (16, 8), 1 of (8, 16)
    optimizer = hpo.Muon(params)
    hpo.reset_stats()
    for step in range(4):
        _set_grads(step, params)
        optimizer.step()
    assert hpo.stats() == {"ns_calls": 2 * 4, "ns_matrices": 6 * 4, "muon_peer_bytes": 0}  # one process
    assert sorted(optimizer.owned()) == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (4, 1)]


# Each symmetric product's inner size k in every one of oneDNN's summation
# regimes (gram.h; with bfloat16 dot products k <= 512: one block,
# 512 < k <= 1024: blocks of 512, more: 1024; emulated: k <= 384 one block,
# then two halves, from 1536 blocks of 768, and halves of an odd number of
# pairs left to torch: 530), partial column blocks and row tiles (38: the
# last row block's 6 rows as tiles of 4, 1 and 1), odd k and
# products of at most 4096 multiply-adds (torch's own calls). Without AVX-512
# (reference_gemm.h): k below 16, below 64 and exactly 64, whole and partial
# chunks of 16 past the 64s, rows past the kernels' blocks of 3 and 4, tall
# matrices (their first round has an order of its own: past k = 1024 with
# bfloat16 dot products, blocks that differ between CPUs).
@pytest.mark.parametrize(
    "shape",
    [(3, 24, 40), (2, 40, 24), (2, 260, 300), (2, 300, 260), (2, 1, 7), (2, 1, 8), (1, 9, 301), (1, 400, 520),
     (1, 530, 520), (1, 100, 1100), (1, 1100, 100), (1, 64, 1600), (2, 5, 13), (2, 7, 50), (2, 10, 64),
     (2, 70, 11), (1, 131, 37), (2, 38, 300), (2, 2100, 64)],
)
def test_batched_newton_schulz_is_torch_bit_for_bit(shape):
    generator = torch.Generator().manual_seed(4)
    batch = torch.randn(shape, generator=generator)
    ours = batch.bfloat16()
    _C.newton_schulz_(ours, _C.NsOptions(a=NS[0], b=NS[1], c=NS[2], steps=5, eps=1e-7))
    for matrix, result in zip(batch, ours):
        assert torch.equal(result, _zeropower_via_newtonschulz(matrix, NS, 5, 1e-7))


@pytest.mark.parametrize("shape", [(2, 24, 40), (2, 10, 64), (1, 64, 1600)])
def test_batched_newton_schulz_is_torch_bit_for_bit_on_three_threads(shape):
    """torch's GEMM spreads a product's outputs over its threads; with three, some shares cut rows
    (m = 10: 100 outputs), which oneDNN's emulated bfloat16 GEMM sums in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        test_batched_newton_schulz_is_torch_bit_for_bit(shape)
    finally:
        torch.set_num_threads(threads)


def test_newton_schulz_without_bfloat16_dot_products_is_torch_bit_for_bit():
    """HP_SIMD=avx2: on an AVX-512 CPU each matrix goes through torch's own GEMM calls (oneDNN's there); on an
    AVX2-only CPU through reference_gemm.h's kernels (torch's GEMM there is ATen's reference one)."""
    script = """
import torch
from torch.optim._muon import _zeropower_via_newtonschulz
from hyperparallel import _C
NS = (3.4445, -4.775, 2.0315)
for shape in [(2, 300, 260), (1, 400, 520)]:
    batch = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    ours = batch.bfloat16()
    _C.newton_schulz_(ours, _C.NsOptions(a=NS[0], b=NS[1], c=NS[2], steps=5, eps=1e-7))
    for matrix, result in zip(batch, ours):
        assert torch.equal(result, _zeropower_via_newtonschulz(matrix, NS, 5, 1e-7)), shape
"""
    subprocess.run([sys.executable, "-c", script], env=dict(os.environ, HP_SIMD="avx2"), check=True)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="give biases, norms and embeddings to AdamW"):
        hpo.Muon([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="use None, 'original' or 'match_rms_adamw'"):
        hpo.Muon(_params([(4, 4)], 0), adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match=r"ns_steps must be in \[0, 100\)"):
        hpo.Muon(_params([(4, 4)], 0), ns_steps=100)
    optimizer = hpo.Muon(_params([(4, 4)], 0))
    with pytest.raises(ValueError, match="momentum must be >= 0"):
        optimizer.add_param_group({"params": _params([(4, 4)], 1), "momentum": -0.5})
    with pytest.raises(RuntimeError, match="call step"):
        optimizer.owned()


def test_the_split_gives_hidden_matrices_to_muon():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    muon, adamw = hpo.muon_with_adamw(model)
    names = {id(p): name for name, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in muon.param_groups[0]["params"]}
    adamw_names = {names[id(p)] for p in adamw.param_groups[0]["params"]}
    assert muon_names.isdisjoint(adamw_names) and len(muon_names) + len(adamw_names) == len(names)
    assert "model.layers.0.mlp.experts.gate_up_proj" in muon_names  # 3-D: one matrix per expert
    assert "model.layers.1.self_attn.q_proj.weight" in muon_names
    assert "model.layers.1.mlp.gate.weight" in muon_names  # the router is a hidden matrix too
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw_names
    assert all(
        model.get_parameter(n).ndim == 1
        for n in adamw_names - {"model.embed_tokens.weight", "lm_head.weight"}
    )
    assert muon.defaults["adjust_lr_fn"] == "match_rms_adamw" and adamw.defaults["betas"] == (0.9, 0.95)

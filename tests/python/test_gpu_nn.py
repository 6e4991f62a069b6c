"""The fused modules on CUDA against HF's on the same GPU: the RMSNorm kernels, and a patched
Qwen3-MoE (modules without a CUDA kernel yet take HF's path, one warning each)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

import hyperparallel.nn as hpnn
from hyperparallel.nn.modules import FUSED

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
    errors = {}
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
        errors[dtype] = [_rel(a, b) for a, b in zip(outputs[1], outputs[0])]
        if dtype == torch.float32:
            reference32 = outputs[0]
        else:
            hf_bf16_error = [_rel(h, r) for h, r in zip(outputs[0], reference32)]
    assert max(errors[torch.float32]) <= 1e-5, errors
    for ours_bf16, hf_bf16 in zip(errors[torch.bfloat16], hf_bf16_error):
        assert ours_bf16 <= 1.5 * hf_bf16 + 1e-7


def test_patched_moe_model_on_cuda_equals_hf():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    hf = Qwen3MoeForCausalLM(config).to(DEVICE)
    ours = copy.deepcopy(hf)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
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

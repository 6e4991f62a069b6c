"""Forward+backward time of each hp.nn fused module against the HF module it replaces.

One thread, the qwen3-moe-bench shapes, batch 4 x seq 512, float32 (lm-head
is the model's nn.Linear 512 -> 8192, fused: hp.nn.FusedLinear). HF and
fused runs alternate so that machine noise hits both; the table shows the
median of each and HF / fused. Times are this process's CPU time (one
thread), which other processes on a shared machine do not inflate; --wall
measures wall-clock time instead.

    .venv/bin/python bench/nn_modules.py [--repeats 5] [--dtype bfloat16]

With HP_SIMD=avx2 the fused modules' float32 products run on ATen's mm (MKL)
instead of hp's AVX-512 GEMM: the difference is what that kernel buys.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hyperparallel.nn as hpnn

CONFIG = Path(__file__).resolve().parents[2] / "shared" / "bench" / "qwen3-moe-bench.config.json"
TARGETS = {"rmsnorm": 2.0, "attention": 1.2, "moe": 3.0, "model": 2.0}


def step(module, args: tuple, kwargs: dict) -> None:
    """One forward and backward; gradients accumulate, which costs both sides alike."""
    out = module(*args, **kwargs)
    out = out.loss if hasattr(out, "loss") else out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--modules", default="rmsnorm,attention,moe,moe-eager,lm-head,model")
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, args.dtype)

    config = AutoConfig.from_pretrained(args.config)
    hf = AutoModelForCausalLM.from_config(config).to(dtype)
    fused = copy.deepcopy(hf)
    hpnn.patch(fused)
    eager_config = copy.deepcopy(config)
    eager_config._experts_implementation = "eager"

    x = torch.randn(args.batch, args.seq, config.hidden_size, dtype=dtype, requires_grad=True)
    position_ids = torch.arange(args.seq)[None]
    rope = hf.model.rotary_emb(x, position_ids)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    cases = {
        "rmsnorm": (lambda m: m.model.layers[0].input_layernorm, (x,), {}),
        "attention": (lambda m: m.model.layers[0].self_attn, (x, rope, None), {}),
        "moe": (lambda m: m.model.layers[0].mlp, (x,), {}),
        "moe-eager": (lambda m: m.model.layers[0].mlp, (x,), {}),
        "lm-head": (lambda m: m.lm_head, (x,), {}),
        "model": (lambda m: m, (), {"input_ids": ids, "labels": ids}),
    }

    clock = time.perf_counter if args.wall else time.process_time
    print(
        f"one thread, {args.dtype}, batch {args.batch} x seq {args.seq}, {Path(args.config).name}, "
        f"{'wall' if args.wall else 'CPU'} time"
    )
    print(f"{'module':<11}{'HF ms':>10}{'hp ms':>10}{'HF/hp':>8}{'target':>8}")
    for name in args.modules.split(","):
        pick, inputs, kwargs = cases[name]
        hf_module = pick(hf)
        if name == "moe-eager":
            hf_module = copy.deepcopy(hf_module)
            hf_module.experts.config = eager_config
        pair = {"HF": hf_module, "hp": pick(fused)}
        for module in pair.values():
            step(module, inputs, kwargs)  # warm-up
        times = {side: [] for side in pair}
        for _ in range(args.repeats):
            for side, module in pair.items():
                start = clock()
                step(module, inputs, kwargs)
                times[side].append(clock() - start)
        hf_ms, hp_ms = (1e3 * statistics.median(times[side]) for side in pair)
        target = TARGETS.get(name.split("-")[0])
        shown = f"{target:>7.1f}x" if target else f"{'-':>8}"
        print(f"{name:<11}{hf_ms:>10.1f}{hp_ms:>10.1f}{hf_ms / hp_ms:>7.2f}x{shown}")


if __name__ == "__main__":
    main()

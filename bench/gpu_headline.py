"""hyperparallel against the best torch offers on one GPU, in one invocation: Muon, the fused
modules, and a whole training step.

    python bench/gpu_headline.py                       # every part, about 3 minutes on an H200
    python bench/gpu_headline.py --muon-layers 8       # the Muon part at 1024 expert matrices
    python bench/gpu_headline.py --parts muon modules  # some of them

Every part alternates the systems, times with CUDA events and reports medians; bf16 mixed
precision on both sides where a model runs.

- muon: one step on stacked experts (768 x 2048 per matrix, as Qwen3-30B-A3B; --muon-layers
  layers of 128 experts): hp.optim.Muon (one batched Newton-Schulz per shape) against
  torch.optim.Muon (one matrix at a time) and against a batched torch reference (the same
  rounds with torch.bmm, in Python). Targets: >= 10x and >= 1.2x. hp's device Newton-Schulz is
  those batched rounds with X Xᵀ and its square as symmetric halves (3/4 of their work), and its
  momentum and update are one pass each; hp with whole products (HP_NS_SYMMETRIC=0) is timed
  beside it, so that the halves' gain is measured, not assumed.
- modules: each fused module's forward + backward against HF's at seq 4096 (bf16): RMSNorm (one
  kernel each way), attention (norm + RoPE kernels around the same SDPA), the MoE block (router,
  then the experts on torch._grouped_mm with SwiGLU and the weighted gather as kernels) against
  HF's with its default experts implementation.
- step: a whole training step of bench/configs/qwen3-moe-1b (1.3 B parameters) on one GPU:
  hp (hp.nn.patch + hp.fully_shard + hp.optim.Muon and AdamW) against torch (FSDP2 + HF
  modules + torch.optim.Muon and AdamW): tokens/s, peak device memory, per-step losses.
- ranks2: the same step at 2 ranks sharing the GPU, for correctness only (losses), labelled.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from _timing import cuda_event_ms
from torch import nn

import hyperparallel as hp
import hyperparallel.optim as hpo
from hyperparallel.launch import run

CONFIG = Path(__file__).parent / "configs" / "qwen3-moe-1b.config.json"
NS = (3.4445, -4.775, 2.0315)


def _batched_ns(x: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz rounds on a batch, with torch.bmm: the batched reference."""
    a, b, c = NS
    x = x.bfloat16()
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.transpose(1, 2)
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.transpose(1, 2)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.transpose(1, 2) if tall else x


def muon_part(layers: int, repeats: int) -> list[str]:
    device = torch.device("cuda", 0)
    generator = torch.Generator(device).manual_seed(0)
    shape = (128, 768, 2048)
    stacks = [nn.Parameter(torch.randn(shape, device=device, generator=generator) * 0.02) for _ in range(layers)]
    for p in stacks:
        p.grad = torch.randn(shape, device=device, generator=generator)
    matrices = [nn.Parameter(m.detach().clone()) for p in stacks for m in p.unbind(0)]
    for m, g in zip(matrices, [g for p in stacks for g in p.grad.unbind(0)]):
        m.grad = g.clone()
    kwargs = {"lr": 2e-3, "adjust_lr_fn": "match_rms_adamw"}
    ours, theirs = hpo.Muon(stacks, **kwargs), torch.optim.Muon(matrices, **kwargs)
    momentum = [torch.zeros_like(p) for p in stacks]

    def batched_reference():
        with torch.no_grad():
            for p, buf in zip(stacks, momentum):
                buf.lerp_(p.grad, 0.05)
                update = _batched_ns(p.grad.lerp(buf, 0.95))
                p.mul_(1 - 2e-3 * 0.1).add_(update, alpha=-2e-3 * 0.2 * 2048**0.5)

    def hp_step(symmetric: str):  # HP_NS_SYMMETRIC per call: whether the halves pay is measured here
        def call():
            os.environ["HP_NS_SYMMETRIC"] = symmetric
            ours.step()
        return call

    times = {"hp": [], "hp, whole products": [], "torch.optim.Muon": [], "batched torch": []}
    systems = {"hp": hp_step("1"), "hp, whole products": hp_step("0"), "torch.optim.Muon": theirs.step,
               "batched torch": batched_reference}
    saved = os.environ.get("HP_NS_SYMMETRIC")
    try:
        for fn in systems.values():
            fn()  # warm-up: plans, cuBLAS handles
        for _ in range(repeats):
            for name, fn in systems.items():
                times[name].append(cuda_event_ms(fn))
    finally:  # the later parts' ranks inherit this environment: they run hp's default
        if saved is None:
            os.environ.pop("HP_NS_SYMMETRIC", None)
        else:
            os.environ["HP_NS_SYMMETRIC"] = saved
    t = {name: statistics.median(v) for name, v in times.items()}
    count = layers * shape[0]
    return [
        (f"muon: one step on {count} expert matrices {shape[1]}x{shape[2]} ({layers} layers x 128): "
        f"hp {t['hp']:.1f} ms, torch.optim.Muon {t['torch.optim.Muon']:.1f} ms "
        f"({t['torch.optim.Muon'] / t['hp']:.2f}x; target >= 10x), batched torch {t['batched torch']:.1f} ms "
        f"({t['batched torch'] / t['hp']:.2f}x; target >= 1.2x); hp with whole products (HP_NS_SYMMETRIC=0) "
        f"{t['hp, whole products']:.1f} ms ({t['hp, whole products'] / t['hp']:.2f}x hp's time)")
    ]


def modules_part(repeats: int) -> list[str]:
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda", 0)
    config = AutoConfig.from_pretrained(CONFIG)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16)
    ours = copy.deepcopy(hf)
    report = hp.nn.patch(ours)
    layer_hf, layer_ours = hf.model.layers[0], ours.model.layers[0]
    seq, hidden = 4096, config.hidden_size
    x = torch.randn(1, seq, hidden, device=device, dtype=torch.bfloat16)
    position_ids = torch.arange(seq, device=device)[None]
    cos_sin = hf.model.rotary_emb(x, position_ids)
    lines = []

    grad = torch.randn_like(x)  # every module here returns (1, seq, hidden)

    def fwd_bwd(mod, fn):
        # Gradients set afresh each call, as a training step's zero_grad(set_to_none=True) leaves
        # them: summing into the last call's would add a pass over every weight gradient to both.
        def call():
            mod.zero_grad(set_to_none=True)
            inp = x.detach().requires_grad_(True)
            out = fn(inp)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad)
        return call

    cases = {
        "RMSNorm (target >= 2x)": (lambda m: m.post_attention_layernorm, lambda mod: fwd_bwd(mod, mod)),
        "attention (target >= 1.0x)": (lambda m: m.self_attn, lambda mod: fwd_bwd(
            mod, lambda inp: mod(inp, cos_sin, None))),
        "MoE block (target >= 1.5x)": (lambda m: m.mlp, lambda mod: fwd_bwd(mod, mod)),
    }
    iterations = 20  # per timing: one call is too short to time apart from launch gaps

    def repeated(fn):
        def call():
            for _ in range(iterations):
                fn()
        return call

    for name, (pick, make) in cases.items():
        theirs, mine = repeated(make(pick(layer_hf))), repeated(make(pick(layer_ours)))
        times = {"hf": [], "hp": []}
        theirs(), mine()
        for _ in range(repeats):
            times["hf"].append(cuda_event_ms(theirs) / iterations)
            times["hp"].append(cuda_event_ms(mine) / iterations)
        hf_ms, hp_ms = statistics.median(times["hf"]), statistics.median(times["hp"])
        lines.append(f"modules: {name}: HF {hf_ms:.3f} ms, hp {hp_ms:.3f} ms: {hf_ms / hp_ms:.2f}x (seq {seq}, bf16)")
    lines.append(f"modules: {report}")
    return lines


def _step_rank(system: str, steps: int, micro: int, seq: int) -> dict:
    """One system's training on this rank: per-step losses and times, peak device memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    # What the device holds before this rank allocates anything (the parent's context and
    # cache): not this system's. One GPU: every rank of these parts runs on device 0.
    free, total_bytes = torch.cuda.mem_get_info(0)
    before = total_bytes - free
    if system == "hp":
        hp.comm.init()
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl")  # torch runs one rank per GPU: NCCL
    device = hp.comm.device()
    torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    config = AutoConfig.from_pretrained(CONFIG)
    config.dtype = torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds of device time less than on the CPU, per run
        model = AutoModelForCausalLM.from_config(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if system == "hp":
        hp.nn.patch(model)
    shard = hp.fully_shard if system == "hp" else torch_fully_shard
    for layer in model.model.layers:
        shard(layer, mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    muon_params, adamw_params = hpo.muon_param_split(model)
    kwargs = {"lr": 2e-3, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    muon = hpo.Muon(muon_params, **kwargs) if system == "hp" else _GatheredTorchMuon(muon_params, **kwargs)
    adamw = torch.optim.AdamW(adamw_params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    losses, times, used = [], [], []
    for _ in range(steps):
        batch = torch.randint(0, config.vocab_size, (world * micro, seq), generator=generator)
        mine = batch[rank * micro : (rank + 1) * micro].to(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(mine, labels=mine).loss
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        end.record()
        end.synchronize()
        total = loss.detach().float().reshape(1).cpu()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
        times.append(start.elapsed_time(end))
        # The device's own count: hp's peer-mapped buffers are cudaMalloc'd outside torch's
        # caching allocator, which keeps what a step reserved, so after a step this is the peak.
        free, total_bytes = torch.cuda.mem_get_info(device)
        used.append(total_bytes - free)
    return {"losses": losses, "ms": times, "peak": max(used) - before}


class _GatheredTorchMuon:
    """torch.optim.Muon as FSDP2 users run it (the protocol's baseline): one parameter at a time,
    its full value and gradient gathered (DTensor.full_tensor()), torch.optim.Muon stepping it one
    matrix at a time (an expert stack is one matrix per expert), each rank keeping its own rows.
    Only one parameter's full copy lives at a time, and none on one rank: there the matrices are
    views of the parameter itself, so torch's memory is not inflated by the harness."""

    def __init__(self, params, **kwargs) -> None:
        self.params = list(params)
        self.world = dist.get_world_size()
        # Per parameter, its matrices and their own torch.optim.Muon (momentum is per matrix, so
        # this is one torch.optim.Muon's numerics); step() points the matrices at the gathered data.
        # Between steps they hold an empty 2-D placeholder (torch.optim.Muon takes only matrices).
        self.matrices, self.inner = [], []
        for p in self.params:
            matrices = [nn.Parameter(self._local(p).new_empty(0, 0)) for _ in range(p.shape[0] if p.dim() == 3 else 1)]
            self.matrices.append(matrices)
            self.inner.append(torch.optim.Muon(matrices, **kwargs))

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) and self.world > 1 else self._local(t)

    @torch.no_grad()
    def step(self) -> None:
        for p, matrices, inner in zip(self.params, self.matrices, self.inner):
            full, grad = self._full(p.detach()), self._full(p.grad)
            for m, value, g in zip(matrices, full.unbind(0) if full.dim() == 3 else [full],
                                   grad.unbind(0) if grad.dim() == 3 else [grad]):
                m.data, m.grad = value, g
            inner.step()
            if self.world > 1:
                self._local(p).copy_(torch.chunk(full, self.world)[dist.get_rank()])
            for m in matrices:  # the gathered copies go now, not at the next step
                m.data, m.grad = m.data.new_empty(0, 0), None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def step_part(steps: int, micro: int, seq: int) -> list[str]:
    results = {}
    for system in ("torch", "hp"):
        results[system] = run(_step_rank, nproc=1, args=(system, steps, micro, seq))[0]
    tokens = micro * seq
    median = {s: statistics.median(r["ms"][3:]) for s, r in results.items()}
    diff = max(abs(a - b) for a, b in zip(results["hp"]["losses"], results["torch"]["losses"]))
    return [
        (f"step: qwen3-moe-1b, 1 GPU, bf16 mixed precision, {micro}x{seq} tokens: "
        f"hp {tokens / median['hp'] * 1e3:.0f} tok/s vs torch {tokens / median['torch'] * 1e3:.0f} tok/s: "
        f"{median['torch'] / median['hp']:.2f}x (target >= 2x); peak memory "
        f"{results['hp']['peak'] / 2**30:.1f} vs {results['torch']['peak'] / 2**30:.1f} GiB on the device "
        f"({results['hp']['peak'] / results['torch']['peak']:.2f}; target <= 0.9); max |loss diff| {diff:.3g}")
    ]


def ranks2_part(steps: int, micro: int, seq: int) -> list[str]:
    one = run(_step_rank, nproc=1, args=("hp", steps, 2 * micro, seq))[0]["losses"]
    two = run(_step_rank, nproc=2, args=("hp", steps, micro, seq))[0]["losses"]
    diff = max(abs(a - b) for a, b in zip(one, two))
    return [(f"ranks2: hp at 2 ranks sharing one GPU (correctness only, not a timing) vs 1 rank: "
            f"max |loss diff| over {steps} steps {diff:.3g}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["muon", "modules", "step", "ranks2"],
                        choices=["muon", "modules", "step", "ranks2"])
    parser.add_argument("--muon-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    parts = {
        "muon": lambda: muon_part(args.muon_layers, args.repeats),
        "modules": lambda: modules_part(args.repeats),
        "step": lambda: step_part(args.steps, args.micro, args.seq),
        "ranks2": lambda: ranks2_part(4, 1, 512),
    }
    failed = []
    for name in args.parts:
        # Each part's lines as soon as it ends, and a failed part does not cost the others':
        # device time is short.
        torch.cuda.empty_cache()  # the step parts' memory figures count the whole device
        try:
            print("\n".join(parts[name]()), flush=True)
        except Exception as error:  # noqa: BLE001 - reported, then the next part runs
            failed.append(name)
            print(f"{name}: FAILED: {type(error).__name__}: {error}", flush=True)
    if failed:
        raise SystemExit(f"gpu_headline: failed parts: {' '.join(failed)}")

if __name__ == "__main__":
    main()

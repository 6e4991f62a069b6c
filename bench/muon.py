"""hp.optim.Muon's step against the redundant FSDP2 recipe, on a model's Muon parameters.

    python bench/muon.py                  # qwen3-moe-bench, 1 and 2 ranks
    python bench/muon.py --config ../shared/bench/qwen3-moe-small.config.json --steps 2

The parameters are those Muon gets in the benchmark protocol
(../shared/bench/README.md): every weight matrix of the HF model built from
the config except embed_tokens and lm_head, a 3-D expert tensor counting as
one matrix per expert (hp.optim.muon_param_split). They are DTensors sharded
Shard(0) over the ranks, with random gradients; one thread per rank.

- redundant: what FSDP2 users do today. Each rank updates the momentum of its
  rows, gathers every full momentum-updated matrix (DTensor.full_tensor()),
  runs torch.optim.Muon's Newton–Schulz on each matrix (each expert), and
  keeps its own rows of the result.
- hp: hp.optim.Muon, with each matrix's Newton–Schulz on one rank, batched by
  shape (and at one rank, the batching and symmetric products alone).

The two run alternately, step by step, so that the machine's noise hits both;
a step's time is the slowest rank's, and the figure is the median step. CPU
seconds (the process's, slowest rank) are printed beside wall seconds: on a
machine shared with other work, ranks wait for a core, and CPU time still
shows the work each system does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _optim import OptimHparams
from _spec import resolve_config
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

import hyperparallel as hp
import hyperparallel.optim as hpo
from hyperparallel.launch import run

# The protocol's Muon settings.
H = OptimHparams()


def muon_shapes(config_path: str) -> list[tuple[int, ...]]:
    """Shapes of the parameters the protocol gives Muon, from the HF model (built on the meta device)."""
    import transformers

    with open(config_path) as file:
        config = transformers.AutoConfig.for_model(**json.load(file))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [tuple(p.shape) for p in hpo.muon_param_split(model)[0]]


@torch.no_grad()
def redundant_step(params: list[DTensor], momentum: list[torch.Tensor]) -> None:
    """The redundant recipe: full matrices on every rank, torch's Newton–Schulz on each."""
    for p, buffer in zip(params, momentum):
        grad = p.grad.to_local()
        buffer.lerp_(grad, 1 - H.momentum)
        update = DTensor.from_local(grad.lerp(buffer, H.momentum), p.device_mesh, p.placements)
        full = update.full_tensor()
        matrices = [full] if full.ndim == 2 else list(full)
        ortho = torch.stack(
            [_zeropower_via_newtonschulz(m, H.ns_coefficients, H.ns_steps, H.eps) for m in matrices]
        )
        rows = torch.chunk(ortho.view(full.shape), dist.get_world_size())[dist.get_rank()]
        local = p.to_local()
        local.mul_(1 - H.lr * H.weight_decay)
        local.add_(rows, alpha=-_adjust_lr(H.lr, H.adjust_lr_fn, full.shape[-2:]))


def _slowest(*seconds: float) -> list[float]:
    value = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.tolist()


def measure(config_path: str, steps: int) -> dict:
    torch.set_num_threads(1)
    hp.comm.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(
            distribute_tensor(torch.randn(shape, generator=generator) * 0.02, mesh, [Shard(0)])
        )
        for shape in muon_shapes(config_path)
    ]
    optimizer = hpo.Muon(params, **H.muon_defaults())
    momentum = [torch.zeros_like(p.to_local()) for p in params]
    systems = {"redundant": lambda: redundant_step(params, momentum), "hp": optimizer.step}
    times: dict[str, list[float]] = {name: [] for name in systems}
    cpu_times: dict[str, list[float]] = {name: [] for name in systems}
    for step in range(steps + 1):  # the first step of each is a warm-up (plan, buffers, first touch)
        grad_generator = torch.Generator().manual_seed(1000 * step + rank)
        for p in params:
            p.grad = DTensor.from_local(
                torch.randn(p.to_local().shape, generator=grad_generator), mesh, [Shard(0)]
            )
        for name, step_fn in systems.items():
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            step_fn()
            elapsed, cpu = _slowest(time.perf_counter() - start, time.process_time() - cpu_start)
            if step > 0:
                times[name].append(elapsed)
                cpu_times[name].append(cpu)
    matrices = sum(1 if p.ndim == 2 else p.shape[0] for p in params)
    return {
        "ranks": world,
        "matrices": matrices,
        "redundant_s": statistics.median(times["redundant"]),
        "hp_s": statistics.median(times["hp"]),
        "redundant_cpu_s": statistics.median(cpu_times["redundant"]),
        "hp_cpu_s": statistics.median(cpu_times["hp"]),
        "owner_balance_max_over_mean": optimizer.balance,
        "ns_matrices_this_rank_per_step": len(optimizer.owned()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="qwen3-moe-bench", help="config.json, or a protocol model name")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per system (after one warm-up)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rows = [run(measure, nproc=n, args=(str(resolve_config(args.config)), args.steps))[0] for n in args.ranks]
    for row in rows:
        row["hp_over_redundant"] = row["hp_s"] / row["redundant_s"]
        row["hp_over_redundant_cpu"] = row["hp_cpu_s"] / row["redundant_cpu_s"]
        print(json.dumps(row))
    for row in rows:
        n = row["ranks"]
        target = "target >= 1.3x (batching alone)" if n == 1 else f"target <= 1.2/N = {1.2 / n:.2f}"
        print(
            f"{n} rank(s): hp {row['hp_s']:.2f} s vs redundant {row['redundant_s']:.2f} s per step: "
            f"hp/redundant {row['hp_over_redundant']:.2f} (speedup {1 / row['hp_over_redundant']:.2f}x; {target}); "
            f"CPU s {row['hp_cpu_s']:.2f} vs {row['redundant_cpu_s']:.2f}: {row['hp_over_redundant_cpu']:.2f}; "
            f"owner balance max/mean {row['owner_balance_max_over_mean']:.3f}"
        )


if __name__ == "__main__":
    main()

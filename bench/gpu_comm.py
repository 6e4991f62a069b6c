"""All-gather and reduce-scatter on the device fabric vs Gloo-on-CUDA, against the device's
own copy ceiling, and a GEMM's slowdown while an all-gather runs beside it.

    python bench/gpu_comm.py                   # 1 MiB ... 1 GiB, 1 rank then 2 ranks
    python bench/gpu_comm.py --max-mib 256 --nproc 2

Run where the ranks have GPUs (scripts/gpu_check.sh does). Two passes:

- one rank: what one GPU's own engines do, free of other processes. The reduce-scatter kernel
  over one input (read once, written once) against a copy of the same bytes, and the GEMM
  beside this rank's all-gather copies (copy engine vs SMs in one process: the situation of a
  rank with a GPU of its own), back to back and one started with each GEMM (as FSDP pulls a
  group while a layer computes);
- ``--nproc`` ranks: the collectives themselves. With one GPU every rank shares it and the
  GPU time-slices their processes, so each rank's time includes the others' slices: the
  bandwidth columns count the bytes *all* ranks move (aggregate), labelled "ranks share one
  GPU: not NVLink".

Times are CUDA-event medians on rank 0 of calls between barriers, the systems alternated per
repetition, each clock started after a short GPU lead (``torch.cuda._sleep``), so that they time
the GPU's work and not the host's launches. Sizes are the full tensor (fp32):

- copy: one device-to-device copy of the full size (the ceiling: bytes read + written over time);
- hp AG: ``all_gather_into_tensor`` (peers' rows pulled straight into place on the copy engines);
- hp RS: the zero-copy reduce-scatter (``symmetric_empty`` + ``reduce_scatter_symmetric``): one
  kernel reading this rank's rows from every rank's buffer. Its bandwidth counts the bytes the
  kernel reads and writes, to compare with the copy's;
- hp RS copy: ``reduce_scatter_tensor`` on private tensors (copy-in, then the same kernel);
- gloo AG / RS: torch.distributed with Gloo on the same CUDA tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.distributed as dist
from _timing import cuda_event_ms, gpu_lead

import hyperparallel as hp
from hyperparallel.launch import run


def _measure_size(mib: int, repeats: int, skipped: list[str]) -> dict:
    device = hp.comm.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = mib * (1 << 20) // 4
    n -= n % world
    full = torch.randn(n, device=device)
    mine = full[rank * (n // world) : (rank + 1) * (n // world)].clone()
    out_full = torch.empty_like(full)
    shard = torch.empty(n // world, device=device)
    grad = hp.comm.symmetric_empty((n,), torch.float32, device=device)
    grad.copy_(full)
    copy_dst = torch.empty_like(full)

    def copy():
        if rank == 0:  # the ceiling: one process alone on the GPU
            copy_dst.copy_(full)

    def hp_all_gather():
        hp.comm.all_gather_into_tensor(out_full, mine)

    def hp_reduce_scatter():
        hp.comm.acquire(grad)
        hp.comm.reduce_scatter_symmetric(shard, grad)

    def hp_reduce_scatter_copy():
        hp.comm.reduce_scatter_tensor(shard, full)

    def gloo_all_gather():
        dist.all_gather_into_tensor(out_full, mine)

    def gloo_reduce_scatter():
        dist.reduce_scatter_tensor(shard, full)

    systems = {"copy": copy, "hp AG": hp_all_gather, "hp RS": hp_reduce_scatter,
               "hp RS copy": hp_reduce_scatter_copy, "gloo AG": gloo_all_gather, "gloo RS": gloo_reduce_scatter}
    usable = {}
    for name, fn in systems.items():  # warm up; drop what this build of Gloo cannot do
        try:
            fn()
            torch.cuda.synchronize()
            usable[name] = fn
        except (RuntimeError, ValueError) as error:
            skipped.append(f"{name} at {mib} MiB: {str(error).splitlines()[0]}")
    times: dict[str, list[float]] = {name: [] for name in usable}
    gloo_repeats = max(1, repeats // 5) if mib >= 64 else repeats
    for index in range(repeats):
        for name, fn in usable.items():  # alternated, so that drift hits every system alike
            if name.startswith("gloo") and index >= gloo_repeats:
                continue
            # The GPU's time: the launches' host time (the same for every size) left outside.
            times[name].append(cuda_event_ms(fn, barrier=True, lead_ms=1.0))
    return {"mib": mib, **{name: statistics.median(values) for name, values in times.items()}}


def measure(sizes_mib: list[int], repeats: int) -> dict:
    hp.comm.init()
    device = hp.comm.device()
    torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    skipped: list[str] = []
    results = [_measure_size(mib, repeats, skipped) for mib in sizes_mib]
    # The GEMM beside an all-gather: rank 0 multiplies while every rank pulls.
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    n = 256 * (1 << 20) // 4
    n -= n % world
    gathered = torch.empty(n, device=device)
    piece = torch.randn(n // world, device=device)
    side = torch.cuda.Stream(device)

    def pulls(count: int) -> None:
        """``count`` all-gathers on the side stream, starting once the default stream has come
        this far (behind a gpu_lead: once the host has enqueued what follows too)."""
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(count):
                hp.comm.all_gather_into_tensor(gathered, piece)

    def timed_gemms(count: int = 10, pull_each: bool = False) -> float:
        """Milliseconds per GEMM over ``count``; ``pull_each``: one all-gather started with each."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            if pull_each:
                pulls(1)
            torch.mm(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / count

    timed_gemms(3)  # warm-up
    # Enough all-gathers to span the ten GEMMs half again (a fixed count left part of them bare,
    # which hid part of the slowdown); rank 0 times both and decides for every rank.
    ag_ms = cuda_event_ms(lambda: hp.comm.all_gather_into_tensor(gathered, piece), repeats=3, warmup=1, barrier=True)
    spans = [math.ceil(1.5 * 10 * timed_gemms() / ag_ms) if rank == 0 else None]
    dist.broadcast_object_list(spans, src=0)
    alone, beside, paced = [], [], []
    for _ in range(max(3, repeats // 3)):
        dist.barrier()
        if rank == 0:
            alone.append(timed_gemms())
        dist.barrier()
        # All-gathers back to back on the side stream, beside the GEMMs on the default stream,
        # both held until the host has enqueued them all: they start together.
        gpu_lead(30.0)
        pulls(spans[0])
        if rank == 0:
            beside.append(timed_gemms())
        torch.cuda.synchronize()
        dist.barrier()
        # One all-gather started with each GEMM, as FSDP pulls the next group's parameters while
        # a layer computes (the other ranks pull as many, for the collective).
        gpu_lead(30.0)
        if rank == 0:
            paced.append(timed_gemms(pull_each=True))
        else:
            for _ in range(10):
                pulls(1)
        torch.cuda.synchronize()
    torch.cuda.synchronize()
    dist.barrier()
    return {"rows": results, "gemm_alone_ms": statistics.median(alone) if alone else None,
            "gemm_beside_ms": statistics.median(beside) if beside else None, "all_gathers_beside": spans[0],
            "gemm_paced_ms": statistics.median(paced) if paced else None,
            "skipped": skipped, "gpu": torch.cuda.get_device_name(device),
            "gpus": torch.cuda.device_count(), "world": world}


def _report(result: dict) -> None:
    world = result["world"]
    shared = result["gpus"] < world
    label = "ranks share one GPU: not NVLink" if shared else ("one rank" if world == 1 else "one GPU per rank")
    print(f"\n{world} rank(s) on {result['gpus']} x {result['gpu']} ({label}); fp32, medians of CUDA events; "
          "GB/s = bytes all ranks read and write / rank 0's time")
    header = ["MiB", "copy GB/s", "hp AG GB/s", "hp RS GB/s", "RS/copy", "hp RS copy GB/s", "gloo AG GB/s",
              "gloo RS GB/s", "AG hp/gloo", "RS hp/gloo"]
    print(" | ".join(header))
    nan = float("nan")  # a system that warm-up dropped (see "skipped")
    for row in result["rows"]:
        size = row["mib"] * (1 << 20)

        def rate(name, moved, row=row):
            return moved / (row[name] * 1e-3) / 1e9 if name in row else nan

        copy_bw = rate("copy", 2 * size)  # rank 0 alone: read + write
        # Every rank's kernel reads its 1/world of every rank's buffer and writes 1/world.
        rs_bw = rate("hp RS", world * (size + size / world))
        # Every rank pulls the rows it lacks (read + write) and copies its own input in.
        ag_bw = rate("hp AG", world * (2 * size * (world - 1) / world + 2 * size / world))
        cells = [
            row["mib"], copy_bw, ag_bw, rs_bw, rs_bw / copy_bw, rate("hp RS copy", world * size),
            rate("gloo AG", world * size), rate("gloo RS", world * size),
            row.get("gloo AG", nan) / row.get("hp AG", nan), row.get("gloo RS", nan) / row.get("hp RS copy", nan),
        ]
        print(" | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells))
    if result["gemm_alone_ms"]:
        slow = result["gemm_beside_ms"] / result["gemm_alone_ms"] - 1
        paced = result["gemm_paced_ms"] / result["gemm_alone_ms"] - 1
        print(f"8192^3 bf16 GEMM: {result['gemm_alone_ms']:.3f} ms alone, {result['gemm_beside_ms']:.3f} ms beside "
              f"{result['all_gathers_beside']} all-gathers of 256 MiB back to back on the copy engines: "
              f"{100 * slow:+.1f}%; {result['gemm_paced_ms']:.3f} ms with one all-gather started with each GEMM "
              f"(as FSDP prefetches): {100 * paced:+.1f}% ({label})")
    for line in result["skipped"]:
        print("skipped:", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    sizes = [s for s in (1, 4, 16, 64, 256, 1024) if s <= args.max_mib]
    # Each pass is reported and saved as it ends: device time is short, and a
    # later pass that dies must not take an earlier one's figures with it.
    results = []
    for n in sorted({1, args.nproc}):
        results.append(run(measure, nproc=n, args=(sizes, args.repeats))[0])
        if args.json:
            with open(args.json, "w") as file:
                json.dump(results, file, indent=1)
        _report(results[-1])


if __name__ == "__main__":
    main()

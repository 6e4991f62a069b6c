"""All-gather and reduce-scatter on the fabric vs Gloo, with memcpy as the physical limit.

    python bench/collectives.py                 # 4 KiB ... 256 MiB, 2 ranks
    python bench/collectives.py --max-mib 64    # quicker

Each rank runs on one thread. Sizes are the full tensor (fp32). GB/s is the
full tensor's bytes over the slowest rank's median time. "hp" is the zero-copy
path FSDP uses: all-gather of a node-shared tensor whose rows each rank wrote
in place (a wait; bytes copied are counted and printed), reduce-scatter of
gradients in each rank's shared slot (one pass). "hp copy" is the c10d-style
API on private tensors. "memcpy" copies the full size on every rank at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import hyperparallel as hp
from hyperparallel.launch import run


def _agree(value: float, op=dist.ReduceOp.MAX) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor.item()


def _timed(fn, min_seconds: float = 0.3, min_batches: int = 3, batch_seconds: float = 0.002) -> float:
    """Median seconds per call, over the slowest rank.

    Calls run in batches of back-to-back calls between barriers, so that the
    skew with which ranks leave a barrier does not swamp microsecond calls.
    """
    fn()  # warm-up: first touch of pages, scratch growth
    dist.barrier()
    start = time.perf_counter()
    fn()
    once = _agree(time.perf_counter() - start)
    batch = max(1, int(batch_seconds / max(once, 1e-9)))
    per_call: list[float] = []
    spent = 0.0
    while len(per_call) < min_batches or (spent < min_seconds and len(per_call) < 100):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        elapsed = _agree(time.perf_counter() - start)
        per_call.append(elapsed / batch)
        spent += elapsed
    return statistics.median(per_call)


def _measure_size(size: int) -> dict:
    world = dist.get_world_size()
    n = size // 4
    per = -(-n // world)
    x = torch.randn(n)
    row: dict = {"bytes": size}

    source, target = torch.randn(n), torch.empty(n)
    row["memcpy"] = _timed(lambda: target.copy_(source))

    shared = hp.comm.shared_empty((n,))
    hp.comm.local_rows(shared).copy_(hp.comm.local_rows(x))

    def all_gather_zero_copy():
        hp.comm.acquire(shared)  # rows would be rewritten here by the optimizer
        hp.comm.all_gather_shared(shared)

    hp.comm.reset_stats()
    row["hp_all_gather"] = _timed(all_gather_zero_copy)
    row["hp_all_gather_bytes_copied"] = hp.comm.stats()["bytes_copied"]

    grad = hp.comm.symmetric_empty((n,))
    grad.copy_(x)
    shard = torch.empty_like(hp.comm.local_rows(x))

    def reduce_scatter_one_pass():
        hp.comm.acquire(grad)  # backward would write the gradient here
        hp.comm.reduce_scatter_symmetric(shard, grad)

    hp.comm.reset_stats()
    row["hp_reduce_scatter"] = _timed(reduce_scatter_one_pass)
    row["hp_reduce_scatter_bytes_copied"] = hp.comm.stats()["bytes_copied"]

    full, mine = torch.empty(n), hp.comm.local_rows(x).clone()
    row["hp_copy_all_gather"] = _timed(lambda: hp.comm.all_gather_into_tensor(full, mine))
    row["hp_copy_reduce_scatter"] = _timed(lambda: hp.comm.reduce_scatter_tensor(shard, x))

    chunk, padded, gathered = torch.empty(per), torch.randn(per * world), torch.empty(per * world)
    row["gloo_all_gather"] = _timed(lambda: dist.all_gather_into_tensor(gathered, chunk))
    row["gloo_reduce_scatter"] = _timed(lambda: dist.reduce_scatter_tensor(chunk, padded))
    return row


def measure(sizes: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    hp.comm.init()
    return [_measure_size(size) for size in sizes]


def _format(rows: list[dict]) -> str:
    def gbs(row, key):
        return row["bytes"] / row[key] / 1e9

    header = (
        f"{'size':>9} {'memcpy':>7} | {'hp AG':>8} {'copied':>6} {'hpcopy':>6} {'gloo AG':>7} | "
        f"{'hp RS':>6} {'hpcopy':>6} {'gloo RS':>7} | {'RS/memcpy':>9} {'RS hp/gloo':>10} {'AG hp/gloo':>10}"
    )
    lines = ["GB/s (full tensor bytes / time)", header]
    for row in rows:
        size = row["bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(
            f"{label:>9} {gbs(row, 'memcpy'):7.2f} | {gbs(row, 'hp_all_gather'):8.1f} "
            f"{row['hp_all_gather_bytes_copied']:>6} {gbs(row, 'hp_copy_all_gather'):6.2f} "
            f"{gbs(row, 'gloo_all_gather'):7.2f} | {gbs(row, 'hp_reduce_scatter'):6.2f} "
            f"{gbs(row, 'hp_copy_reduce_scatter'):6.2f} {gbs(row, 'gloo_reduce_scatter'):7.2f} | "
            f"{row['memcpy'] / row['hp_reduce_scatter']:9.2f} "
            f"{row['gloo_reduce_scatter'] / row['hp_reduce_scatter']:10.1f} "
            f"{row['gloo_all_gather'] / row['hp_all_gather']:10.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    sizes, size = [], args.min_kib << 10
    while size <= args.max_mib << 20:
        sizes.append(size)
        size *= 4
    rows = run(measure, nproc=args.nproc, args=(sizes,))[0]
    print(_format(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()

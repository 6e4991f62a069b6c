"""hp.checkpoint vs torch.distributed.checkpoint: save and load of the same sharded state.

    python bench/checkpoint.py                              # qwen3-moe-bench, 2 ranks, 3 rounds
    python bench/checkpoint.py --config qwen3-moe-small --rounds 2 --dir /tmp

The model (seeded, fp32) is sharded with hp.fully_shard over 2 ranks; Muon + AdamW
(hyperparallel.optim.muon_with_adamw) get their state from one step. The state dict is
{"model", "optim": {"muon", "adamw"}, "step"}. Each round saves it with hp.checkpoint.save and
with torch.distributed.checkpoint.save (FileSystemWriter defaults: one file per rank, fsync),
then loads each back in place (hp.checkpoint.load verifies every file's CRC-32 first; DCP does
not verify). Runs alternate hp, torch, hp, torch so the machine's noise hits both; times are
rank 0's wall time between barriers, medians over rounds. Loads read from the page cache (the
files were just written); saves include fsync.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _spec import build_model, resolve_config

import hyperparallel as hp
import hyperparallel.checkpoint
import hyperparallel.optim
from hyperparallel.launch import run


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def worker(config: str, rounds: int, root: str) -> dict:
    torch.set_num_threads(1)
    hp.comm.init()
    model = build_model(resolve_config(config), seed=0)
    for layer in model.model.layers:
        hp.fully_shard(layer)
    hp.fully_shard(model)
    muon, adamw = hyperparallel.optim.muon_with_adamw(model, lr=2e-3)
    for p in model.parameters():  # one step on zero gradients creates the optimizers' state
        p.grad = torch.zeros_like(p)
    for opt in (muon, adamw):
        opt.step()
        opt.zero_grad()
    state = {"model": model.state_dict(), "optim": {"muon": muon.state_dict(), "adamw": adamw.state_dict()},
             "step": 1}
    rank = dist.get_rank()
    times: dict[str, list[float]] = {k: [] for k in ("hp save", "torch save", "hp load", "torch load")}
    nbytes = {}
    for r in range(rounds):
        for system in ("hp", "torch"):
            path = Path(root) / f"{system}_{r}"
            if system == "hp":
                times["hp save"].append(timed(lambda path=path: hp.checkpoint.save(state, path)))
            else:
                times["torch save"].append(timed(lambda path=path: dcp.save(state, checkpoint_id=str(path))))
            nbytes[system] = size_of(path)
        for system in ("hp", "torch"):
            path = Path(root) / f"{system}_{r}"
            if system == "hp":
                times["hp load"].append(timed(lambda path=path: hp.checkpoint.load(state, path)))
            else:
                times["torch load"].append(timed(lambda path=path: dcp.load(state, checkpoint_id=str(path))))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    return {"times": times, "bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen3-moe-bench")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="hp-ckpt-bench-", dir=args.dir)
    try:
        result = run(worker, nproc=args.nproc, args=(args.config, args.rounds, root))[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times, nbytes = result["times"], result["bytes"]
    gb = nbytes["hp"] / 1e9
    print(f"{args.config}, {args.nproc} ranks, {args.rounds} rounds, HP_CKPT_THREADS={os.environ.get('HP_CKPT_THREADS', '4')}")
    print(f"checkpoint size: hp {nbytes['hp'] / 1e9:.3f} GB, torch {nbytes['torch'] / 1e9:.3f} GB")
    print("| operation | hp | torch DCP | hp / torch |")
    print("| --- | --- | --- | --- |")
    for op in ("save", "load"):
        ours, theirs = statistics.median(times[f"hp {op}"]), statistics.median(times[f"torch {op}"])
        print(f"| {op} | {ours:.2f} s ({gb / ours:.2f} GB/s) | {theirs:.2f} s ({gb / theirs:.2f} GB/s) "
              f"| {ours / theirs:.2f} ({theirs / ours:.1f}x) |")


if __name__ == "__main__":
    main()

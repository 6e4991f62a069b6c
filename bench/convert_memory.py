"""Memory and time of turning an HF model directory into a sharded checkpoint: ``hyperparallel
convert from-hf`` (each tensor read as the writer comes to it) vs the PyTorch way
(``AutoModelForCausalLM.from_pretrained``, then ``torch.distributed.checkpoint.save`` of its
state dict).

    .venv/bin/python bench/convert_memory.py                 # 4 layers: 425 M parameters, 3 rounds
    .venv/bin/python bench/convert_memory.py --layers 8 --rounds 5 --dir /tmp

The model is a Qwen3-MoE (hidden 1024, 32 experts of 512, ``--layers`` layers) saved here with
``save_pretrained`` in fp32: per-expert tensors, as on the hub, which both sides stack into
``experts.gate_up_proj`` / ``down_proj``. Each conversion runs in a fresh process; the figures
are its peak resident set (``ru_maxrss``: everything resident, the file pages it maps
included), its peak anonymous memory (RssAnon, sampled every 20 ms: what it allocated; the
weights transformers maps from safetensors without a copy are not in it) and its wall time.
Runs alternate hp, torch; medians over rounds. Both write to the same file system with fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPE = {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 32,
         "num_experts_per_tok": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
         "vocab_size": 32000}

TORCH = """
import sys, torch, torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM
from transformers.utils import logging
logging.disable_progress_bar()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
dcp.save({"model": model.state_dict()}, checkpoint_id=sys.argv[2], no_dist=True)
"""


def anonymous_bytes(pid: int) -> int:
    """The process's resident anonymous memory (RssAnon): what it allocated, not file pages it maps."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it has exited
        return 0
    line = next((line for line in status.splitlines() if line.startswith("RssAnon:")), "RssAnon: 0 kB")
    return int(line.split()[1]) * 1024


MAKE = """
import json, sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**json.loads(sys.argv[2]), num_hidden_layers=int(sys.argv[3])))
model.save_pretrained(sys.argv[1])
print(sum(p.numel() for p in model.parameters()))
"""


def make_model(out: Path, layers: int) -> int:
    """The HF directory; returns its parameter count. In a process of its own: a child's peak
    resident set (ru_maxrss) starts at its parent's when it forks, so this one stays small."""
    made = subprocess.run([sys.executable, "-c", MAKE, str(out), json.dumps(SHAPE), str(layers)], check=True,
                          capture_output=True, text=True)
    return int(made.stdout.split()[-1])


def measure(command: list[str]) -> tuple[float, float, float]:
    """(peak resident set GiB, peak anonymous memory GiB, seconds) of one run of ``command``."""
    peak = 0
    done = threading.Event()
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.02):
            peak = max(peak, anonymous_bytes(process.pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed")
    return usage.ru_maxrss / (1 << 20), peak / (1 << 30), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the model and checkpoints (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hp-convert-", dir=args.dir))
    try:
        params = make_model(root / "hf", args.layers)
        size = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors")) / (1 << 30)
        print(f"model: {params / 1e6:.0f} M parameters, {size:.2f} GiB of safetensors; {args.rounds} rounds")
        commands = {
            "hp": [sys.executable, "-m", "hyperparallel.checkpoint.convert", "from-hf", str(root / "hf"),
                   str(root / "out")],
            "torch": [sys.executable, "-c", TORCH, str(root / "hf"), str(root / "out")],
        }
        results: dict[str, list] = {name: [] for name in commands}
        for _ in range(args.rounds):
            for name, command in commands.items():
                results[name].append(measure(command))
                shutil.rmtree(root / "out", ignore_errors=True)
        print("| from-hf | peak RSS GiB | peak anonymous GiB | seconds |")
        print("| --- | --- | --- | --- |")
        medians = {}
        for name, runs in results.items():
            medians[name] = [statistics.median(column) for column in zip(*runs)]
            cells = [f"{m:.2f} ({', '.join(f'{r:.2f}' for r in column)})" for m, column in zip(medians[name], zip(*runs))]
            print(f"| {name} | " + " | ".join(cells) + " |")
        ratios = [h / t for h, t in zip(medians["hp"], medians["torch"])]
        print(f"hp / torch: peak RSS {ratios[0]:.2f}, anonymous {ratios[1]:.2f}, time {ratios[2]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

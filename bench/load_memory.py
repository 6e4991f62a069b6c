"""Memory of loading a model for LlamaFactory SFT: hyperparallel's meta load (each rank reads
its rows) vs LlamaFactory's own (the whole model on every rank).

    .venv-llamafactory/bin/python bench/load_memory.py               # 2 ranks, 420 M parameters, 2 rounds
    .venv-llamafactory/bin/python bench/load_memory.py --world 2 --layers 4 --rounds 3

Needs ``.venv-llamafactory`` (``scripts/setup.sh --with-llamafactory``). The model is a Qwen3-MoE
made here by examples/llamafactory/tiny_model.py (fp32 safetensors; hidden 1024, 32 experts of
512, ``--layers`` layers). Each run is ``hyperparallel.integrations.llamafactory`` under torchrun
on examples/llamafactory/qwen3_moe_sft.yaml with that model, stopped once every rank's trainer
holds the sharded model; ``whole`` keeps LlamaFactory's ``load_model`` (the load before
hyperparallel's). The figure is the node's memory in use (MemTotal - MemAvailable in
/proc/meminfo, sampled every 20 ms: private memory and the shared-memory shards alike) at its
peak, over its value before the run. Runs alternate meta, whole; medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = Path(sys.executable).parent
SHAPE = {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 32,
         "num_experts_per_tok": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}


def used_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) * 1024


def make_model(out: Path, layers: int) -> int:
    """The model directory; returns its parameter count."""
    config = json.loads((ROOT / "examples" / "tiny-moe.config.json").read_text())
    config.update(SHAPE, num_hidden_layers=layers, max_window_layers=layers)
    (out.parent / "config.json").write_text(json.dumps(config))
    subprocess.run([sys.executable, str(ROOT / "examples" / "llamafactory" / "tiny_model.py"), str(out),
                    "--config", str(out.parent / "config.json")], check=True, capture_output=True)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as file:
        return sum(math.prod(file.get_slice(name).get_shape()) for name in file.keys())  # noqa: SIM118 (not a dict)


def write_config(path: Path, model: Path, out: Path) -> None:
    import yaml

    config = yaml.safe_load((ROOT / "examples" / "llamafactory" / "qwen3_moe_sft.yaml").read_text())
    config.update(model_name_or_path=str(model), output_dir=str(out), dataset_dir=str(ROOT / "tests" / "data"),
                  plot_loss=False)
    path.write_text(yaml.safe_dump(config))


def peak_over_idle(way: str, world: int, config: Path) -> int:
    """One run's peak node memory in use over the value before it, in bytes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    idle = peak = used_bytes()
    process = subprocess.Popen(
        [str(ENV / "torchrun"), "--nproc-per-node", str(world), __file__, "--rank-entry", way, str(config)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while process.poll() is None:
        peak = max(peak, used_bytes())
        time.sleep(0.02)
    output = process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"load_memory: the {way} run failed ({process.returncode}):\n{output[-4000:]}")
    return peak - idle


def rank_entry(way: str, config: str) -> int:
    """One rank: LlamaFactory SFT under hyperparallel, leaving once the trainer holds the sharded model."""
    import torch.distributed as dist

    import hyperparallel.integrations.llamafactory as integration

    if way == "whole":
        integration.meta_load_model = lambda load_model: load_model
    make = integration.trainer_class

    def trainer_class(base, hp_args):
        cls = make(base, hp_args)
        init = cls.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            dist.barrier()
            sys.stdout.flush()
            os._exit(0)

        cls.__init__ = __init__
        return cls

    integration.trainer_class = trainer_class
    return integration.main([config])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank-entry", nargs=2, metavar=("WAY", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_entry:
        raise SystemExit(rank_entry(*args.rank_entry))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = make_model(tmp / "model", args.layers)
        size = (tmp / "model" / "model.safetensors").stat().st_size
        write_config(tmp / "sft.yaml", tmp / "model", tmp / "out")
        peaks: dict[str, list[int]] = {"meta": [], "whole": []}
        for _ in range(args.rounds):
            for way, runs in peaks.items():
                runs.append(peak_over_idle(way, args.world, tmp / "sft.yaml"))
    gib = 1 << 30
    meta, whole = (statistics.median(peaks[way]) / gib for way in ("meta", "whole"))
    print(f"LlamaFactory SFT load, {args.world} ranks, Qwen3-MoE of {params / 1e6:.0f} M parameters "
          f"({size / gib:.2f} GiB fp32), {args.rounds} rounds; node memory in use over idle, peak, median:")
    print(f"  hyperparallel (meta, each rank its rows): {meta:.2f} GiB   {[round(p / gib, 2) for p in peaks['meta']]}")
    print(f"  LlamaFactory's load (whole on each rank): {whole:.2f} GiB   {[round(p / gib, 2) for p in peaks['whole']]}")
    print(f"  ratio meta / whole: {meta / whole:.2f}")


if __name__ == "__main__":
    main()

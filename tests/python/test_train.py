"""hyperparallel train end to end: 2 real ranks through the real command, on the embedded default.

One shortened default run (data prepared on the way) is shared by the tests: its loss
must fall and its outputs exist; a run stopped half-way and resumed must reproduce its
losses bit for bit; and the dry-run memory estimate must be within 20% of the peak RSS
it measured (and of a second, larger configuration's).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hyperparallel.cli import main
from hyperparallel.launch import run
from hyperparallel.trainer.config import load_config
from hyperparallel.trainer.estimate import estimate
from hyperparallel.trainer.report import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "examples" / "default.yaml"
STEPS = 12


def _train(*args: str, cwd: Path = REPO, nproc: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "hyperparallel", "train", str(DEFAULT), "--nproc", str(nproc), *args]
    result = subprocess.run(command, check=False, cwd=cwd, capture_output=True, text=True, timeout=300)
    if result.returncode:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def _short(tmp: Path, out: str, *extra: str) -> list[str]:
    return [f"data.tokens={tmp / 'data' / 'stories.bin'}", f"output.dir={tmp / out}", f"train.steps={STEPS}",
            "optim.warmup_steps=3", "checkpoint.every=6", "train.device=cpu", *extra]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    result = _train(*_short(tmp, "full"))
    return tmp, result


def test_default_run_learns_and_writes_outputs(full_run):
    tmp, result = full_run
    out = tmp / "full"
    assert "is missing; tokenizing" in result.stdout  # the token file was prepared on the way
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert losses[0] > 7.0  # about ln(2048) from fresh weights
    assert max(losses[-3:]) < losses[0] - 1.0, losses
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in records)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_00000006", "step_00000012"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_run"] == STEPS and len(summary["peak_rss_bytes_per_rank"]) == 2
    assert "hyperparallel train: 12 steps" in result.stdout and "peak RSS per rank" in result.stdout
    assert f"step {STEPS}/{STEPS}" in result.stderr  # the progress bar


def test_resume_into_another_optimizer_names_the_fix(full_run):
    tmp, _ = full_run
    shutil.copytree(tmp / "full", tmp / "other")
    command = [sys.executable, "-m", "hyperparallel", "train", str(DEFAULT), "--nproc", "2",
               *_short(tmp, "other", f"train.steps={STEPS + 2}", "optim.name=adamw")]
    result = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "holds another model or optimizer than this config's" in result.stderr
    assert "pass --overwrite" in result.stderr


def test_resume_reproduces_losses_bitwise(full_run):
    """Stop at step 5, resume: every step's loss and gradient norm equal the uninterrupted run's.
    The first half also runs with activation checkpointing, whose recomputation must not
    change a bit either."""
    tmp, _ = full_run
    # Stops after step 5 with a checkpoint.
    _train(*_short(tmp, "resumed", "train.stop_at=5", "model.activation_checkpointing=true"))
    assert [r["step"] for r in read_metrics(tmp / "resumed" / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    result = _train(*_short(tmp, "resumed"))  # no --overwrite: continues from step 5
    assert result.stdout.count("resumed from") == 1 and "at step 5" in result.stdout  # once, not per rank
    full = read_metrics(tmp / "full" / "metrics.jsonl")
    resumed = read_metrics(tmp / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(full, resumed):
        assert (a["step"], a["loss"], a["grad_norm"], a["lr"]) == (b["step"], b["loss"], b["grad_norm"], b["lr"])


def test_a_failing_rank_is_one_clean_paragraph(full_run, tmp_path):
    """Resuming from a corrupted checkpoint fails on the ranks: the user sees the error once, as a
    paragraph naming the rank, the exception and the file, without torch elastic's log prefixes;
    HP_LOG=debug adds the traceback."""
    tmp, _ = full_run
    out = tmp_path / "out"
    shutil.copytree(tmp / "full", out)
    data = out / "checkpoints" / f"step_{STEPS:08d}" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    args = [str(DEFAULT), "--nproc", "2", *_short(tmp, "out"), f"output.dir={out}", f"train.steps={STEPS + 1}"]
    command = [sys.executable, "-m", "hyperparallel", "train", *args]
    for debug in (False, True):
        env = {**os.environ, "HP_LOG": "debug" if debug else "warning"}
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 1, result.stderr
        assert result.stderr.count("hyperparallel train: rank ") == 1, result.stderr
        assert "failed: CheckpointError: checkpoint file" in result.stderr and "is corrupted" in result.stderr
        assert ("Traceback" in result.stderr) == debug, result.stderr
        if not debug:
            assert "api.py" not in result.stderr and len(result.stderr.splitlines()) == 2, result.stderr


def test_a_stopped_launcher_stops_its_ranks_and_says_what_is_kept(full_run, tmp_path):
    """SIGTERM to `hyperparallel train` (as a scheduler sends): the ranks stop with it, the
    command says which checkpoint is complete and exits 128 + 15."""
    tmp, _ = full_run
    args = [*_short(tmp, "stopped"), f"output.dir={tmp_path / 'out'}", "train.steps=1000", "checkpoint.every=2",
            "output.log_every=1", "output.plot=false"]
    launcher = subprocess.Popen([sys.executable, "-m", "hyperparallel", "train", str(DEFAULT), "--nproc", "2", *args],
                                cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        for line in launcher.stderr:
            if line.startswith("step 3/"):  # past the step-2 checkpoint
                break
        ranks = [pid for pid in _children(launcher.pid) if b"spawn_main" in _cmdline(pid)]
        launcher.send_signal(signal.SIGTERM)
        rest = launcher.stderr.read()
        assert launcher.wait(timeout=120) == 128 + signal.SIGTERM, rest
    finally:
        launcher.kill()
        launcher.wait()
    assert "hyperparallel train: stopped by SIGTERM, and the ranks with it; the latest complete checkpoint is" in rest
    assert "Traceback" not in rest, rest
    assert len(ranks) == 2 and not any(_running(pid) for pid in ranks)
    assert (tmp_path / "out" / "checkpoints" / "step_00000002" / ".metadata").exists()


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, parent pid, ... ([] once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _stat(int(p))[1:2] == [str(pid)]]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], ["Z"])  # gone, or dead and not yet reaped


def _within(estimated: int, measured: list[int]) -> None:
    peak = max(measured)
    assert abs(estimated - peak) <= 0.2 * peak, f"estimate {estimated >> 20} MiB, measured {[m >> 20 for m in measured]}"


def test_dry_run_estimate_matches_peak_rss(full_run, tmp_path, capsys):
    tmp, _ = full_run
    # 1. The default configuration: the shortened run above.
    cfg = load_config(DEFAULT, _short(tmp, "full"))
    summary = json.loads((tmp / "full" / "summary.json").read_text())
    _within(estimate(cfg, 2).total, summary["peak_rss_bytes_per_rank"])
    # 2. A 44M-parameter MoE in bf16 with activation checkpointing and accumulation:
    #    parameters, gradients and Muon's state are most of the memory. Short sequences keep it
    #    quick on every CPU.
    model = json.loads((REPO / "examples" / "tiny-moe.config.json").read_text())
    model.update(hidden_size=512, num_hidden_layers=6, num_experts=16, moe_intermediate_size=256,
                 num_attention_heads=8, head_dim=64, max_window_layers=6)
    (tmp_path / "medium.json").write_text(json.dumps(model))
    args = [f"model.config={tmp_path / 'medium.json'}", "model.activation_checkpointing=true",
            "model.mixed_precision=bfloat16",
            "train.micro_batch=2", "train.global_batch=8", "data.seq_len=128", *_short(tmp, "medium")[:2],
            "train.steps=3", "checkpoint.final=false", "output.plot=false", "train.device=cpu"]
    assert main(["train", str(DEFAULT), "--nproc", "2", "--dry-run", *args]) == 0
    plan = capsys.readouterr().out
    assert "2 per rank x 2 micro-batches x 2 ranks" in plan and "activations" in plan and "bfloat16" in plan
    _train(*args)
    medium = json.loads((tmp / "medium" / "summary.json").read_text())
    _within(estimate(load_config(DEFAULT, args), 2).total, medium["peak_rss_bytes_per_rank"])


def test_two_nodes_hsdp_and_accumulation_match_one_node(full_run):
    """Two simulated nodes of one rank each (HSDP: shard in the node, replicate across), and one
    rank accumulating two micro-batches, train on the same global batches as the 2-rank run, so
    the first losses agree closely."""
    from hyperparallel.launch import run
    from hyperparallel.trainer.loop import rank_main

    tmp, _ = full_run
    cfg = load_config(DEFAULT, _short(tmp, "nodes", "train.steps=12", "train.stop_at=3", "output.plot=false",
                                      "checkpoint.every=0", "checkpoint.final=false", "output.progress=false"))
    results = run(rank_main, nproc=1, nnodes=2, args=(cfg.to_dict(), None))
    assert sorted(results) == [0, 1] and results[0]["world_size"] == 2
    one_node = [r["loss"] for r in read_metrics(tmp / "full" / "metrics.jsonl")][:3]
    two_nodes = [r["loss"] for r in read_metrics(tmp / "nodes" / "metrics.jsonl")]
    assert two_nodes == pytest.approx(one_node, rel=1e-4)
    cfg = load_config(DEFAULT, _short(tmp, "accumulate", "train.steps=12", "train.stop_at=3", "output.plot=false",
                                      "checkpoint.every=0", "checkpoint.final=false", "output.progress=false"))
    results = run(rank_main, nproc=1, args=(cfg.to_dict(), None))
    assert results[0]["accumulation"] == 2
    accumulated = [r["loss"] for r in read_metrics(tmp / "accumulate" / "metrics.jsonl")]
    assert accumulated == pytest.approx(one_node, rel=1e-4)


def test_checkpoint_converts_to_a_hf_model_that_continues(full_run, tmp_path):
    """``hyperparallel convert to-hf`` of the trainer's last checkpoint is a HF directory whose
    weights (loaded as ``model.pretrained``) are the trained ones: lower loss than fresh weights."""
    import torch

    from hyperparallel.trainer import model as model_lib
    from hyperparallel.trainer.data import TokenLoader

    tmp, _ = full_run
    checkpoint = tmp / "full" / "checkpoints" / f"step_{STEPS:08d}"
    config = REPO / "examples" / "tiny-moe.config.json"
    assert main(["convert", "to-hf", str(checkpoint), str(tmp_path / "hf"), "--config", str(config)]) == 0
    trained = model_lib.build(load_config(DEFAULT, ["model.config=null", f"model.pretrained={tmp_path / 'hf'}"]))
    fresh = model_lib.build(load_config(DEFAULT))
    loader = TokenLoader(tmp / "data" / "stories.bin", seq_len=256, global_batch=4, micro_batch=4, dp_rank=0,
                         dp_size=1, seed=1)
    ids = loader.micro_batch(0)
    with torch.no_grad():
        losses = [m(input_ids=ids, labels=ids).loss.item() for m in (fresh, trained)]
    assert losses[1] < losses[0] - 1.0, losses


def generators_resume(device_type: str) -> bool:
    """A rank's generators saved as a checkpoint holds them, drawn from, then restored: the draws
    repeat. Each rank restores its own entry (ranks are seeded apart); an entry of a checkpoint
    written before the GPU's generator was kept (the CPU state's bytes) restores the CPU's."""
    import torch
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel.trainer.model import rank_device
    from hyperparallel.trainer.state import restore_rng, rng_states

    hp.comm.init()
    device = rank_device(device_type)
    torch.manual_seed(dist.get_rank())
    if device.type == "cuda":
        torch.cuda.manual_seed(100 + dist.get_rank())

    def draw() -> list:
        return [torch.rand(4), torch.rand(4, device=device).cpu()]

    states = rng_states(device)
    mine = states[dist.get_rank()]
    expected, _ = draw(), draw()
    restore_rng(mine, device)
    again = draw()
    restore_rng(mine["cpu"], device)
    old = draw()
    return (all(torch.equal(a, b) for a, b in zip(again, expected)) and torch.equal(old[0], expected[0])
            and states[0] != states[1] and ("cuda" in mine) == (device.type == "cuda"))


def test_each_ranks_generators_resume_as_saved():
    assert all(run(generators_resume, nproc=2, args=("cpu",)).values())

"""hyperparallel train on a GPU (train.device=cuda), through the real command: the embedded
default learns, its dry-run GPU estimate is near the measured peak, a run checkpointed on the
CPU resumes on the GPU, 2 ranks sharing the GPU start where 1 rank does, and each rank's CUDA
generator resumes as saved."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_train import DEFAULT, _train, generators_resume

from hyperparallel.launch import run
from hyperparallel.trainer.config import load_config
from hyperparallel.trainer.estimate import estimate
from hyperparallel.trainer.report import read_metrics

pytestmark = pytest.mark.gpu

STEPS = 8


def _short(tmp: Path, out: str, *extra: str) -> list[str]:
    return [f"data.tokens={tmp / 'data' / 'stories.bin'}", f"output.dir={tmp / out}", f"train.steps={STEPS}",
            "optim.warmup_steps=2", "checkpoint.every=4", "output.plot=false", "output.progress=false", *extra]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_train")
    result = _train(*_short(tmp, "gpu", "train.device=cuda"), nproc=1)
    return tmp, result


def test_default_learns_on_the_gpu(gpu_run):
    tmp, result = gpu_run
    summary = json.loads((tmp / "gpu" / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["peak_device_bytes_per_rank"][0] > 0
    losses = [r["loss"] for r in read_metrics(tmp / "gpu" / "metrics.jsonl")]
    assert len(losses) == STEPS and losses[0] > 7.0 and max(losses[-2:]) < losses[0] - 1.0, losses
    assert "ranks (cuda)" in result.stdout and "peak GPU memory per rank" in result.stdout
    assert "dry-run estimate" in result.stdout  # rank 0 made it: the launcher leaves the GPU estimate to it
    print(result.stdout)


def test_dry_run_gpu_estimate_near_the_measured_peak(gpu_run):
    tmp, _ = gpu_run
    cfg = load_config(DEFAULT, _short(tmp, "gpu", "train.device=cuda"))
    estimated = estimate(cfg, 1).allocated  # the rank's own memory: not the context, not other processes'
    measured = json.loads((tmp / "gpu" / "summary.json").read_text())["peak_device_bytes_per_rank"][0]
    print(f"GPU memory: estimate {estimated >> 20} MiB, measured {measured >> 20} MiB (1 rank, no context)")
    # The tiny default's figure is mostly the workspaces' constant and the allocator's rounding.
    assert abs(estimated - measured) <= max(0.5 * measured, 64 << 20)


def test_a_cpu_checkpoint_resumes_on_the_gpu(gpu_run):
    """A run checkpointed on the CPU at step 4 goes on on the GPU, against the same checkpoint
    going on on the CPU: the same weights and optimizer state, other kernels. (Not against the
    GPU run: a model built on the GPU draws other initial weights from CUDA's generator.)"""
    tmp, _ = gpu_run
    _train(*_short(tmp, "moved", "train.device=cpu", "train.stop_at=4"), nproc=1)
    shutil.copytree(tmp / "moved", tmp / "stayed")
    result = _train(*_short(tmp, "moved", "train.device=cuda"), nproc=1)
    assert "resumed from" in result.stdout and "at step 4" in result.stdout
    _train(*_short(tmp, "stayed", "train.device=cpu"), nproc=1)
    moved = [r["loss"] for r in read_metrics(tmp / "moved" / "metrics.jsonl")]
    stayed = [r["loss"] for r in read_metrics(tmp / "stayed" / "metrics.jsonl")]
    # CPU and GPU kernels round differently and Muon carries that on; a resume that lost the
    # weights or the optimizer state would be off by far more (the loss starts near 7.7).
    assert len(moved) == len(stayed) == STEPS
    assert max(abs(a - b) for a, b in zip(moved, stayed)) < 0.05, (moved, stayed)


def test_two_ranks_sharing_the_gpu_start_where_one_does(gpu_run):
    if torch.cuda.device_count() > 1:
        pytest.skip("checks ranks sharing one GPU")
    tmp, _ = gpu_run
    _train(*_short(tmp, "two", "train.device=cuda", "train.stop_at=3", "checkpoint.final=false"), nproc=2)
    two = [r["loss"] for r in read_metrics(tmp / "two" / "metrics.jsonl")]
    one = [r["loss"] for r in read_metrics(tmp / "gpu" / "metrics.jsonl")][:3]
    # The same global batches split over two ranks: the same losses but for summation order.
    assert max(abs(a - b) for a, b in zip(two, one)) < 1e-2, (two, one)


def test_each_ranks_cuda_generator_resumes_as_saved():
    assert all(run(generators_resume, nproc=2, args=("cuda",)).values())

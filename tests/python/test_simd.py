"""The one instruction-set policy (csrc/simd): HP_SIMD caps every C++ kernel, and each tier passes the kernel tests.

The default run exercises the best tier this CPU has; here the kernel tests of
comm (reductions), ops (row kernels), optim (Muon's passes, Newton–Schulz) and
checkpoint (CRC-32) run again under each lesser tier (HP_SIMD=avx2 on an
AVX-512 CPU, HP_SIMD=baseline on any), and the C++ tests with them where
scripts/setup.sh built them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hyperparallel._C import cpu_isa

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/python/test_comm.py",
    "tests/python/test_nn_ops.py",
    "tests/python/test_muon.py",
    "tests/python/test_checkpoint.py::test_crc32_matches_zlib",
]
# Left out under a lesser tier: a test that runs every tier itself, and collectives that add
# ranks and nodes (Gloo across them) but no kernel the 2-rank run does not already exercise.
REDUNDANT = [
    "tests/python/test_nn_ops.py::test_kernels_agree_across_instruction_sets",
    "tests/python/test_comm.py::test_collectives_match_gloo[4]",
    "tests/python/test_comm.py::test_collectives_match_gloo_across_two_nodes",
]
CPP_TESTS = ROOT / "build" / "cpp" / "hp_core_tests"


TIERS = ["baseline", "avx2", "avx512"]


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_kernel_tests_pass_under_a_lesser_instruction_set(isa):
    best = cpu_isa()
    if TIERS.index(isa) >= TIERS.index(best):
        pytest.skip(f"this CPU's best tier is {best}: the default run already ran the kernel tests under it")
    env = dict(os.environ, HP_SIMD=isa)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS,
         *(f"--deselect={test}" for test in REDUNDANT)], cwd=ROOT, env=env, check=True,
    )
    if CPP_TESTS.exists():
        subprocess.run([str(CPP_TESTS), "--gtest_brief=1"], cwd=ROOT, env=env, check=True)


def test_an_unknown_instruction_set_names_the_fix():
    script = "import torch, hyperparallel.nn; torch.ops.hyperparallel.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)"
    result = subprocess.run(
        [sys.executable, "-c", script], env=dict(os.environ, HP_SIMD="sse9"), capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "HP_SIMD=sse9 is not an instruction set hyperparallel knows: use avx512, avx2 or baseline" in result.stderr

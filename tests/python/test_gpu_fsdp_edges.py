"""hp.fully_shard on CUDA at its edges, beside test_gpu_fsdp.py (a file of its own: gpu_check.sh
runs each file in a process of its own, at once): HSDP's cross-node sum in the reduce dtype, and
an iteration aborted by an exception, then reset, groups run many times or never between two
ends of backward, a block some ranks' inputs skip, and an HF directory written from CUDA shards.
Several ranks share the one GPU."""

from __future__ import annotations

import pytest
import torch
from test_fsdp import (
    aborted_iterations,
    assert_hsdp_rounds_once,
    assert_params_close,
    assert_skipped_block_grads,
    hsdp_bf16_gradients,
    long_iterations,
    skipped_block_grads,
)
from test_integrations_transformers import make_model, save_in_shards
from transformers import AutoModelForCausalLM

from hyperparallel.launch import run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nodes", [1, 2])
def test_an_aborted_iteration_is_reset_and_skipped_on_cuda(nodes, monkeypatch):
    # Pulls and reductions in flight when forward or backward raises: reset_iter_state waits
    # for them and drops them, and the run equals the one that skipped those steps.
    monkeypatch.setenv("HP_CROSS_NODE_BACKEND", "gloo")
    for result in run(aborted_iterations, nproc=2, nnodes=nodes, args=(nodes == 2, "cuda")).values():
        for name, shard in result["clean"].items():
            assert torch.equal(result["aborted"][name], shard), name


@pytest.mark.parametrize("per_node", [1, 2])
def test_hsdp_bf16_parameters_reduce_across_nodes_in_fp32(per_node, monkeypatch):
    # One rank a node reduces alone, two through the window's kernel: both keep the node's sum in
    # fp32 for the all-reduce and round it to bf16 once.
    monkeypatch.setenv("HP_CROSS_NODE_BACKEND", "gloo")
    results = run(hsdp_bf16_gradients, nproc=per_node, nnodes=2, args=(("hp",), "cuda"))
    assert_hsdp_rounds_once(results, nodes=2, per_node=per_node, how="hp")


def test_groups_run_many_times_or_never_between_backwards_on_cuda():
    # A pull's and a publish's device signals keep 8 rounds of IPC events: twelve pulls before a
    # release, or ten publishes of a group no forward reaches, must not wait for acknowledgements
    # that would come only after them.
    for result in run(long_iterations, nproc=2, args=("cuda",)).values():
        assert_params_close(result["hp"], result["one process"], 1e-5)


def test_save_pretrained_gathers_cuda_shards_over_gloo(tmp_path):
    # hp.comm.init() starts a Gloo default group (and ranks sharing a GPU must use Gloo): the
    # shards reach rank 0 through host memory, not Gloo's CUDA all-gather.
    run(save_in_shards, nproc=2, args=(str(tmp_path / "hf"), "cuda"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    expected = make_model("moe").state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("nodes,per_node,dtype", [(1, 2, torch.float32), (2, 1, torch.float32),
                                                 (2, 2, torch.float32), (2, 2, torch.bfloat16)])
def test_a_block_some_ranks_skip_gets_its_gradient_on_every_rank_on_cuda(nodes, per_node, dtype, monkeypatch):
    # Within a node the gradient windows carry host flags of who had a gradient; across nodes the
    # flags travel in the tail of the all-reduced sum (bf16 parameters: of its float32 copy), as on
    # the CPU.
    monkeypatch.setenv("HP_CROSS_NODE_BACKEND", "gloo")
    results = run(skipped_block_grads, nproc=per_node, nnodes=nodes, args=("cuda", nodes > 1, dtype))
    assert_skipped_block_grads(results, nodes, per_node, dtype)

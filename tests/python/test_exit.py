"""Every rank ends as its script says: exit codes are the script's own, never a teardown abort.

The script of issue 16: a tiny HF Qwen3-MoE sharded once with torch's fully_shard and once
with hp.fully_shard (each decoder layer, then the root), 5 AdamW steps on both, a last
all_reduce, dist.destroy_process_group(), then one ending. Before hp.comm.shutdown ran at
exit, 4 to 10 runs in 16 had a rank abort ("terminate called without an active
exception", SIGABRT): a Gloo worker released the last all_reduce's tensor while the
interpreter was finalising. Ranks are started as torchrun starts them (its environment,
one process each), so that each one's own exit status is seen; SIGTERM is what torchrun
sends its ranks when it stops a job.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys

import pytest

from hyperparallel.launch import free_port

RUNS = 20  # per ending

SCRIPT = """
import copy, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
import hyperparallel as hp

ending = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
base = Qwen3MoeForCausalLM(config)
systems = []
for shard in (torch_fully_shard, hp.fully_shard):
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        shard(layer)
    shard(model)
    systems.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
steps = 5 if ending != "sigterm" else 10_000  # SIGTERM comes while these run
for step in range(steps):
    for model, opt in systems:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    if step == 2 and ending == "sigterm":
        print("training", flush=True)
total = torch.tensor([float(rank)])
dist.all_reduce(total)
dist.destroy_process_group()
if ending == "exit0":
    sys.exit(0)
if ending == "exit3":
    sys.exit(3)
if ending == "raise":
    raise RuntimeError("the script's own error")
"""

EXPECTED = {"return": 0, "exit0": 0, "exit3": 3, "raise": 1, "sigterm": -signal.SIGTERM}


def _run_once(script: str, ending: str) -> list[tuple[int, str]]:
    """Start 2 ranks as torchrun would, end them as ``ending`` says; (status, stderr) per rank."""
    port = free_port()
    ranks = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0", OMP_NUM_THREADS="1")
        ranks.append(subprocess.Popen([sys.executable, script, ending], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        if ending == "sigterm":
            for process in ranks:
                assert process.stdout.readline().strip() == "training", process.communicate()[1]
            for process in ranks:
                process.send_signal(signal.SIGTERM)
        outs = [process.communicate(timeout=300) for process in ranks]
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    leftovers = [name for name in os.listdir("/dev/shm")
                 if any(name.startswith(f"hp-{os.getuid()}-{p.pid}-") for p in ranks)]
    assert leftovers == [], leftovers
    return [(process.returncode, err) for process, (_, err) in zip(ranks, outs)]


@pytest.mark.slow
@pytest.mark.parametrize("ending", list(EXPECTED))
def test_every_rank_exits_with_the_scripts_own_status(ending, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    seen: collections.Counter = collections.Counter()
    unexpected = []
    for run in range(RUNS):
        for rank, (status, stderr) in enumerate(_run_once(str(script), ending)):
            seen[status] += 1
            clean = "terminate called" not in stderr and "FabricError" not in stderr
            if ending == "raise":
                clean = clean and "RuntimeError: the script's own error" in stderr
            if status != EXPECTED[ending] or not clean:
                unexpected.append(f"run {run} rank {rank}: status {status}\n{stderr[-3000:]}")
    print(f"{ending}: {RUNS} runs x 2 ranks, statuses {dict(seen)}")
    assert not unexpected, "\n\n".join(unexpected)

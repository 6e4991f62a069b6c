"""HSDP between two "machines": one rank in each of two network namespaces joined by a veth pair.

Needs root (ip netns). Each rank is alone on its node, so parameters are sharded over
one rank and replicated across the two; every gradient crosses the veth link over Gloo.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import torch
from test_fsdp import STEPS, assert_params_close, single_process

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for network namespaces"
)

RANK_PROGRAM = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from torch.distributed.device_mesh import init_device_mesh
import hyperparallel as hp
from test_fsdp import batches, full_params, make_model, shard, train
torch.set_num_threads(1)
hp.comm.init()
mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
model = shard(make_model(), "hp", mesh=mesh)
losses = train(model, batches(2), dist.get_rank(), 2)
params = {{k: v.tolist() for k, v in full_params(model).items()}}
if dist.get_rank() == 0:
    json.dump({{"losses": losses, "params": params}}, open({out!r}, "w"))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    """Two namespaces, 10.200.0.1 and .2 on a veth pair; removed afterwards."""
    tag = uuid.uuid4().hex[:6]
    names = [f"hp{tag}a", f"hp{tag}b"]
    links = [f"hv{tag}a", f"hv{tag}b"]
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for index, (name, link) in enumerate(zip(names, links)):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"10.200.0.{index + 1}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield list(zip(names, links))
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)  # best effort


@needs_netns
def test_hsdp_across_network_namespaces_matches_one_process(two_hosts, tmp_path):
    out = tmp_path / "result.json"
    program = RANK_PROGRAM.format(tests=os.path.dirname(__file__), out=str(out))
    ranks = []
    for rank, (namespace, link) in enumerate(two_hosts):
        env = dict(os.environ, MASTER_ADDR="10.200.0.1", MASTER_PORT="29533", RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), GLOO_SOCKET_IFNAME=link)
        ranks.append(subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c", program],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for process in ranks:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
    result = json.loads(out.read_text())
    expected_losses, expected_params = single_process(world=2)
    assert len(result["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(result["losses"], expected_losses)) <= 1e-5
    assert_params_close({k: torch.tensor(v) for k, v in result["params"].items()}, expected_params, 1e-5)

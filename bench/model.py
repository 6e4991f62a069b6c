"""A cost model of one training step for the three systems of the side-by-side benchmark.

    python bench/model.py --save-components comp.json          # measure (about a minute), predict
    python bench/model.py --components comp.json --measured headline.jsonl

From component costs measured on this machine (GEMM rate per dtype, Newton-Schulz rate per matrix shape,
memcpy bandwidth, Gloo latency and bandwidth with 2 real ranks, per-op overhead) it predicts the
per-rank step time, its split and the per-rank work of hyperparallel, torch FSDP2 + gathered
Muon and torch FSDP2 + owner Muon at N = 1..256 ranks, for qwen3-moe-bench (4 x 512 tokens per
rank, the protocol's) and Qwen3-30B-A3B (4 x 4096 tokens per rank: our choice, the seed states
none). With --measured it checks itself against headline.py's --json-out lines.

Assumptions, all parameters: one rank per core, no overlap of Gloo with compute (a rank's
one core runs both), a node is --node-ranks ranks sharing memory, nodes are joined by a network of
--net-gbps and --net-latency-us. Newton-Schulz of the 30B's shapes is extrapolated from the
measured FLOP rate at the bench's shapes (measuring a 4096 x 2048 NS on one core takes seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from baseline_torch import owner_assignment

from hyperparallel import _C

CONFIGS = {"qwen3-moe-bench": 4 * 512, "qwen3-30b-a3b": 4 * 4096}
SEQ = {"qwen3-moe-bench": 512, "qwen3-30b-a3b": 4096}
WORLDS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# headline.py's system names -> the model's.
SYSTEMS = {"hyperparallel": "hp", "torch-fsdp2-muon": "gathered", "torch-fsdp2-owner-muon": "owner"}
NS_STEPS = 5
# Configs whose every Muon matrix shape gets its own measured NS rate (the ones run here).
MEASURED_SHAPES = ("qwen3-moe-small", "qwen3-moe-bench")
TOL = 0.15


@dataclass
class Components:
    """Measured on this machine, one thread."""

    gemm_fp32_flops: float
    gemm_bf16_flops: float
    # Achieved forward+backward FLOP/s of one decoder layer + lm_head of qwen3-moe-bench at
    # 4 x 512 tokens: HF's modules and hp.nn.patch's, fp32 and bf16 (what a GEMM rate misses:
    # attention, routing, elementwise, autograd).
    hf_fp32_flops: float
    hp_fp32_flops: float
    hf_bf16_flops: float
    hp_bf16_flops: float
    ns_torch_flops: float  # torch's _zeropower_via_newtonschulz, bf16, per-matrix calls
    ns_hp_flops: float  # hp.optim.Muon's batched NS and update, same shapes
    memcpy_bps: float
    gloo_latency_s: float
    gloo_bps: float
    op_overhead_s: float  # one small torch op: the per-parameter cost of a Python optimizer loop
    # The two NS rates above per matrix shape ("ROWSxCOLS"), measured for the shapes of the configs
    # that run here: small matrices run further from peak. A shape not measured (Qwen3-30B-A3B's:
    # one NS of them takes seconds) takes the rates above.
    ns_torch_by_shape: dict[str, float] = field(default_factory=dict)
    ns_hp_by_shape: dict[str, float] = field(default_factory=dict)

    def ns_seconds(self, system: str, rows: int, cols: int) -> float:
        """One NS of a rows x cols matrix by `system`'s implementation."""
        by_shape, rate = ((self.ns_hp_by_shape, self.ns_hp_flops) if system == "hp"
                          else (self.ns_torch_by_shape, self.ns_torch_flops))
        return ns_flops(rows, cols) / by_shape.get(f"{rows}x{cols}", rate)


@dataclass
class Matrix:
    """A Muon matrix kind: its shape, how many, and whether it is one expert of a 3-D stack."""

    rows: int
    cols: int
    count: int
    expert: bool


@dataclass
class Shape:
    """What the model needs of a config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    topk: int
    moe_inter: int
    vocab: int

    @property
    def matrices(self) -> list[Matrix]:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        L = self.layers
        return [Matrix(q, h, L, False), Matrix(kv, h, 2 * L, False), Matrix(h, q, L, False),
                Matrix(self.experts, h, L, False),
                Matrix(2 * self.moe_inter, h, L * self.experts, True),  # gate_up per expert
                Matrix(h, self.moe_inter, L * self.experts, True)]

    @property
    def muon_params(self) -> int:
        return sum(m.rows * m.cols * m.count for m in self.matrices)

    @property
    def params(self) -> int:
        norms = self.layers * (2 * self.hidden + 2 * self.head_dim) + self.hidden
        return self.muon_params + 2 * self.vocab * self.hidden + norms

    @property
    def tensors(self) -> int:
        # Per layer 4 projections, 2 qk-norms, router, 2 expert stacks, 2 norms; embed, lm_head, norm.
        return self.layers * 11 + 3

    def flops_per_token(self, seq: int) -> float:
        """Forward FLOPs: projections, causal attention, router, top-k experts, lm_head."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        proj = 2 * h * (2 * q + 2 * kv)
        attn = 2 * 2 * q * seq / 2
        moe = 2 * h * self.experts + self.topk * 2 * 3 * h * self.moe_inter
        return self.layers * (proj + attn + moe) + 2 * h * self.vocab


def load_shape(name: str) -> Shape:
    path = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / f"{name}.config.json"
    c = json.loads(path.read_text())
    return Shape(c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                 c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]), c["num_experts"],
                 c["num_experts_per_tok"], c["moe_intermediate_size"], c["vocab_size"])


def ns_flops(rows: int, cols: int) -> float:
    """One NS: 5 x (X X^T, A A, B X) on the short side m: 4 m^2 n + 2 m^3 each."""
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m ** 3)


def ns_per_rank(shape: Shape, world: int, system: str,
                cost: Callable[[int, int], float] = lambda r, c: ns_flops(r, c)) -> tuple[list[int], list[float]]:
    """NS matrices of each rank per step, and their `cost` (default FLOPs). Gathered: every matrix on
    every rank. hp: each matrix, in parameter order, by hp.optim.Muon's own assignment (balanced
    over the job, an expert preferring the rank that holds its rows). Owner peer
    (baseline_torch.OwnerMuon): an expert stack whose experts divide evenly stays on its holders,
    every other parameter goes whole to its own LPT owner (baseline_torch.owner_assignment)."""
    if system == "gathered" or world == 1:
        count = sum(m.count for m in shape.matrices)
        flops = sum(m.count * cost(m.rows, m.cols) for m in shape.matrices)
        return [count] * world, [flops] * world
    chunk = math.ceil(shape.experts / world)
    items = []  # (count, rows, cols, home or -1)
    for _ in range(shape.layers):
        for m in shape.matrices:
            per_layer = m.count // shape.layers
            if m.expert and system == "owner":
                local = shape.experts % world == 0
                items += ([(chunk, m.rows, m.cols, g) for g in range(world)] if local
                          else [(per_layer, m.rows, m.cols, -1)])
            else:
                items += [(1, m.rows, m.cols, e // chunk if m.expert and world <= shape.experts else -1)
                          for e in range(per_layer)]
    count, flops = [0] * world, [0.0] * world
    if system == "hp":
        costs = [r * c * min(r, c) for _, r, c, _ in items]
        owner = _C.assign_owners(costs, [[h] if h >= 0 else [] for *_, h in items], world)
    else:
        free = [i for i, it in enumerate(items) if it[3] < 0]
        lpt = owner_assignment([n * r * c * min(r, c) for n, r, c, _ in (items[i] for i in free)], world)
        owner = [it[3] for it in items]
        for i, o in zip(free, lpt):
            owner[i] = o
    for (n, r, c, _), o in zip(items, owner):
        count[o] += n
        flops[o] += n * cost(r, c)
    return count, flops


@dataclass
class Prediction:
    """One system at one world size: per-rank seconds by phase and work."""

    system: str
    world: int
    forward: float
    backward: float
    optimizer: float
    comm_wait: float
    gloo_bytes: float  # sent + received per rank and step
    fabric_bytes: float  # hp's node-shared reads and writes, counted the same way
    ns_matrices: int
    # CPU seconds by phase: the compute above plus the CPU a rank spends moving its Gloo bytes
    # (over loopback TCP the transfer is the kernel's copies on the rank's own core), which is
    # what an oversubscribed run's process_time measures and wall time cannot separate.
    cpu: dict[str, float]

    @property
    def step(self) -> float:
        return self.forward + self.backward + self.optimizer + self.comm_wait


def _transfer(bytes_: float, messages: int, world: int, comp: Components, args: argparse.Namespace) -> float:
    """Seconds for a ring collective's per-rank bytes: loopback Gloo within a node, the network
    (the slower) once the ring leaves it."""
    if world <= args.node_ranks:
        return messages * comp.gloo_latency_s * max(world - 1, 0) + bytes_ / comp.gloo_bps
    bw = min(comp.gloo_bps, args.net_gbps * 1e9 / 8)
    return messages * args.net_latency_us * 1e-6 * (world - 1) + bytes_ / bw


def predict(shape: Shape, tokens: int, seq: int, world: int, system: str, comp: Components,
            args: argparse.Namespace, reshard: bool | None = None) -> Prediction:
    """The per-rank step of `system` at `world` ranks; FSDP2's reshard_after_forward as given,
    or the faster of the two (the protocol gives the baseline its best setting)."""
    if reshard is None and system != "hp":
        return min((predict(shape, tokens, seq, world, system, comp, args, r) for r in (True, False)),
                   key=lambda p: p.step)
    elem = 2 if args.precision == "bf16" else 4
    rate = getattr(comp, f"{'hp' if system == 'hp' else 'hf'}_{args.precision}_flops")
    fwd = tokens * shape.flops_per_token(seq) / rate
    bwd = 2 * fwd
    P, N = shape.params, world
    counts, ns_s = ns_per_rank(shape, N, system, lambda r, c: comp.ns_seconds(system, r, c))
    busiest = max(range(N), key=lambda g: ns_s[g])
    ns_count = counts[busiest]
    # Elementwise optimizer work on a rank's shard: ~6 passes of its fp32 state (grad, param,
    # momentum, Adam's two moments), plus one Python op per tensor per pass for torch.
    opt = ns_s[busiest] + 6 * 4 * P / N / comp.memcpy_bps
    if system != "hp":
        opt += 6 * shape.tensors * comp.op_overhead_s
    gloo = fabric = 0.0
    wait = 0.0
    by_phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # torch's Gloo bytes (inbound)
    if N > 1:
        shard = (N - 1) / N
        if system == "hp":
            R = min(N, args.node_ranks)
            nodes = N // R
            # Reduce-scatter in the node: read one's rows of R gradients (counted as backward CPU);
            # hp.comm.stats counts those reads, its own buffer's included (halved below, as Gloo's).
            fabric = P * 4 / 2
            bwd += P * 4 / comp.memcpy_bps
            if nodes > 1:
                # HSDP: all-reduce of the shards between counterparts; Muon results by all_to_all.
                gloo = 2 * P / R * 4 * (nodes - 1) / nodes + shape.muon_params / R * 2 * (nodes - 1) / nodes
                wait = _transfer(gloo, 2 * shape.layers, nodes, comp, argparse.Namespace(
                    node_ranks=1, net_gbps=args.net_gbps, net_latency_us=args.net_latency_us))
        else:
            # FSDP2: all-gather in forward, again in backward if resharded, reduce-scatter (fp32).
            by_phase["forward"] = P * shard * elem
            by_phase["backward"] = P * shard * ((1 if reshard else 0) * elem + 4)
            msgs = 3 * (shape.layers + 1)
            if system == "gathered":
                by_phase["optimizer"] = shape.muon_params * 4 * shard  # full_tensor of every update
                msgs += sum(m.count // (shape.experts if m.expert else 1) for m in shape.matrices)
            else:
                whole = shape.experts % N == 0
                dense = sum(m.rows * m.cols * m.count for m in shape.matrices if not (m.expert and whole))
                # An owner gathers its 1/N of the dense updates; every rank receives every bf16 result.
                by_phase["optimizer"] = dense * 4 * shard / N + dense * 2 * shard
                msgs += 2 * sum(m.count for m in shape.matrices if not m.expert)
            gloo = sum(by_phase.values())
            # Copy-in/out of FSDP2's flat buffers.
            fwd += P * elem * 2 / comp.memcpy_bps
            wait = _transfer(gloo, msgs, N, comp, args)
    # Reported as headline.py counts them: what a rank sends plus what it receives (twice what
    # crosses its link inbound, which is what the time above is charged for).
    compute = {"forward": fwd, "backward": bwd, "optimizer": opt}
    cpu = {phase: compute[phase] + by_phase[phase] / comp.gloo_bps for phase in compute}
    return Prediction(system, N, fwd, bwd, opt, wait, 2 * gloo, 2 * fabric, ns_count, cpu)


# ----- measurement -----------------------------------------------------------------------------

def _best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _gloo_rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    small, big = torch.zeros(world), torch.zeros(world * (4 << 20))
    res = {}
    for name, t in (("small", small), ("big", big)):
        outp = torch.empty_like(t)
        res[name] = _best(lambda o=outp, t=t: dist.all_gather_into_tensor(o, t.chunk(world)[rank].contiguous()), 5)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def _layer_rate(modules: str, dtype: torch.dtype) -> float:
    """Forward+backward FLOP/s of a one-layer qwen3-moe-bench at 4 x 512 tokens."""
    import transformers

    import hyperparallel as hp
    config = json.loads((Path(__file__).resolve().parents[1].parent / "shared" / "bench" /
                         "qwen3-moe-bench.config.json").read_text())
    config["num_hidden_layers"] = 1
    torch.manual_seed(0)
    net = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config)).to(dtype)
    if modules == "hp":
        hp.nn.patch(net)
    ids = torch.randint(0, config["vocab_size"], (4, 512))

    def step():
        net(input_ids=ids, labels=ids).loss.backward()

    shape = Shape(1, config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                  config["head_dim"], config["num_experts"], config["num_experts_per_tok"],
                  config["moe_intermediate_size"], config["vocab_size"])
    return 3 * ids.numel() * shape.flops_per_token(512) / _best(step, 2)


def _ns_hp_rate(rows: int, cols: int) -> float:
    """FLOP/s of hp.optim.Muon's step on 4 same-shape matrices (one batched NS, and the update)."""
    import hyperparallel as hp
    p = torch.nn.Parameter(torch.randn(4, rows, cols))
    p.grad = torch.randn_like(p)
    opt = hp.optim.Muon([p], lr=1e-3, adjust_lr_fn="match_rms_adamw")
    return 4 * ns_flops(rows, cols) / _best(opt.step)


def measure() -> Components:
    """Component costs on this machine, one thread (noisy where the cores are shared)."""
    torch.set_num_threads(1)
    gemm = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 512, dtype=dtype), torch.randn(512, 768, dtype=dtype)
        gemm[dtype] = 2 * 2048 * 512 * 768 / _best(lambda a=a, b=b: a @ b)
    achieved = {key: _layer_rate(*key) for key in (("hf", torch.float32), ("hp", torch.float32),
                                                    ("hf", torch.bfloat16), ("hp", torch.bfloat16))}
    from torch.optim._muon import _zeropower_via_newtonschulz
    mats = [torch.randn(384, 512) for _ in range(4)]
    coefficients = (3.4445, -4.7750, 2.0315)
    t = _best(lambda: [_zeropower_via_newtonschulz(m, coefficients, NS_STEPS, 1e-7) for m in mats])
    ns_torch = 4 * ns_flops(384, 512) / t
    ns_hp = _ns_hp_rate(384, 512)
    shapes = sorted({(m.rows, m.cols) for name in MEASURED_SHAPES for m in load_shape(name).matrices})
    ns_torch_by_shape, ns_hp_by_shape = {}, {}
    for rows, cols in shapes:
        mats = [torch.randn(rows, cols) for _ in range(4)]
        t = _best(lambda mats=mats: [_zeropower_via_newtonschulz(m, coefficients, NS_STEPS, 1e-7) for m in mats])
        ns_torch_by_shape[f"{rows}x{cols}"] = 4 * ns_flops(rows, cols) / t
        ns_hp_by_shape[f"{rows}x{cols}"] = _ns_hp_rate(rows, cols)
    src = torch.empty(16 << 20)
    dst = torch.empty_like(src)
    memcpy = 2 * src.numel() * 4 / _best(lambda: dst.copy_(src))
    x = torch.zeros(8)
    op = _best(lambda: [x.add_(1.0) for _ in range(1000)]) / 1000
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, port, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    res = q.get(timeout=120)
    for pr in procs:
        pr.join()
    latency = res["small"]
    bw = (4 << 20) * 4 / max(res["big"] - latency, 1e-9)  # one rank's half crosses per all-gather
    return Components(gemm[torch.float32], gemm[torch.bfloat16], *achieved.values(), ns_torch, ns_hp, memcpy,
                      latency, bw, op, ns_torch_by_shape, ns_hp_by_shape)


# ----- report ----------------------------------------------------------------------------------

def tables(comp: Components, args: argparse.Namespace) -> dict[tuple[str, int, str], Prediction]:
    preds = {}
    for name, tokens in CONFIGS.items():
        shape = load_shape(name)
        print(f"\n### {name}: {tokens} tokens/rank, {shape.params / 1e6:.0f}M params, {args.precision}\n")
        print("| N | hp s | gathered s | owner s | hp/gathered | hp/owner | hp split f/b/opt/wait |")
        print("|---|---|---|---|---|---|---|")
        for N in WORLDS:
            row = {s: predict(shape, tokens, SEQ[name], N, s, comp, args)
                   for s in ("hp", "gathered", "owner")}
            preds.update({(name, N, s): p for s, p in row.items()})
            h = row["hp"]
            print(f"| {N} | {h.step:.3g} | {row['gathered'].step:.3g} | {row['owner'].step:.3g} | "
                  f"{row['gathered'].step / h.step:.2f}x | {row['owner'].step / h.step:.2f}x | "
                  f"{h.forward:.3g}/{h.backward:.3g}/{h.optimizer:.3g}/{h.comm_wait:.3g} |")
    return preds


def targets(preds: dict) -> None:
    def ratio(cfg, N, other):
        return preds[(cfg, N, other)].step / preds[(cfg, N, "hp")].step

    seed = [(c, N) for c in CONFIGS for N in WORLDS if N > 1 and ratio(c, N, "gathered") > 3]
    where = ", ".join(f"{c} N={N}" for c, N in seed) or "nowhere"
    print(f"\nSeed's '>3x vs FSDP2+Muon' at the tokens per rank above: {where} (by tokens per rank: below)")
    for cfg, N, other, goal in (("qwen3-moe-bench", 8, "owner", 2.5), ("qwen3-moe-bench", 8, "gathered", 3.5),
                                ("qwen3-30b-a3b", 64, "gathered", 3.0)):
        r = ratio(cfg, N, other)
        o = preds[(cfg, N, other)]
        print(f"target {cfg} N={N} >= {goal}x {other}: {r:.2f}x {'MET' if r >= goal else 'NOT MET'}; "
              f"{other} split f/b/opt/wait "
              f"{o.forward:.3g}/{o.backward:.3g}/{o.optimizer:.3g}/{o.comm_wait:.3g} s")


def seed_sweep(comp: Components, args: argparse.Namespace, N: int = 64) -> None:
    """Where the seed's 3x lies for Qwen3-30B-A3B: the gathered baseline's Newton-Schulz is the
    same on every rank whatever the batch, the forward and backward grow with it, so the ratio
    is set by the tokens each rank trains on per optimizer step."""
    shape = load_shape("qwen3-30b-a3b")
    cells = []
    for tokens in (2048, 4096, 8192, 16384, 32768):
        seq = min(tokens, SEQ["qwen3-30b-a3b"])
        row = {s: predict(shape, tokens, seq, N, s, comp, args) for s in ("hp", "gathered", "owner")}
        cells.append(f"{tokens}: {row['gathered'].step / row['hp'].step:.2f}x gathered, "
                     f"{row['owner'].step / row['hp'].step:.2f}x owner")
    print(f"qwen3-30b-a3b N={N}, hp's ratio by tokens per rank and step: " + "; ".join(cells))


def check(preds_for, files: list[str]) -> None:
    """Predicted against headline.py's --json-out lines: step time at 1-2 ranks, work at 4-8."""
    def verdict(p, m):
        ok = m > 0 and abs(p - m) <= TOL * m
        return f"{p:.4g} vs {m:.4g} {'PASS' if ok else 'FAIL'}"

    for f in files:
        for line in Path(f).read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            system = SYSTEMS.get(rec.get("system", ""))
            if system is None or rec.get("config") not in CONFIGS and rec.get("config") != "qwen3-moe-small":
                continue
            N = rec["world_size"]
            p = preds_for(rec["config"], N, system, rec.get("precision", "fp32"),
                          rec.get("reshard_after_forward"))
            head = f"{rec['system']} {rec['config']} N={N}:"
            if N <= 2:
                cpu = rec.get("work_per_rank", {}).get("cpu_s", {})
                print(head, "step", verdict(p.step, rec["step_time_median_s"]),
                      "(cpu s f/b/opt predicted",
                      f"{p.forward:.3g}/{p.backward:.3g}/{p.optimizer:.3g}, measured",
                      "/".join(f"{cpu.get(k, 0):.3g}" for k in ("forward", "backward", "optimizer")) + ")")
            else:
                work = rec["work_per_rank"]
                cpu = work["cpu_s"]
                print(head, "cpu s: fwd", verdict(p.cpu["forward"], cpu["forward"]),
                      "| bwd", verdict(p.cpu["backward"], cpu["backward"]),
                      "| opt", verdict(p.cpu["optimizer"], cpu["optimizer"]),
                      "| bytes", verdict(p.gloo_bytes + p.fabric_bytes, work["bytes_moved"]["total"]),
                      "| ns", verdict(p.ns_matrices, work["ns_matrices"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--components", help="reuse a saved JSON of component costs instead of measuring")
    parser.add_argument("--save-components", help="write the measured component costs here (do not commit)")
    parser.add_argument("--measured", nargs="*", default=[],
                        help="headline.py --json-out files to check against")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--node-ranks", type=int, default=32, help="ranks sharing one node's memory")
    parser.add_argument("--net-gbps", type=float, default=100.0, help="inter-node network, Gb/s per node")
    parser.add_argument("--net-latency-us", type=float, default=10.0)
    args = parser.parse_args()
    comp = Components(**json.loads(Path(args.components).read_text())) if args.components else measure()
    if args.save_components:
        Path(args.save_components).write_text(json.dumps(asdict(comp), indent=1))
    print("components (this machine, one thread):", json.dumps(asdict(comp)))
    print(f"assumptions: node = {args.node_ranks} ranks, "
          f"network {args.net_gbps} Gb/s {args.net_latency_us} us, "
          f"tokens/rank {CONFIGS}, Gloo not overlapped with compute")
    preds = tables(comp, args)
    targets(preds)
    seed_sweep(comp, args)

    def preds_for(cfg, N, system, precision, reshard):
        a = argparse.Namespace(**{**vars(args), "precision": precision})
        shape = load_shape(cfg)
        return predict(shape, CONFIGS.get(cfg, 4 * 256), SEQ.get(cfg, 256), N, system, comp, a, reshard)

    check(preds_for, args.measured)


if __name__ == "__main__":
    main()

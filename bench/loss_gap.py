"""The loss gap between hyperparallel and torch is last-bit noise amplified by Muon, not an error.

    python bench/loss_gap.py                                  # qwen3-moe-small, 10 steps
    python bench/loss_gap.py --config qwen3-moe-bench --steps 12

Muon rounds every update to bf16 before Newton-Schulz, so a last-bit difference in a gradient can
move a bf16 rounding and, through 5 iterations, a whole update. To show that hp's gap to torch is
of that size, the torch system (FSDP2 + gathered Muon) is run twice: as is, and with each rank's
micro-batch accumulated in two halves, which changes only the order of fp32 additions (the weight
gradients' sums over tokens, the reduce-scatter's sums, the loss's mean). Prints one JSON line:
the largest per-step |loss difference| of hp vs torch and of torch vs reordered torch, over the
same steps, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from _spec import RunSpec, add_run_args, config_name, run_spec_from_args
from _timing import max_abs_diff
from baseline_torch import run_baseline
from headline import run_hp


def loss_gaps(spec: RunSpec) -> dict[str, Any]:
    """hp vs torch and torch vs reordered torch, as max |loss difference| over ``spec``'s steps."""
    torch_losses = run_baseline(spec, reshard_after_forward=False)["losses"]
    reordered = run_baseline(spec, reshard_after_forward=False, splits=2)["losses"]
    hp_losses = run_hp(spec)["losses"]
    hp_gap = max_abs_diff(hp_losses, torch_losses)
    reorder_gap = max_abs_diff(reordered, torch_losses)
    return {
        "config": config_name(spec.config_path),
        "steps": spec.steps,
        "world_size": spec.nproc,
        "precision": spec.precision,
        "max_abs_loss_diff_hp_vs_torch": hp_gap,
        "max_abs_loss_diff_torch_vs_reordered_torch": reorder_gap,
        "ratio": hp_gap / reorder_gap if reorder_gap else None,
        "losses": {"hp": hp_losses, "torch": torch_losses, "torch_reordered": reordered},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(parser)
    print(json.dumps(loss_gaps(run_spec_from_args(parser.parse_args(argv)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

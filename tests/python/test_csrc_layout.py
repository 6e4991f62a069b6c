"""The C++ tree's seams: no subsystem reaches into another's private headers, and one instruction-set dispatch.

Each csrc/<subsystem>/ includes its own headers, the public ones under
include/hyperparallel/, and the shared SIMD layer (csrc/simd/); only csrc/simd
reads the CPU's features or HP_SIMD and names a target instruction set.
"""

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh"))
QUOTED = re.compile(r'^\s*#\s*(?:include|define\s+HP_SIMD_BODY)\s+"([^"]+)"', re.MULTILINE)


def test_no_subsystem_includes_another_subsystems_private_header():
    wrong = []
    for path in SOURCES:
        subsystem = path.relative_to(CSRC).parts[0]
        for header in QUOTED.findall(path.read_text()):
            if header.startswith(("hyperparallel/", "simd/")) and ".." not in header:
                continue  # public headers, and the layer every subsystem shares
            own = header.startswith(f"{subsystem}/") or ("/" not in header and (path.parent / header).exists())
            if not own:
                wrong.append(f"{path.relative_to(CSRC)} includes {header}")
    assert not wrong, "move what these need into include/hyperparallel/ or csrc/simd/: " + "; ".join(wrong)


def test_only_the_simd_layer_dispatches_on_the_instruction_set():
    dispatch = re.compile(r"target_clones|__builtin_cpu_supports|#\s*pragma\s+GCC\s+target|\"HP_SIMD\"|target\(\"")
    outside = [
        f"{path.relative_to(CSRC)}: {match.group(0)}"
        for path in SOURCES
        if path.relative_to(CSRC).parts[0] != "simd"
        for match in dispatch.finditer(path.read_text())
    ]
    assert not outside, (
        "compile per tier with simd/foreach_isa.h or HP_SIMD_TARGET and choose by simd::isa(): " + "; ".join(outside)
    )

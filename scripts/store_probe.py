"""Whether the lean kernel's stores into a fresh output can be made cheaper after an L2 flush,
where Liger's in-place kernel leads ours out of place by one or two 32 ns clock steps
(``tile_probe.TIE_SHAPES``): a developer's probe (run BC).

After the flush (a memset, so the L2 is full of dirty lines) an out-of-place store needs an L2
line that a dirty line must first give up, and an address translation the load did not make;
in place the load has made both. Run BA4 asked for the output's lines with a prefetch, which
reads them from DRAM and cost more than it saved. These variants (the kernel module with the
lean kernel's source rewritten, loaded from a temporary file so the shipped module is
untouched; or the shipped kernel launched otherwise) claim the lines another way, or change
the final stores:

- ``shipped``: the final stores only;
- ``shipped copy``: the same source loaded again, a kernel of its own (its code loaded
  elsewhere): how far two builds of one kernel lie apart;
- ``zeros after loads`` / ``zeros first``: zeros stored to the output's addresses right after
  the input's loads are issued (before them), so the lines are claimed while the loads wait
  for DRAM; the final stores (same addresses, same threads) then find their lines in the L2;
- ``discard lines``: right after the loads, each of the tile's 128-byte output lines dropped
  from the L2 by one thread (``discard.global.L2``: no DRAM read, no write-back of what the
  line held, which the final stores overwrite whole), then a barrier before any store;
- ``discard one line``: the same for the tile's first line only (the page's translation);
- ``evict_last`` and ``.cs``: the final stores with that eviction policy or cache operator;
- ``vector 8``: eight adjacent channels a thread (wider stores, more sines a thread);
- ``discard lines, evict_last``: both.

Each variant out of place, the shipped kernel in place, and Liger's in-place kernels, every
buffer placed anew for each trace (``tile_probe._print_paired``, paired against the shipped
kernel out of place and against Liger's); each variant first checked bit for bit against the
shipped in-place result, and its PTX's global stores and discards counted (a store the
compiler dropped would make a variant the shipped kernel). ``python scripts/store_probe.py
[rounds [variant ...]] [--clean-too]`` on the GPU machine: by default 8 rounds of every
variant; ``shipped`` alone, the shipped kernel against Liger's, out of place and in place;
``--clean-too``, everything again after a flush that reads its buffer and so leaves the L2
full of clean lines.

Run BC: no variant lowered the cost; with clean lines it mostly goes (docs/benchmarks.md,
"Run BC"), so it is the write-back of the flush's dirty lines, one for each line written."""
from __future__ import annotations

import importlib.util
import random
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tile_probe  # noqa: E402

from rope_dispatch import bench  # noqa: E402
from rope_dispatch.backends import triton_kernels, triton_rope  # noqa: E402

ZEROS = ("    zero = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_R], dtype=out_ptr.dtype.element_ty)\n"
         "    tl.store(out_ptr + offsets, zero, mask=mask)\n"
         "    if not INTERLEAVED:\n"
         "        tl.store(out_ptr + offsets + HALF, zero, mask=mask)\n")
FIRST_LOAD = "    x_a = tl.load(x_ptr + offsets, mask=mask, other=0.0)\n"
AFTER_LOADS = "    if ONE_SEQUENCE:\n"
FINAL_STORE = re.compile(r"(tl\.store\(out_ptr \+ offsets(?: \+ HALF)?, out_[ab]\.to\(out_ty\), "
                         r"mask=mask)\)")
DISCARD = ("    line = tl.arange(0, 128)\n"
           "    line_tok = block * BLOCK_T + line // LINES\n"
           "    line_ptrs = (out_ptr + line_tok * (HEADS * HEAD_DIM)\n"
           "                 + (program - block * GROUPS) * BLOCK_H * HEAD_DIM + (line % LINES) * 64)\n"
           "    claim = ((line < CLAIMED) & (line_tok < n_tokens)).to(tl.int32)\n"
           "    tl.inline_asm_elementwise(\n"
           "        \"{ .reg .pred p; setp.ne.s32 p, $2, 0; @p discard.global.L2 [$1], 128; \"\n"
           "        \"mov.u32 $0, 0; }\", \"=r,l,r\", [line_ptrs, claim], dtype=tl.int32,\n"
           "        is_pure=False, pack=1)\n"
           "    tl.debug_barrier()\n")
LINES = "    LINES: tl.constexpr = BLOCK_H * HEAD_DIM // 64\n"
VARIANTS: dict[str, tuple[list[tuple[str, str]] | None, dict]] = {
    "shipped": (None, {}),
    "shipped copy": ([], {}),
    "zeros after loads": ([(AFTER_LOADS, ZEROS + AFTER_LOADS)], {}),
    "zeros first": ([(FIRST_LOAD, ZEROS + FIRST_LOAD)], {}),
    "discard lines": ([(AFTER_LOADS, LINES + "    CLAIMED: tl.constexpr = BLOCK_T * LINES\n"
                        + DISCARD + AFTER_LOADS)], {}),
    "discard one line": ([(AFTER_LOADS, LINES + "    CLAIMED: tl.constexpr = 1\n" + DISCARD
                           + AFTER_LOADS)], {}),
    "evict_last": ([("final", ', eviction_policy="evict_last"')], {}),
    ".cs": ([("final", ', cache_modifier=".cs"')], {}),
    "vector 8": (None, {"vector": 8}),
    "discard lines, evict_last": ([(AFTER_LOADS, LINES + "    CLAIMED: tl.constexpr = BLOCK_T * "
                                    "LINES\n" + DISCARD + AFTER_LOADS),
                                   ("final", ', eviction_policy="evict_last"')], {}),
}
"""Name: (edits of the lean kernel's source, ``tile_probe._lean_at``'s keyword arguments). The
discards' addresses count 64 channels a 128-byte line: bf16 only, as the probe's points."""


def _lean_source(source: str) -> tuple[int, int]:
    """Where the lean kernel's definition starts and ends in the kernel module's source."""
    start = source.index("def rope_lean_kernel(")
    return start, source.index("@triton.jit", start)


def _variant_modules(names: list[str]) -> dict[str, ModuleType]:
    """Each named variant's kernel module: the shipped source with the lean kernel rewritten
    (the shipped module where it has no edits)."""
    source = Path(triton_kernels.__file__).read_text()
    start, end = _lean_source(source)
    folder = Path(tempfile.mkdtemp(prefix="store_probe_"))
    modules = {}
    for number, name in enumerate(names):
        edits = VARIANTS[name][0]
        if edits is None:
            modules[name] = triton_kernels
            continue
        body = source[start:end]
        for old, new in edits:
            if old == "final":
                body, count = FINAL_STORE.subn(lambda m, new=new: m.group(1) + new + ")", body)
                if count != 2:
                    raise RuntimeError(f"{name}: {count} final stores found, expected 2")
            elif body.count(old) != 1:
                raise RuntimeError(f"{name}: the lean kernel's source changed: update this probe")
            else:
                body = body.replace(old, new)
        path = folder / f"store_variant_{number}.py"
        path.write_text(source[:start] + body + source[end:])
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def _stores(compiled) -> str:
    """The global store instructions of a compiled kernel's PTX, counted by kind."""
    kinds: dict[str, int] = {}
    for kind in re.findall(r"\b(?:st\.global[\w.:]*|discard[\w.:]*)", compiled.asm["ptx"]):
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))


def timing(modules: dict[str, ModuleType], rounds: int, calls: int = 40,
           dirty: bool = True) -> None:
    """Every variant out of place at ``tile_probe.TIE_SHAPES`` against the shipped kernel out
    of place and Liger's in-place kernels, after a flush that leaves the L2 full of dirty lines
    (``dirty``, as the sweep's) or of clean ones."""
    gen = random.Random(0)
    for layout, seq, batch, heads in tile_probe.TIE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        tile = triton_rope.lean_tile(seq * batch, heads, 128, 2)
        kept: list = []
        printed: list = []

        def variants(src, angles, back, mode, want) -> dict:
            """Each variant out of place (checked against ``want``), the shipped one in place."""
            launched = {}
            for name, module in modules.items():
                call, compiled = tile_probe._out_of_place_checked(
                    src, want, f"{name} {mode}", kept, angles, layout, back, tile,
                    kernels=module, **VARIANTS[name][1])
                if not printed:
                    print(f"   {name}: {_stores(compiled)}", flush=True)
                launched[f"{name} {mode}"] = call
            printed.append(True)
            buffer = src.clone()
            launched[f"in place {mode}"] = tile_probe._lean_at(buffer, buffer, angles, layout,
                                                               back, tile)
            kept.append(buffer)
            return launched

        def fresh() -> dict:
            return tile_probe._placed_anew(shape, gen, kept, variants)[0]

        print(f"{layout} s{seq} b{batch} h{heads} d128 bf16, lean tile {tile[0]}x{tile[1]}, "
              f"out of place, {'dirty' if dirty else 'clean'} flush:", flush=True)
        tile_probe._print_paired(fresh, rounds, calls, peers=("shipped", "liger"), dirty=dirty)


if __name__ == "__main__":
    clean_too = "--clean-too" in sys.argv
    sys.argv = [arg for arg in sys.argv if arg != "--clean-too"]
    named = sys.argv[2:]
    chosen = ["shipped"] + [name for name in named if name != "shipped"] if named else list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    variant_modules = _variant_modules(chosen)
    for dirty_flush in (True, False) if clean_too else (True,):
        timing(variant_modules, int(sys.argv[1]) if len(sys.argv) > 1 else 8, dirty=dirty_flush)

"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, down to the
cubin (Triton's bundled ptxas): the front end, the layout passes and ptxas see every family of
specialisations, so CI catches a kernel that would not compile on the GPU machine.

Run as a script in a process of its own (``tests/test_kernels_compile.py`` does): the kernels
must be imported with ``TRITON_INTERPRET`` unset. Prints one line per kernel; exit code 1 on
the first failure, with its error.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rope_dispatch.backends import triton_kernels as K  # noqa: E402
from rope_dispatch.backends import triton_norm_kernels as N  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)

ROPE = dict(
    LAYOUT=0, ROT_DIM=128, PASS_DIM=0, INTERLEAVED=False, USE_CACHE=False, PAIRED=False,
    RATES=False, LINEAR=False, POSITIONS=0, CONTEXT_PARALLEL=False, BACKWARD=False, BLOCK_T=8,
    BLOCK_H=2, HEAD_ITERS=4, BLOCK_R=64, BLOCK_P=1, FAST_TRIG=True, SEQ_BLOCK=0, SCALE=1.0,
)
# (name, changes to ROPE, the sin pointer's type)
VARIANTS = [
    ("angles", {}, "*fp32"),
    ("angles interleaved partial", dict(INTERLEAVED=True, BLOCK_R=64, ROT_DIM=64, PASS_DIM=64,
                                        BLOCK_P=64), "*fp32"),
    ("linear table, halves", dict(LINEAR=True), "*i32"),
    ("linear table, pairs, backward", dict(LINEAR=True, INTERLEAVED=True, BLOCK_R=128,
                                           BACKWARD=True), "*i32"),
    ("linear table, thd, start positions, cp", dict(LINEAR=True, LAYOUT=2, POSITIONS=1,
                                                    CONTEXT_PARALLEL=True, SEQ_BLOCK=8), "*i32"),
    ("cos/sin cache", dict(USE_CACHE=True), "*fp32"),
    ("cos/sin cache, halves flag", dict(USE_CACHE=True, HALVES=True), "*fp32"),
    ("pair cache, per-token positions", dict(USE_CACHE=True, PAIRED=True, POSITIONS=2), "*fp32"),
    ("rate table, scaled", dict(RATES=True, SCALE=1.25), "*fp32"),
    # a precise rate table: int64 fractions of a turn, read through both table pointers
    ("precise rate table", dict(RATES=True), "*i64"),
    # rotary channels from an offset (DeepSeek's last 64 of 192), pass-through on both sides
    ("rotary offset", dict(ROT_OFFSET=96, ROT_DIM=64, BLOCK_R=32, PASS_DIM=128, BLOCK_P=128),
     "*fp32"),
    ("deinterleave, offset, cos/sin cache", dict(ROT_OFFSET=128, DEINTERLEAVE=1, ROT_DIM=64,
                                                 BLOCK_R=32, PASS_DIM=128, BLOCK_P=128,
                                                 USE_CACHE=True), "*fp32"),
    ("deinterleave, backward", dict(DEINTERLEAVE=2, BACKWARD=True), "*fp32"),
]
CHANNEL_STAGE = ("ROT_OFFSET", "DEINTERLEAVE")
"""Constants of the channel stage, which the lean kernel never takes."""

# the lean kernel (small contiguous sbhd/bshd calls): its own tile and sizes, the same changes
LEAN = dict(
    LAYOUT=0, HEADS=8, HEAD_DIM=128, ROT_DIM=128, PASS_DIM=0, INTERLEAVED=False, USE_CACHE=False,
    PAIRED=False, RATES=False, LINEAR=False, BACKWARD=False, BLOCK_T=1, BLOCK_H=8, BLOCK_R=64,
    BLOCK_P=1, FAST_TRIG=True, SCALE=1.0, SHARED_ROWS=True, VECTOR=64,
)
# two channels a thread (triton_tiles.lean_vector), on angle rows and through a linear flag; a
# bshd batch of one, whose token index is its position
LEAN_VECTOR_VARIANTS = [
    ("two channels a thread", dict(SHARED_ROWS=False, VECTOR=2), "*fp32"),
    ("two channels a thread, linear flag", dict(SHARED_ROWS=False, VECTOR=2, LINEAR=True),
     "*i32"),
    ("one sequence, bshd", dict(LAYOUT=1, ONE_SEQUENCE=True), "*fp32"),
]
LEAN_DROPPED = ("POSITIONS", "CONTEXT_PARALLEL", "SEQ_BLOCK", "HEAD_ITERS", "HALVES")

# rope_norm_kernel: the norm stage both ways, and the cache stage after the rotation (thd,
# per-token positions) into each kind of cache, FP8 stores by a number or a device scalar
NORM = dict(
    ROPE, LAYOUT=2, POSITIONS=2, HAS_V=True, V_WIDTH=128, BLOCK_W=128, HALVES=False, Q_NORM=1,
    K_NORM=1, Q_EPS=1e-6, K_EPS=1e-6, Q_OFFSET=0.0, K_OFFSET=0.0, TOKEN_ITERS=1, TOKEN_STAGES=1,
    CACHE=0, PAGE_SIZE=1, Q_QUANT=0, K_QUANT=0, V_QUANT=0,
)
# (name, changes to NORM, q's output type, the cache's type, the index tensors' type)
NORM_VARIANTS = [
    ("norm", {}, "*bf16", "*bf16", "*i64"),
    ("norm over the heads, backward", dict(Q_NORM=2, LAYOUT=0, POSITIONS=0, BACKWARD=True,
                                           TOKEN_ITERS=2), "*bf16", "*bf16", "*i64"),
    ("norm, backward, pipelined token loop", dict(LAYOUT=1, POSITIONS=0, BACKWARD=True,
                                                  HAS_V=False, TOKEN_ITERS=20, TOKEN_STAGES=3),
     "*bf16", "*bf16", "*i64"),
    ("cache slots", dict(CACHE=1, PAGE_SIZE=16, Q_NORM=0, K_NORM=0), "*bf16", "*bf16", "*i64"),
    ("cache pages e4m3, device scales, q e4m3", dict(CACHE=2, PAGE_SIZE=16, Q_QUANT=1, K_QUANT=2,
                                                     V_QUANT=2), "*fp8e4nv", "*fp8e4nv", "*i32"),
    ("cache slots e5m2, scales by number, interleaved partial", dict(
        CACHE=1, K_QUANT=1, V_QUANT=1, INTERLEAVED=True, ROT_DIM=64, PASS_DIM=64, BLOCK_R=64,
        BLOCK_P=64), "*bf16", "*fp8e5", "*i64"),
    ("cache pages e4m3, MLA (the key part, a 512-channel compressed kv in chunks; WIDE_V_TILE)",
     dict(CACHE=2, PAGE_SIZE=16, Q_NORM=0, K_NORM=0, Q_QUANT=1, K_QUANT=1, V_QUANT=1, ROT_DIM=64,
          BLOCK_R=32, V_WIDTH=512, BLOCK_W=64, BLOCK_T=8, BLOCK_H=2, HEAD_ITERS=1), "*fp8e4nv",
     "*fp8e4nv", "*i32"),
]


def norm_pointers(q_out: str, cache: str, index: str) -> dict[str, str]:
    """rope_norm_kernel's argument types: bf16 data and weights, float32 tables, partials and
    scales."""
    types = {name: "*bf16" for name in ("q_x", "k_x", "v_x", "q_src", "k_src", "q_w", "k_w")}
    types.update(
        q_out=q_out, k_out=cache, v_out=cache, q_tab="*fp32", k_tab="*fp32", q_sin="*fp32",
        k_sin="*fp32", cu_ptr="*i32", pos_ptr="*i64", q_part="*fp32", k_part="*fp32",
        slot_ptr=index, place_ptr=index, indptr_ptr="*i32", indices_ptr="*i32",
        q_scale_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32", q_scale="fp32",
        k_scale="fp32", v_scale="fp32",
    )
    return types


def compile_kernel(fn, pointers: dict[str, str], consts: dict) -> None:
    names = fn.arg_names
    signature = {
        name: "constexpr" if name in consts else pointers.get(name, "i32") for name in names
    }
    constexprs = {(names.index(name),): value for name, value in consts.items()}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                   options={"num_warps": 4})


def compiles(label: str, fn, pointers: dict[str, str], consts: dict) -> bool:
    """Compile one variant and print ``ok <label>`` or ``FAIL <label>: <error>``."""
    try:
        compile_kernel(fn, pointers, consts)
    except Exception as exc:  # noqa: BLE001 (reported with its variant)
        print(f"FAIL {label}: {type(exc).__name__}: {exc}")
        return False
    print(f"ok {label}")
    return True


def table_type(sin_type: str) -> str:
    """The table pointer's type beside a sin pointer of ``sin_type``: a precise rate table's
    int64 fractions of a turn are both, every other table's values float32."""
    return sin_type if sin_type == "*i64" else "*fp32"


def lean_pointers(sin_type: str) -> dict[str, str]:
    """rope_lean_kernel's pointer types (cu_ptr and pos_ptr unused: any type)."""
    return {"x_ptr": "*bf16", "out_ptr": "*bf16", "tab_ptr": table_type(sin_type),
            "sin_ptr": sin_type, "cu_ptr": "*fp32", "pos_ptr": "*fp32"}


def main() -> int:
    for name, changes, sin_type in VARIANTS:
        consts = {**ROPE, **changes}
        for kernel, pointers, extra in (
            (K.rope_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "tab_ptr": table_type(sin_type),
                             "sin_ptr": sin_type, "cu_ptr": "*i32", "pos_ptr": "*i64"},
             dict(SHARED_ROWS=not changes.get("HALVES", False))),
            (K.rope_qkv_kernel, {
                **{p: "*bf16" for p in ("q_x", "q_out", "k_x", "k_out", "v_x", "v_out")},
                "q_tab": table_type(sin_type), "k_tab": table_type(sin_type), "q_sin": sin_type,
                "k_sin": sin_type,
                "cu_ptr": "*i32", "pos_ptr": "*i64",
            }, dict(HAS_V=True, V_WIDTH=128, BLOCK_W=128)),
        ):
            if not compiles(f"{kernel.__name__} {name}", kernel, pointers, {**consts, **extra}):
                return 1
        if ("CONTEXT_PARALLEL" in changes or changes.get("LAYOUT") == 2
                or any(name in changes for name in CHANNEL_STAGE)):
            continue  # calls the lean kernel never takes
        lean = {**LEAN, **{k: v for k, v in changes.items() if k not in LEAN_DROPPED}}
        if lean["PASS_DIM"]:
            lean["HEAD_DIM"] = lean["ROT_DIM"] + lean["PASS_DIM"]
        if not compiles(f"rope_lean_kernel {name}", K.rope_lean_kernel, lean_pointers(sin_type),
                        lean):
            return 1
    for name, changes, sin_type in LEAN_VECTOR_VARIANTS:
        if not compiles(f"rope_lean_kernel {name}", K.rope_lean_kernel, lean_pointers(sin_type),
                        {**LEAN, **changes}):
            return 1
    for name, changes, q_out, cache, index in NORM_VARIANTS:
        if not compiles(f"rope_norm_kernel {name}", N.rope_norm_kernel,
                        norm_pointers(q_out, cache, index), {**NORM, **changes}):
            return 1
    if not compiles("weight_grad_kernel", N.weight_grad_kernel,
                    {"q_part": "*fp32", "q_grad": "*bf16", "k_part": "*fp32", "k_grad": "*bf16"},
                    dict(BLOCK_ROWS=512, BLOCK_COLS=16, ROW_ITERS=2)):
        return 1
    if not compiles("linear_table_kernel", K.linear_table_kernel,
                    {"tab_ptr": "*fp32", "flag_ptr": "*i32"},
                    dict(ROT_DIM=128, BLOCK_ROWS=32, BLOCK_C=128)):
        return 1
    if not compiles("halves_table_kernel", K.halves_table_kernel,
                    {"cos_ptr": "*i16", "sin_ptr": "*i16", "flag_ptr": "*i32"},
                    dict(ROT_DIM=128, BLOCK_ROWS=64, BLOCK_C=64)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sines and cosines for the Triton kernels: of float32 angles (reduced to about [-pi, pi] in
float32 first), of a rate table's angles, and of a precise rate table's exact angles
(:class:`rope_dispatch.RateTable` with ``precise=True``), whose rates the kernels read as
fractions of a turn.

A precise table gives each pair's rate as ``rate / 2pi`` modulo 1 in 64-bit fixed point
(:func:`rope_dispatch.tables.turn_fractions`). A whole position times it, modulo 2^64, is the
exact angle's fraction of a turn to 2^-41 (the fixed point's rounding times positions below
2^24): its top 32 bits come from two 32-bit integer products, wrapping, and are then one
conversion and one multiply-add from an angle in [-pi, pi) (about 2e-7 rad at most). No
float64 and no range reduction: the same integer work on the GPU and in the interpreter.

Imported by ``triton_kernels`` (only where triton is importable).
"""

from __future__ import annotations

import triton
import triton.language as tl

# radians per 2^-32 of a turn, 2*pi / 2^32, as a float32 sum (2*pi's float32 value and its
# remainder, each times 2^-32: exact)
_UNIT_RADIANS_HI: tl.constexpr = tl.constexpr(6.2831854820251465 * 2.0**-32)
_UNIT_RADIANS_LO: tl.constexpr = tl.constexpr(-1.7484555314695172e-07 * 2.0**-32)
# 2*pi as a sum of three float32 numbers (Cody-Waite): reduces an angle to [-pi, pi] with an
# error near 1e-7 up to |angle| ~ 1e6, so the sin/cos that follow stay accurate for positions
# far beyond 2*pi, where float32 sin/cos hardware approximations lose precision.
_TWO_PI_A: tl.constexpr = tl.constexpr(6.28125)
_TWO_PI_B: tl.constexpr = tl.constexpr(0.0019353071693331003)
_TWO_PI_C: tl.constexpr = tl.constexpr(1.0253376273028358e-11)
_INV_TWO_PI: tl.constexpr = tl.constexpr(0.15915494309189535)


@triton.jit
def _reduced_cos_sin(r, FAST_TRIG: tl.constexpr):
    """float32 cos and sin of float32 angles ``r`` in about [-pi, pi]: there the GPU's
    ``cos.approx``/``sin.approx`` err by about 1e-6 at most (far below float32 tolerance for
    RoPE), and cost a fraction of libdevice's sinf/cosf (no call, no stack frame, few
    registers). The interpreter (``FAST_TRIG`` off) uses tl.cos/tl.sin."""
    if FAST_TRIG:
        cos = tl.inline_asm_elementwise(
            "cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1
        )
        sin = tl.inline_asm_elementwise(
            "sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        cos = tl.cos(r)
        sin = tl.sin(r)
    return cos, sin


@triton.jit
def _turn_cos_sin(pos, turns, ok, FAST_TRIG: tl.constexpr):
    """float32 cos and sin ``[BLOCK_T, pairs]`` of the exact angles ``pos[t] * rate[k]``
    (``pos`` whole numbers below 2^24, ``turns[k]`` the rate's fraction of a turn as int64
    fixed point, :func:`rope_dispatch.tables.turn_fractions`); NaN where ``ok`` is off."""
    p = pos.to(tl.uint32)[:, None]
    t = turns.to(tl.uint64, bitcast=True)[None, :]
    # the top 32 bits of p * t modulo 2^64: the angle's fraction of a turn, wrapped
    units = p * (t >> 32).to(tl.uint32) + tl.umulhi(p, t.to(tl.uint32))
    v = units.to(tl.int32, bitcast=True).to(tl.float32)  # in [-2^31, 2^31): [-pi, pi)
    angle = tl.fma(v, _UNIT_RADIANS_HI, v * _UNIT_RADIANS_LO)
    return _reduced_cos_sin(tl.where(ok, angle, float("nan")), FAST_TRIG)


@triton.jit
def _cos_sin(angle, FAST_TRIG: tl.constexpr):
    """float32 cos and sin of float32 angles: the angle is first reduced to [-pi, pi] exactly
    enough (see _TWO_PI_*), where :func:`_reduced_cos_sin` is accurate and cheap. The
    reduction needs a fused multiply-add (its first product is exact only inside one): the
    interpreter's tl.fma rounds the product first (0.04 rad off at angles near 1e6), so there
    (``FAST_TRIG`` off) tl.cos/tl.sin, NumPy's, reduce the angle themselves."""
    if not FAST_TRIG:
        return tl.cos(angle), tl.sin(angle)
    turns = tl.floor(angle * _INV_TWO_PI + 0.5)
    r = tl.fma(turns, -_TWO_PI_A, angle)
    r = tl.fma(turns, -_TWO_PI_B, r)
    r = tl.fma(turns, -_TWO_PI_C, r)
    return _reduced_cos_sin(r, FAST_TRIG)


@triton.jit
def _rate_cos_sin(
    rate_ptr, STEP: tl.constexpr, pos, inside, c, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, FAST_TRIG: tl.constexpr,
):
    """cos and sin of pair ``k``'s angle ``float32(pos) * rate_ptr[k * STEP]`` (one product, as
    an angle table's entry is), NaN for tokens outside the table: ``(cos_a, sin_a, cos_b,
    sin_b)`` as :func:`_row_cos_sin` gives them, both channels of a pair sharing one value.
    int64 rates are a precise rate table's fractions of a turn: the exact angle
    (:func:`_turn_cos_sin`)."""
    k = tl.arange(0, BLOCK_R // 2) if INTERLEAVED else c
    k_ok = k < ROT_DIM // 2
    rate = tl.load(rate_ptr + k * STEP, mask=k_ok, other=0)  # the same for every row
    if rate_ptr.dtype.element_ty == tl.int64:
        cos, sin = _turn_cos_sin(pos, rate, inside[:, None] & k_ok[None, :], FAST_TRIG)
    else:
        angle = pos.to(tl.float32)[:, None] * rate[None, :]
        angle = tl.where(inside[:, None] & k_ok[None, :], angle, float("nan"))
        cos, sin = _cos_sin(angle, FAST_TRIG)
    return cos, sin, cos, sin

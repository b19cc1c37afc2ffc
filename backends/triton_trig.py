"""Sines and cosines for the Triton kernels: of float32 angles (reduced to about [-pi, pi] in
float32 first), of a rate table's angles, and of a precise rate table's exact angles
(:class:`rope_dispatch.RateTable` with ``precise=True``), whose rates the kernels read as
float64.

A precise angle is the float64 product ``position * rate``: a position below 2^24 and a
float32 rate have 24 significant bits each, so the product is exact. It is reduced modulo 2*pi
in float64 by three float32 parts of 2*pi (Cody-Waite): each part times a whole number of turns
below 2^29 is exact, so is the first subtraction, and the rounding of the others is near
1e-16 rad; the reduced angle is then rounded to float32 once (1.2e-7 rad at most) before its
sine and cosine. No fused multiply-add is needed for any of it, so the interpreter, whose
``fma`` is a multiply and an add, computes the same angles.

Imported by ``triton_kernels`` (only where triton is importable).
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2*pi as three float32 numbers, the sum within 5e-23 of it. Float32 values, so Triton's
# literals (float32 constants, widened in float64 operations) keep them whole.
_TWO_PI_1: tl.constexpr = tl.constexpr(6.2831854820251465)
_TWO_PI_2: tl.constexpr = tl.constexpr(-1.7484555314695172e-07)
_TWO_PI_3: tl.constexpr = tl.constexpr(-6.8604980400235275e-15)
_TURNS_PER_RADIAN: tl.constexpr = tl.constexpr(0.15915493667125702)  # float32(1 / (2 pi))
# 1.5 * 2^52: in float64, (x + it) - it is x rounded to the nearest whole number (|x| < 2^51),
# two additions at the full float64 rate where a floor is a conversion (a quarter of it)
_ROUNDER: tl.constexpr = tl.constexpr(6755399441055744.0)
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
def _exact_cos_sin(pos, rate, ok, FAST_TRIG: tl.constexpr):
    """float32 cos and sin ``[BLOCK_T, pairs]`` of the exact angles ``pos[t] * rate[k]``
    (``pos`` whole numbers below 2^24, ``rate`` float32 values held as float64), reduced modulo
    2*pi in float64; NaN where ``ok`` is off."""
    angle = pos.to(tl.float64)[:, None] * rate[None, :]  # exact: 24 bits times 24 bits
    angle = tl.where(ok, angle, float("nan"))
    turns = (angle * _TURNS_PER_RADIAN + _ROUNDER) - _ROUNDER
    r = angle - turns * _TWO_PI_1  # exact
    r = r - turns * _TWO_PI_2
    r = r - turns * _TWO_PI_3
    return _reduced_cos_sin(r.to(tl.float32), FAST_TRIG)


@triton.jit
def _cos_sin(angle, FAST_TRIG: tl.constexpr):
    """float32 cos and sin of float32 angles: the angle is first reduced to [-pi, pi] exactly
    enough (see _TWO_PI_*), where :func:`_reduced_cos_sin` is accurate and cheap."""
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
    float64 rates are a precise rate table's: the exact angle, reduced in float64
    (:func:`_exact_cos_sin`)."""
    k = tl.arange(0, BLOCK_R // 2) if INTERLEAVED else c
    k_ok = k < ROT_DIM // 2
    rate = tl.load(rate_ptr + k * STEP, mask=k_ok, other=0.0)  # the same for every row
    if rate_ptr.dtype.element_ty == tl.float64:
        cos, sin = _exact_cos_sin(pos, rate, inside[:, None] & k_ok[None, :], FAST_TRIG)
    else:
        angle = pos.to(tl.float32)[:, None] * rate[None, :]
        angle = tl.where(inside[:, None] & k_ok[None, :], angle, float("nan"))
        cos, sin = _cos_sin(angle, FAST_TRIG)
    return cos, sin, cos, sin

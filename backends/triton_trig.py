"""Sines and cosines for the Triton kernels: of float32 angles already reduced to about
[-pi, pi], and of a precise rate table's exact angles (:class:`rope_dispatch.RateTable` with
``precise=True``), whose rates the kernels read as float64.

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

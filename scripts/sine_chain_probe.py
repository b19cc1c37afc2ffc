"""Whether the arithmetic between a table row's load and the sines sets the lean kernel's time
where Liger's in-place kernel leads (``tile_probe.TIE_SHAPES``): a developer's probe (run AN).

Each variant is the kernel module with :func:`~backends.triton_kernels._cos_sin`'s body
replaced (a copy loaded from a temporary file, so the shipped module is untouched):

- ``shipped``: ``floor(angle / 2 pi + 0.5)`` turns (an ``FRND``, on the same quarter-rate
  pipe as the 8 ``MUFU`` a thread of a 1 x 8 tile), a three-part reduction, ``MUFU`` sin/cos;
- ``round by add``: the turns rounded by adding and subtracting ``1.5 * 2**23`` (full-rate
  adds, no ``FRND``);
- ``two-part``: that, and the reduction in two fused multiply-adds (``2 pi`` as float32 and
  its remainder: the first product is exact in an FMA);
- ``poly sin``: that, and sin by an odd polynomial of degree 13 (4 ``MUFU`` a thread);
- ``poly both``: that, and cos by an even one of degree 12 (no ``MUFU``).

First the variants' cos and sin against float64 at float32 angles of several magnitudes
(rounding by an add holds only below ``2**22`` turns, so none of them could ship as is),
then each in place against Liger's in-place kernels (``tile_probe._print_paired``) and warm.
``python scripts/sine_chain_probe.py`` on the GPU machine."""
from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tile_probe  # noqa: E402

from rope_dispatch import bench  # noqa: E402
from rope_dispatch.backends import triton_kernels, triton_rope  # noqa: E402

# float32 2 pi and its remainder; coefficients fitted (least squares reweighted towards
# minimax, float64) on [-pi, pi] for sin(r) - r (r^3 ... r^13) and cos(r) - 1 (r^2 ... r^12)
TWO_PI_HIGH, TWO_PI_LOW = 6.2831854820251465, -1.7484556000744883e-07
SIN_COEFFICIENTS = [-0.1666666567325592, 0.008333317935466766, -0.0001984039117814973,
                    2.7533092179510277e-06, -2.470451576641608e-08, 1.3532866494081475e-10]
COS_COEFFICIENTS = [-0.4999999403953552, 0.04166651889681816, -0.0013887913664802909,
                    2.4771778043941595e-05, -2.7094671395389014e-07, 1.7294536913681213e-09]


def _horner(name: str, coefficients: list[float]) -> str:
    """Source lines: ``name = c1 + r2 (c2 + r2 (...))`` with ``r2`` the square of ``r``."""
    lines = [f"    {name} = tl.fma(r2, {coefficients[-1]!r}, {coefficients[-2]!r})"]
    lines += [f"    {name} = tl.fma({name}, r2, {c!r})" for c in coefficients[-3::-1]]
    return "\n".join(lines) + "\n"


def _hardware(fn: str) -> str:
    return (f'    {fn} = tl.inline_asm_elementwise("{fn}.approx.f32 $0, $1;", "=r,r", [r], '
            f'dtype=tl.float32, is_pure=True, pack=1)\n')


ROUND_BY_ADD = "    turns = tl.fma(angle, _INV_TWO_PI, 12582912.0) - 12582912.0\n"
THREE_PART = ("    r = tl.fma(turns, -_TWO_PI_A, angle)\n    r = tl.fma(turns, -_TWO_PI_B, r)\n"
              "    r = tl.fma(turns, -_TWO_PI_C, r)\n")
TWO_PART = (f"    r = tl.fma(turns, -{TWO_PI_HIGH!r}, angle)\n"
            f"    r = tl.fma(turns, -({TWO_PI_LOW!r}), r)\n")
POLY_SIN = ("    r2 = r * r\n" + _horner("sin_p", SIN_COEFFICIENTS)
            + "    sin = tl.fma(sin_p * r2, r, r)\n")
POLY_COS = _horner("cos_p", COS_COEFFICIENTS) + "    cos = tl.fma(cos_p, r2, 1.0)\n"
VARIANTS: dict[str, str | None] = {
    "shipped": None,
    "round by add": ROUND_BY_ADD + THREE_PART + _hardware("cos") + _hardware("sin"),
    "two-part": ROUND_BY_ADD + TWO_PART + _hardware("cos") + _hardware("sin"),
    "poly sin": ROUND_BY_ADD + TWO_PART + _hardware("cos") + POLY_SIN,
    "poly both": ROUND_BY_ADD + TWO_PART + POLY_SIN + POLY_COS,
}


def _variant_modules() -> dict[str, ModuleType]:
    """Each variant's kernel module: the shipped source with ``_cos_sin``'s body replaced."""
    source = Path(triton_kernels.__file__).read_text()
    body = re.search(r"    turns = tl\.floor.*?        sin = tl\.sin\(r\)\n", source, re.S)
    if body is None:
        raise RuntimeError("_cos_sin's body changed: update this probe")
    folder = Path(tempfile.mkdtemp(prefix="sine_chain_"))
    modules = {}
    for number, (name, replacement) in enumerate(VARIANTS.items()):
        if replacement is None:
            modules[name] = triton_kernels
            continue
        path = folder / f"sine_variant_{number}.py"
        path.write_text(source.replace(body.group(0), replacement))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def _lean(module: ModuleType, x: torch.Tensor, table: torch.Tensor, layout: str,
          backward: bool) -> Callable[[], object]:
    """``module``'s lean kernel in place on ``x`` at the launcher's tile, reading ``table``'s
    rows, as a call of no argument (:func:`tile_probe._lean_at`)."""
    n0, dim1, heads, d = x.shape
    tile = triton_rope.lean_tile(n0 * dim1, heads, d, x.element_size())
    return tile_probe._lean_at(x, x, table, layout, backward, tile, kernels=module)


def accuracy(modules: dict[str, ModuleType]) -> None:
    """Largest error of each variant's cos and sin against float64, at 4,096 x 128 float32
    angles uniform in ``[-top, top]``: a float32 input of ones on the first half and zeros on
    the second comes out as (cos of the first half's angles, sin of the second's)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for top in (1e-3, 3.2, 1e2, 1e4, 1e6, 3e7, 1e8, 2.1e9):
        angles = (torch.rand(4096, 128, device="cuda", generator=gen) * 2 - 1) * top
        ones_zeros = torch.zeros(4096, 1, 8, 128, device="cuda")
        ones_zeros[..., :64] = 1
        exact = angles.double()
        cells = []
        for name, module in modules.items():
            got = ones_zeros.clone()
            _lean(module, got, angles, "sbhd", False)()
            cos_error = (got[:, 0, 0, :64].double() - exact[:, :64].cos()).abs().max().item()
            sin_error = (got[:, 0, 0, 64:].double() - exact[:, 64:].sin()).abs().max().item()
            cells.append(f"{name} {cos_error:.2g} / {sin_error:.2g}")
        print(f"|angle| <= {top:g}, cos / sin error: " + " | ".join(cells), flush=True)


def timing(modules: dict[str, ModuleType], rounds: int = 10, calls: int = 40) -> None:
    """Each variant in place at ``tile_probe.TIE_SHAPES`` against Liger's in-place kernels."""
    for layout, seq, batch, heads in tile_probe.TIE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        inp = bench.make_inputs(shape, draw_on_device=True)
        angles = inp.freqs.view(inp.freqs.shape[0], -1)
        fns = {}
        for name, module in modules.items():
            for mode, src, backward in (("fwd", inp.t, False), ("bwd", inp.grad, True)):
                fns[f"{name} {mode}"] = _lean(module, src.clone(), angles, layout, backward)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d128 in place (lean):", flush=True)
        tile_probe._print_paired(fns, rounds, calls)
        tile_probe._print_warm_forwards(fns)


if __name__ == "__main__":
    variant_modules = _variant_modules()
    accuracy(variant_modules)
    timing(variant_modules)

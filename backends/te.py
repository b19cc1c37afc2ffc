"""The TE backend: TransformerEngine's own fused RoPE, ``apply_rotary_pos_emb(..., fused=True)``.

TransformerEngine defines the semantics rope-dispatch follows, so this backend is the
reference implementation where it runs. It is imported lazily, from whichever module the
installed version keeps it in, and checked against what that version's fused kernel can do.
What the TE 2.9-2.20 sources show (``common/fused_rope/fused_rope.cu``, ``pytorch/csrc/extensions/
apply_rope.cpp``, ``pytorch/attention/rope.py``), and how this backend answers it:

- ``freqs`` must be float32 ``[s2, 1, 1, d2]`` and is read as a contiguous array: we pass a
  view of our contiguous ``[s2, d2]`` angle table. TE reads angles only, so a
  :class:`~rope_dispatch.CosSinCache` is refused (cos/sin cannot be turned back into the
  exact angles). A :class:`~rope_dispatch.RateTable` is served by its angle table
  (:meth:`~rope_dispatch.RateTable.angle_table` in the spec's layout, made once and kept on
  the object): the same float32 angles; a precise one's holds its exact angles reduced modulo
  2*pi from float64 (in [-pi, pi], right to float32 rounding below 2^24 positions).
- ``cu_seqlens`` and ``start_positions`` are read as ``int*``: int64 tensors are converted to
  int32 here (an int64 tensor would be misread, not rejected).
- Offsets and strides are 32-bit ``int``: tensors whose elements or strides reach 2^31 are
  refused.
- The grid is ``(s, b)`` (``(s2, number of sequences)`` for thd): the second axis holds at most
  65,535, so larger batches are refused.
- Before 2.10 the backward kernel had no ``start_positions`` argument (it rotated gradients as
  if every sequence started at 0) and the forward ignored them under context parallelism: with
  such a version ``start_positions`` is refused when autograd records the call or ``cp_size > 1``.
  2.10 (PR #2188) adds the start position to the zigzag position in both directions.
- Any input strides are read directly, and the output is a new contiguous tensor.
- Neither function has an inverse option (rotation by minus the angle): a spec with
  ``inverse=True`` is refused (``supports_inverse`` stays False).
- Inside ``torch.compile`` it refuses: the pybind call cannot be traced and would break the
  graph, where the other backends fuse or trace.

Packed qkv calls go to ``apply_fused_qkv_rotary_pos_emb`` (TE 2.8 and newer, PR #2122), which
takes a contiguous ``[s, b, h, q + k + v]`` tensor in sbhd or bshd only, asserts against
``start_positions`` with context parallelism, has no ``start_positions`` in its backward kernel
(2.8 to 2.20.2), and takes the head dim from v's width while shaping q by k's: such calls are
refused with those reasons.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rope_dispatch.call import RoPECall
from rope_dispatch.registry import Backend, Plan
from rope_dispatch.spec import RoPESpec
from rope_dispatch.tables import RateTable
from rope_dispatch.tracing import forward_ad, transformed

from .eager import rope_eager

# Where apply_rotary_pos_emb lives, newest first.
MODULE_PATHS = (
    "transformer_engine.pytorch.attention.rope",  # 2.3 and newer
    "transformer_engine.pytorch.dot_product_attention.rope",  # 2.2
    "transformer_engine.pytorch.attention",  # before 2.2
)
FEATURES_SINCE = (2, 3)  # interleaved, start_positions, context parallel for sbhd/bshd (fused)
STARTS_EVERYWHERE_SINCE = (2, 10)  # start_positions in the backward and with context parallelism
INT32_LIMIT = 2**31
GRID_Y_LIMIT = 65535
INSTALL_HINT = "pip install 'transformer-engine[pytorch]>=2.2'"


@dataclass(frozen=True)
class TEInfo:
    """The TransformerEngine found in this process."""

    version: str
    release: tuple[int, ...] | None  # (major, minor, patch), None when unparseable
    module: str
    apply: Callable[..., torch.Tensor]
    parameters: frozenset[str]
    apply_qkv: Callable[..., tuple[torch.Tensor, ...]] | None = None

    def at_least(self, release: tuple[int, ...]) -> bool:
        return self.release is not None and self.release >= release


def parse_release(version: str) -> tuple[int, ...] | None:
    """``"2.9.0+abc"`` -> ``(2, 9, 0)``; ``"2.3.0.dev0"`` -> ``(2, 3, 0)``; junk -> ``None``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if match is None:
        return None
    return tuple(int(part or 0) for part in match.groups())


def _te_version(package: object) -> str:
    version = getattr(package, "__version__", None)
    if isinstance(version, str):
        return version
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _missing(exc: ModuleNotFoundError, path: str) -> bool:
    """Whether ``exc`` says ``path`` (or a parent of it) does not exist, rather than a module
    that ``path`` itself imports being missing."""
    name = exc.name or ""
    return bool(name) and (path == name or path.startswith(name + "."))


def te_installed() -> bool:
    """Whether a ``transformer_engine`` package can be found, without importing it."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec: it is there
        return True


def load_te(import_module: Callable[[str], object] = importlib.import_module) -> TEInfo | list[str]:
    """Import TransformerEngine's ``apply_rotary_pos_emb`` from where its version keeps it.

    Returns what was found, or the reasons (sentences) it could not be used.
    """
    try:
        with warnings.catch_warnings():  # TE warns on import wherever JAX is installed without
            warnings.filterwarnings("ignore", message=".*Transformer Engine Jax extension")
            package = import_module("transformer_engine")  # its extension: not ours to report
    except ModuleNotFoundError as exc:
        if _missing(exc, "transformer_engine"):
            return [f"transformer_engine is not installed ({INSTALL_HINT})"]
        return [f"transformer_engine is installed but importing it failed: {type(exc).__name__}: {exc}"]
    except Exception as exc:
        return [f"transformer_engine is installed but importing it failed: {type(exc).__name__}: {exc}"]
    version = _te_version(package)
    tried = []
    for path in MODULE_PATHS:
        try:
            module = import_module(path)
        except ModuleNotFoundError as exc:
            if _missing(exc, path):
                tried.append(f"{path} does not exist")
                continue
            tried.append(f"importing {path} failed: {type(exc).__name__}: {exc}")
            continue
        except Exception as exc:
            tried.append(f"importing {path} failed: {type(exc).__name__}: {exc}")
            continue
        apply = getattr(module, "apply_rotary_pos_emb", None)
        if apply is None:
            tried.append(f"{path} has no apply_rotary_pos_emb")
            continue
        try:
            parameters = frozenset(inspect.signature(apply).parameters)
        except (TypeError, ValueError):
            parameters = frozenset()
        apply_qkv = getattr(module, "apply_fused_qkv_rotary_pos_emb", None)
        return TEInfo(version, parse_release(version), path, apply, parameters, apply_qkv)
    return [
        f"transformer_engine {version} is installed but its apply_rotary_pos_emb could not be "
        f"imported: {'; '.join(tried)}"
    ]


def _version_reason(
    info: TEInfo, feature: str, since: tuple[int, ...] = FEATURES_SINCE
) -> str | None:
    if info.at_least(since):
        return None
    need = ".".join(map(str, since))
    if info.release is None:
        return (
            f"{feature} needs TransformerEngine {need} or newer, and the installed version "
            f"{info.version!r} could not be parsed"
        )
    return f"{feature} needs TransformerEngine {need} or newer; installed {info.version}"


def _qkv_reasons(call: RoPECall, info: TEInfo) -> list[str]:
    """Why TE's ``apply_fused_qkv_rotary_pos_emb`` cannot serve a packed qkv call."""
    if info.apply_qkv is None:
        return [
            f"TransformerEngine {info.version} ({info.module}) has no "
            "apply_fused_qkv_rotary_pos_emb (added in 2.8)"
        ]
    reasons = []
    spec, t = call.spec, call.t
    if spec.layout == "thd":
        reasons.append("TransformerEngine's apply_fused_qkv_rotary_pos_emb takes sbhd or bshd, not thd")
    if not t.is_contiguous():
        reasons.append(
            f"qkv with strides {tuple(t.stride())} is not contiguous; TransformerEngine's "
            "apply_fused_qkv_rotary_pos_emb asserts a contiguous qkv"
        )
    _, k_len, v_len = call.split
    if v_len != k_len:
        reasons.append(
            f"split {call.split}: TransformerEngine's fused QKV kernel takes the head dim from "
            f"v ({v_len}) but shapes q by k ({k_len}); it is right only when they are equal"
        )
    if call.start_positions is not None:
        if spec.cp_size > 1:
            reasons.append(
                f"start_positions with context parallelism (cp_size={spec.cp_size}): "
                "TransformerEngine's apply_fused_qkv_rotary_pos_emb asserts against it"
            )
        if t.requires_grad and torch.is_grad_enabled():
            reasons.append(
                "start_positions while qkv requires grad: TransformerEngine's fused QKV "
                f"backward (2.8 to 2.20.2; installed {info.version}) takes no start_positions "
                "and would rotate the gradient by the wrong positions"
            )
    return reasons


UNBOUNDED_REASON = (
    "the positions are not known to lie inside the table: {what} on the GPU are not read on "
    "the host (no sync), and TransformerEngine's kernel does not guard its table reads (an "
    "out-of-range position would read past the table or leave rows unwritten); set "
    "ROPE_DISPATCH_CHECK_VALUES=1 (one sync per call){promise}, or another backend marks such "
    "rows NaN"
)


def _unbounded_reason(call: RoPECall) -> str:
    unread = "start_positions" if call.start_positions is not None else "cu_seqlens"
    promise = (
        ", give the spec max_seqlen" if unread == "cu_seqlens" and call.spec.max_seqlen is None
        else ""
    )
    return UNBOUNDED_REASON.format(what=unread, promise=promise)


def te_reasons(call: RoPECall, info: TEInfo) -> list[str]:
    """Why this TransformerEngine cannot serve ``call`` (beyond device, layout and dtype)."""
    common = [] if call.positions_bounded else [_unbounded_reason(call)]
    if call.tensors == "qkv":
        return _qkv_reasons(call, info) + _limit_reasons(call) + common
    reasons = []
    spec, t = call.spec, call.t
    params = info.parameters
    wanted = {"fused": True, "tensor_format": True}
    if spec.interleaved:
        wanted["interleaved"] = True
        if (why := _version_reason(info, "interleaved=True in the fused kernel")) is not None:
            reasons.append(why)
    if call.start_positions is not None:
        wanted["start_positions"] = True
        if (why := _version_reason(info, "start_positions in the fused kernel")) is not None:
            reasons.append(why)
        if t.requires_grad and torch.is_grad_enabled():
            why = _version_reason(
                info, "start_positions while t requires grad (the fused backward ignores them "
                "before 2.10)", STARTS_EVERYWHERE_SINCE,
            )
            if why is not None:
                reasons.append(why)
        if spec.cp_size > 1:
            why = _version_reason(
                info, f"start_positions with context parallelism (cp_size={spec.cp_size})",
                STARTS_EVERYWHERE_SINCE,
            )
            if why is not None:
                reasons.append(why)
    if spec.layout == "thd":
        wanted["cu_seqlens"] = True
    if spec.cp_size > 1:
        wanted["cp_size"] = wanted["cp_rank"] = True
        if spec.layout != "thd":
            why = _version_reason(
                info, f"context parallelism (cp_size={spec.cp_size}) with layout {spec.layout!r}"
            )
            if why is not None:
                reasons.append(why)
    if params:
        absent = sorted(name for name in wanted if name not in params)
        if absent:
            reasons.append(
                f"TransformerEngine {info.version}'s apply_rotary_pos_emb ({info.module}) has no "
                f"{', '.join(absent)} argument{'s' if len(absent) > 1 else ''}"
            )
    return reasons + _limit_reasons(call) + common


def _limit_reasons(call: RoPECall) -> list[str]:
    """TE's kernels use 32-bit offsets and put the batch on grid axis y."""
    reasons = []
    spec, t = call.spec, call.t
    numel = t.numel()
    if numel >= INT32_LIMIT:
        reasons.append(
            f"t has {numel:,} elements; TransformerEngine's kernel uses int32 offsets, so at most "
            f"{INT32_LIMIT - 1:,}"
        )
    else:
        reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n > 0)
        if reach >= INT32_LIMIT:
            reasons.append(
                f"t's strides {tuple(t.stride())} reach element offset {reach:,}; "
                f"TransformerEngine's kernel uses int32 offsets (below {INT32_LIMIT:,})"
            )
    if spec.layout == "thd" and call.seq_len * spec.cp_size >= INT32_LIMIT:
        reasons.append(
            f"{call.seq_len * spec.cp_size:,} global tokens do not fit TransformerEngine's int32 "
            "cu_seqlens"
        )
    if call.batch > GRID_Y_LIMIT:
        what = "number of sequences" if spec.layout == "thd" else "batch size"
        reasons.append(
            f"{what} {call.batch:,} exceeds {GRID_Y_LIMIT:,}: TransformerEngine puts it on CUDA "
            "grid axis y, which holds at most 65,535 blocks"
        )
    return reasons


CACHE_REASON = (
    "a {kind} table is not supported: TE reads angles; pass the angle table (cos/sin "
    "cannot be turned back into the exact angles)"
)
INVERSE_REASON = (
    "the inverse rotation (spec.inverse=True) is not supported: TransformerEngine's "
    "apply_rotary_pos_emb and apply_fused_qkv_rotary_pos_emb (2.20.2) have no inverse option"
)
DEINTERLEAVE_REASON = (
    "interleaved pairs in, halves out (spec.deinterleave=True) is not supported: "
    "TransformerEngine's kernels (2.20.2) write each pair where they read it"
)
COMPILE_REASON = (
    "inside torch.compile: TransformerEngine's fused RoPE is a pybind call that Dynamo cannot "
    "trace, so it would break the graph"
)


def _default_load() -> TEInfo | list[str]:
    if not te_installed():
        return [f"transformer_engine is not installed ({INSTALL_HINT})"]
    if not torch.cuda.is_available():
        return [
            "no CUDA device (torch.cuda.is_available() is False); TransformerEngine's fused "
            "RoPE runs on CUDA only"
        ]
    return load_te()


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 else x.to(torch.int32)


class TEBackend(Backend):
    """TransformerEngine's fused kernel: the semantics' own implementation, CUDA only."""

    name = "te"
    description = "TransformerEngine apply_rotary_pos_emb(fused=True) (CUDA)"
    priority = 30
    devices = frozenset({"cuda"})
    tables = frozenset({"angles", "rates", "precise_rates"})
    tensors = frozenset({"t", "qkv"})
    supports_rotary_offset = True  # single tensors: TE on the view from the offset on
    heavy_import = True  # TransformerEngine imports Dynamo and its own extensions

    def __init__(self, load: Callable[[], TEInfo | list[str]] = _default_load) -> None:
        self._load = load
        self._info: TEInfo | None = None

    def unavailable_reasons(self) -> list[str]:
        found = self._load()
        if isinstance(found, TEInfo):
            self._info = found
            return []
        return list(found)

    @property
    def info(self) -> TEInfo | None:
        """The TransformerEngine in use (``None`` where unavailable)."""
        return self._info if self.available else None

    def not_supported_reasons(self, call: RoPECall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        kind = call.table_kind
        if kind not in self.tables and self.available:  # say why, in TE's terms
            generic = f"a {kind} table is not supported"
            reasons = [CACHE_REASON.format(kind=kind) if r.startswith(generic) else r for r in reasons]
        if call.spec.inverse and self.available:  # say why, in TE's terms
            reasons = [INVERSE_REASON if r.startswith("the inverse") else r for r in reasons]
        if call.spec.deinterleave and self.available:
            reasons = [DEINTERLEAVE_REASON if r.startswith("interleaved pairs in") else r
                       for r in reasons]
        return reasons

    def extra_reasons(self, call: RoPECall) -> list[str]:
        if torch.compiler.is_compiling():
            return [COMPILE_REASON]
        reasons = te_reasons(call, self._info)
        if call.spec.rotary_offset and call.tensors != "t":
            reasons.append(
                f"spec.rotary_offset={call.spec.rotary_offset}: TransformerEngine's fused qkv "
                "function rotates each head's first channels; only a single tensor is served "
                "with an offset (TE on the view that starts there)"
            )
        return reasons

    def apply(self, call: RoPECall) -> torch.Tensor:
        if self._info is None and self.availability:
            raise RuntimeError(f"the te backend is unavailable: {'; '.join(self.availability)}")
        if transformed() or forward_ad():  # TE's autograd.Function has no setup_context,
            return rope_eager(call)  # which torch.func needs, nor a jvp: torch ops
        offset = call.spec.rotary_offset
        if offset:  # exact: TE rotates the view from the offset on, the channels before it copied
            spec = call.spec.model_copy(update={"rotary_offset": 0})
            spec._set_static_key()
            view = call.t[..., offset:]
            out = self.apply(call._replace(t=view, spec=spec, head_dim=view.shape[-1]))
            return torch.cat((call.t[..., :offset], out), dim=-1).contiguous()
        t, kwargs = call.t, te_arguments(call)
        interleaved = call.spec.interleaved
        if call.tensors == "qkv":
            k_table = call.table if call.k_table is None else call.k_table
            fn = self._info.apply_qkv
            args = (t, _angles_4d(call.table, interleaved), _angles_4d(k_table, interleaved),
                    list(call.split))
            kwargs.pop("fused")
        else:
            fn, args = self._info.apply, (t, _angles_4d(call.table, interleaved))
        if t.is_cuda and t.device.index != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return _scaled(fn(*args, **kwargs), call)
        return _scaled(fn(*args, **kwargs), call)

    def plan(self, call: RoPECall) -> Plan:
        """TE's function with its keyword arguments made once: a repeated call passes the
        user's table as TE takes it (itself when it is ``[s2, 1, 1, d2]``, else a view of the
        ``[s2, d2]`` table: dispatch runs a plan only for the table object it was made for,
        over the memory it held then, so its rank and size are known here; a strided table,
        which the checks copy, takes the generic plan) and, when it has them, the start
        positions and the spec's offsets in int32. Other calls (packed qkv, rate tables, a
        cos/sin scale) take the generic plan. Run R: checking the table again per call (with
        the checks ``tables.angles_2d`` remembers) put the plan 6.3 us above TE's function on
        the H200 host (27.2 against 20.9 us)."""
        generic = super().plan(call)
        info = self._info
        if (
            info is None or call.tensors != "t" or type(call.table) is not torch.Tensor
            or call.spec.cos_sin_scale != 1.0 or call.spec.rotary_offset
        ):
            return generic
        fn = info.apply
        fixed = te_arguments(call)
        per_call = ("start_positions" in fixed, "cu_seqlens" in fixed)
        fixed.pop("start_positions", None)
        fixed.pop("cu_seqlens", None)
        device_index = call.t.device.index
        several = call.t.is_cuda and torch.cuda.device_count() > 1
        current_device = torch.cuda.current_device
        shape_4d = (call.table.shape[0], 1, 1, call.table.shape[1])

        def run_te(
            t: torch.Tensor, freqs: torch.Tensor, spec: RoPESpec,
            start_positions: torch.Tensor | None, positions: torch.Tensor | None, k: None,
            norms: tuple,
        ) -> torch.Tensor:
            if not freqs.is_contiguous() or (several and current_device() != device_index) or (
                    forward_ad()):
                return generic(t, freqs, spec, start_positions, positions, k, norms)
            table = freqs if freqs.dim() == 4 else freqs.view(shape_4d)
            if per_call == (False, False):
                return fn(t, table, **fixed)
            kwargs = dict(fixed)
            if per_call[0]:
                kwargs["start_positions"] = _int32(start_positions)
            if per_call[1]:
                kwargs["cu_seqlens"] = _int32(spec.cu_seqlens)
            return fn(t, table, **kwargs)

        return run_te


def _scaled(out: torch.Tensor | tuple[torch.Tensor, ...], call: RoPECall):
    """TE's output with the spec's ``cos_sin_scale`` applied: TE's kernels have no factor on cos
    and sin, and ``x cos s + r sin s = s (x cos + r sin)``, so the rotated channels (q's and
    k's of a qkv call) are multiplied by it: one more pass and one more rounding to the output
    dtype (the factor stays a float64 scalar, never rounded to that dtype). Out of place: TE's
    qkv outputs are views that autograd forbids writing."""
    scale = call.spec.cos_sin_scale
    if scale == 1.0:
        return out
    d2 = call.rotary_dim

    def rescale(t: torch.Tensor) -> torch.Tensor:
        if d2 == t.shape[-1]:
            return t * scale
        return torch.cat((t[..., :d2] * scale, t[..., d2:]), dim=-1)

    if call.tensors == "qkv":
        return rescale(out[0]), rescale(out[1]), out[2]
    return rescale(out)


def _angles_4d(table: torch.Tensor | RateTable, interleaved: bool) -> torch.Tensor:
    """TE's ``[s2, 1, 1, d2]`` view of a checked, contiguous ``[s2, d2]`` angle table (no
    copy), or a rate table's kept angle table in the call's layout (made on its first call)."""
    if type(table) is RateTable:
        return table.angle_table(interleaved)
    return table.view(table.shape[0], 1, 1, table.shape[1])


def te_arguments(call: RoPECall) -> dict[str, object]:
    """Keyword arguments for TE's ``apply_rotary_pos_emb``: only what differs from its defaults,
    so that older versions, which lack some of them, are called correctly."""
    spec = call.spec
    kwargs: dict[str, object] = {"tensor_format": spec.layout, "fused": True}
    if spec.interleaved:
        kwargs["interleaved"] = True
    if spec.layout == "thd":
        kwargs["cu_seqlens"] = _int32(spec.cu_seqlens)
    if spec.cp_size > 1:
        kwargs["cp_size"], kwargs["cp_rank"] = spec.cp_size, spec.cp_rank
    if call.start_positions is not None:
        kwargs["start_positions"] = _int32(call.start_positions)
    return kwargs

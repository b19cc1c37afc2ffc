"""TransformerEngine 2.20.2's public RoPE API, running on rope-dispatch.

Moving TE-based code (Megatron-style models, for instance) onto rope-dispatch is one changed
import line::

    from rope_dispatch.compat.te import (
        RotaryPositionEmbedding, apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb,
    )

The three names have TE's signatures (argument names, order and defaults) and return what TE
returns: :func:`apply_rotary_pos_emb` one new contiguous tensor,
:func:`apply_fused_qkv_rotary_pos_emb` a tuple ``(q, k, v)`` shaped as TE shapes them,
:class:`RotaryPositionEmbedding` an ``nn.Module`` whose ``forward(max_seq_len, offset)`` gives
the same float32 angle table as TE's (bit for bit on the same device; it also runs without
CUDA). The values are TE's fused kernel's: float32 math and one rounding to the input's dtype,
forward and backward, with the positions of docs/semantics.md (start positions,
context-parallel zigzag, packed thd). Two corners of TE's fused qkv kernel are not copied
(docs/te.md): its backward ignores ``start_positions`` (ours is the exact transpose of the
forward), and it steps through q and k in chunks of v's width (ours rotates heads of k's width,
the head dim of the tensors both return; the two agree whenever ``v == k``).

This module is an adapter: it maps arguments and runs no kernel of its own. ``tensor_format``,
``t.dtype``, ``interleaved``, ``cp_size``, ``cp_rank`` and (thd only) ``cu_seqlens`` become a
:class:`~rope_dispatch.RoPESpec`, taken from a small cache because a training step calls this
once per layer; ``freqs`` that are not float32 are converted with ``.float()``, as TE's fused
path does; then :func:`rope_dispatch.apply` or :func:`rope_dispatch.apply_qkv` checks the call,
picks the backend and runs it. Bad arguments raise :class:`~rope_dispatch.RoPEError` from those
checks (where TE asserts, the core raises for the same condition); those of ``apply_qkv``, which
names its own arguments, say how the door mapped them (``qkv=qkv``, ``freqs=q_freqs``,
``split=qkv_split_arg_list``).

``fused`` is accepted and changes nothing: every rope-dispatch backend computes what TE's fused
kernel computes (float32 math, one rounding), so ``fused=False`` gives those values too, not
those of TE's unfused PyTorch path (which rounds cos and sin to the input dtype first).

The adapter's only checks of its own mirror three asserts of TE's
``apply_fused_qkv_rotary_pos_emb`` that :func:`rope_dispatch.apply_qkv` deliberately does not
make: ``tensor_format="thd"``, ``start_positions`` with ``cp_size > 1``, and a non-contiguous
``qkv``, ``q_freqs`` or ``k_freqs``. Each raises :class:`~rope_dispatch.RoPEError`; call
:func:`rope_dispatch.apply_qkv` directly to use them.
"""

from __future__ import annotations

import numbers
from typing import Any, List, Optional, Tuple

import torch

from ..dispatch import apply, apply_qkv
from ..errors import RoPEError, RoPETypeError
from ..spec import SUPPORTED_DTYPES, RoPESpec, constant_spec, dtype_name
from ..table_kinds import _base, _positive, _rotary_dim
from ..tables import angle_table, inverse_frequencies
from .flashinfer import _mapped

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "apply_fused_qkv_rotary_pos_emb"]


# Specs by their static fields: pydantic validation costs microseconds, a dict lookup does not.
# For thd the entry is the last spec made for those fields, so the layers of one step, which
# pass the same cu_seqlens tensor, share one spec (with_cu_seqlens costs microseconds too);
# it keeps that small offsets tensor alive until another one arrives.
_specs: dict[tuple, RoPESpec] = {}
_MAX_SPECS = 64
_FORMATS = ("sbhd", "bshd", "thd")


def _spec(
    tensor_format: Any, dtype: torch.dtype, interleaved: Any, cp_size: Any, cp_rank: Any,
    cu_seqlens: Optional[torch.Tensor],
) -> RoPESpec:
    """The spec for these arguments; ``cu_seqlens`` counts for ``thd`` only, as in TE."""
    thd = tensor_format == "thd"
    if not thd:
        cu_seqlens = None
    elif cu_seqlens is None:  # the spec's error would offer per-token positions, not TE's
        raise RoPEError("tensor_format='thd' needs cu_seqlens (the [n + 1] offsets of the "
                        "packed sequences), got None")
    # the types too: 1 == True and 1.0 == 1 hash alike, and the spec refuses interleaved=1
    key = (tensor_format, dtype, interleaved, cp_size, cp_rank,
           type(interleaved), type(cp_size), type(cp_rank))
    try:
        spec = _specs.get(key)
    except TypeError:  # an unhashable argument: validation below names it
        spec, key = None, None
    if spec is not None and spec.cu_seqlens is cu_seqlens:
        return spec
    if spec is None and not (isinstance(tensor_format, str) and tensor_format in _FORMATS):
        # the spec would name its own field, layout, which a caller of TE's API never passed
        raise RoPEError(f"tensor_format must be 'sbhd', 'bshd' or 'thd', got {tensor_format!r}")
    if torch.compiler.is_compiling():  # the cache is left alone: a spec made here is the trace's
        if spec is None:
            spec = constant_spec(layout=tensor_format, dtype=dtype, interleaved=interleaved,
                                 cp_size=cp_size, cp_rank=cp_rank)
        # (called on the class: Dynamo cannot look a method up on a constant spec)
        return spec if cu_seqlens is None else RoPESpec.with_cu_seqlens(spec, cu_seqlens)
    if spec is not None and cu_seqlens is not None:
        spec = spec.with_cu_seqlens(cu_seqlens)
    else:  # full validation; thd without cu_seqlens raises here
        spec = RoPESpec(layout=tensor_format, dtype=dtype, interleaved=interleaved,
                        cp_size=cp_size, cp_rank=cp_rank, cu_seqlens=cu_seqlens)
    if key is not None:
        if len(_specs) >= _MAX_SPECS:
            _specs.clear()
        _specs[key] = spec
    return spec


def _dtype(argument: str, t: Any) -> torch.dtype:
    """``t``'s dtype, which the spec takes; anything but a tensor is refused as ``apply``
    refuses it, and a dtype the spec refuses is refused here, naming the argument (the spec
    would name its own field, dtype)."""
    if not isinstance(t, torch.Tensor):
        raise RoPETypeError(f"{argument} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise RoPEError(f"{argument} must be float32, float16 or bfloat16, got "
                        f"{dtype_name(t.dtype)}")
    return t.dtype


def _float(freqs: Any) -> Any:
    """``freqs`` as float32, as TE's fused path converts it (other objects go to the checks)."""
    if isinstance(freqs, torch.Tensor) and freqs.dtype != torch.float32:
        return freqs.float()
    return freqs


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Rotary position embedding of ``t``: TransformerEngine's function, on rope-dispatch.

    ``t`` is ``[s, b, h, d]`` (sbhd), ``[b, s, h, d]`` (bshd) or ``[T, h, d]`` (thd, with the
    ``[n + 1]`` offsets ``cu_seqlens``, global ones under context parallelism); ``freqs`` is the
    angle table ``[s2, 1, 1, d2]``, ``d2 <= d`` (converted to float32 if it is not). Channels
    past ``d2`` are copied. ``start_positions`` (one per sequence) shift each sequence's
    positions; ``cp_size``/``cp_rank`` select this rank's zigzag chunks. ``cu_seqlens`` is
    ignored for sbhd and bshd, as TE ignores it.

    ``fused`` has no effect: the result is always what TE's fused kernel computes (float32
    math, one rounding to ``t``'s dtype). Returns a new tensor, contiguous, of ``t``'s dtype,
    differentiable with respect to ``t``.
    """
    spec = _spec(tensor_format, _dtype("t", t), interleaved, cp_size, cp_rank, cu_seqlens)
    return apply(t, _float(freqs), spec, start_positions=start_positions)


def _te_refuses(problem: str) -> RoPEError:
    return RoPEError(
        f"apply_fused_qkv_rotary_pos_emb: {problem}; TransformerEngine's API refuses this (an "
        "assert), so this adapter does too. rope_dispatch.apply_qkv accepts it"
    )


def _not_contiguous(argument: str, t: torch.Tensor) -> RoPEError:
    return _te_refuses(
        f"{argument} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
    )


def apply_fused_qkv_rotary_pos_emb(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    qkv_split_arg_list: List[int],
    tensor_format: str = "sbhd",
    start_positions: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE of a packed qkv tensor: TransformerEngine's function, on rope-dispatch.

    ``qkv`` is ``[s, b, h, q + k + v]`` (sbhd) or ``[b, s, h, q + k + v]`` (bshd), contiguous,
    with ``qkv_split_arg_list = [q, k, v]`` channels per head group; ``k`` is the head dim.
    Returns new ``(q, k, v)``: q ``[.., h * q / k, k]`` rotated by ``q_freqs``, k ``[.., h, k]``
    rotated by ``k_freqs``, v ``[.., h, v]`` copied; the backward gives one packed gradient.
    ``cu_seqlens`` is unused, as in TE. Positions, ``start_positions`` and context parallelism
    are as in :func:`apply_rotary_pos_emb`.

    Raises :class:`~rope_dispatch.RoPEError` where TE's function asserts (thd,
    ``start_positions`` with ``cp_size > 1``, a non-contiguous ``qkv``, ``q_freqs`` or
    ``k_freqs``); :func:`rope_dispatch.apply_qkv` accepts all of these.
    """
    # TransformerEngine's asserts, mirrored: the adapter's only checks of its own (a cp_size
    # that is no integer is left to the spec's check, which names it; a NumPy one the spec
    # takes, so it counts here too)
    integer = isinstance(cp_size, numbers.Integral) and not isinstance(cp_size, bool)
    if start_positions is not None and integer and cp_size > 1:
        raise _te_refuses(f"start_positions given with cp_size={cp_size} (> 1)")
    if tensor_format == "thd":
        raise _te_refuses("tensor_format='thd' (TE takes 'sbhd' and 'bshd' only)")
    dtype = _dtype("qkv", qkv)
    if k_freqs is None:  # apply_qkv would rotate k by q_freqs; TE's k_freqs has no default
        raise RoPETypeError("k_freqs must be a tensor [s2, 1, 1, d2] (k's angle table), got None")
    q_freqs, k_freqs = _float(q_freqs), _float(k_freqs)  # TE converts before its checks too
    if not qkv.is_contiguous():
        raise _not_contiguous("qkv", qkv)
    if isinstance(q_freqs, torch.Tensor) and not q_freqs.is_contiguous():
        raise _not_contiguous("q_freqs", q_freqs)
    if isinstance(k_freqs, torch.Tensor) and not k_freqs.is_contiguous():
        raise _not_contiguous("k_freqs", k_freqs)

    spec = _spec(tensor_format, dtype, interleaved, cp_size, cp_rank, None)
    split = qkv_split_arg_list
    if isinstance(split, (list, tuple)):
        split = tuple(split)  # anything else goes to apply_qkv's checks as it is
    try:
        return apply_qkv(qkv, q_freqs, spec, split, k_freqs=k_freqs,
                         start_positions=start_positions)
    except RoPEError as error:  # the core names its own arguments: t, freqs, split
        raise _mapped(error, "apply_fused_qkv_rotary_pos_emb", _QKV_MAPPING,
                      "apply_qkv") from error


# How apply_fused_qkv_rotary_pos_emb maps its arguments onto apply_qkv's, for the core's errors.
_QKV_MAPPING = "qkv=qkv, freqs=q_freqs, split=qkv_split_arg_list, k_freqs=k_freqs"


class RotaryPositionEmbedding(torch.nn.Module):
    """TransformerEngine's angle-table module: ``forward(max_seq_len, offset=0)`` returns the
    float32 ``freqs`` ``[max_seq_len, 1, 1, dim']`` that :func:`apply_rotary_pos_emb` takes.

    ``dim'`` is ``dim`` (``int(dim * rotary_percent)`` when ``rotary_percent < 1``) rounded up
    to even. Row ``p`` holds the angles of position ``p + offset`` (scaled as below) at rates
    ``1 / rotary_base ** (2k / dim')``, each rate once per rotated pair: the two halves
    ``[a, a]``, or ``[a_0, a_0, a_1, a_1, ...]`` when ``interleaved``.

    Position interpolation applies only when ``seq_len_interpolation_factor`` and
    ``pretrained_max_position_embeddings`` are both set: positions are divided by the factor,
    or, when ``max_seq_len`` exceeds ``pretrained_max_position_embeddings * factor``, scaled by
    ``pretrained_max_position_embeddings / max_seq_len`` (dynamic linear scaling).

    The ``inv_freq`` buffer is made on the current CUDA device when CUDA is available (as TE
    makes it, so tables match TE's bit for bit) and on the CPU otherwise; ``.to(device)`` moves
    it. The table is computed with autocast off. The math is
    :func:`rope_dispatch.tables.inverse_frequencies` and :func:`rope_dispatch.tables.angle_table`.
    """

    inv_freq: torch.Tensor

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[int] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ):
        super().__init__()
        if rotary_percent < 1.0:  # named here: inverse_frequencies would blame dim
            dim = _rotary_dim(int(dim * rotary_percent), "the rotary dim int(dim * "
                              f"rotary_percent) = int({dim} * {rotary_percent!r})", least=1)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        _base("rotary_base", rotary_base)  # inverse_frequencies would call it base
        # 0 divides by zero in forward, a negative one turns positions negative; any other
        # number serves TE's math (a length of 4096.0 too)
        for name, value in (("seq_len_interpolation_factor", seq_len_interpolation_factor),
                            ("pretrained_max_position_embeddings",
                             pretrained_max_position_embeddings)):
            if value is not None:
                _positive(name, value)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.register_buffer("inv_freq", inverse_frequencies(dim, rotary_base, device=device))

    def _position_scale(self, max_seq_len: int) -> float:
        """TE's position interpolation as a factor on positions (1.0: none)."""
        factor = self.seq_len_interpolation_factor
        pretrained = self.pretrained_max_position_embeddings
        if factor is None or pretrained is None or not isinstance(
                max_seq_len, (numbers.Real, torch.SymInt)):
            return 1.0  # (a max_seq_len that is no number is named by angle_table's check)
        if max_seq_len > pretrained * factor:
            return 1 / (max_seq_len / pretrained)  # dynamic: longer than interpolation covers
        return 1 / factor  # fixed

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """The angle table for positions ``offset .. offset + max_seq_len - 1``, float32
        ``[max_seq_len, 1, 1, dim']`` on ``inv_freq``'s device."""
        try:
            return angle_table(
                self.inv_freq, max_seq_len, offset=offset,
                scale=self._position_scale(max_seq_len), interleaved=self.interleaved,
            )
        except RoPEError as error:  # angle_table calls max_seq_len length
            raise type(error)(str(error).replace("length must", "max_seq_len must", 1)
                              ) from error

    def extra_repr(self) -> str:
        return (
            f"dim={2 * self.inv_freq.shape[0]}, rotary_base={self.rotary_base}, "
            f"interleaved={self.interleaved}, seq_len_interpolation_factor="
            f"{self.seq_len_interpolation_factor}, pretrained_max_position_embeddings="
            f"{self.pretrained_max_position_embeddings}"
        )

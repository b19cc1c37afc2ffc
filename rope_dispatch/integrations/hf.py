"""Hugging Face transformers models on rope-dispatch: their RoPE call, mapped onto ours.

One line moves a model of any family in :data:`SUPPORTED_MODELS` over (158 families: Llama,
Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma, Gemma3, OLMo2, GLM-4-MoE, DeepSeek-V3, Qwen2-VL,
Qwen2.5-VL, Llama 4, Qwen3-VL, Qwen3-VL-MoE and those of :mod:`.hf_families`; docs/hf.md)::

    rope_dispatch.integrations.hf.patch(model)

The attention modules of these families call a global of their modeling module by name at every
forward, so :func:`patch` rebinds that name to our function of the same name and signature, as
Liger-Kernel does, and :func:`unpatch` binds the original object back once no other patched
model holds the family. The rebinding is per modeling module: it reaches every model of the
family in the process, not only the one passed.

The names, per family (:data:`SUPPORTED_MODELS`; docs/hf.md): ``apply_rotary_pos_emb``
(:func:`apply_rotary_pos_emb`, or :func:`apply_rotary_pos_emb_pairs` and
:func:`apply_rotary_pos_emb_pairs_of_halves` in the families that rotate interleaved pairs,
:data:`.hf_families.PAIR_FAMILIES`), ``apply_rotary_pos_emb_interleave`` (DeepSeek-V3 and the
other latent-attention families with ``rope_interleave``: ``RoPESpec(deinterleave=True)``; q's and
the key latent's rotary parts arrive as views of their projections, whose gradients flow back to
them), ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL and Qwen2.5-VL where the modeling module
defines it) and Llama 4's ``apply_rotary_emb`` (:mod:`.hf_llama4`). A name the module lacks is
skipped. The vision towers' ``apply_rotary_pos_emb_vision`` is a different call, left to
transformers.

QK norm (:data:`QK_NORM_MODELS`: Qwen3, Qwen3-MoE, Qwen3-VL, Qwen3-VL-MoE, Gemma3, OLMo2,
GLM-4-MoE with ``use_qk_norm``): these attentions normalize q and k (their ``q_norm`` and
``k_norm`` modules) right before the RoPE call. In the model passed to :func:`patch`, each such attention's
``forward`` and its two norms' ``forward`` get instance attributes: while the attention's forward
runs, its norms hand their input on unchanged and :func:`apply_rotary_pos_emb` passes them to
:func:`rope_dispatch.apply_qk` as ``q_norm``/``k_norm`` (:class:`~rope_dispatch.HeadNorm` of the
module's weight and epsilon, with the family's offset and scope), so norm and rotation are one
call. The call checks that the q and k it gets are the norms' inputs, and the forward that every
input handed on was normalized; either failing raises instead of leaving a norm out. Norms that
Liger-Kernel's patch made ``LigerRMSNorm`` fuse too (its offset read from the module); a norm of
another class, or with another instance ``forward`` (an offload hook), is left as it is.

An adapter: it maps arguments and checks only what the mapping needs. q and k go to
:func:`rope_dispatch.apply_qk` as bshd views (no copy), the per-token ``cos``/``sin`` as a
:class:`~rope_dispatch.CosSinCache` with one row per token. This module reads transformers'
modules from ``sys.modules`` and never imports transformers itself.
"""

from __future__ import annotations

import functools
import gc
import inspect
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..dispatch import apply_qk
from ..errors import RoPEError
from ..norm import HeadNorm, normalized
from ..spec import SUPPORTED_DTYPES, RoPESpec
from ..tables import CosSinCache
from ..tracing import memoryless
from . import hf_llama4
from .hf_families import MLA_FAMILIES, PAIR_FAMILIES, STANDARD_FAMILIES
from .hf_shared import (
    _own_forward, _sequence_starts, _traced_with_grad, _unkept, _version, unsupported_dtype,
)

__all__ = [
    "QK_NORM_MODELS", "SUPPORTED_MODELS", "apply_multimodal_rotary_pos_emb",
    "apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb_pairs",
    "apply_rotary_pos_emb_pairs_of_halves", "apply_rotary_pos_emb_with_position_ids", "patch",
    "unpatch",
]

_PLAIN = ("apply_rotary_pos_emb",)
_INTERLEAVE = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")
_MULTIMODAL = ("apply_rotary_pos_emb", "apply_multimodal_rotary_pos_emb")

SUPPORTED_MODELS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "Llama": ("transformers.models.llama.modeling_llama", "LlamaAttention", _PLAIN),
    "Mistral": ("transformers.models.mistral.modeling_mistral", "MistralAttention", _PLAIN),
    "Qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention", _PLAIN),
    "Qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention", _PLAIN),
    "Qwen3-MoE": (
        "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention", _PLAIN
    ),
    "Gemma": ("transformers.models.gemma.modeling_gemma", "GemmaAttention", _PLAIN),
    "Gemma3": ("transformers.models.gemma3.modeling_gemma3", "Gemma3Attention", _PLAIN),
    "OLMo2": ("transformers.models.olmo2.modeling_olmo2", "Olmo2Attention", _PLAIN),
    "GLM-4-MoE": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeAttention", _PLAIN),
    "DeepSeek-V3": (
        "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Attention", _INTERLEAVE
    ),
    "Qwen2-VL": (
        "transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLAttention", _MULTIMODAL
    ),
    "Qwen2.5-VL": (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLAttention", _MULTIMODAL
    ),
    "Llama4": ("transformers.models.llama4.modeling_llama4", "Llama4TextAttention",
               ("apply_rotary_emb",)),
    "Qwen3-VL": (
        "transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextAttention", _PLAIN
    ),
    "Qwen3-VL-MoE": (
        "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextAttention", _PLAIN
    ),
}
"""Family -> (its modeling module, its attention class, the module globals that attention looks
up at call time): a model is supported when it holds attention modules of these classes;
:func:`patch` rebinds those of the names that the module defines."""

QK_NORM_MODELS: dict[str, tuple[str, float, str]] = {
    "Qwen3": ("Qwen3RMSNorm", 0.0, "head"),
    "Qwen3-MoE": ("Qwen3MoeRMSNorm", 0.0, "head"),
    "Gemma3": ("Gemma3RMSNorm", 1.0, "head"),
    "OLMo2": ("Olmo2RMSNorm", 0.0, "heads"),
    "GLM-4-MoE": ("Glm4MoeRMSNorm", 0.0, "head"),
    "Qwen3-VL": ("Qwen3VLTextRMSNorm", 0.0, "head"),
    "Qwen3-VL-MoE": ("Qwen3VLMoeTextRMSNorm", 0.0, "head"),
}
"""Family (of :data:`SUPPORTED_MODELS`) -> (the RMSNorm class of its attention's ``q_norm`` and
``k_norm``, the :class:`~rope_dispatch.HeadNorm` offset and scope that reproduce it): Gemma3
multiplies by ``1 + weight``; OLMo2 normalizes a token's heads together, before the head split
(weights of ``heads * head_dim``, and ``kv_heads * head_dim`` for k)."""

SUPPORTED_MODELS.update({
    family: (f"transformers.models.{folder}.modeling_{folder}", attention, names)
    for families, names in ((STANDARD_FAMILIES, _PLAIN), (MLA_FAMILIES, _INTERLEAVE))
    for family, (folder, attention) in families.items()
})
SUPPORTED_MODELS.update({
    family: (f"transformers.models.{folder}.modeling_{folder}", attention, _PLAIN)
    for family, (folder, attention, _) in PAIR_FAMILIES.items()
})

_STREAMS = 3
"""Position streams of multimodal RoPE: temporal, height, width."""
_HEADS_DIM = {0: 1, 1: 1, -3: 1, 2: 2, -2: 2}
"""``unsqueeze_dim`` -> where q's heads are: 1 for ``[b, heads, s, d]``, 2 for ``[b, s, heads, d]``;
0 is Pixtral's ``[b, heads, s, d]`` with a ``[s, d2]`` cos shared by the batch."""

_PAIRINGS = ((False, False), (True, False), (False, True))
"""(deinterleave, interleaved): halves, DeepSeek's ``rope_interleave``, interleaved pairs."""
_specs: dict[tuple[torch.dtype, bool, bool], RoPESpec] = {
    (dtype, deinterleave, interleaved): RoPESpec(
        layout="bshd", dtype=dtype, deinterleave=deinterleave, interleaved=interleaved)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for deinterleave, interleaved in _PAIRINGS
}
"""The bshd spec of each dtype a model runs in, for each pairing (:data:`_PAIRINGS`), made at
import: pydantic's validation cannot be traced, so a first call inside
``torch.compile(fullgraph=True)`` must find its spec made."""
_last_pairs: list = [None]
"""The latest ``(cos, sin, their versions, (cos, sin) of pairs)`` of :func:`_pairs_of_halves`."""
_last_table: list = [None]
"""The latest ``(table, cos, sin, grad mode)`` of :func:`_token_table`: one tuple, read and
replaced whole, so a thread never pairs one call's table with another's tensors."""
_last_streams: list = [None]
"""The latest ``(cos, sin, key, (cos_out, sin_out))`` of :func:`_select_streams`: one tuple,
read and replaced whole (as :data:`_last_table`)."""
_originals: dict[tuple[str, str], object] = {}
"""(modeling module name, global name) -> the object that name held before :func:`patch`."""
_holders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each model passed to :func:`patch` and not yet to :func:`unpatch` -> the (modeling module
name, global name) pairs it was patched for: :func:`unpatch` of one model restores a name only
once no other such model holds it."""


_MARK = "_rope_dispatch_patched"  # patch's mark (a _Patched) on the model and its attentions


class _Patched:
    """Set on a model passed to :func:`patch` and on its attentions, so that a ``copy.deepcopy``
    of it or of a part (an EMA copy, a layer) is held as the model is: the family's names stay
    ours until the copy too is unpatched (a part copied in its model's copy: that copy holds
    it). Pickled (``torch.save``) it loads as a mark of no model: a loaded model is not held."""

    __slots__ = ("model", "root")

    def __init__(self, model: torch.nn.Module | None = None, root: torch.nn.Module | None = None):
        self.model, self.root = (None if x is None else weakref.ref(x) for x in (model, root))

    def __deepcopy__(self, memo: dict) -> _Patched:
        model = None if self.model is None else self.model()
        root = model if self.root is None else self.root()
        held = None if root is None else _holders.get(root)
        twin = None if held is None else memo.get(id(model))  # made before its state is copied
        if not isinstance(twin, torch.nn.Module):
            return _Patched()
        if root is not model and isinstance(memo.get(id(root)), torch.nn.Module):
            return _Patched(twin, memo[id(root)])  # a part of its model's copy
        _holders[twin] = held
        return _Patched(twin)

    def __reduce__(self) -> tuple:
        return _Patched, ()


class _Window(threading.local):
    """Per thread: the fused attention whose forward runs (``None`` outside one) and what its
    q_norm and k_norm handed on to :func:`apply_rotary_pos_emb`, ``[q's, k's]``, each ``None``
    or ``(input, HeadNorm, input's version or None)``. Per thread, so models run in several
    threads keep theirs apart."""

    def __init__(self):
        self.attention: torch.nn.Module | None = None
        self.handed: list = [None, None]


_window = _Window()

Model = TypeVar("Model", bound=torch.nn.Module)


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb``, in one rope-dispatch launch for q and k.

    q and k are ``[b, heads, s, d]`` (``unsqueeze_dim=1``) or ``[b, s, heads, d]``
    (``unsqueeze_dim=2``), any strides and head counts; ``cos`` and ``sin`` are the model's
    per-token ``[b, s, d2]`` (or ``[1, s, d2]``, shared by the batch), as its rotary embedding
    returns them (attention factor included). Returns ``(q_embed, k_embed)`` with q's and k's
    shapes and dtype: views of new tensors contiguous in ``[b, s, heads, d]``. The math is
    float32, rounded once. Gradients flow to q and k, and to cos and sin where they require
    grad (most models make them without). With ``d2 < d`` the first ``d2`` channels are
    rotated and the rest passed through, where transformers' function would fail to broadcast
    (``d2 = 0``: all of them, as in transformers).

    Inside the forward of an attention whose norms :func:`patch` fused, q and k arrive as the
    norms' inputs and are normalized in the same call (the whole head, then the rotation).
    """
    return _rotate_qk(q, k, cos, sin, unsqueeze_dim, False)


def apply_rotary_pos_emb_with_position_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: object = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_pos_emb` with the signature of the modeling modules whose own takes
    ``position_ids`` fifth (GlmAsr, Nemotron 3 speech; transformers 4.x): unused, as in
    theirs (cos and sin are already per token). :func:`patch` rebinds those modules' name to
    it, so a caller passing ``position_ids`` by position keeps working."""
    return _rotate_qk(q, k, cos, sin, unsqueeze_dim, False)


def apply_rotary_pos_emb_interleave(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: object = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb_interleave`` (DeepSeek-V3 with ``rope_interleave``),
    in one rope-dispatch launch for q and k: each head's ``d2`` channels are interleaved pairs
    ``(2j, 2j+1)``, and pair ``j`` comes out at channels ``j`` and ``j + d2/2``, rotated by
    angle ``j`` (``RoPESpec(deinterleave=True)``, the halves table transformers passes). q and
    k may have different head counts (one shared key head against every query head) and any
    strides; arguments, outputs and rounding as :func:`apply_rotary_pos_emb`. ``position_ids``
    is unused, as in transformers (cos and sin are already per token)."""
    return _rotate_qk(q, k, cos, sin, unsqueeze_dim, True)


def apply_rotary_pos_emb_pairs(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` of the families that rotate interleaved pairs
    ``(2j, 2j+1)`` with each pair's angle repeated in ``cos`` and ``sin`` (Cohere, Cohere 2:
    :data:`.hf_families.PAIR_FAMILIES`), in one launch: ``RoPESpec(interleaved=True)`` on the
    per-channel values as given. Arguments, outputs and rounding as
    :func:`apply_rotary_pos_emb`."""
    return _rotate_qk(q, k, cos, sin, unsqueeze_dim, False, interleaved=True)


def apply_rotary_pos_emb_pairs_of_halves(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` of the families that rotate interleaved pairs
    ``(2j, 2j+1)`` by the standard rotary embedding's halves ``cos`` and ``sin`` (GLM, GLM-4,
    Helium, ERNIE 4.5: :data:`.hf_families.PAIR_FAMILIES`): pair ``j`` turns by the angle of
    the first half's entry ``j``, on the first ``cos.shape[-1]`` channels, the rest passed
    through (GLM's partial rotary). One launch; arguments, outputs and rounding as
    :func:`apply_rotary_pos_emb` (GLM, GLM-4 and Helium compute in q's dtype, rounding at each
    step; this rounds once)."""
    return _rotate_qk(q, k, cos, sin, unsqueeze_dim, False, interleaved=True, of_halves=True)


def _pairs_of_halves(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Halves ``cos`` and ``sin`` ``[.., d2]`` as one value per channel of interleaved pairs
    (entry ``j`` of the first half at channels ``2j`` and ``2j+1``). A model passes the same
    two to every layer of a forward, so the latest pair's values are kept (never while tracing,
    nor for tensors that require grad, whose graph is the forward's, nor for inference-mode
    tensors, which keep no version counter, nor under a dispatch mode: :func:`_unkept`) and
    given again while neither tensor changed."""
    cacheable = not (_unkept() or cos.is_inference() or sin.is_inference())
    versions = (cos._version, sin._version) if cacheable else None
    last = _last_pairs[0]
    if last is not None and last[0] is cos and last[1] is sin and last[2] == versions:
        return last[3]
    half = cos.shape[-1] // 2
    pairs = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
    if versions is not None and not (cos.requires_grad or sin.requires_grad):
        _last_pairs[0] = (cos, sin, versions, pairs)
    return pairs


def _rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int, deinterleave: bool, interleaved: bool = False,
               of_halves: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_pos_emb`'s mapping onto :func:`rope_dispatch.apply_qk`; ``of_halves``:
    cos and sin come in halves and are read as interleaved pairs (:func:`_pairs_of_halves`)."""
    try:  # an integer: a float or bool, which transformers' unsqueeze refuses, hashes as one
        heads_dim = _HEADS_DIM.get(operator.index(unsqueeze_dim))
    except TypeError:
        heads_dim = None
    if heads_dim is None or isinstance(unsqueeze_dim, bool):
        raise RoPEError(
            f"unsqueeze_dim must be 1 (q, k [b, heads, s, d]), 2 ([b, s, heads, d]) or 0 ([b, "
            f"heads, s, d] with cos [s, d2]), got {unsqueeze_dim!r}"
        )
    if q.dim() != 4 or k.dim() != 4:
        raise RoPEError(
            f"q and k must be 4-D, {'[b, s, heads, d]' if heads_dim == 2 else '[b, heads, s, d]'} "
            f"for unsqueeze_dim={unsqueeze_dim}; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if (unsqueeze_dim == 0) != (cos.dim() == 2) or unsqueeze_dim == 0 and cos.shape[0] != q.shape[2]:
        raise RoPEError(
            f"cos must be [batch, seq, rotary_dim], or [seq, rotary_dim] with unsqueeze_dim=0 "
            f"(Pixtral's call, shared by the batch), seq being q's sequence length; got cos "
            f"{tuple(cos.shape)}, q {tuple(q.shape)}, unsqueeze_dim={unsqueeze_dim}"
        )
    if sin.shape != cos.shape:
        raise RoPEError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if of_halves:
        cos, sin = _pairs_of_halves(cos, sin)
    if q.dtype not in SUPPORTED_DTYPES:
        raise unsupported_dtype("q", q.dtype)
    q_norm, k_norm = _take_norms(q, k) if _window.attention is not None else (None, None)
    if heads_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    starts = None if unsqueeze_dim == 0 else _sequence_starts(cos, q)
    if cos.numel() == 0:  # no token, or no rotary channel (partial_rotary_factor < 2 / d)
        q_out, k_out = (x.clone() if norm is None else normalized(x, norm).to(x.dtype)
                        for x, norm in ((q, q_norm), (k, k_norm)))
    else:
        q_out, k_out = apply_qk(
            q, k, _token_table(cos, sin), _spec(q.dtype, deinterleave, interleaved),
            start_positions=starts, q_norm=q_norm, k_norm=k_norm,
        )
    if heads_dim == 1:
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


def apply_multimodal_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL, Qwen2.5-VL), in one
    rope-dispatch launch for q and k.

    ``cos`` and ``sin`` are ``[3, b, s, d2]`` (or ``[3, 1, s, d2]``): the temporal, height and
    width streams of the multimodal rotary embedding. ``mrope_section`` is three channel counts
    ``(t, h, w)`` with ``t + h + w = d2 / 2``: in each half of the rotary channels the first
    ``t`` take the temporal stream, the next ``h`` the height stream and the last ``w`` the
    width stream (transformers repeats the list for the second half). That pick is made on the
    small cos/sin tensors (one ``[b, s, d2]`` copy each); q and k then go through
    :func:`apply_rotary_pos_emb`, whose arguments, outputs, rounding and dtype rules apply.
    transformers' function would also take other list lengths (section ``j`` of the doubled
    list reading stream ``j % 3``); every Qwen2-VL and Qwen2.5-VL config has three, and other
    lengths are refused here.
    """
    cos, sin = _select_streams(cos, sin, mrope_section, q.shape[0])
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _select_streams(
    cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int], batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``[b, s, d2]`` cos and sin of ``[3, b, s, d2]`` ones: each channel from the
    stream its section names.

    A model hands the same cos and sin to every layer, so the latest result is handed out again
    for the same objects with unchanged values (their version counters), and the layers after
    the first reuse its table and plan (:func:`_token_table`). Not kept while torch.compile
    traces or a torch.func transform runs, nor for inference-mode tensors, which have no
    version counter. Kept per grad mode, as :func:`_token_table` is (a reentrant checkpoint's
    forward picks without grad, its recomputation needs the pick's gradient)."""
    sections = _check_streams(cos, sin, mrope_section, batch)
    cacheable = not (_unkept() or cos.is_inference() or sin.is_inference())
    if cacheable:
        key = (sections, cos._version, sin._version, torch.is_grad_enabled())
        last = _last_streams[0]
        if last is not None and last[0] is cos and last[1] is sin and last[2] == key:
            return last[3]
    runs, start = [], 0
    for j, size in enumerate(sections * 2):  # both halves: temporal, height, width
        runs.append((j % _STREAMS, start, start + size))
        start += size
    selected = tuple(
        torch.cat([t[stream, ..., begin:end] for stream, begin, end in runs], dim=-1)
        for t in (cos, sin)
    )
    if cacheable:
        _last_streams[0] = (cos, sin, key, selected)
    return selected


def _check_streams(
    cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int], batch: int
) -> tuple[int, ...]:
    """``mrope_section`` as a tuple, after checking it and the cos/sin shapes against each
    other; :class:`~rope_dispatch.RoPEError` naming the argument otherwise."""
    if cos.dim() != 4 or cos.shape[0] != _STREAMS or cos.shape[1] not in (1, batch):
        raise RoPEError(
            f"cos must be [3, batch, seq, rotary_dim] (temporal, height and width streams) with "
            f"batch 1 or q's batch {batch}, got {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape:
        raise RoPEError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    try:
        if any(isinstance(size, bool) for size in mrope_section):  # torch.split refuses them
            raise TypeError
        sections = tuple(operator.index(size) for size in mrope_section)
    except TypeError:
        sections = ()
    half = cos.shape[-1] / 2
    if len(sections) != _STREAMS or min(sections) < 0 or sum(sections) != half:
        total = f" (sum {sum(sections)})" if len(sections) == _STREAMS else ""
        raise RoPEError(
            f"mrope_section must be 3 non-negative integers (temporal, height, width channels) "
            f"summing to {half:g}, half of cos's last dim {cos.shape[-1]}; got "
            f"{mrope_section!r}{total}"
        )
    return sections


def _token_table(cos: torch.Tensor, sin: torch.Tensor) -> CosSinCache:
    """``cos`` and ``sin`` ``[b, s, d2]`` as a table of ``b * s`` rows, one per token, in the
    model's dtype (no copy of the usual contiguous values; the kernels widen them).

    A model passes the same ``cos`` and ``sin`` to every layer of a forward, so the table for
    them is kept and handed out again: rope-dispatch then reuses the first layer's checks and
    decision (its plan, kept per table object) for the other layers. Only the latest pair is
    kept, so a finished forward's values are released by the next one. Only contiguous values
    are kept (the table is then a view: values rewritten in place are seen), never while
    torch.compile traces or a torch.func transform runs. It is kept per grad mode: views made
    without it (a reentrant checkpoint's forward) carry no gradient back to cos and sin when
    the recomputation, with grad, reads them."""
    d2 = cos.shape[-1]
    if _unkept() or not (cos.is_contiguous() and sin.is_contiguous()):
        return CosSinCache(cos.reshape(-1, d2).contiguous(), sin.reshape(-1, d2).contiguous())
    last, grad = _last_table[0], torch.is_grad_enabled()
    if last is not None and last[1] is cos and last[2] is sin and last[3] is grad:
        return last[0]
    table = CosSinCache(cos.view(-1, d2), sin.view(-1, d2))
    _last_table[0] = (table, cos, sin, grad)  # built, then published in one store
    return table


def _spec(dtype: torch.dtype, deinterleave: bool = False, interleaved: bool = False) -> RoPESpec:
    """The bshd spec of a dtype and pairing, from :data:`_specs` (pydantic validation costs
    microseconds, and a model calls this once per layer; other dtypes get the spec's error)."""
    spec = _specs.get((dtype, deinterleave, interleaved))
    if spec is None:
        spec = _specs[dtype, deinterleave, interleaved] = RoPESpec(
            layout="bshd", dtype=dtype, deinterleave=deinterleave, interleaved=interleaved)
    return spec


def _take_norms(q: torch.Tensor, k: torch.Tensor) -> tuple[HeadNorm | None, HeadNorm | None]:
    """The norms an attention's q_norm and k_norm handed on for this call (``None`` where
    none did), taken out of :data:`_window`; a :class:`~rope_dispatch.RoPEError` when q or k
    is not the tensor its norm got (the norm would otherwise be lost), or was written in place
    since (a forward hook editing the norm's "output", which is its input: the edit would be
    normalized away). Checked by memory and version counter (the models reshape and transpose
    the norm's input, never copy or write it); not while torch.compile traces or a
    ``torch.func`` transform runs, whose tensors have no memory of their own, nor the version of
    an inference-mode tensor, which has none."""
    handed, _window.handed = _window.handed, [None, None]
    norms = []
    for name, t, entry in (("q", q, handed[0]), ("k", k, handed[1])):
        if entry is None:
            norms.append(None)
            continue
        x, norm, version = entry
        if not memoryless() and (
            x.data_ptr() != t.data_ptr() or x.numel() != t.numel()
        ):
            raise RoPEError(
                f"{name} is not the tensor that {type(_window.attention).__name__}.{name}_norm "
                f"handed on ({tuple(x.shape)} at {x.data_ptr():#x}, got {tuple(t.shape)} at "
                f"{t.data_ptr():#x}): this attention's forward is not the one rope-dispatch "
                "knows; hf.unpatch the model"
            )
        if version is not None and t._version != version:
            raise RoPEError(
                f"{name} was written in place after {type(_window.attention).__name__}."
                f"{name}_norm handed it on (a forward hook editing the norm's output in place?): "
                "the norm runs in the RoPE call, so the edit would reach its input, not its "
                "output (a hook returning an edited copy is refused too); hf.unpatch the model "
                "to run such a hook"
            )
        norms.append(norm)
    return norms[0], norms[1]


def _fused_forward(attention: torch.nn.Module, module_name: str, previous: Callable | None,
                   *args, **kwargs):
    """An attention's forward with its q_norm and k_norm deferred to the RoPE call.

    ``previous``: the instance's own forward before :func:`patch` (an offload hook's, say),
    ``None`` for its class's. The norms defer only while our :func:`apply_rotary_pos_emb` is
    the modeling module's (else nothing would apply them: another model's :func:`unpatch`, or
    another library's rebinding); a norm handed on and never taken raises."""
    run = previous or functools.partial(type(attention).forward, attention)
    current = getattr(sys.modules[module_name], "apply_rotary_pos_emb", None)
    if _traced_with_grad() or getattr(current, "__module__", None) != __name__:
        return run(*args, **kwargs)  # (ours: each of this module's forms takes the norms)
    outer = _window.attention, _window.handed
    _window.attention, _window.handed = attention, [None, None]
    try:
        result = run(*args, **kwargs)
        left = [name for name, entry in zip(("q_norm", "k_norm"), _window.handed) if entry]
        if left:
            raise RoPEError(
                f"{type(attention).__name__}.{' and '.join(left)} handed its input on but no RoPE "
                "call took it: this attention's forward is not the one rope-dispatch knows; "
                "hf.unpatch the model"
            )
    finally:
        _window.attention, _window.handed = outer
    return result


def _deferred_norm(norm: torch.nn.Module, slot: int, offset: float, scope: str,
                   previous: Callable | None, x: torch.Tensor) -> torch.Tensor:
    """A q_norm's (``slot`` 0) or k_norm's (1) forward: inside the fused forward of the attention
    holding it, ``x`` unchanged, its :class:`~rope_dispatch.HeadNorm` kept for the RoPE call;
    elsewhere its earlier forward (``previous``, Liger's) or its class's. The attention is found
    by what it holds, so a replica's norm (:func:`_replicate`) serves the replica's attention."""
    if (getattr(_window.attention, ("q_norm", "k_norm")[slot], None) is not norm
            or _window.handed[slot] is not None):
        return type(norm).forward(norm, x) if previous is None else previous(x)
    _window.handed[slot] = (
        x, HeadNorm(norm.weight, _norm_eps(norm), offset=offset, scope=scope), _version(x)
    )
    return x


def _norm_eps(norm: torch.nn.Module) -> object:
    """An RMSNorm's ``variance_epsilon`` (Qwen3, OLMo2, GLM) or ``eps`` (Gemma3), else None."""
    eps = getattr(norm, "variance_epsilon", None)
    return getattr(norm, "eps", None) if eps is None else eps


def _fusable(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, tuple, str]]:
    """(attention, its modeling module's name, q_norm's and k_norm's HeadNorm offsets, the
    scope) for each attention of ``model`` of a :data:`QK_NORM_MODELS` family whose norms both
    run a forward we fuse (:func:`_norm_offset`); a :class:`~rope_dispatch.RoPEError` naming a
    norm without a 1-D weight or a positive epsilon."""
    families = {}
    for family, (norm_class, offset, scope) in QK_NORM_MODELS.items():
        module_name, attention_class, _ = SUPPORTED_MODELS[family]
        module = sys.modules.get(module_name)
        if hasattr(module, attention_class):  # (its norm class by name: Liger rebinds it)
            families[getattr(module, attention_class)] = (module_name, norm_class, offset, scope)
    found = []
    for name, child in model.named_modules():
        if type(child) not in families:
            continue
        module_name, _, _, scope = family = families[type(child)]
        norms = {part: getattr(child, part, None) for part in ("q_norm", "k_norm")}
        offsets = tuple(_norm_offset(norm, family) for norm in norms.values())
        if None in offsets:
            continue
        for part, norm in norms.items():
            weight, eps = getattr(norm, "weight", None), _norm_eps(norm)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
                raise RoPEError(f"{name}.{part}.weight must be a 1-D tensor to fuse the norm, got "
                                f"{getattr(weight, 'shape', type(weight).__name__)}")
            if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
                raise RoPEError(f"{name}.{part} must have a positive variance_epsilon or eps to "
                                f"fuse the norm, got {eps!r}")
        found.append((child, module_name, offsets, scope))
    return found


def _norm_offset(norm: object, family: tuple) -> float | None:
    """The HeadNorm offset of a q_norm or k_norm we fuse (``None``: left as it is): the family's
    for its RMSNorm (``family``: modeling module, norm class name, offset, scope), its own
    ``offset`` for one with a weight running ``LigerRMSNorm.forward`` (its class's, or bound on
    it by Liger-Kernel's patch)."""
    if not isinstance(norm, torch.nn.Module):  # (GLM without use_qk_norm has none)
        return None
    own = _own_forward(norm)
    liger = getattr(sys.modules.get("liger_kernel.transformers.rms_norm"), "LigerRMSNorm", None)
    if liger is not None and (
        own is None and getattr(type(norm), "forward", None) is liger.forward
        or getattr(own, "__func__", None) is liger.forward and own.__self__ is norm
    ):
        shift, weight = getattr(norm, "offset", None), getattr(norm, "weight", None)
        return float(shift) if weight is not None and isinstance(shift, (int, float)) else None
    kind = type(norm)
    return family[2] if (kind.__module__, kind.__qualname__) == family[:2] and own is None else None


def _is_ours(forward: object) -> bool:
    """Whether an instance ``forward`` is one :func:`_fuse` set."""
    return isinstance(forward, functools.partial) and forward.func in (
        _fused_forward, _deferred_norm, *hf_llama4.FORWARDS
    )


def _fuse(attention: torch.nn.Module, module_name: str, offsets: tuple, scope: str) -> None:
    """Give ``attention`` and its two norms our forwards, where not ours yet (a norm that
    Liger's patch rebound after ours gets ours again, around Liger's)."""
    for slot, norm in ((0, attention.q_norm), (1, attention.k_norm)):
        if not _is_ours(_own_forward(norm)):
            _set_forward(norm, functools.partial(_deferred_norm, norm, slot, offsets[slot], scope,
                                                 _own_forward(norm)))
    if not _is_ours(_own_forward(attention)):
        _set_forward(attention, functools.partial(_fused_forward, attention, module_name,
                                                 _own_forward(attention)))


def _set_forward(module: torch.nn.Module, forward: functools.partial) -> None:
    """Give ``module`` our instance ``forward`` (a partial whose first argument is ``module``)
    and a ``_replicate_for_data_parallel`` that gives each replica a forward of its own:
    ``nn.DataParallel`` (which the Trainer uses on several GPUs of one process) makes its
    replicas from a copy of the module's ``__dict__``, whose forward would run the original's
    weights (on another device)."""
    module.forward = forward
    module._replicate_for_data_parallel = functools.partial(_replicate, module)


def _replicate(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s data-parallel replica, its forward (while ours) bound to the replica."""
    replica = type(module)._replicate_for_data_parallel(module)
    forward = _own_forward(replica)
    if _is_ours(forward):  # (an earlier forward bound to the module, Liger's, rebound too)
        _set_forward(replica, functools.partial(forward.func, replica, *(
            a.__func__.__get__(replica) if getattr(a, "__self__", None) is module else a
            for a in forward.args[1:])))
    else:
        replica._replicate_for_data_parallel = functools.partial(_replicate, replica)
    return replica


def _unfuse(model: torch.nn.Module) -> None:
    """Give every module of ``model`` whose ``forward`` attribute is ours the one it had (an
    attention's earlier instance forward, else none: its class's again)."""
    for module in model.modules():
        if getattr(vars(module).get("_replicate_for_data_parallel"), "func", None) is _replicate:
            del module._replicate_for_data_parallel  # (also where a later patch took forward)
        forward = _own_forward(module)
        if not _is_ours(forward):
            continue
        previous = (forward.args[2] if forward.func in (_fused_forward, hf_llama4.FORWARDS[0])
                    else forward.args[4] if forward.func is _deferred_norm else None)
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def patch(model: Model) -> Model:
    """Route the RoPE of ``model`` (the attention of any family in :data:`SUPPORTED_MODELS`)
    through this module's functions; returns ``model``.

    Rebinds, in the modeling module of each supported family found in ``model``, each of the
    family's names that the module defines to our function of that name, so every model of
    those families in the process is served. In ``model`` itself, the attentions of the
    :data:`QK_NORM_MODELS` families also get their q_norm and k_norm fused into that call (an
    instance ``forward`` on the attention and on each norm). Patching again is harmless. Raises
    :class:`~rope_dispatch.RoPEError` for a model holding none of these families, for a
    family whose modeling module defines none of its names (another transformers version), or
    for a q_norm or k_norm without a 1-D weight or a positive epsilon; nothing is rebound then.
    """
    targets = _targets(model)
    fusable = _fusable(model)
    l2_fusable = hf_llama4.l2_fusable(model)
    for (module_name, name), ours in targets.items():
        module = sys.modules[module_name]
        current = getattr(module, name)
        if current is not ours:
            _originals[module_name, name] = current
            setattr(module, name, ours)
    for attention, module_name, offsets, scope in fusable:
        _fuse(attention, module_name, offsets, scope)
    for attention, eps in l2_fusable:
        hf_llama4.fuse(attention, eps, _set_forward)
    _holders[model] = _holders.get(model, frozenset()) | frozenset(targets)
    vars(model)[_MARK] = _Patched(model)
    kinds = {module_name for module_name, _ in targets}
    attentions = tuple(getattr(sys.modules[m], a) for m, a, _ in SUPPORTED_MODELS.values()
                       if m in kinds and hasattr(sys.modules[m], a))
    for part in model.modules():
        if part is not model and isinstance(part, attentions):
            vars(part)[_MARK] = _Patched(part, model)
    return model


def unpatch(model: torch.nn.Module) -> None:
    """Undo :func:`patch` for the families in ``model``: each rebound name of their modeling
    modules gets back the exact object it held before, once no other model passed to
    :func:`patch` (alive, not unpatched since, neither a part of ``model`` nor holding it)
    holds that family: until then the name stays ours, so those models stay patched. Each of
    ``model``'s attentions and norms gets back its own ``forward`` (none, or the instance's
    earlier one). A name or forward that was not patched, or that another library has rebound
    since, is left as it is."""
    targets = _targets(model)
    parts = {id(part) for part in model.modules()}
    for holder in list(_holders):  # the model itself, a part of it, or a model holding it
        if id(holder) in parts or any(part is model for part in holder.modules()):
            del _holders[holder]
            vars(holder).pop(_MARK, None)
    for part in model.modules():
        vars(part).pop(_MARK, None)
    if any(not held.isdisjoint(targets) for held in _holders.values()):
        gc.collect()  # a model dropped while patched may wait in a reference cycle
    held = set().union(*_holders.values())
    for (module_name, name), ours in targets.items():
        if (module_name, name) in held:
            continue
        original = _originals.pop((module_name, name), None)
        module = sys.modules[module_name]
        if original is not None and getattr(module, name) is ours:
            setattr(module, name, original)
    _unfuse(model)
    _forget()


def _forget() -> None:
    """Drop what the latest calls kept for the next (cos/sin tables, picks, pairs), which only
    a next call would release: the model's tensors, on its device, outlive it otherwise."""
    _last_table[0] = None
    _last_streams[0] = None
    _last_pairs[0] = None
    hf_llama4._last_table[0] = None


def _targets(model: object) -> dict[tuple[str, str], Callable]:
    """(modeling module, global name) -> our replacement, for the supported families whose
    attention classes ``model`` holds; a clear error when there are none."""
    classes = {
        getattr(sys.modules[module_name], attention): (family, module_name, names)
        for family, (module_name, attention, names) in SUPPORTED_MODELS.items()
        if module_name in sys.modules and hasattr(sys.modules[module_name], attention)
    }
    found = set()
    if isinstance(model, torch.nn.Module) and classes:
        for child in model.modules():
            for cls, entry in classes.items():
                if isinstance(child, cls):
                    found.add(entry)
    if not found:
        raise RoPEError(
            f"{type(model).__name__} holds no attention module that rope-dispatch can patch: "
            f"it patches {len(SUPPORTED_MODELS)} families ({', '.join(list(SUPPORTED_MODELS)[:6])}"
            ", ...; each with its attention class in hf.SUPPORTED_MODELS, listed in docs/hf.md)"
        )
    targets = {}
    for family, module_name, names in sorted(found):
        present = [name for name in names if hasattr(sys.modules[module_name], name)]
        if not present:
            raise RoPEError(
                f"{module_name} defines none of {', '.join(names)}, which {family} attention "
                f"called in the transformers versions rope-dispatch knows; cannot patch it"
            )
        module = sys.modules[module_name]
        targets.update({(module_name, name): _replacement(name, getattr(module, name))
                        for name in present})
    return targets


def _replacement(name: str, current: Callable) -> Callable:
    """Our function for global ``name`` of a modeling module, whose object is ``current`` (the
    module's own, or ours once patched): the one whose signature matches, or the pairing of the
    module's family (:data:`.hf_families.PAIR_FAMILIES`)."""
    if name == "apply_rotary_pos_emb":
        if current in _PAIR_FUNCTIONS.values():
            return current
        paired = _PAIR_FUNCTIONS.get(getattr(current, "__module__", None))
        if paired is not None:
            return paired
        try:
            parameters = list(inspect.signature(current).parameters)
        except (TypeError, ValueError):  # no signature to read: the module's 5.x form
            parameters = []
        if parameters[4:5] == ["position_ids"]:
            return apply_rotary_pos_emb_with_position_ids
    return _REPLACEMENTS[name]


_REPLACEMENTS: dict[str, Callable] = {
    "apply_rotary_pos_emb": apply_rotary_pos_emb,
    "apply_multimodal_rotary_pos_emb": apply_multimodal_rotary_pos_emb,
    "apply_rotary_pos_emb_interleave": apply_rotary_pos_emb_interleave,
    "apply_rotary_emb": hf_llama4.apply_rotary_emb,
}
"""Each global name :func:`patch` rebinds -> our function of that name."""
_PAIR_FUNCTIONS: dict[str, Callable] = {
    f"transformers.models.{folder}.modeling_{folder}": (
        apply_rotary_pos_emb_pairs_of_halves if halves else apply_rotary_pos_emb_pairs)
    for folder, _, halves in PAIR_FAMILIES.values()
}
"""The modeling module of each family of :data:`.hf_families.PAIR_FAMILIES` -> our function
for its ``apply_rotary_pos_emb``."""

"""Hugging Face transformers models on rope-dispatch: their RoPE call, mapped onto ours.

One line moves a Llama, Mistral, Qwen2, Qwen3 or Gemma model over (docs/hf.md)::

    rope_dispatch.integrations.hf.patch(model)

The attention modules of these families call their modeling module's global
``apply_rotary_pos_emb`` by name at every forward, so :func:`patch` rebinds that one name to
:func:`apply_rotary_pos_emb` here, as Liger-Kernel does, and :func:`unpatch` binds the original
object back. The rebinding is per modeling module: it reaches every model of the family in the
process, not only the one passed.

An adapter: it maps arguments and checks only what the mapping needs. q and k go to
:func:`rope_dispatch.apply_qk` as bshd views (no copy), the per-token ``cos``/``sin`` as a
:class:`~rope_dispatch.CosSinCache` with one row per token. This module reads transformers'
modules from ``sys.modules`` and never imports transformers itself.
"""

from __future__ import annotations

import sys
from typing import TypeVar

import torch

from ..dispatch import apply_qk
from ..errors import RoPEError
from ..spec import RoPESpec
from ..tables import CosSinCache

__all__ = ["SUPPORTED_MODELS", "apply_rotary_pos_emb", "patch", "unpatch"]

SUPPORTED_MODELS: dict[str, tuple[str, str]] = {
    "Llama": ("transformers.models.llama.modeling_llama", "LlamaAttention"),
    "Mistral": ("transformers.models.mistral.modeling_mistral", "MistralAttention"),
    "Qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),
    "Qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),
    "Gemma": ("transformers.models.gemma.modeling_gemma", "GemmaAttention"),
}
"""Family -> (its modeling module, its attention class): a model is supported when it holds
attention modules of these classes, whose forward looks up the module's
``apply_rotary_pos_emb`` at call time (transformers 5.x)."""

_ROPE_NAME = "apply_rotary_pos_emb"
_HEADS_DIM = {1: 1, -3: 1, 2: 2, -2: 2}
"""``unsqueeze_dim`` -> where q's heads are: 1 for ``[b, heads, s, d]``, 2 for ``[b, s, heads, d]``."""

_specs: dict[torch.dtype, RoPESpec] = {}
_last_table: list = [None, None, None]
"""The latest ``[table, cos, sin]`` of :func:`_token_table`."""
_token_rows: dict[tuple, torch.Tensor] = {}
_MAX_TOKEN_ROWS = 64
_originals: dict[str, object] = {}
"""Modeling module name -> the object its ``apply_rotary_pos_emb`` held before :func:`patch`."""

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
    float32, rounded once. Gradients flow to q and k (the models compute cos and sin without
    gradients). With ``d2 < d`` the first ``d2`` channels are rotated and the rest passed
    through, where transformers' function would fail to broadcast.
    """
    heads_dim = _HEADS_DIM.get(unsqueeze_dim)
    if heads_dim is None:
        raise RoPEError(
            f"unsqueeze_dim must be 1 (q, k [b, heads, s, d]) or 2 ([b, s, heads, d]), got "
            f"{unsqueeze_dim!r}"
        )
    if heads_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q_out, k_out = apply_qk(
        q, k, _token_table(cos, sin), _spec(q.dtype), positions=_token_positions(cos, q)
    )
    if heads_dim == 1:
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


def _token_table(cos: torch.Tensor, sin: torch.Tensor) -> CosSinCache:
    """``cos`` and ``sin`` ``[b, s, d2]`` as a table of ``b * s`` rows, one per token, in the
    model's dtype (no copy of the usual contiguous values; the kernels widen them).

    A model passes the same ``cos`` and ``sin`` to every layer of a forward, so the table for
    them is kept and handed out again: rope-dispatch then reuses the first layer's checks and
    decision (its plan, kept per table object) for the other layers. Only the latest pair is
    kept, so a finished forward's values are released by the next one. Only contiguous values
    are kept (the table is then a view: values rewritten in place are seen), never while
    torch.compile traces."""
    d2 = cos.shape[-1]
    if torch.compiler.is_compiling() or not (cos.is_contiguous() and sin.is_contiguous()):
        return CosSinCache(cos.reshape(-1, d2).contiguous(), sin.reshape(-1, d2).contiguous())
    table = _last_table[0]
    if table is not None and _last_table[1] is cos and _last_table[2] is sin:
        return table
    table = CosSinCache(cos.view(-1, d2), sin.view(-1, d2))
    _last_table[:] = [table, cos, sin]
    return table


def _token_positions(cos: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """Each token's row in :func:`_token_table`: none needed for ``cos`` ``[1, s, d2]`` (the
    row is the token's place in its sequence), else ``[b, s]`` indices ``i * s + j``, cached
    per shape and device."""
    if cos.dim() != 3 or cos.shape[0] not in (1, q.shape[0]):
        raise RoPEError(
            f"cos must be [batch, seq, rotary_dim] with batch 1 or q's batch {q.shape[0]}, got "
            f"{tuple(cos.shape)}"
        )
    if cos.shape[0] == 1:
        return None
    batch, seq_len, rows_per_sequence = q.shape[0], q.shape[1], cos.shape[1]
    if torch.compiler.is_compiling():
        return _token_index(batch, seq_len, rows_per_sequence, q.device)
    key = (batch, seq_len, rows_per_sequence, q.device)
    index = _token_rows.get(key)
    if index is None:
        if len(_token_rows) >= _MAX_TOKEN_ROWS:
            _token_rows.clear()
        with torch.inference_mode(False):
            index = _token_rows[key] = _token_index(batch, seq_len, rows_per_sequence, q.device)
    return index


def _token_index(
    batch: int, seq_len: int, rows_per_sequence: int, device: torch.device
) -> torch.Tensor:
    """``[batch, seq_len]`` int64: token ``(i, j)`` reads row ``i * rows_per_sequence + j``."""
    starts = torch.arange(batch, device=device).mul_(rows_per_sequence)
    return (starts[:, None] + torch.arange(seq_len, device=device)).contiguous()


def _spec(dtype: torch.dtype) -> RoPESpec:
    """The bshd spec of a dtype, from a small cache (pydantic validation costs microseconds,
    and a model calls this once per layer)."""
    spec = _specs.get(dtype)
    if spec is None:
        spec = _specs[dtype] = RoPESpec(layout="bshd", dtype=dtype)
    return spec


def patch(model: Model) -> Model:
    """Route the RoPE of ``model`` (Llama, Mistral, Qwen2, Qwen3 or Gemma attention) through
    :func:`apply_rotary_pos_emb`; returns ``model``.

    Rebinds ``apply_rotary_pos_emb`` in the modeling module of each supported family found in
    ``model``, so every model of those families in the process is served. Patching again is
    harmless. Raises :class:`~rope_dispatch.RoPEError` for a model holding none of them.
    """
    for name in _modeling_modules(model):
        module = sys.modules[name]
        current = getattr(module, _ROPE_NAME)
        if current is not apply_rotary_pos_emb:
            _originals[name] = current
            setattr(module, _ROPE_NAME, apply_rotary_pos_emb)
    return model


def unpatch(model: torch.nn.Module) -> None:
    """Undo :func:`patch` for the families in ``model``: each modeling module gets back the
    exact object it held before. A module that was not patched, or whose name another library
    has rebound since, is left as it is."""
    for name in _modeling_modules(model):
        original = _originals.pop(name, None)
        module = sys.modules[name]
        if original is not None and getattr(module, _ROPE_NAME) is apply_rotary_pos_emb:
            setattr(module, _ROPE_NAME, original)


def _modeling_modules(model: object) -> list[str]:
    """The modeling modules of the supported attention classes in ``model``; a clear error
    when there are none."""
    classes = {
        getattr(sys.modules[name], attention): name
        for name, attention in SUPPORTED_MODELS.values()
        if name in sys.modules and hasattr(sys.modules[name], attention)
    }
    found = set()
    if isinstance(model, torch.nn.Module) and classes:
        for child in model.modules():
            for cls, name in classes.items():
                if isinstance(child, cls):
                    found.add(name)
    if not found:
        raise RoPEError(
            f"{type(model).__name__} holds no attention module that rope-dispatch can patch; "
            f"supported: {', '.join(SUPPORTED_MODELS)} models "
            f"({', '.join(a for _, a in SUPPORTED_MODELS.values())})"
        )
    return sorted(found)

"""Llama 4's text attention on rope-dispatch (part of :mod:`rope_dispatch.integrations.hf`).

Llama 4 differs from the other families in three ways, each mapped here:

- Its attention calls ``apply_rotary_emb(xq, xk, freqs_cis)`` of its modeling module: q and k
  ``[b, s, heads, d]``, ``freqs_cis`` the complex ``[b, s, d / 2]`` (or ``[1, s, d / 2]``) that
  its rotary embedding returns, and channels ``(2i, 2i + 1)`` rotated as one complex number:
  rope-dispatch's ``interleaved=True``. :func:`apply_rotary_emb` passes the real and imaginary
  parts on as a :class:`~rope_dispatch.PairCosSinCache` with one row per token.
- Layers whose ``no_rope_layers`` entry is 0 call no RoPE at all; they are left alone.
- With ``use_qk_norm`` the RoPE layers L2-normalize q and k *after* the rotation
  (``Llama4TextL2Norm``: ``x * rsqrt(mean(x**2) + eps)`` in float32, no weight). A rotation
  by unit complex numbers keeps each head's sum of squares, so normalizing before it gives the
  same values: :func:`fuse` passes that norm to the RoPE call as a
  :class:`~rope_dispatch.HeadNorm` of unit weight, and the attention's ``qk_norm`` hands the
  call's outputs on unchanged. That holds while the rotary embedding's attention factor is 1
  (it scales ``freqs_cis``, and the norm after the rotation removes the scale); a model whose
  factor is not 1 keeps its ``qk_norm``, unfused.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

import torch

from ..dispatch import apply_qk
from ..errors import RoPEError
from ..norm import HeadNorm
from ..spec import RoPESpec
from ..tables import PairCosSinCache
from .hf_shared import (
    _own_forward, _sequence_starts, _traced_with_grad, _unkept, _version, unsupported_dtype,
)

MODULE = "transformers.models.llama4.modeling_llama4"
ATTENTION, NORM, ROTARY = "Llama4TextAttention", "Llama4TextL2Norm", "Llama4TextRotaryEmbedding"

_specs: dict[torch.dtype, RoPESpec] = {
    dtype: RoPESpec(layout="bshd", dtype=dtype, interleaved=True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
}
"""The interleaved bshd spec of each model dtype, made at import (see ``hf._specs``)."""
_last_table: list = [None]
"""The latest ``(table, freqs_cis, (its version, the grad mode))`` of :func:`_pair_table`: one
tuple, read and replaced whole (``hf._token_table``'s)."""
_unit: dict[tuple, torch.Tensor] = {}
"""Unit norm weights by (head dim, device)."""


class _Window(threading.local):
    """Per thread: the fused Llama 4 attention whose forward runs (``None`` outside one), its
    L2 norm's epsilon, and the RoPE outputs already normalized that its ``qk_norm`` is still
    to hand on (each with its version, or ``None``)."""

    def __init__(self):
        self.attention: torch.nn.Module | None = None
        self.eps: float | None = None
        self.normalized: list = []


_window = _Window()


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's ``apply_rotary_emb``, in one rope-dispatch launch for q and k.

    ``xq`` and ``xk`` are ``[b, s, heads, d]`` (any strides and head counts); ``freqs_cis`` is the
    complex ``[b, s, d2 / 2]`` (or ``[1, s, d2 / 2]``) of the model's rotary embedding. Pairs
    ``(2i, 2i + 1)`` turn by ``freqs_cis[..., i]``; channels past ``d2`` are passed through. The
    math is float32 rounded once to the input dtype, as transformers' (which computes in float32
    and casts back). Inside an attention whose ``qk_norm`` :func:`fuse` fused, q and k
    are L2-normalized in the same call."""
    if not torch.is_complex(freqs_cis):
        raise RoPEError(
            f"freqs_cis must be the complex [batch, seq, rotary_dim / 2] tensor of Llama 4's "
            f"rotary embedding, got {freqs_cis.dtype} {tuple(freqs_cis.shape)}"
        )
    if xq.dim() != 4 or xk.dim() != 4:
        raise RoPEError(f"xq and xk must be 4-D, [b, s, heads, d]; got xq {tuple(xq.shape)}, "
                        f"xk {tuple(xk.shape)}")
    spec = _specs.get(xq.dtype)
    if spec is None:
        raise unsupported_dtype("xq", xq.dtype)
    norm = None
    if _window.attention is not None and _window.eps is not None:
        norm = HeadNorm(_unit_weight(xq.shape[-1], xq.device), _window.eps)
    q_out, k_out = apply_qk(
        xq, xk, _pair_table(freqs_cis), spec,
        start_positions=_sequence_starts(freqs_cis, xq, "freqs_cis", "rotary_dim / 2"),
        q_norm=norm, k_norm=norm,
    )
    if norm is not None:
        _window.normalized += [(t, _version(t)) for t in (q_out, k_out)]
    return q_out, k_out


def _pair_table(freqs_cis: torch.Tensor) -> PairCosSinCache:
    """``freqs_cis`` ``[b, s, d2 / 2]`` as a float32 pair cache of ``b * s`` rows (cosines, then
    sines). The model hands the same ``freqs_cis`` to every layer, so the latest table is handed
    out again while the tensor is the same object with unchanged values (not while
    torch.compile traces, nor for inference-mode tensors, which have no version counter), in
    the grad mode it was made in (a reentrant checkpoint's recomputation, with grad, needs a
    table with a graph to ``freqs_cis``, which its forward, without, did not make)."""
    cacheable = not (_unkept() or freqs_cis.is_inference())
    key = None if not cacheable else (freqs_cis._version, torch.is_grad_enabled())
    last = _last_table[0]
    if cacheable and last is not None and last[1] is freqs_cis and last[2] == key:
        return last[0]
    pairs = freqs_cis.shape[-1]
    table = PairCosSinCache(
        torch.cat((freqs_cis.real, freqs_cis.imag), dim=-1).float().reshape(-1, 2 * pairs)
    )
    if cacheable:
        _last_table[0] = (table, freqs_cis, key)
    return table


def _unit_weight(head_dim: int, device: torch.device) -> torch.Tensor:
    """A float32 weight of ones (the L2 norm has none), one per head dim and device."""
    key = (head_dim, device)
    weight = _unit.get(key)
    if weight is None:
        with torch.inference_mode(False):
            weight = _unit[key] = torch.ones(head_dim, device=device)
    return weight


def _fused_forward(attention: torch.nn.Module, eps: float, previous, *args, **kwargs):
    """A Llama 4 attention's forward with its L2 qk_norm done in the RoPE call. ``previous``:
    the instance's own forward before the patch (``None``: its class's). Runs unfused while
    our :func:`apply_rotary_emb` is not the modeling module's (another model's unpatch);
    an output normalized and never handed on by ``qk_norm`` raises."""
    run = previous or functools.partial(type(attention).forward, attention)
    module = sys.modules[MODULE]
    if _traced_with_grad() or getattr(module, "apply_rotary_emb", None) is not apply_rotary_emb:
        return run(*args, **kwargs)
    outer = _window.attention, _window.eps, _window.normalized
    # the norm's epsilon as it is now, not at the patch (the other families' too)
    eps = getattr(attention.qk_norm, "eps", eps)
    _window.attention, _window.eps, _window.normalized = attention, eps, []
    try:
        result = run(*args, **kwargs)
        if _window.normalized:
            raise RoPEError(
                f"{type(attention).__name__}'s RoPE call normalized q and k but qk_norm did not "
                "receive them: this attention's forward is not the one rope-dispatch knows; "
                "hf.unpatch the model"
            )
    finally:
        _window.attention, _window.eps, _window.normalized = outer
    return result


def _handed_on_norm(norm: torch.nn.Module, x: torch.Tensor):
    """The fused attention's ``qk_norm``: an output of our RoPE call, already normalized, passes
    unchanged; anything else is normalized by the class's forward. An output written in place
    since (a forward pre-hook on ``qk_norm`` editing its input) raises: the model would
    normalize the edit, which the call cannot (it normalized before)."""
    attention = _window.attention
    if getattr(attention, "qk_norm", None) is norm:
        for i, (done, version) in enumerate(_window.normalized):
            if done is x:
                if version is not None and x._version != version:
                    raise RoPEError(
                        f"{type(attention).__name__}.qk_norm's input was written in place after "
                        "the RoPE call had normalized it (a forward pre-hook editing it?): the "
                        "edit would not be normalized (nor is an edited copy: qk_norm would "
                        "not receive the call's outputs); hf.unpatch the model to run such a hook"
                    )
                del _window.normalized[i]
                return x
    return type(norm).forward(norm, x)


FORWARDS = (_fused_forward, _handed_on_norm)
"""The functions of the instance forwards :func:`fuse` sets; an attention's keeps its earlier
forward at ``args[2]``, as ``hf``'s own fused forwards do."""


def l2_fusable(model: torch.nn.Module) -> list[tuple[torch.nn.Module, float]]:
    """(attention, its norm's epsilon) for each Llama 4 text attention of ``model`` whose L2
    ``qk_norm`` can be fused exactly: the family's ``Llama4TextL2Norm`` running its class's
    forward, in a model whose rotary embeddings all have attention factor 1. Attentions fused
    already are left out; a norm without a positive epsilon raises."""
    module = sys.modules.get(MODULE)
    if module is None or not hasattr(module, ATTENTION):
        return []
    attention_class, norm_class = getattr(module, ATTENTION), getattr(module, NORM, None)
    rotary_class = getattr(module, ROTARY, None)
    if any(type(m) is rotary_class and getattr(m, "attention_scaling", 1.0) != 1.0
           for m in model.modules()):
        return []
    found = []
    for name, attention in model.named_modules():
        norm = getattr(attention, "qk_norm", None)
        if (type(attention) is not attention_class or type(norm) is not norm_class
                or _own_forward(norm) is not None):
            continue
        eps = getattr(norm, "eps", None)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise RoPEError(f"{name}.qk_norm must have a positive eps to fuse the norm, got "
                            f"{eps!r}")
        found.append((attention, float(eps)))
    return found


def fuse(attention: torch.nn.Module, eps: float,
         set_forward: Callable[[torch.nn.Module, functools.partial], None]) -> None:
    """Give a Llama 4 attention and its ``qk_norm`` the forwards that fuse the norm, each set
    by ``set_forward`` (``hf._set_forward``, which also makes data-parallel replicas their own)."""
    set_forward(attention.qk_norm, functools.partial(_handed_on_norm, attention.qk_norm))
    set_forward(attention, functools.partial(_fused_forward, attention, eps,
                                             _own_forward(attention)))

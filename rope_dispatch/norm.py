"""``HeadNorm``: the RMSNorm of q or k that runs in the same pass as their rotation.

Qwen3, Gemma 3, OLMo 2, GLM-4.5 and others normalize q and k right before RoPE. Passed as
``q_norm=``/``k_norm=`` (``norm=`` for a single tensor), the norm is a stage of the call: the
Triton backend normalizes and rotates in one launch forward and one backward, which also writes
the weight's gradient. The math is float32 from the input to the rotated output, rounded once
to the tensor's dtype (docs/semantics.md; docs/hf.md compares it with each Hugging Face family's
rounding).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .errors import RoPEError, RoPETypeError
from .spec import FLOAT32_MAX, FLOAT32_TINY, dtype_name

SCOPES = ("head", "heads")
"""``"head"``: each head over its ``head_dim`` channels (one weight per channel, shared by the
heads); ``"heads"``: a token's heads together (``heads * head_dim`` weights), as OLMo 2."""


class NormForm(NamedTuple):
    """What a compiled launch depends on of a norm: its scope, epsilon and offset."""

    scope: str
    eps: float
    offset: float


class HeadNorm:
    """``y = x / sqrt(mean(x**2) + eps) * (offset + weight)``, before the rotation.

    ``weight``: 1-D, ``head_dim`` entries (``scope="head"``) or ``heads * head_dim``
    (``scope="heads"``), on the tensor's device, any float dtype; it gets a gradient where it
    requires one. ``offset=1.0`` is Gemma's ``x * (1 + w)``. The whole head is normalized, the
    channels past the rotary dim too (and rewritten in place by ``apply_`` and ``apply_qk_``).
    ``eps``, ``offset`` and ``scope`` are fixed when it is made (the launches are compiled for
    them); the weight may be replaced or written, the form not (calling ``__init__`` again
    raises AttributeError, as assigning ``form`` does).
    """

    __slots__ = ("weight", "form")

    def __setattr__(self, name: str, value: object) -> None:
        """``form`` is read-only (a slot, so reads on the decode path stay as fast as any)."""
        if name == "form":
            raise AttributeError(
                "HeadNorm.form is fixed when the norm is made (its eps, offset and scope are "
                "compiled into the launches); make a new HeadNorm for another form"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name == "form":
            raise AttributeError("HeadNorm.form is fixed when the norm is made")
        if name == "weight":  # (a norm without one: every call and repr an AttributeError)
            raise AttributeError("HeadNorm.weight cannot be deleted; assign a new weight instead")
        object.__delattr__(self, name)

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0,
                 scope: str = "head"):
        # built per call by integrations (a decode step's host path): plain floats checked first
        _check_weight(weight, "HeadNorm weight")
        eps, offset = _finite("eps", eps), _finite("offset", offset)
        if not FLOAT32_TINY <= eps <= FLOAT32_MAX:
            if eps <= 0:
                raise RoPEError(f"HeadNorm eps must be positive, got {eps!r}")
            # added in float32: below its smallest normal number it is 0 (an all-zero head
            # then comes out NaN, 0 / 0) or a denormal the GPU's rsqrt flushes to 0
            raise RoPEError(f"HeadNorm eps must lie in float32's normal range [{FLOAT32_TINY}, "
                            f"{FLOAT32_MAX}] (the norm adds it in float32), got {eps!r}")
        if not -FLOAT32_MAX <= offset <= FLOAT32_MAX:  # float32 inf: every output NaN
            raise RoPEError(f"HeadNorm offset must be a number float32 holds (|offset| <= "
                            f"{FLOAT32_MAX}), got {offset!r}")
        if scope not in SCOPES:
            raise RoPEError(f"HeadNorm scope must be one of {SCOPES}, got {scope!r}")
        if type(scope) is not str:  # a str subclass (NumPy's, from a config): the plain name
            scope = SCOPES[SCOPES.index(scope)]
        # what a launch depends on; one object per form, so a plan's key compares by identity
        form = _new_form(NormForm, (scope, eps, offset))
        if torch.compiler.is_compiling():
            # not interned while tracing: traced code reading _FORMS makes Dynamo guard on it,
            # and the interning, replayed after the graph, fails that guard at the next call (a
            # recompile); traced calls compare forms by value, never by identity. (Dynamo
            # traces object.__setattr__, not the slots' setters.)
            object.__setattr__(self, "weight", weight)
            object.__setattr__(self, "form", form)
        else:  # the slots' own setters: no trip through __setattr__
            if getattr(self, "form", None) is not None:  # (an unset slot: None, no raise)
                raise AttributeError(
                    f"{type(self).__name__} is made once: __init__ called again on {self!r} "
                    "would change its fixed form (eps, offset and scope are compiled into the "
                    "launches); make a new HeadNorm instead"
                )
            _set_weight(self, weight)
            _set_form(self, _FORMS.setdefault(form, form) if len(_FORMS) < 1024
                      else _FORMS.get(form, form))

    @property
    def eps(self) -> float:
        return self.form.eps

    @property
    def offset(self) -> float:
        return self.form.offset

    @property
    def scope(self) -> str:
        return self.form.scope

    def __reduce__(self) -> tuple:
        """Pickled and copied as its constructor's arguments: at every pickle protocol (below
        2, a class with ``__slots__`` and no ``__getstate__`` cannot be pickled), checked
        again and its form interned where it is loaded. A subclass's copy is of the subclass,
        its own attributes (in a ``__dict__`` or slots of its own) copied too."""
        made = (self.weight, self.eps, self.offset, self.scope)
        if type(self) is HeadNorm:
            return (_made, made) if self.eps else (zero_eps_norm, (self.weight,))
        slots = {name: getattr(self, name) for klass in type(self).__mro__
                 if klass not in (HeadNorm, object)
                 for name in ((klass.__dict__.get("__slots__", ()),)
                              if isinstance(klass.__dict__.get("__slots__"), str)
                              else klass.__dict__.get("__slots__", ()))
                 if name not in ("__dict__", "__weakref__") and hasattr(self, name)}
        return _made_as, (type(self), *made), (getattr(self, "__dict__", None) or None,
                                               slots or None)

    def __repr__(self) -> str:
        weight = self.weight  # replaceable by anything after the norm is made: repr never fails
        if isinstance(weight, torch.Tensor):
            shown = (f"weight[{weight.shape[0]}]" if weight.dim() == 1
                     else f"weight=<tensor of shape {tuple(weight.shape)}>")
        else:
            shown = f"weight=<{type(weight).__name__}>"
        return f"HeadNorm({shown}, eps={self.eps}, offset={self.offset}, scope={self.scope!r})"


_set_form = HeadNorm.form.__set__  # the slots' own setters (HeadNorm.__setattr__ refuses form)
_set_weight = HeadNorm.weight.__set__


def _made(weight: torch.Tensor, eps: float, offset: float, scope: str) -> HeadNorm:
    """A pickled :class:`HeadNorm` again."""
    return HeadNorm(weight, eps, offset=offset, scope=scope)


def _made_as(cls: type, weight: torch.Tensor, eps: float, offset: float,
             scope: str) -> HeadNorm:
    """A pickled or copied instance of ``cls``, a subclass of :class:`HeadNorm` (made as a
    HeadNorm: the subclass's constructor may take other arguments)."""
    norm = object.__new__(cls)
    HeadNorm.__init__(norm, weight, eps, offset=offset, scope=scope)
    return norm


_new_form = tuple.__new__
_FORMS: dict[NormForm, NormForm] = {}


def zero_eps_norm(weight: torch.Tensor) -> HeadNorm:
    """A per-head :class:`HeadNorm` of ``eps=0``, ``y = x * rsqrt(mean(x**2)) * weight``, which
    HeadNorm itself refuses: for adapters of ops whose semantics take it (vLLM's fused op), where
    an all-zero head gives what that formula gives, ``0 * inf = NaN``."""
    norm = HeadNorm(weight, 1.0)  # the weight checked as HeadNorm checks it
    form = _new_form(NormForm, ("head", 0.0, 0.0))
    if torch.compiler.is_compiling():  # not interned while tracing (HeadNorm.__init__ says why)
        object.__setattr__(norm, "form", form)
    else:
        _set_form(norm, _FORMS.setdefault(form, form) if len(_FORMS) < 1024
                  else _FORMS.get(form, form))
    return norm


def _finite(name: str, value: object) -> float:
    """``value`` as a float, where it is a finite real number (not a bool)."""
    if type(value) is not float and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
        raise RoPEError(f"HeadNorm {name} must be a finite number, got {value!r}")
    # __float__, not float(): under torch.compile(dynamic=True) a module's float attribute (an
    # RMSNorm's epsilon) is traced as a symbolic float, which float() keeps symbolic (math.isfinite
    # and hashing it then fail); __float__ specializes it to its value, guarded
    try:
        value = value.__float__()
    except OverflowError:  # an int past float64's range (float() names no argument)
        raise RoPEError(f"HeadNorm {name} must be a number float32 holds, got {value!r}") from None
    if not math.isfinite(value):
        raise RoPEError(f"HeadNorm {name} must be a finite number, got {value!r}")
    return value


def _check_weight(weight: object, name: str) -> None:
    """A norm weight: a 1-D float tensor, or an error naming it ``name``."""
    if not isinstance(weight, torch.Tensor):
        raise RoPETypeError(f"{name} must be a 1-D float tensor, got {type(weight).__name__}")
    if weight.dim() != 1 or not weight.is_floating_point():
        raise RoPEError(
            f"{name} must be a 1-D float tensor, got shape {tuple(weight.shape)} and dtype "
            f"{dtype_name(weight.dtype)}"
        )


def check_norm(norm: object, argument: str, heads: int, head_dim: int,
               device: torch.device) -> HeadNorm | None:
    """``norm`` (a :class:`HeadNorm` or ``None``) checked against the tensor it normalizes."""
    if norm is None:
        return None
    if not isinstance(norm, HeadNorm):
        raise RoPETypeError(
            f"{argument} must be a rope_dispatch.HeadNorm or None, got {type(norm).__name__}"
        )
    weight = norm.weight
    # the weight may be replaced after the norm is made: what the constructor checks, again
    _check_weight(weight, f"{argument}.weight")
    want = head_dim if norm.scope == "head" else heads * head_dim
    if weight.shape[0] != want:
        over = ("head_dim" if norm.scope == "head"
                else f"heads * head_dim = {heads} * {head_dim}")
        raise RoPEError(
            f"{argument}.weight has {weight.shape[0]} entries but scope={norm.scope!r} needs "
            f"{over} = {want}"
        )
    if weight.device != device:
        raise RoPEError(
            f"{argument}.weight is on {weight.device} but the tensor is on {device}; expected "
            "the same device"
        )
    return norm


def normalized(x: torch.Tensor, norm: HeadNorm) -> torch.Tensor:
    """``x`` ``[.., heads, head_dim]`` normalized in float32 (the eager backend's stage, and
    the math the compile backend traces)."""
    return head_norm(x, norm.weight, norm.eps, norm.offset, norm.scope)


def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
              scope: str) -> torch.Tensor:
    """:func:`normalized` from plain values: traceable."""
    x = x.float()
    shape = x.shape
    if scope == "heads":
        x = x.flatten(-2)
    # 1 / sqrt, not rsqrt: rsqrt's autograd backward takes r**3, which overflows float32 where
    # eps is tiny (r up to 2**63), and a zero head's gradient came out NaN (inf * 0)
    y = x * (1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (weight.float() + offset)
    return y.reshape(shape)


def head_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float,
                       offset: float, scope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 gradients ``(dx, dweight)`` of :func:`head_norm` for ``grad`` of its output,
    written out (``dx = r (g - x r**2 mean(g x))``, ``g = grad (offset + w)``,
    ``r = rsqrt(mean(x**2) + eps)``) so a compiled backward needs no autograd graph: traceable."""
    x, grad = x.float(), grad.float()
    shape = x.shape
    if scope == "heads":
        x, grad = x.flatten(-2), grad.flatten(-2)
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    g = grad * (weight.float() + offset)
    dx = r * (g - x * (r * r) * (g * x).mean(-1, keepdim=True))
    dweight = (grad * x * r).flatten(0, -2).sum(0)  # not reshape(-1, n): n may be 0
    return dx.reshape(shape), dweight

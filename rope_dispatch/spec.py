"""``RoPESpec``: the static description of a RoPE call (layout, dtype, rotary dim, packing, CP)."""

from __future__ import annotations

import ast
import math
import numbers
from collections.abc import Iterator
from copy import deepcopy
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema,
    field_serializer, model_validator,
)

from .errors import RoPEError
from .tracing import constant_while_tracing, distributed, exact_size, symbolic

Layout = Literal["sbhd", "bshd", "thd"]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, float32's smallest normal number
FLOAT32_MAX = torch.finfo(torch.float32).max

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the short name used in messages and cache keys."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any) -> torch.dtype:
    """Accept a torch dtype or one of its names (``"bf16"``, ``"torch.float16"``, ...)."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key not in _DTYPE_NAMES:
            raise ValueError(
                f"dtype {value!r} is not a known dtype name; expected one of {sorted(_DTYPE_NAMES)}"
            )
        dtype = _DTYPE_NAMES[key]
    else:
        raise ValueError(f"dtype {value!r} must be a torch.dtype or a dtype name such as 'bf16'")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype {dtype_name(dtype)} is not supported; expected one of "
            f"{[dtype_name(d) for d in SUPPORTED_DTYPES]}"
        )
    return dtype


def _integer(value: Any) -> Any:
    """An integer field's value: a Python or NumPy integer (not a bool), or ``None`` for an
    optional field (pydantic refuses it where ``None`` is not allowed). pydantic alone would
    take ``2.0``, ``"2"`` and ``True`` as 2, 2 and 1."""
    if value is None:
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"expected an integer, got {value!r} ({type(value).__name__})")


def _real(value: Any) -> float:
    """A float field's value: a Python or NumPy number that is not a bool (``"1.5"`` and
    ``True`` are refused)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int or a Fraction past float64's range, let alone float32's
            raise ValueError(f"expected a number float32 holds, got {value!r} (beyond float64's "
                             "range)") from None
    raise ValueError(f"expected a number, got {value!r} ({type(value).__name__})")


def _boolean(value: Any) -> bool:
    """A bool field's value: ``True`` or ``False`` (or a NumPy bool); pydantic alone would take
    ``1``, ``"yes"`` and ``"off"``."""
    kind = type(value)  # NumPy's bool by module and name (NumPy is not imported for it)
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool_",
                                                                                   "bool")):
        return bool(value)
    raise ValueError(f"expected True or False, got {value!r} ({type(value).__name__})")


def _three_integers(value: Any) -> Any:
    """``mrope_section``: ``None`` or three integers (a tuple or a list)."""
    if value is None:
        return value
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(f"expected three integers (temporal, height, width), got {value!r}")
    try:
        return tuple(_integer(part) for part in value)
    except ValueError:
        raise ValueError(f"expected three integers (temporal, height, width), got {value!r}") from None


def _check_interleaved_sections(sections: tuple[int, int, int]) -> None:
    """Interleaved sections (Qwen3-VL) give the height stream pairs 1, 4, .., 3h - 2 and the
    width stream pairs 2, 5, .., 3w - 1 of each half: both must lie in the half's ``t + h + w``
    pairs, or the streams would get fewer pairs than the sections say."""
    t, h, w = sections
    half = t + h + w
    if 3 * h - 2 >= half or 3 * w - 1 >= half:
        raise ValueError(
            f"mrope_section={sections} cannot be interleaved: height takes pairs 1, 4, .. "
            f"{3 * h - 2} and width pairs 2, 5, .. {3 * w - 1}, which must be below the "
            f"{half} pairs of each half"
        )


# JSON schemas of the two fields pydantic has none for: the dtype's name; cu_seqlens, which
# JSON holds as numbers and a spec takes back only as a tensor (RoPESpec.with_cu_seqlens)
_TEXT = WithJsonSchema({"type": "string"})
_NO_OFFSETS = WithJsonSchema({"type": "null"}, mode="validation")
_OFFSETS = WithJsonSchema(
    {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
    mode="serialization",
)

Integer = Annotated[int, BeforeValidator(_integer)]
Real = Annotated[float, BeforeValidator(_real)]
Boolean = Annotated[bool, BeforeValidator(_boolean)]

# Every field but the cu_seqlens tensor, in the order of RoPESpec.static_key.
STATIC_FIELDS = (
    "layout", "dtype", "rotary_dim", "interleaved", "max_seqlen", "cp_size", "cp_rank",
    "cos_sin_scale", "mrope_section", "inverse", "rotary_offset", "deinterleave",
    "mrope_interleaved",
)

# Fields added after autotune's cache keys were fixed, with their defaults: named in a key (and
# a spec's repr) only when set, so an absent one means the default and older keys still match.
LATER_FIELDS = {"inverse": False, "rotary_offset": 0, "deinterleave": False,
                "mrope_interleaved": False}


def named_fields(values: tuple) -> dict[str, Any]:
    """``STATIC_FIELDS`` (then anything after them) named, as JSON keys and reports take them:
    a :data:`LATER_FIELDS` field only where it differs from its default."""
    names = (*STATIC_FIELDS, "rotary_dim")
    return {name: value for name, value in zip(names, values)
            if name not in LATER_FIELDS or value != LATER_FIELDS[name]}


def check_cu_seqlens_tensor(cu_seqlens: Any) -> None:
    """Static checks on ``cu_seqlens`` (type, rank, dtype, length); values are checked per call."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise RoPEError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if distributed(cu_seqlens):
        raise RoPEError(
            "cu_seqlens must be a plain tensor of the global offsets (the same on every rank), "
            "got a DTensor; pass a plain one (a replicated DTensor's to_local())"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise RoPEError(
            f"cu_seqlens must have dtype int32 or int64, got {dtype_name(cu_seqlens.dtype)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise RoPEError(
            "cu_seqlens must be a 1-D tensor of at least 2 offsets [0, end_0, ..., total], "
            f"got shape {tuple(cu_seqlens.shape)}"
        )


MAX_SEQLEN_SET = "set"
"""What a traced call's key (a spec's ``static_text``) holds for a ``max_seqlen`` that is set,
and a traced spec's ``static_key`` for a symbolic one: no choice depends on its value, which a
thd loop changes every step, and a key read while Dynamo traces is a guard (a recompile per
value)."""


def _choice_key(key: tuple) -> tuple:
    """A spec's key with ``max_seqlen`` only as set or not: what a backend's choice keys on."""
    at = STATIC_FIELDS.index("max_seqlen")
    return (*key[:at], None if key[at] is None else MAX_SEQLEN_SET, *key[at + 1:])


@constant_while_tracing
def _text_with(static_text: str, at: int, value: object) -> str:
    """``static_text`` (a spec's key as text) with entry ``at`` replaced by ``value``: run
    once at trace time, its result a constant (:meth:`RoPESpec.with_cu_seqlens` traced)."""
    key = ast.literal_eval(static_text)
    return repr((*key[:at], value, *key[at + 1:]))


def _checked(make: Any, *args: Any, **kwargs: Any) -> Any:
    """``make(*args, **kwargs)`` (pydantic's validation of a spec), its ValidationError raised
    as :class:`~rope_dispatch.RoPEError` naming the field (:func:`_spec_problem`)."""
    try:
        return make(*args, **kwargs)
    except ValidationError as exc:
        raise RoPEError(_spec_problem(exc)) from None


def _spec_problem(exc: ValidationError) -> str:
    """A pydantic validation failure as one sentence per field, with the value it got."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        # (model_validate runs __init__ inside pydantic's validation: its RoPEError, prefixed)
        message = error["msg"].removeprefix("Value error, ").removeprefix("invalid RoPESpec: ")
        if error["type"] != "value_error":  # pydantic's own words: add what it got
            message = f"{message} (got {repr(error['input'])[:80]})"
        if field and not message.startswith(field):
            message = f"{field}: {message}"
        problems.append(message)
    return "invalid RoPESpec: " + "; ".join(problems)


class RoPESpec(BaseModel):
    """What a RoPE call looks like, validated once and reused every step.

    Semantics are TransformerEngine 2.20.2 ``apply_rotary_pos_emb``; ``cos_sin_scale`` (1.0, as
    in TE, by default) multiplies cos and sin as Hugging Face's YaRN/LongRoPE models do. The
    static fields (all but ``cu_seqlens``) form :attr:`static_key`, a hashable tuple that
    dispatch and autotune key on. For ``thd`` batches that change every step, build the spec
    once and call :meth:`with_cu_seqlens` per step: it checks the tensor and skips full
    validation.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    static_key: ClassVar[tuple]
    """Hashable tuple of every field but the ``cu_seqlens`` tensor, set once at validation."""
    static_text: ClassVar[str]
    """``repr(choice_key)``: the key traced code passes on (:func:`.call_keys.call_key`)."""
    choice_key: ClassVar[tuple]
    """:attr:`static_key` with ``max_seqlen`` only as set or not: what an eager call's backend
    choice keys on (:func:`.call_keys.call_key`), as a traced call's ``static_text``."""
    scale_text: ClassVar[str]
    """``repr(cos_sin_scale)``: the scale a traced launch passes on."""

    layout: Layout = Field(description="sbhd, bshd or thd (packed sequences with cu_seqlens)")
    dtype: Annotated[torch.dtype, BeforeValidator(parse_dtype), _TEXT] = Field(
        description="dtype of the input tensor: float32, float16 or bfloat16"
    )
    rotary_dim: Integer | None = Field(
        default=None, description="channels rotated; must equal the table's last dim when given"
    )
    interleaved: Boolean = Field(default=False, description="rotate pairs (2k, 2k+1), not halves")
    cu_seqlens: Annotated[torch.Tensor | None, _NO_OFFSETS, _OFFSETS] = Field(
        default=None,
        description="int32/int64 [n+1] global sequence offsets, thd only (optional when every "
        "call passes per-token positions)",
    )
    max_seqlen: Integer | None = Field(
        default=None, description="longest global sequence (thd): lets calls skip any host sync"
    )
    cp_size: Integer = Field(default=1, description="context-parallel world size")
    cp_rank: Integer = Field(default=0, description="this rank in the context-parallel group")
    cos_sin_scale: Real = Field(
        default=1.0,
        description="factor on cos and sin (YaRN's and LongRoPE's attention factor, as Hugging "
        "Face applies it): the rotated channels come out scaled by it, for every table kind",
    )
    mrope_section: Annotated[
        tuple[int, int, int] | None, BeforeValidator(_three_integers)
    ] = Field(
        default=None,
        description="multimodal RoPE (Qwen2-VL): channels of each half taken from the temporal, "
        "height and width position streams; calls then pass positions [3, *t.shape[:-2]]",
    )
    mrope_interleaved: Boolean = Field(
        default=False,
        description="multimodal RoPE with the sections interleaved across frequency pairs "
        "(Qwen3-VL): pair j of each half takes the height stream where j % 3 == 1 and "
        "j < 3 * h, the width stream where j % 3 == 2 and j < 3 * w, else the temporal stream",
    )
    inverse: Boolean = Field(
        default=False,
        description="rotate by minus the angle (Megatron's inverse=True): the transpose of the "
        "rotation, forward and backward; it undoes a rotation whose pairs share one angle",
    )
    rotary_offset: Integer = Field(
        default=0,
        description="where the rotary channels start in each head: channels [rotary_offset, "
        "rotary_offset + d2) rotate, all others pass through (DeepSeek V2/V3 rotate the last "
        "64 channels: head_dim - 64)",
    )
    deinterleave: Boolean = Field(
        default=False,
        description="interleaved pairs in, halves out (DeepSeek V2/V3's rope_interleave): the "
        "rotary channels' pairs (2k, 2k+1) move to (k, k + d2/2), then turn rotate-half style "
        "by a table in the halves layout; needs interleaved=False",
    )

    def __init__(self, **fields: Any) -> None:
        """Validate ``fields``; a bad one raises :class:`~rope_dispatch.RoPEError` naming it.
        While ``torch.compile`` traces, the spec is validated once at trace time (pydantic's
        validation does not trace) and this object given its attributes."""
        if torch.compiler.is_compiling():
            cu_seqlens = fields.pop("cu_seqlens", None)
            longest = fields.get("max_seqlen")
            # (not thd: refused below naming its value, which a placeholder 0 would hide)
            dynamic = _dynamic(longest) and fields.get("layout") == "thd"
            if dynamic:  # validated as a number; the spec holds the symbol (_traced_copy)
                fields["max_seqlen"] = 0
            # a size taken from a tensor is a symbol with dynamic=True: the spec's is a number
            # (Dynamo takes a symbolic size for an int)
            fields = {name: (exact_size(v) if v >= 0 else -exact_size(-v))
                      if isinstance(v, int) and not isinstance(v, bool) else v
                      for name, v in fields.items()}
            made = constant_spec(**fields)
            longest = longest if dynamic else fields.get("max_seqlen")
            if cu_seqlens is not None:  # (on the class: Dynamo finds no method of a constant)
                made = RoPESpec.with_cu_seqlens(made, cu_seqlens, longest)
            elif dynamic:
                if longest < 0:
                    raise RoPEError(f"max_seqlen must be >= 0, got {int(longest)}")
                made = _traced_copy(made, made.cu_seqlens, longest)
            for name in _ATTRIBUTES:
                object.__setattr__(self, name, getattr(made, name))
        else:
            self._validate(fields)

    def _validate(self, fields: dict[str, Any]) -> None:
        _checked(super().__init__, **fields)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> RoPESpec:
        """A spec from a dict (a config's), validated as the constructor validates: a bad field
        raises :class:`~rope_dispatch.RoPEError` naming it, not pydantic's error."""
        return _checked(super().model_validate, obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> RoPESpec:
        """:meth:`model_validate` from JSON text."""
        return _checked(super().model_validate_json, json_data, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> RoPESpec:
        """:meth:`model_validate` in pydantic's strings mode."""
        return _checked(super().model_validate_strings, obj, **kwargs)

    @classmethod
    def model_construct(cls, _fields_set: set[str] | None = None, **values: Any) -> RoPESpec:
        """A spec validated as the constructor validates: pydantic's own skips validation and
        leaves out :attr:`static_key`, which every call reads."""
        return cls(**values)

    @field_serializer("dtype", when_used="json")
    def _dtype_text(self, dtype: torch.dtype) -> str:
        """JSON holds the dtype's name (``"bfloat16"``), which the field takes back."""
        return dtype_name(dtype)

    @field_serializer("cu_seqlens", when_used="json")
    def _offsets_text(self, cu_seqlens: torch.Tensor | None) -> list[int] | None:
        """JSON holds the offsets as numbers (for a log); a spec takes them back as a tensor
        only (:meth:`with_cu_seqlens`)."""
        return None if cu_seqlens is None else cu_seqlens.tolist()

    @model_validator(mode="after")
    def _check(self) -> RoPESpec:
        if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            raise ValueError(f"rotary_dim must be a positive even integer, got {self.rotary_dim}")
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if self.rotary_offset < 0:
            raise ValueError(
                f"rotary_offset must be >= 0 (the first rotary channel of a head), got "
                f"{self.rotary_offset}"
            )
        if self.deinterleave and self.interleaved:
            raise ValueError(
                "deinterleave=True reads interleaved pairs and writes them as halves (the "
                "table in the halves layout); interleaved=True would keep pairs in place: pass "
                "deinterleave=True with interleaved=False"
            )
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"cp_rank must satisfy 0 <= cp_rank < cp_size={self.cp_size}, got {self.cp_rank}"
            )
        if self.layout == "thd":
            if self.cu_seqlens is not None:  # without it, every call must give positions
                check_cu_seqlens_tensor(self.cu_seqlens)
        else:
            if self.cu_seqlens is not None:
                raise ValueError(
                    f"cu_seqlens is only for layout 'thd', got it with layout {self.layout!r}"
                )
            if self.max_seqlen is not None:
                raise ValueError(
                    f"max_seqlen is only for layout 'thd', got {self.max_seqlen} with layout "
                    f"{self.layout!r}"
                )
        if not (math.isfinite(self.cos_sin_scale) and self.cos_sin_scale > 0):
            raise ValueError(
                f"cos_sin_scale must be a finite number > 0, got {self.cos_sin_scale}"
            )
        if not FLOAT32_TINY <= self.cos_sin_scale <= FLOAT32_MAX:
            # the backends multiply cos and sin by it in float32: beyond float32's largest
            # number it would be inf (NaN outputs), below its smallest normal one 0 or inexact
            raise ValueError(
                f"cos_sin_scale must lie in float32's normal range [{FLOAT32_TINY}, "
                f"{FLOAT32_MAX}] (cos and sin are scaled in float32), got {self.cos_sin_scale}"
            )
        if self.max_seqlen is not None and self.max_seqlen < 0:  # (0: a batch of no tokens)
            raise ValueError(f"max_seqlen must be >= 0, got {self.max_seqlen}")
        if self.mrope_section is not None:
            if min(self.mrope_section) < 0 or sum(self.mrope_section) == 0:
                raise ValueError(
                    "mrope_section must be 3 non-negative channel counts (temporal, height, "
                    f"width) with a positive sum, got {self.mrope_section}"
                )
            if self.interleaved:
                raise ValueError(
                    "mrope_section needs interleaved=False: multimodal RoPE splits each half "
                    "of the rotate-half layout into sections"
                )
            if self.mrope_interleaved:
                _check_interleaved_sections(self.mrope_section)
            if self.cp_size > 1:
                raise ValueError(
                    f"mrope_section cannot be combined with cp_size={self.cp_size}: its calls "
                    "pass every token's positions; give this rank's tokens with cp_size=1"
                )
        elif self.mrope_interleaved:
            raise ValueError("mrope_interleaved=True needs mrope_section (the three section sizes)")
        self._set_static_key()
        return self

    def _set_static_key(self) -> None:
        # A plain instance attribute: read on every call, so no property, no pydantic private
        # attribute (2 us) and no cached_property (its lock breaks torch.compile graphs).
        self.__dict__["static_key"] = tuple(
            dtype_name(self.dtype) if name == "dtype" else getattr(self, name)
            for name in STATIC_FIELDS
        )
        self.__dict__["choice_key"] = _choice_key(self.static_key)
        # as text, which Dynamo reads as constants: with dynamic=True it reads a float held by
        # an object as a symbol, which a key or an op's constant argument cannot hold
        self.__dict__["static_text"] = repr(self.choice_key)
        self.__dict__["scale_text"] = repr(float(self.cos_sin_scale))

    def static_fields(self) -> dict[str, Any]:
        """The static fields as JSON-friendly values (for cache keys and reports); a later
        field (:data:`LATER_FIELDS`) only where it is set."""
        return named_fields(self.static_key)

    def with_cu_seqlens(
        self, cu_seqlens: torch.Tensor, max_seqlen: int | None = None
    ) -> RoPESpec:
        """The same ``thd`` spec for a new batch, without re-running pydantic validation."""
        if self.layout != "thd":
            raise RoPEError(f"with_cu_seqlens needs layout 'thd', this spec has {self.layout!r}")
        check_cu_seqlens_tensor(cu_seqlens)
        try:  # as the field takes it: an integer (not a bool, a float or a string) or None
            max_seqlen = _integer(max_seqlen)
        except ValueError as exc:
            raise RoPEError(f"max_seqlen: {exc}") from None
        if max_seqlen is not None and max_seqlen < 0:
            raise RoPEError(f"max_seqlen must be >= 0, got {max_seqlen}")
        if torch.compiler.is_compiling():
            return _traced_copy(self, cu_seqlens, max_seqlen)
        new = super().model_copy(update={"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen})
        new._set_static_key()
        return new

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> RoPESpec:
        """A copy, with the fields in ``update`` changed: validated as a new spec (pydantic's
        own copy skips validation and keeps the old :attr:`static_key`, which dispatch keys
        its decisions on, so a changed field would run on the original's decision)."""
        if not update:
            return super().model_copy(deep=deep)
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        fields.update(update)
        new = type(self)(**fields)
        return super(RoPESpec, new).model_copy(deep=True) if deep else new

    def copy(self, **kwargs: Any) -> RoPESpec:  # type: ignore[override]
        """pydantic's deprecated ``copy`` (``include``, ``exclude``, ``update``, ``deep``), its
        result validated as a new spec, as :meth:`model_copy`'s (pydantic's skips validation).
        ``update`` is validated with the rest: a name that is no field is refused, not dropped."""
        update = kwargs.pop("update", None) or {}
        copied = super().copy(**kwargs)
        fields = {name: value for name, value in vars(copied).items()
                  if name in type(self).model_fields}
        fields.update(deepcopy(update) if kwargs.get("deep") else update)
        return type(self)(**fields)

    def __hash__(self) -> int:
        return hash(self.static_key) ^ id(self.cu_seqlens)

    def __eq__(self, other: object) -> bool:
        """Equal static fields and the very same ``cu_seqlens`` tensor (tensors compare by identity)."""
        if not isinstance(other, RoPESpec):
            return NotImplemented
        return self.static_key == other.static_key and self.cu_seqlens is other.cu_seqlens

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """``(name, value)`` of each field, as ``dict(spec)`` takes them (pydantic's iteration
        walks ``__dict__``, which holds :attr:`static_key` and its texts too)."""
        return ((name, getattr(self, name)) for name in type(self).model_fields)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.static_fields().items())
        cu = "" if self.cu_seqlens is None else f", cu_seqlens=<{self.cu_seqlens.numel()} offsets>"
        return f"RoPESpec({fields}{cu})"

    __str__ = __repr__


def constant_spec(**fields: Any) -> RoPESpec:
    """``RoPESpec(**fields)`` for code that makes a spec while ``torch.compile`` traces it (the
    compat doors, on a first call): Dynamo cannot trace pydantic's validation, so it runs once
    at trace time and the spec enters the graph as a constant. ``fields``: plain values, no
    tensor (a thd spec's ``cu_seqlens`` comes by :meth:`RoPESpec.with_cu_seqlens`). A bad
    field is refused here, in traced code, as every other refusal is (raised inside the
    constant's call, Dynamo wrapped it in its ``InternalTorchDynamoError``)."""
    made = _validated(**fields)  # (the constructor, traced, comes here)
    if isinstance(made, tuple):
        kind, problem = made
        raise kind(problem)
    return made


@constant_while_tracing
def _validated(**fields: Any) -> RoPESpec | tuple[type[RoPEError], str]:
    """The spec of ``fields``, or the class and message of the error that refuses it."""
    spec = object.__new__(RoPESpec)
    try:
        spec._validate(fields)
    except RoPEError as exc:
        return type(exc), str(exc)
    return spec


_ATTRIBUTES = (*RoPESpec.model_fields, "static_key", "static_text", "scale_text", "choice_key")
"""What a spec's methods and the calls read of it (a traced copy is given these)."""


def _dynamic(max_seqlen: Any) -> bool:
    """Whether a traced spec's ``max_seqlen`` is a symbol: an int the caller passes a new value
    of every step (a batch's longest sequence), or any with ``dynamic=True``."""
    return isinstance(max_seqlen, int) and not isinstance(max_seqlen, bool) and symbolic(
        max_seqlen)


def _traced_copy(spec: RoPESpec, cu_seqlens: Any, max_seqlen: Any) -> RoPESpec:
    """``spec`` with ``cu_seqlens`` and ``max_seqlen`` while Dynamo traces: pydantic's copy (its
    object's __dict__ copied in C) and its frozen __setattr__ cannot be traced, so Dynamo traces
    a new object given the fields (attribute by attribute: torch 2.11's Dynamo cannot update an
    object's __dict__). A symbolic ``max_seqlen`` stays a symbol (only the table's length
    bounds it, a guard on a range): made a number, each new value was a recompile."""
    key = spec.static_key  # (its float a symbol with dynamic=True: not repr'd here)
    at = STATIC_FIELDS.index("max_seqlen")
    keyed = MAX_SEQLEN_SET if _dynamic(max_seqlen) else max_seqlen
    changed = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
               "static_key": (*key[:at], keyed, *key[at + 1:]),
               "static_text": _text_with(spec.static_text, at,
                                         None if max_seqlen is None else MAX_SEQLEN_SET),
               "choice_key": _choice_key((*key[:at], max_seqlen, *key[at + 1:]))}
    new = object.__new__(RoPESpec)
    for name in _ATTRIBUTES:
        object.__setattr__(new, name, changed[name] if name in changed else getattr(spec, name))
    return new

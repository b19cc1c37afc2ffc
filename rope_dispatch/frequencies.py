"""Rotary frequencies of model families: the rates a model's rotary embedding turns by, built
as Hugging Face's rope types and TransformerEngine's options build them, and the tables made
from them (:class:`RotaryFrequencies`)."""

from __future__ import annotations

import math
import numbers
from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
import torch

from .errors import RoPEError
from .hf_defaults import with_class_defaults
from .hf_layer_types import split as split_per_layer_type
from .tracing import fake
from .table_kinds import (
    FLOAT32_MAX, CosSinCache, RateTable, _base, _count, _positive, _rotary_dim, add_frequency_type,
    angle_table, inverse_frequencies, refuse_non_finite,
)


# --- rotary frequencies of model families -----------------------------------------------------
# Hugging Face models choose their rates by a "rope type" (transformers 5.23 reads it from
# ``config.rope_parameters``); TE's RotaryPositionEmbedding by its constructor options. Each
# builder below gives a RotaryFrequencies: the rates, the factor cos and sin are multiplied by,
# and, for TE, a factor on positions. The Hugging Face builders run transformers' float32
# operations in the same order on the CPU (where transformers computes its rates when a model
# is built), so their rates equal transformers' there (bit for bit with torch 2.13; the tests,
# tests/test_tables_hf.py, allow float32 rounding).

HF_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
"""The ``rope_type`` values of ``config.rope_parameters`` that :func:`from_hf_config` reads."""

_DeviceLike = torch.device | str | int | None


@add_frequency_type
@dataclass(frozen=True, eq=False)
class RotaryFrequencies:
    """The rotation rates of one rotary family and how its cos and sin are scaled.

    - ``inv_freq``: float32 ``[d2 / 2]`` rates (radians per position), one per rotated pair.
    - ``attention_factor``: the factor cos and sin are multiplied by (transformers'
      ``attention_scaling``: YaRN and LongRoPE use it to keep attention logits in range;
      ``1.0`` for the other families).
    - ``rope_type``: the family's name (``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``,
      ``"longrope"``, ``"llama3"``; TE's options give ``"default"`` or ``"linear"``).
    - ``position_scale``: positions are multiplied by it before the rates (TE's position
      interpolation; Hugging Face's families fold their scaling into the rates and keep 1.0).
    - ``max_positions``: for rates chosen for one sequence length (dynamic NTK, LongRoPE, TE's
      interpolation), that length: the longest table they are valid for (rows of a shorter
      table are those of the long one, not the ones a shorter sequence would get). ``None``
      when the rates do not depend on the length.

    An angle table cannot carry ``attention_factor`` (YaRN's and LongRoPE's multiplier of cos
    and sin): :meth:`cos_sin_cache` includes it, and :meth:`angle_table` (like
    :meth:`rate_table`, the rates themselves for the Triton kernels to multiply out) refuses a
    factor other than 1.0 unless told that the caller applies it.
    """

    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    rope_type: str = "default"
    position_scale: float = 1.0
    max_positions: int | None = None

    def __post_init__(self) -> None:
        rates = self.inv_freq
        if not isinstance(rates, torch.Tensor) or rates.dtype != torch.float32 or rates.dim() != 1:
            shown = (
                f"dtype {str(rates.dtype).removeprefix('torch.')}, shape {tuple(rates.shape)}"
                if isinstance(rates, torch.Tensor) else type(rates).__name__
            )
            raise RoPEError(f"inv_freq must be a float32 tensor [d2 / 2], got {shown}")
        if rates.numel() < 1:
            raise RoPEError("inv_freq must hold at least one rate, got an empty tensor")
        # (rates without memory, meta or fake tensors, cannot be read: a table of them neither;
        # nor while torch.compile traces, where reading them would break the graph)
        unread = torch.compiler.is_compiling() or rates.is_meta or fake(rates)
        if not unread:
            refuse_non_finite(rates, "inv_freq")
        for name in ("attention_factor", "position_scale"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        if not isinstance(self.rope_type, str):
            raise RoPEError(f"rope_type must be a str, got {self.rope_type!r}")
        if self.max_positions is not None:
            object.__setattr__(self, "max_positions", _count("max_positions", self.max_positions))

    @property
    def rotary_dim(self) -> int:
        """``d2``: the number of channels the rates rotate (two per rate)."""
        return 2 * self.inv_freq.shape[0]

    def angle_table(
        self, max_positions: int, *, device: _DeviceLike = None, interleaved: bool = False,
        without_attention_factor: bool = False,
    ) -> torch.Tensor:
        """float32 angles ``[max_positions, 1, 1, d2]`` of positions ``0 .. max_positions - 1``.

        Each angle is one float32 product ``position * inv_freq`` (as transformers computes
        ``inv_freq @ position_ids``; TE's options multiply positions by ``position_scale``
        first). The halves layout ``[a_0 .. a_{n-1}, a_0 .. a_{n-1}]``, or pairs with
        ``interleaved``. ``device``: where the table lives (``None``: where ``inv_freq`` is).
        An angle table cannot apply ``attention_factor``: where it is not 1.0 this raises
        (use :meth:`cos_sin_cache`) unless ``without_attention_factor=True`` says the caller
        applies it, as ``RoPESpec(cos_sin_scale=attention_factor)`` does in every backend.
        """
        _check_flag("without_attention_factor", without_attention_factor)
        if self.attention_factor != 1.0 and not without_attention_factor:
            raise RoPEError(
                f"this {self.rope_type!r} table has attention_factor={self.attention_factor:.6g}, "
                "which an angle table cannot carry; use cos_sin_cache(), which includes it, or "
                "pass without_attention_factor=True and give the call's RoPESpec "
                f"cos_sin_scale={self.attention_factor!r}"
            )
        length = self._checked_length(max_positions)
        _check_flag("interleaved", interleaved)
        rates = self.inv_freq if device is None else self.inv_freq.to(device)
        return angle_table(rates, length, scale=self.position_scale, interleaved=interleaved)

    def rate_table(
        self, max_positions: int, *, device: _DeviceLike = None,
        without_attention_factor: bool = False, precise: bool = False,
    ) -> RateTable:
        """The rates as a :class:`RateTable` of ``max_positions`` rows: the same angles as
        :meth:`angle_table` (bit for bit: each is the float32 product ``position * inv_freq``),
        which the Triton kernels compute instead of reading a table row per token.

        Refused where positions are scaled (``position_scale``, TE's interpolation: the angle
        is then ``(position * scale) * rate``, which one multiply by a rate cannot reproduce;
        use :meth:`angle_table`), and, as by :meth:`angle_table`, where ``attention_factor``
        is not 1.0 unless ``without_attention_factor=True`` says the call's
        ``RoPESpec(cos_sin_scale=attention_factor)`` applies it. ``device``: where the rates
        live (``None``: where ``inv_freq`` is). ``precise=True``: exact angles, each the float64
        product reduced modulo 2*pi (:class:`RateTable`; at most 2^24 positions), not the
        float32 products of :meth:`angle_table` that models are trained with.
        """
        if self.position_scale != 1.0:
            raise RoPEError(
                f"these {self.rope_type!r} rates scale positions by "
                f"position_scale={self.position_scale:.6g} (TransformerEngine's interpolation), "
                "which a RateTable cannot carry (its angle is one product position * rate); "
                "use angle_table()"
            )
        _check_flag("without_attention_factor", without_attention_factor)
        if self.attention_factor != 1.0 and not without_attention_factor:
            raise RoPEError(
                f"this {self.rope_type!r} table has attention_factor={self.attention_factor:.6g}, "
                "which a RateTable cannot carry; use cos_sin_cache(), which includes it, or "
                "pass without_attention_factor=True and give the call's RoPESpec "
                f"cos_sin_scale={self.attention_factor!r}"
            )
        length = self._checked_length(max_positions)
        rates = self.inv_freq if device is None else self.inv_freq.to(device)
        return RateTable(rates.contiguous(), length, precise=precise)

    def cos_sin_cache(
        self, max_positions: int, *, device: _DeviceLike = None, interleaved: bool = False
    ) -> CosSinCache:
        """float32 cos and sin ``[max_positions, d2]`` of :meth:`angle_table`, multiplied by
        ``attention_factor`` as transformers' rotary modules multiply them.

        Evaluated in float64 from the float32 angles and rounded once, like
        :func:`cos_sin_cache`. Every backend that reads caches serves it as it is.
        """
        angles = self.angle_table(max_positions, device=device, interleaved=interleaved,
                                  without_attention_factor=True)
        angles = angles.view(angles.shape[0], angles.shape[3]).double()
        factor = self.attention_factor
        cos = (torch.cos(angles) * factor).float().contiguous()
        sin = (torch.sin(angles) * factor).float().contiguous()
        return CosSinCache(cos, sin)

    def _checked_length(self, max_positions: int) -> int:
        length = _count("max_positions", max_positions)
        if self.max_positions is not None and length > self.max_positions:
            raise RoPEError(
                f"max_positions={length} exceeds the {self.max_positions} positions these "
                f"{self.rope_type!r} rates were chosen for (they depend on the sequence length); "
                f"build them again for {length} positions"
            )
        return length


def _check_flag(argument: str, value: object) -> None:
    """Refuse a flag that is not a bool (a truthy string or number would pass for True)."""
    if not isinstance(value, bool):
        raise RoPEError(f"{argument} must be a bool, got {value!r}")


def _cpu_rates(dim: int, base: float) -> torch.Tensor:
    """``1 / base ** (2k / dim)`` in float32 on the CPU, where transformers computes them."""
    return inverse_frequencies(dim, base, device="cpu")


def default_frequencies(dim: int, *, rope_theta: float = 10000.0) -> RotaryFrequencies:
    """The original RoPE rates ``1 / rope_theta ** (2k / dim)`` for a rotary dim ``dim``."""
    dim = _rotary_dim(dim)
    return RotaryFrequencies(_cpu_rates(dim, _base("rope_theta", rope_theta)))


def linear_frequencies(
    dim: int, *, factor: float, rope_theta: float = 10000.0
) -> RotaryFrequencies:
    """Position interpolation: the default rates divided by ``factor`` (positions stretched
    ``factor`` times, so ``factor`` times the trained length fits)."""
    dim = _rotary_dim(dim)
    factor = _positive("factor", factor)
    rates = _cpu_rates(dim, _base("rope_theta", rope_theta)) / factor
    return RotaryFrequencies(rates, rope_type="linear")


def dynamic_ntk_frequencies(
    dim: int, *, factor: float, max_position_embeddings: int, seq_len: int,
    rope_theta: float = 10000.0,
) -> RotaryFrequencies:
    """Dynamic NTK scaling: the default rates of a larger base, chosen for ``seq_len``.

    Up to ``max_position_embeddings`` positions the rates are the default ones. Beyond, the
    base grows to ``rope_theta * (factor * seq_len / max_position_embeddings - factor + 1)
    ** (dim / (dim - 2))``: transformers recomputes it each time a sequence outgrows the last
    length it saw, so the rates for ``seq_len`` are those of a sequence of that length.
    """
    dim = _rotary_dim(dim)
    if dim < 3:
        raise RoPEError(
            f"dim must be > 2 for dynamic NTK scaling (its exponent is dim / (dim - 2)), got {dim}"
        )
    factor = _positive("factor", factor)
    original = _count("max_position_embeddings", max_position_embeddings)
    length = _count("seq_len", seq_len)
    base = _base("rope_theta", rope_theta)
    if length > original:
        try:
            base = base * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
        except OverflowError:  # float's power (or the division) past float64's range
            base = math.inf
        if not math.isfinite(base):
            raise RoPEError(
                f"factor={factor!r} and seq_len={length} grow the base past float64's range: "
                f"rope_theta * (factor * seq_len / max_position_embeddings - factor + 1) ** "
                f"(dim / (dim - 2)) with rope_theta={rope_theta!r}, max_position_embeddings="
                f"{original} and dim={dim}"
            )
        if base > FLOAT32_MAX:  # the rates are float32 powers of it: all but the first 0
            raise RoPEError(
                f"factor={factor!r} and seq_len={length} grow the base to {base:.6g}, past "
                f"float32's largest number {FLOAT32_MAX:.6g} (the rates are float32 powers of "
                f"it; every rate but the first would be 0), with rope_theta={rope_theta!r}, "
                f"max_position_embeddings={original} and dim={dim}"
            )
    return RotaryFrequencies(_cpu_rates(dim, base), rope_type="dynamic", max_positions=length)


def _yarn_magnitude(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(
    dim: int, *, factor: float, original_max_position_embeddings: int,
    rope_theta: float = 10000.0, beta_fast: float = 32.0, beta_slow: float = 1.0,
    mscale: float | None = None, mscale_all_dim: float | None = None,
    attention_factor: float | None = None, truncate: bool = True,
) -> RotaryFrequencies:
    """YaRN (arXiv 2309.00071): pairs that turn fast over the trained length keep their rate,
    slow ones are interpolated by ``factor``, and a linear ramp blends the pairs between.

    The ramp runs over pair indices from the pair that turns ``beta_fast`` times in
    ``original_max_position_embeddings`` positions to the one that turns ``beta_slow`` times
    (rounded outwards when ``truncate``, clipped to ``[0, dim - 1]``). ``attention_factor``
    defaults to ``0.1 ln(factor) + 1``, or, when ``mscale`` and ``mscale_all_dim`` are both
    given and non-zero, to the ratio of that term with each of them as multiplier (DeepSeek's
    form); a given ``attention_factor`` is used as it is.
    """
    dim = _rotary_dim(dim)
    if dim % 2:
        raise RoPEError(f"dim must be even for YaRN (one ramp value per pair), got {dim}")
    factor = _positive("factor", factor)
    original = _count("original_max_position_embeddings", original_max_position_embeddings)
    base = _base("rope_theta", rope_theta)
    if base == 1.0:
        raise RoPEError("rope_theta must not be 1 for YaRN (its ramp divides by log(rope_theta))")
    fast, slow = _positive("beta_fast", beta_fast), _positive("beta_slow", beta_slow)
    if not isinstance(truncate, bool):
        raise RoPEError(f"truncate must be a bool, got {truncate!r}")
    for argument, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not math.isfinite(value)):  # (NumPy numbers too)
            raise RoPEError(f"{argument} must be a finite number or None, got {value!r}")
    # as Python floats: NumPy float32 terms would compute the attention factor in float32
    mscale, mscale_all_dim = (None if v is None else float(v) for v in (mscale, mscale_all_dim))
    if attention_factor is None:
        if mscale and mscale_all_dim:
            above, below = _yarn_magnitude(factor, mscale), _yarn_magnitude(factor, mscale_all_dim)
            if below == 0 or not above / below > 0:
                raise RoPEError(
                    f"mscale={mscale!r} and mscale_all_dim={mscale_all_dim!r} give YaRN's "
                    f"attention factor (0.1 ln(factor) mscale + 1) / (0.1 ln(factor) "
                    f"mscale_all_dim + 1) = {above:.6g} / {below:.6g} with factor={factor!r}; "
                    "expected a number > 0"
                )
            attention_factor = above / below
        else:
            attention_factor = _yarn_magnitude(factor)

    def pair_turning(turns: float) -> float:
        # The (fractional) pair index whose rate makes `turns` full turns in `original` positions.
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    ramp_start, ramp_end = pair_turning(fast), pair_turning(slow)
    if truncate:
        ramp_start, ramp_end = math.floor(ramp_start), math.ceil(ramp_end)
    ramp_start, ramp_end = max(ramp_start, 0), min(ramp_end, dim - 1)
    if ramp_start == ramp_end:
        ramp_end += 0.001  # a ramp of width 0 would divide by zero

    pairs = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
    wavelength_terms = base ** (pairs / dim)
    kept = 1.0 / wavelength_terms
    interpolated = 1.0 / (factor * wavelength_terms)
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu") - ramp_start
    ramp = ramp / (ramp_end - ramp_start)
    kept_share = 1 - ramp.clamp(0, 1)
    rates = interpolated * (1 - kept_share) + kept * kept_share
    return RotaryFrequencies(rates, attention_factor=attention_factor, rope_type="yarn")


def _factor_list(argument: str, values: object, count: int) -> torch.Tensor:
    if isinstance(values, torch.Tensor) or type(values).__module__ == "numpy":  # (an ndarray)
        values = values.tolist()  # type: ignore[union-attr]
    if (
        not isinstance(values, (list, tuple)) or len(values) != count
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < math.inf
                   for v in values)  # Python or NumPy numbers, as the other arguments
    ):
        raise RoPEError(
            f"{argument} must be {count} finite positive numbers (one per pair), got {values!r}"
        )
    return torch.tensor(values, dtype=torch.float32, device="cpu")


def longrope_frequencies(
    dim: int, *, short_factor: Sequence[float], long_factor: Sequence[float],
    original_max_position_embeddings: int, seq_len: int, factor: float,
    rope_theta: float = 10000.0, attention_factor: float | None = None,
) -> RotaryFrequencies:
    """LongRoPE (Phi-3 and later): the default rates, each divided by its own factor.

    ``long_factor`` serves a sequence longer than ``original_max_position_embeddings``
    (``seq_len`` decides, as transformers decides by the running sequence length),
    ``short_factor`` one up to that length. ``attention_factor`` defaults to
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 when ``factor <= 1``).
    """
    dim = _rotary_dim(dim)
    count = (dim + 1) // 2
    original = _count("original_max_position_embeddings", original_max_position_embeddings)
    length = _count("seq_len", seq_len)
    factor = _positive("factor", factor)
    base = _base("rope_theta", rope_theta)
    # both lists are checked, whichever the length selects: a bad one is a bad model config
    short = _factor_list("short_factor", short_factor, count)
    long = _factor_list("long_factor", long_factor, count)
    pair_factors = long if length > original else short
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        elif original < 2:
            raise RoPEError(
                "original_max_position_embeddings must be >= 2 to derive LongRoPE's attention "
                f"factor (it divides by its log), got {original}"
            )
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    rates = 1.0 / (pair_factors * base ** exponents)
    return RotaryFrequencies(
        rates, attention_factor=attention_factor, rope_type="longrope", max_positions=length
    )


def llama3_frequencies(
    dim: int, *, factor: float, original_max_position_embeddings: int,
    low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, rope_theta: float = 10000.0,
) -> RotaryFrequencies:
    """Llama 3.1's rates: by wavelength ``2 pi / rate``. Wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` keep their rate, those longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and the
    band between blends the two linearly in ``original / wavelength``."""
    dim = _rotary_dim(dim)
    factor = _positive("factor", factor)
    original = _count("original_max_position_embeddings", original_max_position_embeddings)
    low = _positive("low_freq_factor", low_freq_factor)
    high = _positive("high_freq_factor", high_freq_factor)
    if high <= low:
        raise RoPEError(
            f"high_freq_factor must be greater than low_freq_factor, got high_freq_factor={high} "
            f"and low_freq_factor={low}"
        )
    rates = _cpu_rates(dim, _base("rope_theta", rope_theta))
    wavelengths = 2 * math.pi / rates
    kept_below, scaled_above = original / high, original / low
    scaled = torch.where(wavelengths > scaled_above, rates / factor, rates)
    blend = (original / wavelengths - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    between = (wavelengths >= kept_below) & (wavelengths <= scaled_above)
    return RotaryFrequencies(torch.where(between, blended, scaled), rope_type="llama3")


def _te_position_scale(
    max_positions: int, seq_len_interpolation_factor: float | None,
    pretrained_max_position_embeddings: int | None,
) -> float:
    """TransformerEngine's position interpolation as a factor on positions (1.0: none).

    It applies only when both options are set: ``1 / factor``, or, for a table longer than
    ``pretrained * factor``, ``pretrained / max_positions`` (the table then just fits).
    """
    if seq_len_interpolation_factor is None or pretrained_max_position_embeddings is None:
        return 1.0
    if max_positions > pretrained_max_position_embeddings * seq_len_interpolation_factor:
        return 1 / (max_positions / pretrained_max_position_embeddings)
    return 1 / seq_len_interpolation_factor


def _length(argument: str, value: object) -> int:
    """A length option as an int: a positive int, or a float that is a whole number (a JSON
    config's ``4096.0``, which transformers' and TE's arithmetic take as 4096); anything else is
    a RoPEError naming ``argument``."""
    if isinstance(value, float) or (  # NumPy floats too; not bools, ints or NumPy ints
            isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)):
        number = float(value)
        if not (math.isfinite(number) and number.is_integer() and number >= 1):
            raise RoPEError(
                f"{argument} must be a positive int (or a float of a whole number), got {value!r}"
            )
        return int(number)
    return _count(argument, value)


def from_te_options(
    dim: int, max_positions: int, *, rotary_percent: float = 1.0,
    seq_len_interpolation_factor: float | None = None,
    pretrained_max_position_embeddings: int | None = None, rotary_base: float = 10000.0,
    device: _DeviceLike = None,
) -> RotaryFrequencies:
    """The rates of TE's ``RotaryPositionEmbedding(dim, rotary_percent,
    seq_len_interpolation_factor, pretrained_max_position_embeddings, rotary_base)`` for a
    table of ``max_positions`` rows.

    ``angle_table(max_positions, interleaved=...)`` then equals that module's
    ``forward(max_positions)`` bit for bit when the rates are computed on the same device
    (``device``; TE uses the current CUDA device, ``None`` means torch's default device).
    Interpolation (both options set) scales positions, not rates, by ``1 / factor``, or by
    ``pretrained / max_positions`` for a table longer than ``pretrained * factor``: the scale
    depends on ``max_positions``, so the result records that length.
    """
    dim = _rotary_dim(dim, least=1)  # an odd dim is rounded up, as TE's module rounds it
    length = _count("max_positions", max_positions)
    percent = _positive("rotary_percent", rotary_percent)
    if percent > 1.0:
        raise RoPEError(f"rotary_percent must be in (0, 1], got {rotary_percent!r}")
    if percent < 1.0:
        dim = _rotary_dim(int(dim * percent), "the rotary dim int(dim * rotary_percent) = "
                          f"int({dim} * {percent})", least=1)
    if seq_len_interpolation_factor is not None:
        seq_len_interpolation_factor = _positive(
            "seq_len_interpolation_factor", seq_len_interpolation_factor
        )
    if pretrained_max_position_embeddings is not None:  # (4096.0 too, as TE's module takes)
        pretrained_max_position_embeddings = _length(
            "pretrained_max_position_embeddings", pretrained_max_position_embeddings
        )
    interpolating = (
        seq_len_interpolation_factor is not None and pretrained_max_position_embeddings is not None
    )
    scale = _te_position_scale(
        length, seq_len_interpolation_factor, pretrained_max_position_embeddings
    )
    rates = inverse_frequencies(dim, _base("rotary_base", rotary_base), device=device)
    return RotaryFrequencies(
        rates, rope_type="linear" if interpolating else "default", position_scale=scale,
        max_positions=length if interpolating else None,
    )


# --- reading a Hugging Face config --------------------------------------------------------------
# Duck-typed: any object with transformers' attribute names works, and transformers is never
# imported. Where a value lives and what it defaults to follow transformers 5.23's
# modeling_rope_utils (RotaryEmbeddingConfigMixin.standardize_rope_params and the functions of
# ROPE_INIT_FUNCTIONS).


_FLAT_KEYS = frozenset((
    "rope_type", "type", "rope_theta", "factor", "partial_rotary_factor",
    "original_max_position_embeddings",
))
"""Fields of flat rope parameters: a mapping with one of them is not per layer type, whatever
its values (None too)."""


def _hf_rope_parameters(
    config: object, layer_type: str | None, model_type: object = None
) -> tuple[dict, str]:
    """A copy of the config's flat rope parameters, and how to name them in messages.
    ``model_type``: the config's (or its composite's), which may make it Gemma 3's."""
    where = "config.rope_parameters"
    parameters = _hf_attribute(config, "rope_parameters")
    scaling = None if parameters else _hf_attribute(config, "rope_scaling")
    if scaling:  # a transformers 4 config
        where, parameters = "config.rope_scaling", scaling
    parameters = parameters or {}
    if not isinstance(parameters, Mapping):
        raise RoPEError(f"{where} must be a mapping of rope parameters, got {parameters!r}")
    if where == "config.rope_scaling" or not parameters:  # flat fields transformers may split
        parameters = split_per_layer_type(
            lambda name: _hf_attribute(config, name), parameters, model_type) or parameters
    # transformers' YaRN reads "truncate" at the top level only, beside the layer types too
    layers = {key: value for key, value in parameters.items() if key != "truncate"}
    per_layer = bool(layers) and all(
        value is None or isinstance(value, Mapping) for value in layers.values()
    ) and not any(key in _FLAT_KEYS for key in parameters)  # ({"rope_type": None} is flat)
    names = ", ".join(map(repr, layers))
    if layer_type is None:
        if per_layer:
            raise RoPEError(
                f"{where} holds rope parameters per layer type ({names}); "
                "pass layer_type= to choose one"
            )
        return dict(parameters), where
    if not per_layer or layer_type not in layers:
        known = f"its layer types are {names}" if per_layer else (
            "they are not given per layer type"
        )
        raise RoPEError(f"layer_type={layer_type!r} is not in {where}: {known}")
    if parameters[layer_type] is None:
        raise RoPEError(
            f"{where}[{layer_type!r}] is None: layers of type {layer_type!r} use no rotary embedding"
        )
    chosen = dict(parameters[layer_type])
    chosen.pop("truncate", None)  # a layer type's own is not read: the top level's, else True
    if "truncate" in parameters:
        chosen["truncate"] = parameters["truncate"]
    return chosen, f"{where}[{layer_type!r}]"


def _hf_attribute(config: object, name: str) -> object:
    """``config.<name>``, ``None`` when unset; a RoPEError where the config holds it per layer
    (transformers raises a RuntimeError when the global value of a per-layer attribute is read)
    or reading it fails otherwise (a property of a config class raising). A mapping (a
    config.json's dict, or a dict whose missing attributes raise KeyError) is read by its keys
    where it has no such attribute."""
    keyed = isinstance(config, Mapping)
    try:
        found = getattr(config, name, None)
    except RuntimeError as error:
        raise RoPEError(
            f"config.{name} differs between layers ({error}); pass layer_type= or the layer's own "
            "config (config.per_layer_config[i])"
        ) from error
    except Exception as error:
        if keyed and name not in config:  # an attribute-dict's missing key: unset
            return None
        raise RoPEError(
            f"config.{name} could not be read: {type(error).__name__}: {error}"
        ) from error
    return config.get(name) if found is None and keyed else found


_TEXT_SECTIONS = ("text_encoder", "decoder", "generator", "text_config", "thinker_config",
                  "decoder_config")
"""Where a composite config keeps its text model's (transformers' get_text_config; Qwen Omni's
overrides it with its thinker's, Dia's with its decoder's)."""


def _hf_text_section(config: object) -> object:
    """The text section of a composite config given as its config.json's fields (no
    ``get_text_config``), or the config itself when it has none."""
    found = [
        (name, section) for name in _TEXT_SECTIONS
        if (section := _hf_attribute(config, name)) is not None
        and not isinstance(section, (str, bytes, numbers.Number, Sequence))
    ]
    if len(found) > 1:
        raise RoPEError(
            f"config has several text sections ({', '.join(name for name, _ in found)}); pass "
            "the one whose rotary embedding is wanted"
        )
    return _hf_text_section(found[0][1]) if found else config  # (the thinker's text_config)


def _hf_layer_config(config: object, layer_type: str | None) -> object:
    """The config transformers reads a model's rotary embedding from: the text model's of a
    composite (vision-language) config, and of a heterogeneous config the one of
    ``layer_type``'s layers (``config.per_layer_config[layer_type]``), where head dims may
    differ between layer types."""
    text_config = _hf_attribute(config, "get_text_config")
    if callable(text_config):
        try:
            config = text_config() or config
        except Exception as error:
            raise RoPEError(
                f"config.get_text_config() failed: {type(error).__name__}: {error}"
            ) from error
    elif text_config is None:  # a config.json's fields: its text section, as transformers finds it
        config = _hf_text_section(config)
    if layer_type is not None:
        per_layer = _hf_attribute(config, "per_layer_config")
        if per_layer is not None:
            try:
                return per_layer[layer_type]
            except (KeyError, IndexError, TypeError, ValueError):
                pass  # not a per-layer-type config: transformers reads the config itself
            if isinstance(per_layer, Mapping):  # a config.json's: overrides by layer index
                return _hf_layer_overrides(config, per_layer, layer_type)
    return config


def _hf_layer_overrides(config: object, per_layer: Mapping, layer_type: str) -> object:
    """``config`` as the layers of ``layer_type`` see it, where its ``per_layer_config`` is a
    config.json's: overrides by layer index (``"05"`` or ``5``) over the global fields, which
    transformers applies to each layer (overrides equal to the global value count as none, as
    transformers drops them). ``config`` itself where it names no ``layer_types`` holding
    ``layer_type``, or where layers of that type differ (``per_layer_config[layer_type]``
    raises ValueError there, and transformers' rotary embedding reads the global config)."""
    layer_types = _hf_attribute(config, "layer_types")
    if not isinstance(layer_types, Sequence) or isinstance(layer_types, str) or (
            layer_type not in layer_types):
        return config
    overrides = {}
    for key, entry in per_layer.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise RoPEError(f"config.per_layer_config has a key {key!r}; expected layer indices "
                            "(a config.json's overrides by layer)") from None
        if not isinstance(entry, Mapping):
            raise RoPEError(f"config.per_layer_config[{key!r}] must be a mapping of overrides, "
                            f"got {entry!r}")
        overrides[index] = {name: value for name, value in entry.items()
                            if name != "skip" and value != _hf_attribute(config, name)}
    layers = [index for index, kind in enumerate(layer_types) if kind == layer_type]
    chosen = overrides.get(layers[0], {})
    if not chosen or any(overrides.get(index, {}) != chosen for index in layers):
        return config  # (layers of the type that differ: transformers reads the global config)
    return ChainMap(chosen, config if isinstance(config, Mapping) else vars(config))


_HF_ALIASES = {"head_dim": ("attention_head_dim", "kv_channels"), "hidden_size": (
    "n_embd", "d_model"), "num_attention_heads": ("n_head", "n_heads")}
"""The fields transformers' configs map these names to (their attribute_map: Zamba 2's and
JetMoe's head dim; GPT-J's, CodeGen's and DBRX's width and head count): a config.json's."""


def _hf_aliased(config: object, name: str) -> tuple[str, object]:
    """``(field, value)`` of ``config.<name>`` or of its first alias set; ``(name, None)``."""
    for field in (name, *_HF_ALIASES[name]):
        if (found := _hf_attribute(config, field)) is not None:
            return field, found
    return name, None


def _hf_head_dim(config: object, model_type: object = None) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when it is unset, each
    under the names transformers maps (:data:`_HF_ALIASES`); as their configs set it, JetMoe's
    is ``kv_channels`` (default 128) and Zamba 2's ``2 * hidden_size // num_attention_heads``
    (where no head dim is given: its config keeps a given one)."""
    name, head_dim = _hf_aliased(config, "head_dim")
    if head_dim is None and model_type == "jetmoe":
        head_dim = 128
    if head_dim is None:
        hidden_name, hidden = _hf_aliased(config, "hidden_size")
        heads_name, heads = _hf_aliased(config, "num_attention_heads")
        if hidden is None or heads is None:
            raise RoPEError(
                "config must have head_dim, or hidden_size and num_attention_heads; got "
                f"head_dim=None, hidden_size={hidden!r}, num_attention_heads={heads!r}"
            )
        name, head_dim = "head_dim", (_count(f"config.{hidden_name}", hidden) * (
            2 if model_type == "zamba2" else 1)) // _count(f"config.{heads_name}", heads)
    return _count(f"config.{name}", head_dim)


def from_hf_config(
    config: object, max_positions: int, *, layer_type: str | None = None
) -> RotaryFrequencies:
    """The rotary frequencies of a Hugging Face model config, as transformers 5.23 computes them.

    Reads ``config.rope_parameters`` (``rope_type`` and its fields; ``config.rope_scaling`` for
    transformers 4 configs) with ``rope_theta``, ``partial_rotary_factor``, ``head_dim`` (or
    ``hidden_size // num_attention_heads``) and ``max_position_embeddings`` (a mapping's keys,
    for a config.json's dict), with transformers' defaults (a config.json's missing head dim and
    lengths from its model_type's config class where transformers is installed: hf_defaults).
    The rotary dim is ``int(head_dim * partial_rotary_factor)``; every family honours ``partial_rotary_factor`` (as GPT-NeoX, Phi
    or GLM do; Llama's own default ignores it). ``layer_type`` picks one entry of
    per-layer-type parameters (Gemma 3's ``"sliding_attention"`` and ``"full_attention"``; a
    transformers 4 Gemma 3 config's ``rope_local_base_freq`` is its sliding layers' base), and
    of a heterogeneous config (Gemma 4's, EmbeddingGemma 2's) that layer type's own config,
    with its own head dim. A composite (vision-language) config is read through its
    ``get_text_config()`` (a config.json's through its ``text_config``). A config with a
    ``rotary_dim`` field and no ``rope_parameters`` (GPT-J, CodeGen) rotates that many channels
    (an even number); those models rotate interleaved pairs (``RoPESpec(interleaved=True)``).
    One with ``qk_rope_head_dim`` and no partial factor (DeepSeek's latent attention) rotates
    that many channels, as transformers sets them. LongRoPE's ``short_mscale`` and
    ``long_mscale`` (Phi-3.5-MoE) are its attention factor up to and beyond
    ``original_max_position_embeddings``, as that model's rotary embedding applies them.

    ``max_positions`` is the length of the sequence the table serves. Dynamic NTK and LongRoPE
    choose their rates by it, as transformers does for a sequence of that length: dynamic NTK
    keeps the default rates up to ``max_position_embeddings`` and rescales for anything longer;
    LongRoPE uses ``short_factor`` up to ``original_max_position_embeddings`` and ``long_factor``
    beyond. The result records that length (``max_positions``) for those families. Then::

        f = rope_dispatch.tables.from_hf_config(model.config, 4096)
        table = f.cos_sin_cache(4096, device="cuda")  # attention factor included

    Raises :class:`~rope_dispatch.RoPEError` for an unsupported ``rope_type`` (naming the
    supported ones: :data:`HF_ROPE_TYPES`), a missing field, or a value out of range.
    """
    length = _count("max_positions", max_positions)
    if layer_type is not None and not isinstance(layer_type, str):
        raise RoPEError(f"layer_type must be a layer type's name (a str) or None, got {layer_type!r}")
    outer_type = _hf_attribute(config, "model_type")
    original, config = config, _hf_layer_config(config, layer_type)
    # a composite's text section without a model_type is built as the composite's text config
    own_type = _hf_attribute(config, "model_type")
    model_type = own_type or outer_type
    if not callable(_hf_attribute(config, "get_text_config")):  # a config.json's fields
        config = with_class_defaults(config, model_type, (
            None if own_type is not None or config is original else original))
    parameters, where = _hf_rope_parameters(config, layer_type, model_type)
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "mrope":  # Qwen2-VL's checkpoints: default rates, as transformers reads them
        rope_type = "default"
    if rope_type == "su":  # Phi-3's first checkpoints: transformers' Phi-3 config renames it
        rope_type = "longrope"
    if rope_type not in HF_ROPE_TYPES:
        raise RoPEError(
            f"{where}['rope_type'] is {rope_type!r}; rope-dispatch builds tables for the rope "
            f"types {', '.join(map(repr, HF_ROPE_TYPES))}"
        )

    def value(key: str, fallback: object = None) -> object:
        found = parameters.get(key)
        return fallback if found is None else found

    def required(key: str) -> object:
        if parameters.get(key) is None:
            raise RoPEError(f"{where} has no {key!r}, which rope_type {rope_type!r} needs")
        return parameters[key]

    def max_position_embeddings() -> int:
        found = _hf_attribute(config, "max_position_embeddings")
        if found is None:
            raise RoPEError(
                f"config has no max_position_embeddings, which rope_type {rope_type!r} needs"
            )
        return _length("config.max_position_embeddings", found)

    def original_max_position_embeddings() -> int:
        # transformers gives a config attribute of this name priority (Phi-3 keeps it there).
        found, name = None, "config.original_max_position_embeddings"
        if layer_type is None:
            found = _hf_attribute(config, "original_max_position_embeddings")
        if found is None:
            found = parameters.get("original_max_position_embeddings")
            name = f"{where}['original_max_position_embeddings']"
        return max_position_embeddings() if found is None else _length(name, found)

    # GPT-NeoX's configs (and transformers 4's GPTNeoXConfig) name the base and the partial
    # factor rotary_emb_base and rotary_pct; transformers 5 reads them as these two.
    theta = value("rope_theta", _hf_attribute(config, "rope_theta"))
    if theta is None:
        theta = _hf_attribute(config, "rotary_emb_base")
    if theta is None:
        theta = _hf_attribute(config, "default_theta") or 10000.0
    partial_name = f"{where}['partial_rotary_factor']"
    partial = value("partial_rotary_factor", _hf_attribute(config, "partial_rotary_factor"))
    if partial is None and _hf_attribute(config, "rotary_pct") is not None:
        partial_name, partial = "config.rotary_pct", _hf_attribute(config, "rotary_pct")
    # DeepSeek's latent attention (MLA; Kimi K2, GLM-4.7-Flash, MiniCPM3 too) rotates
    # qk_rope_head_dim channels of each head: transformers 5.23's configs set head_dim to it (or
    # the partial factor to its share of head_dim); a config.json gives neither. Where the
    # config always sets head_dim to it, a partial factor given applies to it.
    rope_head_dim = _hf_attribute(config, "qk_rope_head_dim") if partial is None or model_type in (
        "deepseek_v2", "deepseek_v3", "kimi_linear", "minicpm3", "youtu", "axk1", "glm4_moe_lite"
    ) else None
    partial = 1.0 if partial is None else _positive(partial_name, partial)
    if partial > 1.0:
        raise RoPEError(f"{partial_name} must be in (0, 1], got {partial!r}")
    head_dim = (
        _hf_head_dim(config, model_type) if rope_head_dim is None
        else _count("config.qk_rope_head_dim", rope_head_dim)
    )
    dim = int(head_dim * partial)
    # GPT-J and CodeGen give their rotated channels outright (and no rope_parameters); where a
    # config has rope_parameters, transformers' rotary modules read the partial factor, not a
    # rotary_dim field beside it (MiniMax-M3's config keeps one that its model does not read,
    # with rope_parameters or, in a config.json, rope_theta beside it).
    rotary_dim = None if _hf_attribute(config, "rope_parameters") or model_type in (
        "minimax_m3_vl", "minimax_m3_vl_text") else _hf_attribute(config, "rotary_dim")
    if rotary_dim is not None:
        dim = _count("config.rotary_dim", rotary_dim)
        if dim > head_dim:
            raise RoPEError(
                f"config.rotary_dim={dim} is more than the head dim {head_dim}; expected at most that"
            )
        if dim < 2 or dim % 2:  # GPT-J's and CodeGen's modules rotate pairs of those channels
            raise RoPEError(
                f"config.rotary_dim must be an even int >= 2 (the channels rotate in pairs), "
                f"got {dim}"
            )
    if dim < 2:
        raise RoPEError(
            f"the rotary dim int(head_dim * partial_rotary_factor) = int({head_dim} * {partial}) "
            f"= {dim} must be >= 2"
        )

    try:
        if rope_type == "default":
            return default_frequencies(dim, rope_theta=theta)
        if rope_type == "linear":
            return linear_frequencies(dim, factor=required("factor"), rope_theta=theta)
        if rope_type == "dynamic":
            # transformers rescales beyond max_position_embeddings (not the original length).
            return dynamic_ntk_frequencies(
                dim, factor=required("factor"), max_position_embeddings=max_position_embeddings(),
                seq_len=length, rope_theta=theta,
            )
        original = original_max_position_embeddings()
        if rope_type == "llama3":
            return llama3_frequencies(
                dim, factor=required("factor"), original_max_position_embeddings=original,
                low_freq_factor=required("low_freq_factor"),
                high_freq_factor=required("high_freq_factor"), rope_theta=theta,
            )
        # yarn and longrope derive a missing factor from the two lengths.
        factor = value("factor")
        if factor is None:
            factor = max_position_embeddings() / original
        if rope_type == "yarn":
            truncate = parameters.get("truncate", True)
            return yarn_frequencies(
                dim, factor=factor, original_max_position_embeddings=original, rope_theta=theta,
                beta_fast=value("beta_fast") or 32.0, beta_slow=value("beta_slow") or 1.0,
                mscale=value("mscale"), mscale_all_dim=value("mscale_all_dim"),
                attention_factor=value("attention_factor"),
                truncate=False if truncate is None else truncate,
            )
        # Phi-3.5-MoE gives its attention factor for each regime; its rotary embedding applies
        # the one of the running length (transformers 5.23 then keeps short_factor's rates at
        # any length, which its Phi-3 models and this function switch by that length).
        # Both are checked (here, so that a bad one is named as what it is), as both lists.
        mscales = {key: value(key) for key in ("short_mscale", "long_mscale")}
        mscales = {key: None if v is None else _positive(key, v) for key, v in mscales.items()}
        mscale = mscales["long_mscale" if length > original else "short_mscale"]
        return longrope_frequencies(
            dim, short_factor=required("short_factor"), long_factor=required("long_factor"),
            original_max_position_embeddings=original, seq_len=length, factor=factor,
            rope_theta=theta, attention_factor=value("attention_factor") if mscale is None else mscale,
        )
    except RoPEError as error:
        if str(error).startswith("config"):  # already names the config field
            raise
        raise RoPEError(f"{where} (rope_type {rope_type!r}): {error}") from error


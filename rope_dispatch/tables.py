"""Rotary tables, public in one place: the table kinds a call reads (the float32 angle table
``freqs``, cos/sin caches, an engine's pair cache, rate tables; :mod:`.table_kinds`) and the
builders of every model family's rates and tables (:mod:`.frequencies`)."""

from __future__ import annotations

from .frequencies import (
    HF_ROPE_TYPES, RotaryFrequencies, default_frequencies, dynamic_ntk_frequencies,
    from_hf_config, from_te_options, linear_frequencies, llama3_frequencies, longrope_frequencies,
    yarn_frequencies,
)
from .table_kinds import (
    PRECISE_MAX_ROWS, TABLE_KINDS, CosSinCache, PairCosSinCache, RateTable, RotaryTable,
    address_reader, angle_table, angles_2d, cos_sin_cache, inverse_frequencies, kernel_tables,
    multimodal_rows, reduced_angle_table, table_address, table_cos_sin, table_kind,
    table_requires_grad, table_shape, table_tensors, turn_fractions,
)

__all__ = [
    "HF_ROPE_TYPES", "PRECISE_MAX_ROWS", "TABLE_KINDS", "CosSinCache", "PairCosSinCache", "RateTable",
    "RotaryFrequencies", "RotaryTable", "address_reader", "angle_table", "angles_2d",
    "cos_sin_cache", "default_frequencies", "dynamic_ntk_frequencies", "from_hf_config",
    "from_te_options", "inverse_frequencies", "kernel_tables", "linear_frequencies",
    "llama3_frequencies", "longrope_frequencies", "multimodal_rows", "reduced_angle_table",
    "table_address", "table_cos_sin", "table_kind", "table_requires_grad", "table_shape",
    "table_tensors", "turn_fractions", "yarn_frequencies",
]

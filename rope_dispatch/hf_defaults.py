"""The fields a config.json (a dict or namespace of its fields) lacks, as transformers' config
class of its ``model_type`` sets them: read by :func:`rope_dispatch.tables.from_hf_config`.
Where transformers is not installed, or the class refuses the fields, nothing is filled."""

from __future__ import annotations

import copy
import importlib.util
from collections import ChainMap
from collections.abc import Mapping
from types import SimpleNamespace

FIELDS = ("head_dim", "hidden_size", "num_attention_heads", "max_position_embeddings",
          "original_max_position_embeddings", "default_theta", "partial_rotary_factor")
"""The fields filled: those whose class default (or value derived from the other fields in the
class's ``__init__``, as Llama's ``head_dim``) changes the rates."""

_FLAT = {"default_theta": "rope_theta", "partial_rotary_factor": "partial_rotary_factor"}
"""Fields taken from the built config's flat rope parameters: ``default_theta`` is its base,
read where the fields give no base (from_hf_config reads it last)."""


def _plain(value: object) -> object:
    """A namespace's fields as a dict, recursively (what a config class takes)."""
    if isinstance(value, SimpleNamespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


def _config_class(model_type: str) -> type | None:
    """transformers' config class of ``model_type``, ``None`` when there is none."""
    if importlib.util.find_spec("transformers") is None:
        return None
    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[model_type]
    except Exception:  # an unknown model_type, or a transformers that fails to import
        return None
    return cls if isinstance(cls, type) else None


def _fields(config: object) -> Mapping | None:
    """A config.json's fields: the mapping itself, or a namespace's attributes."""
    fields = config if isinstance(config, Mapping) else getattr(config, "__dict__", None)
    return fields if isinstance(fields, Mapping) else None


def with_class_defaults(config: object, model_type: object, outer: object = None) -> object:
    """``config`` (a config.json's fields: a mapping or a namespace) with each of
    :data:`FIELDS` that it lacks (or holds as ``None``) taken from transformers' config class of
    ``model_type`` built from those fields, so that derived defaults follow them; the config's
    own fields come first, but for ``head_dim``: the built class's, which transformers' rotary
    embeddings read (the latent-attention classes replace a given one by qk_rope_head_dim).
    ``outer``: the composite config whose text section ``config`` is, where the section has no
    model_type of its own: the composite (of ``model_type``) is built, and its
    ``get_text_config()`` read (only for the fields the section lacks). ``config`` itself where
    nothing is filled."""
    if not isinstance(model_type, str):
        return config
    fields, whole = _fields(config), _fields(config if outer is None else outer)
    cls = _config_class(model_type)
    if fields is None or whole is None or cls is None:
        return config
    try:
        built = cls(**copy.deepcopy(_plain(dict(whole))))
        if outer is not None:
            built = built.get_text_config()
    except Exception:  # the class refuses these fields: read them as they are
        return config
    filled = {}
    for name in FIELDS:
        # (a head_dim the class replaces: its own; a composite's is read for a missing one only)
        if fields.get(name) is None or (name == "head_dim" and outer is None):
            try:
                found = _flat(built, _FLAT[name]) if name in _FLAT else getattr(built, name, None)
            except Exception:  # (a per-layer attribute read globally)
                found = None
            if found is not None:
                filled[name] = found
    if fields.get("rope_parameters") is None and fields.get("rope_scaling") is None:
        scaled = _flat(built, None)  # a class whose default rope parameters scale (GPT-OSS's)
        if scaled and scaled.get("rope_type", scaled.get("type")) not in (None, "default"):
            filled["rope_parameters"] = scaled
    return ChainMap(filled, fields) if filled else config


def _flat(built: object, key: str | None) -> object:
    """``key`` of the built config's flat rope parameters (its class default where the fields
    give none; a copy of them all for ``None``), ``None`` where it has none or keeps them per
    layer type."""
    parameters = getattr(built, "rope_parameters", None)
    if not isinstance(parameters, Mapping) or any(
            isinstance(value, Mapping) for value in parameters.values()):
        return None
    if key is None:
        return copy.deepcopy(dict(parameters))
    found = parameters.get(key)
    return found if isinstance(found, (int, float)) and not isinstance(found, bool) else None

"""How transformers 5.23 splits a config.json's flat rope fields per layer type, for the model
types whose configs do so (their ``convert_rope_params_to_dict``): read by
:func:`rope_dispatch.tables.from_hf_config` for a transformers 4 config, a config.json's dict
or namespace, whose fields are still flat."""

from __future__ import annotations

from collections.abc import Callable, Mapping

_GEMMA3 = ("rope_theta", 1_000_000.0, "rope_local_base_freq", 10_000.0, ("full_attention",), {})
_MODERNBERT = ("global_rope_theta", 160_000.0, "local_rope_theta", 10_000.0,
               ("full_attention", "sliding_attention"), {})
SPLITS: dict[str, tuple] = {
    **dict.fromkeys(("gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "t5gemma2",
                     "t5gemma2_encoder", "t5gemma2_decoder", "t5gemma2_text"), _GEMMA3),
    **dict.fromkeys(("modernbert", "modernbert-decoder"), _MODERNBERT),
    # Olmo 3's sliding layers always get the default base (its rope_theta goes to full ones)
    "olmo3": ("rope_theta", 500_000.0, None, 500_000.0, ("full_attention",), {}),
    # NeoMME's rope_theta serves both; its partial factors are its own (a global one unread)
    "neomme": ("rope_theta", 1_000_000.0, "rope_theta", 10_000.0, (),
               {"full_attention": 0.25, "sliding_attention": 1.0}),
}
"""``model_type`` -> (the full-attention layers' base field, its default, the sliding ones'
base field (``None``: none read), its default, the layer types ``rope_scaling`` serves, each
layer type's partial rotary factor where the config sets its own): a composite's type too
(its text section's)."""


def split(read: Callable[[str], object], scaling: Mapping, model_type: object) -> Mapping | None:
    """The rope parameters per layer type that transformers makes of a config's flat fields
    (``read(name)``: a field, ``None`` when unset) and its ``rope_scaling`` (``{}``: none):
    each layer type's ``{"rope_type": "default"}`` updated with the scaling (so a legacy
    ``"type"`` key beside it changes nothing, as in transformers), then its base where the
    scaling gives none. ``None`` for a config of no such model type (found by ``model_type``,
    or by a field only these configs have: ``rope_local_base_freq``, ``global_rope_theta``,
    ``local_rope_theta``)."""
    form = SPLITS.get(model_type) if isinstance(model_type, str) else None
    if form is None:
        form = next((f for f in (_GEMMA3, _MODERNBERT) if read(f[2]) is not None or (
            f is _MODERNBERT and read(f[0]) is not None)), None)
    if form is None:
        return None
    full_field, full_default, sliding_field, sliding_default, scaled, partials = form
    layers = {}
    for layer, field, default in (("sliding_attention", sliding_field, sliding_default),
                                  ("full_attention", full_field, full_default)):
        parameters = {"rope_type": "default", **(scaling if layer in scaled else {})}
        base = None if field is None else read(field)
        parameters.setdefault("rope_theta", default if base is None else base)
        if layer in partials:
            parameters["partial_rotary_factor"] = partials[layer]
        layers[layer] = parameters
    return layers

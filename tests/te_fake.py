"""A TransformerEngine backend whose fused call records what it was given (TE need not be
installed): tests check what the backend hands TE, not TE's own math."""

from __future__ import annotations

from rope_dispatch.backends.te import TEBackend, TEInfo

TE_2_20_PARAMETERS = frozenset(["t", "freqs", "tensor_format", "start_positions", "interleaved",
                                "fused", "cu_seqlens", "cp_size", "cp_rank"])


def recording_te(seen: dict) -> TEBackend:
    """A TE 2.20.2 backend whose call stores its ``freqs`` and keyword arguments in ``seen``
    and returns ``t`` as it came."""
    def recording(t, freqs, **kwargs):
        seen.update(freqs=freqs, kwargs=kwargs)
        return t

    backend = TEBackend(load=lambda: TEInfo("2.20.2", (2, 20, 2), "fake", recording,
                                            TE_2_20_PARAMETERS))
    assert backend.available
    return backend

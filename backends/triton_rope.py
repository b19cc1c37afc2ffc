"""Placeholder: the triton backends are being written."""

from rope_dispatch.registry import Backend


class TritonBackend(Backend):
    name = "triton"
    description = "not yet implemented"

    def unavailable_reasons(self) -> list[str]:
        return ["not implemented yet"]

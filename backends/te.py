"""Placeholder: the te backend is being written."""

from rope_dispatch.registry import Backend


class TEBackend(Backend):
    name = "te"
    description = "not yet implemented"

    def unavailable_reasons(self) -> list[str]:
        return ["not implemented yet"]

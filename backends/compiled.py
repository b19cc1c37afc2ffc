"""Placeholder: the compile backend is being written."""

from rope_dispatch.registry import Backend


class CompileBackend(Backend):
    name = "compile"
    description = "not yet implemented"

    def unavailable_reasons(self) -> list[str]:
        return ["not implemented yet"]

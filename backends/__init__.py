"""Built-in backends, one module each; installed as ``rope_dispatch.backends``.

Importing this package registers every backend. Optional ones (triton, TransformerEngine,
torch.compile) import their package lazily and report themselves unavailable with the reason.
"""

from rope_dispatch.registry import register

from .compiled import CompileBackend
from .eager import EagerBackend
from .te import TEBackend
from .triton_rope import TritonBackend

for _backend in (TritonBackend(), TEBackend(), CompileBackend(), EagerBackend()):
    register(_backend)

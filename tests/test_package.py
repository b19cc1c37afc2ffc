"""``import rope_dispatch`` loads nothing; the first use of a name loads the whole package."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import rope_dispatch as rd


def run_python(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_import_loads_nothing_and_the_first_name_loads_the_package():
    """``python -m rope_dispatch.selftest`` imports the package first: it must not import torch
    then (the selftest starts its workers before that). The first name used loads the package
    and registers the built-in backends, as an eager import did."""
    out = run_python("""
        import sys
        import rope_dispatch as rd
        print('torch' in sys.modules, 'rope_dispatch.registry' in sys.modules)
        print(rd.__version__ != '')
        rd.RoPESpec
        print('rope_dispatch.dispatch' in sys.modules, 'rope_dispatch.cp' in sys.modules)
        names = sorted(b.name for b in rd.registry.backends())
        print(names == ['compile', 'eager', 'te', 'triton'])
        print(callable(rd.tables.angle_table), rd.autotune.cache_dir is rd.cache_dir)
    """)
    assert out == ["False", "False", "True", "True", "True", "True", "True", "True"]


def test_a_submodule_imported_directly_finds_the_built_in_backends():
    """``from rope_dispatch.compat.te import ...`` never looks a name up on the package; the
    registry loads the built-in backends on its first use, and a user's backend registered
    before that still replaces the built-in one of its name."""
    out = run_python("""
        import torch
        from rope_dispatch.compat.te import apply_rotary_pos_emb
        from rope_dispatch import registry
        t, freqs = torch.randn(4, 1, 2, 8), torch.rand(4, 1, 1, 8)
        print(tuple(apply_rotary_pos_emb(t, freqs).shape))
        print(registry.get_backend('eager').name)
    """)
    assert out == ["(4,", "1,", "2,", "8)", "eager"]
    out = run_python("""
        from rope_dispatch.registry import backends, register
        from rope_dispatch.backends.eager import EagerBackend

        class Mine(EagerBackend):
            description = 'mine'

        register(Mine())
        print([b.description for b in backends() if b.name == 'eager'])
    """)
    assert out == ["['mine']"]


def test_first_use_from_threads_and_from_inside_a_compiled_function():
    """Two threads using their first names at once both get them; a first use inside
    ``torch.compile(fullgraph=True)`` traces without a break."""
    out = run_python("""
        import torch
        import rope_dispatch as rd
        from rope_dispatch.spec import RoPESpec

        spec = RoPESpec(layout='sbhd', dtype='fp32')
        t, freqs = torch.randn(4, 1, 2, 8), torch.rand(4, 1, 1, 8)
        f = torch.compile(lambda x, fr: rd.apply(x, fr, spec, backend='eager'), fullgraph=True,
                          backend='eager')
        print(torch.equal(f(t, freqs), rd.apply(t, freqs, spec, backend='eager')))
    """)
    assert out == ["True"]
    out = run_python("""
        import threading
        import rope_dispatch as rd

        found = []
        names = ['apply', 'RoPESpec', 'list_backends', 'cos_sin_cache'] * 2
        threads = [threading.Thread(target=lambda n=n: found.append(callable(getattr(rd, n))))
                   for n in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(found.count(True), len(names))
    """)
    assert out[0] == out[1] == "8"


def test_the_public_names_agree_everywhere():
    """``__all__``, what the first use binds (``_PUBLIC``) and the imports type checkers read
    (the ``TYPE_CHECKING`` block) name the same things, and each is bound after a load."""
    source = Path(rd.__file__).read_text()
    typed = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            typed |= {alias.name for stmt in node.body for alias in stmt.names}
    assert typed == set(rd.__all__)
    bound = {name for names in rd._PUBLIC.values() for name in names}
    assert set(rd.__all__) == bound | {"autotune", "cp", "tune"}
    assert callable(rd.tune)  # the tune module, callable as rd.tune(t, freqs, spec)
    assert all(getattr(rd, name) is not None for name in rd.__all__)
    assert set(rd.__all__) <= set(dir(rd))
    missing = "no_such_name"
    try:
        getattr(rd, missing)
    except AttributeError as exc:
        assert missing in str(exc) and "rope_dispatch" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")

"""The README's quickstart and every ```python block of docs/*.md run as written on the CPU.

A page's blocks run in order in one fresh interpreter, as a reader pastes them one after the
other; each page must define every name it uses. A block that cannot run on a CPU (a process
group of several ranks, say) carries the marker ``# docs-test: skip: <reason>`` and is left
out; there are few, and each says why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^# docs-test: skip: (\S.*)$", re.MULTILINE)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
MOST_SKIPPED = 3


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def runnable(page: Path) -> list[str]:
    return [code for code in blocks(page) if not SKIP.search(code)]


def test_the_readme_has_a_quickstart_and_few_blocks_are_skipped():
    readme = runnable(ROOT / "README.md")
    assert readme and "device = \"cuda\" if torch.cuda.is_available() else \"cpu\"" in readme[0]
    skipped = [(page.name, SKIP.search(code).group(1)) for page in PAGES for code in blocks(page)
               if SKIP.search(code)]
    assert len(skipped) <= MOST_SKIPPED, skipped


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_examples_run_on_the_cpu(page, tmp_path):
    code = "\n".join(runnable(page))
    env = {**os.environ, "ROPE_DISPATCH_CACHE_DIR": str(tmp_path / "cache"),
           "CUDA_VISIBLE_DEVICES": ""}
    for name in ("ROPE_AUTOTUNE", "ROPE_BACKEND", "TRITON_INTERPRET"):
        env.pop(name, None)  # as a user's shell has them
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page.name}:\n{done.stderr[-4000:]}"
    assert "Warning" not in done.stderr, done.stderr[-4000:]

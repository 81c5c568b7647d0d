"""The ckptstore package of another commit, for the tools that measure it beside this tree.

``tools/scale_sim.py``, ``tools/scale_real.py``, ``tools/bench_ab.py`` and
``tools/index_scale.py`` run a baseline's ckptstore (``--baseline REV``) from a directory
put first on its processes' path.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["extract"]

#: This repository.
ROOT = Path(__file__).resolve().parent.parent


def extract(rev: str, into: Path) -> Path:
    """The ckptstore package of commit ``rev`` of this repository, under ``into`` (made)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "ckptstore"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into

"""``made_once``: what a module's costly fixture makes, made once in a pytest run.

Apart from ``_helpers`` (which imports torch): the processes of its own test import only
this.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def made_once(factory: Any, name: str, make: Callable[[Path], Any]) -> tuple[Path, Any]:
    """The directory ``name`` of this pytest run, filled by ``make(dir)`` once in the whole
    run, and what ``make`` returned (JSON); ``factory`` is pytest's ``tmp_path_factory``.

    A module-scoped fixture is set up by every pytest-xdist worker that runs one of the
    module's tests, and again by a worker whose tests of the module ``--dist worksteal``
    split apart: one that runs a multi-rank job paid for it up to four times a run
    (test_lightning_sharded.py's job, 57-92 s each, measured 2026-11-29). The workers share
    the run's base temporary directory: the first to take the lock (``flock``) makes it,
    the others wait for it and reuse it. Where ``make`` raised, every later caller fails
    with its message instead of making it again. Never modify what it made in a test:
    tests on other workers read it at the same time.
    """
    import fcntl
    import shutil

    import pytest

    base = Path(factory.getbasetemp())
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-of-<user>/pytest-<n>: the run's, above popen-gw<i>
    out = base / f"once-{name}"
    with open(base / f"once-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        failed, made = base / f"once-{name}.failed", base / f"once-{name}.json"
        if failed.exists():
            pytest.fail(f"{name}, made once for the run, failed:\n{failed.read_text()}")
        if not made.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker killed while it made it
            out.mkdir()
            try:
                value = make(out)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-8000:])
                raise
            made.write_text(json.dumps(value))
        return out, json.loads(made.read_text())

"""A pytest plugin: the CPU each test cost the whole machine, for finding what makes the suite
slow (``make test-cpu``).

Reads the machine's CPU counters (``/proc/stat``: user, nice, system, irq, softirq) around
each test, setup and teardown included, so the CPU of every process the test started (ranks
forked by the zygote, tools, moto's server) counts, which ``RUSAGE_CHILDREN`` misses for
processes that are not the test's own children. Meaningful only in a serial run (``-n 0``)
on an otherwise idle machine. Prints the heaviest tests and test files at the end, and
writes every row to ``$TESTCPU_OUT`` (JSON: ``[nodeid, cpu_s, wall_s]``) when that is set.

    .venv/bin/python -m pytest -n 0 -p testcpu tests/   # with tools/ on PYTHONPATH
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_rows: list[tuple[str, float, float]] = []


def _busy() -> float:
    """Seconds the machine's CPUs have been busy since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Time one test, its setup and teardown included."""
    cpu, wall = _busy(), time.monotonic()
    yield
    _rows.append((item.nodeid, _busy() - cpu, time.monotonic() - wall))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The heaviest tests and files by CPU."""
    if not _rows:
        return
    tr = terminalreporter
    total = sum(r[1] for r in _rows)
    tr.section(f"CPU by test (machine-wide, {total:.0f} s in all)")
    for node, cpu, wall in sorted(_rows, key=lambda r: -r[1])[:30]:
        tr.write_line(f"{cpu:7.1f} s cpu {wall:7.1f} s wall  {node}")
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for node, cpu, wall in _rows:
        files[node.split("::")[0]][0] += cpu
        files[node.split("::")[0]][1] += wall
    tr.section("CPU by file")
    for name, (cpu, wall) in sorted(files.items(), key=lambda kv: -kv[1][0])[:20]:
        tr.write_line(f"{cpu:7.1f} s cpu {wall:7.1f} s wall  {name}")
    out = os.environ.get("TESTCPU_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(_rows, f)

"""A pytest plugin: the CPU each test cost, for finding what makes the suite slow
(``make test-cpu``).

Where it may (root, a cgroup-v1 ``cpuacct`` hierarchy), pytest moves itself into a cgroup of
its own before the first test and reads that cgroup's ``cpuacct.usage`` around each test,
setup and teardown included: every process the test started (ranks forked by the zygote,
tools, moto's server) counts, which ``RUSAGE_CHILDREN`` misses for processes that are not
the test's own children, and nothing else running on the machine does. Elsewhere it reads
the machine's counters (``/proc/stat``: user, nice, system, irq, softirq), which mean
something only on an otherwise idle machine. Either way only a serial run (``-n 0``) gives
each test its own figure. Prints the heaviest tests and test files at the end, and writes
every row to ``$TESTCPU_OUT`` (JSON: ``[nodeid, cpu_s, wall_s]``) when that is set.

    .venv/bin/python -m pytest -n 0 -p testcpu tests/   # with tools/ on PYTHONPATH
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_CPUACCT = "/sys/fs/cgroup/cpuacct"
_rows: list[tuple[str, float, float]] = []
_group: list[str] = []  # [the cgroup of this run, the one pytest came from], once made


def _busy() -> float:
    """CPU seconds this run's cgroup has used, or the machine's CPUs since boot."""
    if _group:
        with open(os.path.join(_group[0], "cpuacct.usage")) as f:
            return int(f.read()) / 1e9
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / _TICK


def _own_cpuacct() -> str | None:
    """The directory of this process's cpuacct cgroup (v1), or None."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpuacct" in controllers.split(","):
                return os.path.join(_CPUACCT, path.lstrip("/"))
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Move pytest into a cgroup of its own, where it may: its children inherit it.

    Made inside the cgroup pytest runs in (so its limits and shares still hold), and left
    for that one at the end. Empty groups that earlier runs left behind are removed first.
    """
    parent = _own_cpuacct()
    if parent is None or not os.path.isdir(parent):
        return
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith("ckptstore-testcpu-"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))  # refused while a process is in it
    path = os.path.join(parent, f"ckptstore-testcpu-{os.getpid()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return
    _group[:] = [path, parent]


def pytest_unconfigure(config: pytest.Config) -> None:
    """Go back to the cgroup pytest came from; this run's is removed once the processes the
    tests started are gone (a few seconds at most: a fork server exiting after its pipe
    closed), else left behind for the next run to remove."""
    if not _group:
        return
    path, parent = _group
    with contextlib.suppress(OSError), open(os.path.join(parent, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


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
    scope = "this run's cgroup" if _group else "machine-wide"
    tr.section(f"CPU by test ({scope}, {total:.0f} s in all)")
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

"""One launch helper for every multi-rank test: real processes, gloo on CPU, a hard timeout.

Each rank is a fresh ``python tests/multirank/worker.py`` process that joins a gloo process group
over TCP on loopback and runs one scenario function from ``tests/multirank/scenarios.py``. The
worker writes its outcome (result or exception, with ``BarrierTimeout`` attributes) as JSON.
The parent kills every rank when the deadline passes, so a hang fails the test instead of
stalling CI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    ok: bool = False
    value: Any = None
    error_type: str | None = None
    message: str = ""
    missing_ranks: list[int] = field(default_factory=list)
    phase: str | None = None
    step: int | None = None
    elapsed: float = 0.0
    output: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    scenario: str,
    world_size: int,
    workdir: Path,
    *,
    timeout: float = 60.0,
    args: dict[str, Any] | None = None,
) -> list[RankResult]:
    """Run ``scenario`` on ``world_size`` ranks; return one result per rank (by rank)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    for rank in range(world_size):
        out = workdir / f"rank{rank}.json"
        if out.exists():
            out.unlink()
        log = open(workdir / f"rank{rank}.log", "w")  # noqa: SIM115
        cmd = [
            sys.executable,
            str(HERE / "worker.py"),
            scenario,
            str(rank),
            str(world_size),
            str(port),
            str(workdir),
            json.dumps(args or {}),
        ]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    hung = False
    for p, _ in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, (p, log) in enumerate(procs):
        log.close()
        output = (workdir / f"rank{rank}.log").read_text()
        r = RankResult(rank, p.returncode, output=output)
        out = workdir / f"rank{rank}.json"
        if out.exists():
            data = json.loads(out.read_text())
            r.ok = data["ok"]
            r.value = data.get("value")
            r.error_type = data.get("error_type")
            r.message = data.get("message", "")
            r.missing_ranks = data.get("missing_ranks") or []
            r.phase = data.get("phase")
            r.step = data.get("step")
            r.elapsed = data.get("elapsed", 0.0)
        results.append(r)
    if hung:
        logs = "\n".join(f"--- rank {r.rank} ---\n{r.output[-3000:]}" for r in results)
        msg = f"scenario {scenario!r} hung past {timeout}s and was killed\n{logs}"
        raise AssertionError(msg)
    return results


def describe(results: list[RankResult]) -> str:
    """Everything about a run, for assertion messages."""
    return "\n".join(
        f"rank {r.rank}: rc={r.returncode} ok={r.ok} {r.error_type}: {r.message}\n"
        f"{r.output[-2000:]}"
        for r in results
    )

"""Distributed trials: one rank of a 2-rank job killed or frozen; the survivor must raise
BarrierTimeout naming it and exit in time, and the store must still verify."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import time
from typing import Any

from crashkit.common import DIST_SLACK, DIST_TIMEOUT
from crashkit.server import Server


@dataclasses.dataclass
class DistStats:
    """Figures of the distributed campaign."""

    trials: int = 0
    kills: int = 0
    timed_kills: int = 0
    protocol_kills: int = 0
    frozen: int = 0
    killed_in: dict[str, int] = dataclasses.field(default_factory=dict)
    survivor_timeouts: int = 0
    max_exit_after_kill: float = 0.0
    violations: list[str] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0


def dist_trials(n: int, rng: random.Random, server: Server, base: str, verbose: bool) -> DistStats:
    from ckptstore import CheckpointManager

    stats = DistStats()
    t0 = time.monotonic()
    for i in range(n):
        stats.trials += 1
        victim = rng.randrange(2)
        timed = rng.random() < 0.5
        kill_at = 0 if timed else rng.randint(1, 30)
        kill_when = rng.choice(["before", "after"])
        fmt = rng.choice(["safetensors", "torch"])
        async_save = rng.random() < 0.5
        # A third of the victims freeze (SIGSTOP) instead of dying: a hung rank whose
        # sockets stay open, so only the timeout can tell; it is killed once the survivor
        # has exited.
        freeze = rng.random() < 1 / 3
        root = os.path.join(base, f"dist-{i}")
        lines: list[str] = []
        problems: list[str] = []
        server.submit(
            dict(
                kind="dist",
                port_file=root + ".port",
                root=root,
                victim=victim,
                kill_at=kill_at,
                kill_when=kill_when,
                fmt=fmt,
                async_save=async_save,
                seed=i,
                freeze=freeze,
            )
        )
        pids: dict[int, int] = {}
        exits: dict[int, tuple[float, str]] = {}
        outcomes: dict[int, dict[str, Any]] = {}
        killed_at: float | None = None
        killed_in = "?"
        where = ("freeze " if freeze else "kill ") + (
            "timed" if timed else f"at wait {kill_at} ({kill_when})"
        )
        try:
            deadline = time.monotonic() + 120
            ready = 0
            while ready < 2:
                _, line = server.next(deadline - time.monotonic())
                lines.append(line)
                if line.startswith("rank "):
                    _, r, _, pid_s = line.split()
                    pids[int(r)] = int(pid_s)
                    server.children = list(pids.values())
                elif line.startswith("ready "):
                    ready += 1
                elif line.startswith("dying "):  # the victim's first wait came first
                    killed_at = float(line.split()[1])
                    killed_in = line.split(maxsplit=3)[3]
                elif line.startswith(("exit ", "error ")):
                    raise RuntimeError(f"a rank ended before it was ready: {line}")
            backlog: list[tuple[float, str]] = []
            if timed:
                time.sleep(rng.uniform(0.0, 1.0))
                backlog = server.drain()  # what the ranks were doing when the kill came
                last_op = [x for _, x in backlog if x.startswith(f"op {victim} ")]
                last_op = last_op or [x for x in lines if x.startswith(f"op {victim} ")]
                killed_in = last_op[-1].split()[2] if last_op else "start"
                killed_at = time.time()
                os.kill(pids[victim], signal.SIGSTOP if freeze else signal.SIGKILL)
            # Read until both ranks have exited, or give up: a hang is a violation. (A frozen
            # victim is killed when the survivor exits, so it exits too.)
            hard = time.monotonic() + 120
            while len(exits) < 2:
                if backlog:
                    t, line = backlog.pop(0)
                else:
                    limit = hard - time.monotonic()
                    if killed_at is not None:
                        limit = min(limit, killed_at + DIST_TIMEOUT + DIST_SLACK + 30 - time.time())
                    t, line = server.next(limit)
                lines.append(line)
                if line.startswith("dying "):
                    killed_at = float(line.split()[1])
                    killed_in = line.split(maxsplit=3)[3]
                elif line.startswith("outcome "):
                    out = json.loads(line.split(" ", 1)[1])
                    outcomes[out["rank"]] = out
                elif line.startswith("exit "):
                    pid = int(line.split()[1])
                    rank = next(r for r, p in pids.items() if p == pid)
                    exits[rank] = (t, " ".join(line.split()[2:]))
                    if rank == 1 - victim and freeze:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pids[victim], signal.SIGKILL)
            server.line("jobdone", 10, lines)
            server.children = []
        except (TimeoutError, EOFError, RuntimeError) as e:
            server.kill_children()
            problems.append(f"stalled or broke: {e}; the ranks said: {' | '.join(lines[-15:])}")
            with contextlib.suppress(TimeoutError, EOFError):
                server.line("jobdone", 30, lines)
        survivor = 1 - victim
        if not problems:
            stats.kills += 1
            stats.timed_kills += timed
            stats.protocol_kills += not timed
            stats.frozen += freeze
            phase = killed_in.split()[-1].split(":")[0] if killed_in else "?"
            stats.killed_in[phase] = stats.killed_in.get(phase, 0) + 1
            if exits[victim][1] != f"signal {int(signal.SIGKILL)}":
                problems.append(f"rank {victim} was to be killed but ended with {exits[victim][1]}")
            out = outcomes.get(survivor)
            if out is None or out["error"] != "BarrierTimeout":
                tail = " | ".join(lines[-15:])
                problems.append(
                    f"survivor rank {survivor} did not raise BarrierTimeout: {out}; said: {tail}"
                )
            else:
                stats.survivor_timeouts += 1
                if victim not in out["missing"]:
                    problems.append(f"BarrierTimeout names {out['missing']}, not rank {victim}")
            assert killed_at is not None
            took = exits[survivor][0] - killed_at
            stats.max_exit_after_kill = max(stats.max_exit_after_kill, took)
            if took > DIST_TIMEOUT + DIST_SLACK:
                problems.append(
                    f"survivor exited {took:.1f}s after the kill (barrier_timeout {DIST_TIMEOUT}s)"
                )
        # The store the job leaves must still be usable.
        try:
            with CheckpointManager(root, distributed=False) as mgr:
                steps = mgr.steps()
                if steps and not mgr.verify(steps[-1]).ok:
                    problems.append(f"newest step {steps[-1]} does not verify")
                if steps:
                    mgr.load(steps[-1])
                mgr.gc()
                if mgr.storage.list_garbage():
                    problems.append(f"gc left {mgr.storage.list_garbage()}")
        except Exception as e:
            problems.append(f"the store check failed: {e!r}")
        for p in problems:
            stats.violations.append(f"dist trial {i} (victim rank {victim}, {where}): {p}")
        if verbose or problems:
            took_s = (
                f"{exits[survivor][0] - killed_at:.1f}s" if killed_at and survivor in exits else "?"
            )
            print(
                f"  dist trial {i:3d} rank {victim}: {where:26s} in {killed_in:22s}"
                f" survivor: {outcomes.get(survivor, {}).get('error')} at"
                f" {outcomes.get(survivor, {}).get('phase')}, exit after {took_s}  "
                + ("OK" if not problems else "VIOLATION: " + "; ".join(problems)),
                flush=True,
            )
    stats.elapsed = time.monotonic() - t0
    return stats

"""Crash campaign: SIGKILL checkpoint writers at random moments and check every invariant.

    python tools/crashtest.py [--store local|s3|both] [--trials N] [--seed S]
                              [--dist-trials M] [--upload-trials U] [--json OUT] [--verbose]

**Writers.** A writer process resumes from its store and saves step after step (sync or
async, safetensors or torch payloads, retention ``keep=1`` or ``2`` pruning after every
commit: 8 configurations, each with its own store, taken in turn). The campaign kills it
with SIGKILL after a random delay, then checks the store from this process:

1. the newest visible checkpoint verifies deeply and loads, holding exactly its own data
   (every tensor of step N holds N);
2. it is the last one whose save returned (sync) or was waited for (async), or the one in
   flight if its commit completed, never older and never newer;
3. nothing committed was lost except by retention: the ``keep`` newest steps are all there,
   and at most the one retention was deleting besides; every visible step verifies;
4. ``gc`` leaves no ``.tmp-``/``.trash-`` entry and no manifest-less step;
5. a new manager on the store saves the next step and loads it back.

Stores: a local directory, and S3 (moto's server on loopback, tests/s3server.py).

**Uploads.** ``--upload-trials`` kills (SIGKILL) an uploader of the replica tier
(``ckptstore.tiers.replica.Replicator``) at a random moment of uploading a local store of two
steps (6 MB payloads, multipart, and small ones) to a fresh S3 prefix. After each kill:
every step visible on the replica verifies deeply and its manifest is the local one byte
for byte, and every step the uploader reported safe is there; then a new uploader on the
same roots must leave the replica with every step, no manifest-less step and no incomplete
multipart upload.

**Distributed.** ``--dist-trials`` runs 2-rank jobs (gloo on loopback) that save and restore
in a loop; one rank is killed (SIGKILL) or, a third of the time, frozen (SIGSTOP: a hung
rank whose sockets stay open, so only the timeout can tell), either after a random delay or
at a random one of its protocol waits (before or after it). The survivor must raise
``BarrierTimeout`` naming that rank and exit within ``barrier_timeout`` plus a few seconds,
never hang; the store must still hold a checkpoint that verifies.

Writers are forked by a fork server (this file with ``--serve``) that imported torch once,
so a trial costs milliseconds, not an interpreter start. Prints a summary table; exits 1 on
any violation (each is listed), 0 otherwise. ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools"), str(REPO / "tests")]

#: Every writer configuration: (format, async_save, keep).
CONFIGS = [
    (fmt, a, keep) for fmt in ("safetensors", "torch") for a in (False, True) for keep in (1, 2)
]
#: Upper bound of the random delay before a kill, seconds, per store.
KILL_WITHIN = {"local": 0.25, "s3": 1.5}
#: barrier_timeout of the distributed jobs, and the slack allowed on top of it: an idle host's
#: 5 s times CKPTSTORE_TEST_SLOWDOWN (1 unless set; the test suite sets it, see tests/timing.py),
#: since on a busy host a survivor takes longer to report and exit once its wait ran out.
DIST_TIMEOUT = 3.0
DIST_SLACK = 5.0 * float(os.environ.get("CKPTSTORE_TEST_SLOWDOWN", "1"))


def emit(line: str) -> None:
    """One line on stdout in one write(2), so lines of concurrent children never mix."""
    os.write(1, (line + "\n").encode())


# ---- the fork server and its children ------------------------------------------------------


def run_writer(
    root: str,
    *,
    storage_options: dict[str, Any] | None = None,
    format: str = "safetensors",
    async_save: bool = False,
    keep: int = 2,
    steps: int = 1_000_000,
) -> int:
    """Resume from ``root`` and save steps until killed: crash_writer.py's loop, any URL."""
    import crash_writer as cw

    return cw.run(
        root,
        storage_options=storage_options,
        format=format,
        async_save=async_save,
        keep=keep,
        steps=steps,
    )


def run_uploader(local: str, url: str, storage_options: dict[str, Any]) -> int:
    """Upload the local store to ``url`` until done (or killed): the replica tier's uploader.

    Prints ``safe N`` once step N is committed and verified on the replica: a crash from
    then on must not lose it there.
    """
    from ckptstore.storage import open_storage
    from ckptstore.tiers.replica import Replicator

    emit(f"pid {os.getpid()}")
    up = Replicator(
        open_storage(local),
        open_storage(url, storage_options),
        on_safe=lambda s: emit(f"safe {s}"),
        retention=False,
    )
    emit(f"queued {' '.join(str(s) for s in up.recover())}")
    up.close()
    emit("done")
    return 0


def run_rank(
    rank: int,
    *,
    port: int,
    root: str,
    victim: int,
    kill_at: int,
    kill_when: str,
    fmt: str,
    async_save: bool,
    seed: int,
    freeze: bool = False,
) -> int:
    """One rank of a 2-rank job that saves and restores until a rank dies (or freezes)."""
    import datetime
    import faulthandler

    import torch
    import torch.distributed as dist
    from torch import nn

    from ckptstore import BarrierTimeout, CheckpointManager
    from ckptstore.dist import Coordinator

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    emit(f"rank {rank} pid {os.getpid()}")
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    mgr = CheckpointManager(
        root, keep=2, format=fmt, async_save=async_save, barrier_timeout=DIST_TIMEOUT
    )
    if rank == victim and kill_at:
        calls = 0
        real = Coordinator.barrier

        sig = signal.SIGSTOP if freeze else signal.SIGKILL

        def barrier(self: Coordinator, phase: str, step: int | None = None) -> None:
            nonlocal calls
            calls += 1
            if calls == kill_at and kill_when == "before":
                emit(f"dying {time.time():.6f} before {phase}")
                os.kill(os.getpid(), sig)
            real(self, phase, step)
            if calls == kill_at and kill_when == "after":
                emit(f"dying {time.time():.6f} after {phase}")
                os.kill(os.getpid(), sig)

        Coordinator.barrier = barrier  # type: ignore[method-assign]
    # A watchdog: a rank still running this long after the start is stuck; its stacks go
    # to the campaign's output (and the trial is reported), then it exits.
    faulthandler.dump_traceback_later(DIST_TIMEOUT + DIST_SLACK + 15, exit=True)
    emit(f"ready {rank}")
    step = 0
    try:
        for i in range(1_000_000):
            if i % 3 == 2:
                emit(f"op {rank} restore")
                mgr.restore(state)
            else:
                emit(f"op {rank} save {step}")
                state["step"] = step
                mgr.save(step, state)
                step += 1
    except BarrierTimeout as e:
        raised = time.time()
        out = {"rank": rank, "error": "BarrierTimeout", "phase": e.phase, "at": raised}
        out.update(missing=e.missing_ranks, message=str(e))
        emit("outcome " + json.dumps(out))
        mgr.close()  # after a dead peer: must not hang either
        emit(f"closed {rank} {time.time():.6f}")
        return 2
    except BaseException as e:
        out = {"rank": rank, "error": type(e).__name__, "message": str(e), "at": time.time()}
        emit("outcome " + json.dumps(out))
        emit(traceback.format_exc().replace("\n", " | "))
        return 1
    return 0


def _child(fn: Any, kwargs: dict[str, Any]) -> None:
    code = 1
    try:
        code = fn(**kwargs)
    except BaseException:
        emit("error " + traceback.format_exc().replace("\n", " | "))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # A survivor of a dead peer exits without destroying the default process group:
        # its collectives would wait for the dead rank (torch, not ckptstore).
        os._exit(code)


def _warm_up() -> None:
    """Run once what imports lazily, so that each forked child starts in milliseconds."""
    import crash_writer as cw

    from ckptstore import CheckpointManager

    state = cw.make_state()
    with tempfile.TemporaryDirectory() as d:
        for fmt in ("safetensors", "torch"):
            with CheckpointManager(os.path.join(d, fmt), format=fmt, keep=1) as mgr:
                mgr.save(0, state)
                mgr.save(1, state)
                mgr.restore(state)
    with contextlib.suppress(ImportError):
        import s3fs  # noqa: F401
    import torch.distributed  # noqa: F401


def serve() -> int:
    """Fork children for the JSON jobs read from stdin; report how each ended."""
    import torch

    torch.set_num_threads(1)  # before any op: no thread pool for the children to inherit
    _warm_up()
    emit("serving")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        kind = job.pop("kind")
        pids = []
        if kind == "writer":
            jobs: list[tuple[Any, dict[str, Any]]] = [(run_writer, job)]
        elif kind == "uploader":
            jobs = [(run_uploader, job)]
        else:
            jobs = [(run_rank, dict(job, rank=r)) for r in (0, 1)]
        for fn, kwargs in jobs:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(fn, kwargs)
            pids.append(pid)
        for _ in pids:
            pid, status = os.wait()
            if os.WIFSIGNALED(status):
                emit(f"exit {pid} signal {os.WTERMSIG(status)}")
            else:
                emit(f"exit {pid} code {os.WEXITSTATUS(status)}")
        emit("jobdone")
    return 0


class Server:
    """The fork server, seen from the campaign."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self._q: queue.Queue[tuple[float, str | None]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.line("serving", timeout=120)
        self.children: list[int] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put((time.time(), line.rstrip("\n")))
        self._q.put((time.time(), None))

    def next(self, timeout: float) -> tuple[float, str]:
        """The next line and when it arrived; raises TimeoutError."""
        try:
            t, line = self._q.get(timeout=max(timeout, 0.001))
        except queue.Empty:
            raise TimeoutError(f"no output for {timeout:.0f}s") from None
        if line is None:
            raise EOFError("the fork server died")
        return t, line

    def drain(self) -> list[tuple[float, str]]:
        """The lines already received (and when), without waiting."""
        out = []
        while True:
            try:
                t, line = self._q.get_nowait()
            except queue.Empty:
                return out
            if line is None:
                self._q.put((t, None))
                return out
            out.append((t, line))

    def line(self, prefix: str, timeout: float, into: list[str] | None = None) -> str:
        """Skip lines (keeping them in ``into``) until one starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            _, line = self.next(deadline - time.monotonic())
            if into is not None:
                into.append(line)
            if line.startswith(prefix):
                return line

    def submit(self, **job: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def kill_children(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill_children()
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- writer trials ---------------------------------------------------------------------------


@dataclasses.dataclass
class StoreStats:
    """Figures of one store's campaign."""

    store: str
    trials: int = 0
    kills: int = 0
    configs: set[str] = dataclasses.field(default_factory=set)
    killed_mid_save: int = 0  # the kill left a save in flight (tmp / manifest-less step)
    killed_mid_retention: int = 0  # ... or a deletion in flight (trash)
    inflight_committed: int = 0  # the step in flight had committed before the kill
    saves_returned: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["configs"] = sorted(self.configs)
        return d


def _numbers(lines: list[str], word: str) -> list[int]:
    return [int(x.split()[1]) for x in lines if x.startswith(word + " ")]


@dataclasses.dataclass
class Store:
    """One store under test and what is known about it."""

    url: str
    fmt: str
    async_save: bool
    keep: int
    options: dict[str, Any] | None
    newest: int | None = None  # the newest step known committed before the next trial

    @property
    def name(self) -> str:
        return f"{self.fmt}-{'async' if self.async_save else 'sync'}-keep{self.keep}"


class Checker:
    """Checks a store after a kill, from the campaign's own process."""

    def __init__(self) -> None:
        import crash_writer as cw

        self.cw = cw
        self.state = cw.make_state()

    def check(self, store: Store, lines: list[str], stats: StoreStats) -> list[str]:
        from ckptstore import CheckpointManager
        from ckptstore.layout import parse_step_dirname
        from ckptstore.storage import wait_for_deletions

        cw = self.cw
        bad: list[str] = []
        saved, returned = _numbers(lines, "saved"), _numbers(lines, "returned")
        starts = _numbers(lines, "start")
        stats.saves_returned += len(returned)
        expected_start = store.newest + 1 if store.newest is not None else 0
        if starts and starts[0] != expected_start:
            bad.append(f"writer resumed at {starts[0]}, the newest was {store.newest}")
        start = starts[0] if starts else expected_start
        lower = max([*saved, *([store.newest] if store.newest is not None else [])], default=None)
        upper = returned[-1] + 1 if returned else start
        with CheckpointManager(
            store.url, keep=store.keep, format=store.fmt, storage_options=store.options
        ) as mgr:
            garbage = mgr.storage.list_garbage()
            steps = mgr.steps()
            newest = steps[-1] if steps else None
            # What the kill interrupted: a deletion leaves .trash- (local) or a manifest-less
            # old step (S3: the manifest goes first); a save a .tmp- or a manifest-less new one.
            olds = [parse_step_dirname(g) for g in garbage]
            if any(g.startswith(".trash-") for g in garbage) or any(
                s is not None and newest is not None and s < newest for s in olds
            ):
                stats.killed_mid_retention += 1
            if any(g.startswith(".tmp-") for g in garbage) or any(
                s is not None and (newest is None or s > newest) for s in olds
            ):
                stats.killed_mid_save += 1
            if lower is not None and (newest is None or newest < lower):
                bad.append(f"step {lower} was saved (its save returned) but the newest is {newest}")
            if newest is not None and newest > upper:
                bad.append(f"step {newest} is visible but only steps < {upper + 1} were saved")
            if newest is not None and newest == upper and upper != lower:
                stats.inflight_committed += 1
            if newest is not None:
                report = mgr.verify(newest, deep=True)
                if not report.ok:
                    bad.append(f"newest step {newest} does not verify: {report.problems}")
                try:
                    cw.check_loaded(mgr.load(newest), newest)
                except Exception as e:
                    bad.append(f"newest step {newest} does not load its own data: {e!r}")
                keep_from = max(0, newest - store.keep + 1)
                must = set(range(keep_from, newest + 1))
                may = {newest - store.keep} if newest - store.keep >= 0 else set()
                if must - set(steps):
                    bad.append(f"step(s) {sorted(must - set(steps))} lost; have {steps}")
                if set(steps) - must - may:
                    extra = sorted(set(steps) - must - may)
                    bad.append(f"step(s) {extra} should have been pruned (keep={store.keep})")
                for s in steps[:-1]:
                    report = mgr.verify(s, deep=not store.url.startswith("s3://"))
                    if not report.ok:
                        bad.append(f"visible step {s} does not verify: {report.problems}")
            mgr.gc()
            wait_for_deletions()
            left = mgr.storage.list_garbage()
            if not store.url.startswith("s3://"):
                left += [n for n in os.listdir(store.url) if n.startswith((".tmp-", ".trash-"))]
            if left:
                bad.append(f"gc left {sorted(set(left))}")
            nxt = newest + 1 if newest is not None else 0
            try:
                cw.fill(self.state, nxt)
                mgr.save(nxt, self.state)
                mgr.wait()
                cw.check_loaded(mgr.load(nxt), nxt)
                store.newest = nxt
            except Exception as e:
                bad.append(f"a new manager could not save step {nxt}: {e!r}")
                store.newest = mgr.latest_step()
        return bad


def writer_trials(
    kind: str,
    n: int,
    *,
    rng: random.Random,
    server: Server,
    checker: Checker,
    make_url: Any,
    options: dict[str, Any] | None,
    verbose: bool,
) -> StoreStats:
    stats = StoreStats(kind)
    t0 = time.monotonic()
    stores = [Store(make_url(), f, a, k, options) for f, a, k in CONFIGS]
    for i in range(n):
        store = stores[i % len(stores)]
        stats.trials += 1
        stats.configs.add(store.name)
        lines: list[str] = []
        server.submit(
            kind="writer",
            root=store.url,
            storage_options=options,
            format=store.fmt,
            async_save=store.async_save,
            keep=store.keep,
        )
        problems: list[str] = []
        try:
            pid = int(server.line("pid ", 60, lines).split()[1])
            server.children = [pid]
            server.line("start ", 120, lines)
            time.sleep(rng.uniform(0.0, KILL_WITHIN[kind]))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            end = server.line("exit ", 60, lines)
            server.line("jobdone", 10, lines)
            server.children = []
            if end.split()[2:] == ["signal", str(int(signal.SIGKILL))]:
                stats.kills += 1
            else:
                tail = " | ".join(lines[-8:])
                problems.append(f"the writer ended by itself ({end}); it said: {tail}")
            problems += checker.check(store, lines, stats)
        except (TimeoutError, EOFError) as e:
            server.kill_children()
            problems.append(f"the trial stalled: {e}; the writer said: {' | '.join(lines[-8:])}")
        except Exception as e:
            problems.append(f"the check failed: {e!r}")
        for p in problems:
            stats.violations.append(f"{kind} trial {i} ({store.name}): {p}")
        if problems:  # start that configuration afresh, so one failure is reported once
            stores[i % len(stores)] = Store(
                make_url(), store.fmt, store.async_save, store.keep, options
            )
        if verbose or problems:
            print(
                f"  {kind} trial {i:4d} {store.name:24s} steps saved "
                f"{len(_numbers(lines, 'saved')):3d}  newest now {store.newest}  "
                + ("OK" if not problems else "VIOLATION: " + "; ".join(problems)),
                flush=True,
            )
        elif (i + 1) % 50 == 0:
            print(f"  {kind}: {i + 1}/{n} trials, {len(stats.violations)} violations", flush=True)
    stats.elapsed = time.monotonic() - t0
    return stats


# ---- distributed trials ----------------------------------------------------------------------


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
            kind="dist",
            port=_free_port(),
            root=root,
            victim=victim,
            kill_at=kill_at,
            kill_when=kill_when,
            fmt=fmt,
            async_save=async_save,
            seed=i,
            freeze=freeze,
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
                    _, r, _, pid = line.split()
                    pids[int(r)] = int(pid)
                    server.children = list(pids.values())
                elif line.startswith("ready "):
                    ready += 1
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


# ---- upload trials (the replica tier) --------------------------------------------------------

#: The local store every upload trial replicates: steps whose model payload is above the
#: multipart threshold (so kills land in multipart uploads too) and a small optimizer.
UPLOAD_STEPS = (1, 2)
UPLOAD_BLOCK = 5 << 20


@dataclasses.dataclass
class UploadStats:
    """Figures of the upload campaign."""

    trials: int = 0
    kills: int = 0
    killed_mid_upload: int = 0  # the kill left a manifest-less step or a multipart upload
    multipart_left: int = 0  # ... of which an incomplete multipart upload
    complete_at_kill: int = 0  # replica steps committed when the kill came (all verified)
    safe_reported: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    upload_s: float = 0.0  # one whole upload, measured before the trials


def _upload_template(base: str) -> str:
    """A local store with UPLOAD_STEPS, each step's tensors holding its number."""
    import torch

    from ckptstore import CheckpointManager

    root = os.path.join(base, "upload-template")
    with CheckpointManager(root, keep=None) as mgr:
        for s in UPLOAD_STEPS:
            state = {
                "model": {"w": torch.full((3 << 19,), float(s))},  # 6 MB: multipart
                "optimizer": {"m": torch.full((1 << 16,), float(s))},  # 256 kB: one PUT
                "step": s,
            }
            mgr.save(s, state)
    return root


def _clone(template: str, dst: str) -> None:
    """A copy of the template store whose files are hard links (the uploader only reads)."""
    import shutil

    shutil.copytree(template, dst, copy_function=os.link)


def _replica_problems(replica: Any, local: Any, stats: UploadStats | None) -> list[str]:
    """Every committed replica step verifies deeply and is the local step, byte for byte."""
    from ckptstore.ops.verify import verify_checkpoint

    bad = []
    for s in replica.list_steps():
        if stats is not None:
            stats.complete_at_kill += 1
        report = verify_checkpoint(replica, s, deep=True)
        if not report.ok:
            bad.append(f"replica step {s} is visible but does not verify: {report.problems}")
        elif replica.read_manifest(s).to_bytes() != local.read_manifest(s).to_bytes():
            bad.append(f"replica step {s} differs from the local one")
    return bad


def upload_trials(
    n: int, rng: random.Random, server: Server, base: str, verbose: bool
) -> UploadStats:
    """Kill an uploader at random moments; check the replica; let a new one finish."""
    from ckptstore.storage import open_storage
    from ckptstore.tiers.replica import Replicator

    stats = UploadStats()
    t0 = time.monotonic()
    template = _upload_template(base)
    with _s3() as ep:
        opts = dict(ep.storage_options, default_block_size=UPLOAD_BLOCK)
        fs = ep.fs(fresh=True)
        bucket = ep.bucket

        def run(local: str, url: str, delay: float | None) -> tuple[list[str], float]:
            lines: list[str] = []
            server.submit(kind="uploader", local=local, url=url, storage_options=opts)
            pid = int(server.line("pid ", 60, lines).split()[1])
            # The clock starts once the uploader has recovered and queued its steps (its
            # start, s3fs's client and the first listings come before): the kills land in
            # the uploads themselves.
            server.line("queued", 120, lines)
            start = time.monotonic()
            if delay is None:
                server.line("jobdone", timeout=300, into=lines)
                return lines, time.monotonic() - start
            deadline = start + delay
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    _, line = server.next(deadline - time.monotonic())
                    lines.append(line)
                    if line == "jobdone":
                        return lines, time.monotonic() - start
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            server.line("jobdone", timeout=60, into=lines)
            return lines, delay

        # One whole upload, to spread the kills over its length.
        local0 = os.path.join(base, "upload-0")
        _clone(template, local0)
        _, stats.upload_s = run(local0, ep.url(ep.unique_prefix("upload")), None)
        for i in range(n):
            local = os.path.join(base, f"upload-{i + 1}")
            _clone(template, local)
            prefix = ep.unique_prefix("upload")
            url = ep.url(prefix)
            delay = rng.uniform(0.0, stats.upload_s * 1.1)
            lines, took = run(local, url, delay)
            if took < delay:  # it finished first: uploads got faster (a quieter host)
                stats.upload_s = min(stats.upload_s, took)
            stats.trials += 1
            killed = any(ln.startswith("exit ") and " signal 9" in ln for ln in lines)
            stats.kills += killed
            safe = _numbers(lines, "safe")
            stats.safe_reported += len(safe)
            lstore = open_storage(local)
            replica = open_storage(url, dict(opts, skip_instance_cache=True))
            problems = _replica_problems(replica, lstore, stats)
            have = set(replica.list_steps())
            lost = sorted(set(safe) - have)
            if lost:
                problems.append(f"step(s) {lost} were reported safe but are not on the replica")
            uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")
            mpu = len(uploads.get("Uploads", []))
            garbage = replica.list_garbage()
            stats.multipart_left += mpu > 0
            stats.killed_mid_upload += bool(garbage or mpu)
            # The next uploader on the same roots finishes the job and cleans up.
            up = Replicator(lstore, open_storage(url, dict(opts, skip_instance_cache=True)))
            up.recover()
            up.close()
            after = open_storage(url, dict(opts, skip_instance_cache=True))
            problems += _replica_problems(after, lstore, None)
            if after.list_steps() != list(UPLOAD_STEPS):
                problems.append(f"after recovery the replica has {after.list_steps()}")
            if after.list_garbage():
                problems.append(f"after recovery the replica has garbage {after.list_garbage()}")
            left = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")
            if left.get("Uploads"):
                problems.append("after recovery incomplete multipart uploads are left")
            stats.violations += [f"upload trial {i}: {p}" for p in problems]
            if verbose:
                print(
                    f"  upload trial {i:3d} kill at {delay:5.2f}s: safe {safe}, committed "
                    f"{sorted(have)}, garbage {garbage}, multipart {mpu}  "
                    + ("OK" if not problems else "VIOLATION: " + "; ".join(problems)),
                    flush=True,
                )
            import shutil

            shutil.rmtree(local, ignore_errors=True)
    stats.elapsed = time.monotonic() - t0
    return stats


# ---- the campaign ----------------------------------------------------------------------------


@contextlib.contextmanager
def _s3() -> Iterator[Any]:
    from s3server import s3_server

    with s3_server(bucket="ckptstore-crashtest") as ep:
        yield ep


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def campaign(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    rng = random.Random(args.seed)
    stores = ["local", "s3"] if args.store == "both" else [args.store]
    print(
        f"crashtest: seed {args.seed}; {args.trials} trials per store on {', '.join(stores)}; "
        f"{args.dist_trials} distributed trials",
        flush=True,
    )
    results: list[StoreStats] = []
    dstats: DistStats | None = None
    ustats: UploadStats | None = None
    server = Server()
    base = tempfile.mkdtemp(prefix="ckptstore-crashtest-")
    try:
        checker = Checker()
        for kind in stores:
            if args.trials <= 0:
                continue
            if kind == "local":

                def make_url() -> str:
                    return tempfile.mkdtemp(prefix="store-", dir=base)

                results.append(
                    writer_trials(
                        "local",
                        args.trials,
                        rng=rng,
                        server=server,
                        checker=checker,
                        make_url=make_url,
                        options=None,
                        verbose=args.verbose,
                    )
                )
            else:
                with _s3() as ep:

                    def make_url_s3() -> str:
                        return ep.url(ep.unique_prefix("crash"))

                    results.append(
                        writer_trials(
                            "s3",
                            args.trials,
                            rng=rng,
                            server=server,
                            checker=checker,
                            make_url=make_url_s3,
                            options=ep.storage_options,
                            verbose=args.verbose,
                        )
                    )
        if args.dist_trials > 0:
            dstats = dist_trials(args.dist_trials, rng, server, base, args.verbose)
        if args.upload_trials > 0:
            ustats = upload_trials(args.upload_trials, rng, server, base, args.verbose)
    finally:
        server.close()
        import shutil

        from ckptstore.storage import wait_for_deletions

        wait_for_deletions()
        shutil.rmtree(base, ignore_errors=True)
    elapsed = time.monotonic() - t0

    rows = [
        [
            "store",
            "configs",
            "trials",
            "kills",
            "mid-save",
            "mid-prune",
            "in-flight done",
            "violations",
            "elapsed",
        ]
    ]
    for s in results:
        rows.append(
            [
                s.store,
                str(len(s.configs)),
                str(s.trials),
                str(s.kills),
                str(s.killed_mid_save),
                str(s.killed_mid_retention),
                str(s.inflight_committed),
                str(len(s.violations)),
                f"{s.elapsed:.0f}s",
            ]
        )
    if dstats is not None:
        rows.append(
            [
                "dist (2 ranks)",
                "-",
                str(dstats.trials),
                str(dstats.kills),
                "-",
                "-",
                "-",
                str(len(dstats.violations)),
                f"{dstats.elapsed:.0f}s",
            ]
        )
    print()
    print(_table(rows))
    if dstats is not None and dstats.trials:
        phases = ", ".join(f"{k} {v}" for k, v in sorted(dstats.killed_in.items()))
        print(
            f"dist: {dstats.timed_kills} timed kills, {dstats.protocol_kills} at a protocol wait, "
            f"{dstats.frozen} of them a freeze (SIGSTOP) "
            f"(killed in: {phases}); survivors raised BarrierTimeout {dstats.survivor_timeouts}"
            f"/{dstats.kills}; slowest exit {dstats.max_exit_after_kill:.1f}s after the kill "
            f"(barrier_timeout {DIST_TIMEOUT:g}s, allowed {DIST_TIMEOUT + DIST_SLACK:g}s)"
        )
    if ustats is not None:
        print(
            f"uploads: {ustats.kills}/{ustats.trials} uploaders killed (SIGKILL) within "
            f"{ustats.upload_s * 1.1:.2f}s of their first upload (one whole upload of "
            f"{len(UPLOAD_STEPS)} steps: {ustats.upload_s:.2f}s); {ustats.killed_mid_upload} "
            f"left a partial step or multipart upload ({ustats.multipart_left} a multipart "
            f"upload); {ustats.complete_at_kill} replica steps committed at the kills, all "
            f"checked; {ustats.safe_reported} reported safe; violations "
            f"{len(ustats.violations)}; {ustats.elapsed:.0f}s"
        )
    violations = [v for s in results for v in s.violations] + (dstats.violations if dstats else [])
    violations += ustats.violations if ustats else []
    print(f"violations: {len(violations)}; elapsed {elapsed:.0f}s")
    for v in violations:
        print(f"  {v}")
    if args.json:
        doc = {
            "seed": args.seed,
            "trials_per_store": args.trials,
            "stores": [s.to_dict() for s in results],
            "dist": dataclasses.asdict(dstats) if dstats else None,
            "uploads": dataclasses.asdict(ustats) if ustats else None,
            "violations": violations,
            "elapsed": elapsed,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--store", choices=["local", "s3", "both"], default="both")
    p.add_argument("--trials", type=int, default=300, help="writer kills per store")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dist-trials", type=int, default=20, help="2-rank jobs with a rank killed")
    p.add_argument(
        "--upload-trials", type=int, default=300, help="uploads to S3 killed (replica tier)"
    )
    p.add_argument("--json", metavar="OUT", help="write every figure to OUT")
    p.add_argument("--verbose", action="store_true", help="one line per trial")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve()
    return campaign(args)


if __name__ == "__main__":
    sys.exit(main())

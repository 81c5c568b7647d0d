"""Writer trials: SIGKILL a writer at a random moment, then check the store it left."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import time
from typing import Any

from crashkit.common import CONFIGS, KILL_WITHIN, numbers_of
from crashkit.server import Server


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
        saved, returned = numbers_of(lines, "saved"), numbers_of(lines, "returned")
        starts = numbers_of(lines, "start")
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
            dict(
                kind="writer",
                root=store.url,
                storage_options=options,
                format=store.fmt,
                async_save=store.async_save,
                keep=store.keep,
            )
        )
        problems: list[str] = []
        try:
            pid = int(server.line("pid ", 60, lines).split()[1])
            server.children = [pid]
            server.line("start ", 120, lines)
            if (i // len(stores)) % 2:
                # Every other round of the configurations kills only after a save has
                # returned, so that the campaign checks returned saves on a host of any
                # speed (a busy one may otherwise kill every writer inside its first save).
                server.line("returned ", 120, lines)
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
                f"{len(numbers_of(lines, 'saved')):3d}  newest now {store.newest}  "
                + ("OK" if not problems else "VIOLATION: " + "; ".join(problems)),
                flush=True,
            )
        elif (i + 1) % 50 == 0:
            print(f"  {kind}: {i + 1}/{n} trials, {len(stats.violations)} violations", flush=True)
    stats.elapsed = time.monotonic() - t0
    return stats

"""The bench's harness: one size's context (state, timings, shared resources), the
contender protocol and the round-robin loop that runs contenders.

Contender groups call ``harness.settle()`` through the module (not a name imported from it),
so that one replacement (tests/test_bench.py) reaches every timed region.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchkit.disk import drop_cache, du, probe_odirect, remove
from benchkit.state import build_state, own_memory, state_tensors
from benchkit.units import GB
from ckptstore import CheckpointManager
from ckptstore.layout import step_dirname


def settle() -> None:
    """Before a timed operation: no garbage pending, no dirty pages of ours in flight."""
    gc.collect()
    os.sync()
    time.sleep(0.05)


class Ctx:
    """State, timings and shared resources of one benchmark size."""

    def __init__(self, args: argparse.Namespace, work: Path, param_bytes: int) -> None:
        self.args = args
        self.work = work
        t0 = time.perf_counter()
        self.model, self.opt, self.shape = build_state(param_bytes, args.layers)
        self.build_s = time.perf_counter() - t0
        ts = state_tensors(self.model, self.opt)
        self.n_tensors = len(ts)
        self.param_bytes = sum(
            t.numel() * t.element_size() for k, t in ts if k.startswith("model.")
        )
        self.state_bytes = sum(t.numel() * t.element_size() for _, t in ts)
        self.times: dict[tuple[str, str], list[float]] = {}
        self.extra: dict[str, Any] = {}
        self.disk_bytes: dict[str, int] = {}
        self.resident_after_drop: list[float] = []
        self.load_seen: list[float] = [os.getloadavg()[0]]
        self._counter = 0
        self.odirect_ok, self.odirect_why = probe_odirect(work)
        self._async: CheckpointManager | None = None
        self._async_step = 0

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return state_tensors(self.model, self.opt)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt}

    def newdir(self, name: str) -> Path:
        self._counter += 1
        d = self.work / f"{name}-{self._counter:03d}"
        d.mkdir(parents=True)
        return d

    def record(self, name: str, op: str, seconds: float) -> None:
        self.times.setdefault((name, op), []).append(seconds)
        self.load_seen.append(os.getloadavg()[0])
        log(f"  {name:<16} {op:<10} {seconds:8.3f} s  {self.state_bytes / seconds / GB:7.2f} GB/s")

    def drop(self, root: Path) -> None:
        """fsync and evict every file under ``root`` from the page cache; check it worked."""
        resident = drop_cache(root)
        if resident is not None:
            self.resident_after_drop.append(resident)

    def own_memory(self) -> None:
        """See :func:`own_memory`; the count moved is kept in ``extra``."""
        moved = own_memory(self.model, self.opt)
        if moved:
            self.extra["tensors_moved_out_of_file_mappings"] = (
                self.extra.get("tensors_moved_out_of_file_mappings", 0) + moved
            )

    def async_manager(self) -> CheckpointManager:
        """One async manager for the run: its staging buffers are allocated once, reused."""
        if self._async is None:
            self.own_memory()
            root = self.newdir("ckpt-async")
            self._async = CheckpointManager(root, keep=None, async_save=True)
            settle()
            t0 = time.perf_counter()
            h = self._async.save(self.next_async_step(), self.state())
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
            self.extra["async_first_save"] = {
                "blocked_s": t1 - t0,
                "committed_s": t2 - t0,
                "note": "first async save: staging buffers allocated (fresh memory); "
                "not part of the medians",
            }
            self.drop_async_step(h.step)
        return self._async

    def next_async_step(self) -> int:
        self._async_step += 1
        return self._async_step

    def drop_async_step(self, step: int) -> None:
        assert self._async is not None
        remove(Path(self._async.root) / step_dirname(step))

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
            self._async = None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Contender:
    name = ""

    def setup(self, ctx: Ctx) -> None:
        """Untimed preparation."""

    def round(self, ctx: Ctx, r: int) -> None:
        raise NotImplementedError

    def teardown(self, ctx: Ctx) -> None:
        """Free what setup made."""


class Pair(Contender):
    """A save (durable, new directory) followed by a cold restore of what it wrote."""

    def begin_save(self, ctx: Ctx, d: Path) -> None:
        """Untimed, before the save."""

    def save(self, ctx: Ctx, d: Path) -> None:
        raise NotImplementedError

    def begin_restore(self, ctx: Ctx, d: Path) -> None:
        """Untimed, before the restore."""

    def restore(self, ctx: Ctx, d: Path) -> None:
        raise NotImplementedError

    def end(self, ctx: Ctx, d: Path) -> None:
        """Untimed, after both."""

    def round(self, ctx: Ctx, r: int) -> None:
        d = ctx.newdir(self.name)
        try:
            self.begin_save(ctx, d)
            settle()
            t0 = time.perf_counter()
            self.save(ctx, d)
            ctx.record(self.name, "save", time.perf_counter() - t0)
            ctx.disk_bytes[self.name] = du(d)
            self.begin_restore(ctx, d)
            ctx.drop(d)
            settle()
            t0 = time.perf_counter()
            self.restore(ctx, d)
            ctx.record(self.name, "restore", time.perf_counter() - t0)
        finally:
            self.end(ctx, d)
            remove(d)


def run_rounds(ctx: Ctx, contenders: list[Contender], repeats: int) -> None:
    """Every contender once per round; round r starts at contender r (round-robin)."""
    usable = []
    for c in contenders:
        if c.name == "disk-odirect" and not ctx.odirect_ok:
            log(f"skipping disk-odirect: {ctx.odirect_why}")
            continue
        log(f"setup {c.name}")
        c.setup(ctx)
        usable.append(c)
    try:
        for r in range(repeats):
            k = r % max(1, len(usable))
            order = usable[k:] + usable[:k]
            log(f"round {r + 1}/{repeats}: {', '.join(c.name for c in order)}")
            for c in order:
                c.round(ctx, r)
    finally:
        for c in usable:
            c.teardown(ctx)

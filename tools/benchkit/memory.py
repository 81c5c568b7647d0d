"""In-memory contenders: what an async save costs the caller (blocked time, a training
step's slowdown) next to copying the state into allocated memory and ``clone()``."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from benchkit import harness
from benchkit.harness import Contender, Ctx, log


class CkptAsync(Contender):
    name = "ckpt-async"

    def setup(self, ctx: Ctx) -> None:
        ctx.async_manager()

    def round(self, ctx: Ctx, r: int) -> None:
        mgr = ctx.async_manager()
        ctx.own_memory()
        harness.settle()
        t0 = time.perf_counter()
        h = mgr.save(ctx.next_async_step(), ctx.state())
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        ctx.record(self.name, "blocked", t1 - t0)
        ctx.record(self.name, "committed", t2 - t0)
        ctx.extra.setdefault("async_last_blocked_s", []).append(mgr.last_blocked_s)
        ctx.drop_async_step(h.step)


def cpu_ticks() -> tuple[int, int, int] | None:
    """``(busy, total, ours)`` CPU ticks so far: the machine's, and this process's (Linux).

    ``None`` where ``/proc`` is missing. Busy excludes idle and iowait.
    """
    try:
        head = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    vals = [int(x) for x in head[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(vals) - vals[3] - vals[4]
    return busy, sum(vals), int(mine[11]) + int(mine[12])  # utime + stime


def others_share(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float:
    """The fraction of the machine's CPU time that other processes used between two samples."""
    if before is None or after is None or after[1] <= before[1]:
        return math.nan
    others = (after[0] - before[0]) - (after[2] - before[2])
    return max(0.0, others / (after[1] - before[1]))


def copied_bytes(ctx: Ctx, name: str, tensors: list[torch.Tensor]) -> None:
    """Keep the byte count a copy contender produced (equal to the state's, or it is wrong)."""
    n = sum(t.numel() * t.element_size() for t in tensors)
    ctx.extra.setdefault("copied_bytes", {}).setdefault(name, []).append(n)


class CopyPrealloc(Contender):
    """``copy_`` of every state tensor into buffers allocated and touched in ``setup``.

    The source is the state in anonymous memory (``Ctx.own_memory``), as for ``clone``.
    """

    name = "copy-prealloc"

    def setup(self, ctx: Ctx) -> None:
        ctx.own_memory()
        self.bufs = [torch.empty_like(t) for _, t in ctx.tensors()]
        for b, (_, t) in zip(self.bufs, ctx.tensors(), strict=True):
            b.copy_(t)  # touch every page once: "already allocated"

    def round(self, ctx: Ctx, r: int) -> None:
        ctx.own_memory()
        ts = [t for _, t in ctx.tensors()]
        harness.settle()
        t0 = time.perf_counter()
        for b, t in zip(self.bufs, ts, strict=True):
            b.copy_(t)
        ctx.record(self.name, "copy", time.perf_counter() - t0)
        copied_bytes(ctx, self.name, self.bufs)

    def teardown(self, ctx: Ctx) -> None:
        self.bufs = []


class Clone(Contender):
    """``clone()`` of every state tensor (fresh memory), from the same source as copy-prealloc."""

    name = "clone"

    def round(self, ctx: Ctx, r: int) -> None:
        ctx.own_memory()
        ts = [t for _, t in ctx.tensors()]
        harness.settle()
        t0 = time.perf_counter()
        copies = [t.clone() for t in ts]
        ctx.record(self.name, "clone", time.perf_counter() - t0)
        copied_bytes(ctx, self.name, copies)
        del copies


class StepSlowdown(Contender):
    """A training-like step, timed with and without an async save in flight.

    The step is the forward and backward pass of a two-layer MLP (about 1.6 GFLOP, tens of
    milliseconds on 2 cores), the same work in every window. The step it replaces (two small
    matmuls, ~2 ms) was dominated by what does not scale with work: waking the second
    intra-op thread, Python, allocation. Those depend on whether the CPUs are otherwise busy
    and on the other load of a shared host more than on the save (not proven here: on the
    shared 2-core host of this change the 2 ms step took 135-200 ms under others' load),
    and issue 13 saw that step run 10-33% *faster* during a save.
    Every timed window starts after untimed warm-up steps (``settle()`` sleeps, so the first
    steps after it paid for cold caches and sleeping threads in the base windows only). The
    slowdown is that of the mean step (throughput); medians are kept too.
    """

    name = "step-slowdown"
    #: Untimed steps after every ``settle()``, before a timed window.
    WARMUP = 3
    #: Seconds of steps timed before and after the save.
    WINDOW_S = 1.0
    #: A round whose windows saw other processes' CPU share differ by more than this (a
    #: fraction of the machine) is marked confounded.
    CONFOUNDED = 0.1

    def setup(self, ctx: Ctx) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(128, 1024, generator=gen)
        self.w1 = torch.randn(1024, 1024, generator=gen).div_(32).requires_grad_()
        self.w2 = torch.randn(1024, 1024, generator=gen).div_(32).requires_grad_()
        self.warm_up()
        ctx.async_manager()

    def warm_up(self) -> None:
        for _ in range(self.WARMUP):
            self.work()

    def steps_for(self, seconds: float) -> list[float]:
        self.warm_up()
        out: list[float] = []
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(out) < 5:
            out.append(self.step())
        return out

    def work(self) -> None:
        """One training-like step: forward, backward, gradients dropped."""
        loss = torch.mm(torch.mm(self.x, self.w1).relu_(), self.w2).square().mean()
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.w1.grad = self.w2.grad = None

    def step(self) -> float:
        t0 = time.perf_counter()
        self.work()
        return time.perf_counter() - t0

    def round(self, ctx: Ctx, r: int) -> None:
        mgr = ctx.async_manager()
        ctx.own_memory()
        harness.settle()
        c0 = cpu_ticks()
        base = self.steps_for(self.WINDOW_S)
        c1 = cpu_ticks()
        harness.settle()
        h = mgr.save(ctx.next_async_step(), ctx.state())
        c2 = cpu_ticks()
        during: list[float] = []
        while not h.done() or not during:
            during.append(self.step())
        c3 = cpu_ticks()
        h.wait()
        harness.settle()
        # Before and after: load drifting over the run cancels.
        c4 = cpu_ticks()
        base += self.steps_for(self.WINDOW_S)
        c5 = cpu_ticks()
        ctx.drop_async_step(h.step)
        # What other processes took of the CPU in each window. On a shared host the windows
        # can see different competition (other jobs start, stop, or wait on the disk the
        # save holds); then the step figure says nothing about the save, and is marked.
        others_base = statistics.fmean([others_share(c0, c1), others_share(c4, c5)])
        others_during = others_share(c2, c3)
        confounded = bool(abs(others_during - others_base) > self.CONFOUNDED)
        mean_base = statistics.fmean(base)
        mean_during = statistics.fmean(during)
        ctx.times.setdefault((self.name, "step-base"), []).append(mean_base)
        ctx.times.setdefault((self.name, "step-during"), []).append(mean_during)
        slow = mean_during / mean_base - 1
        ctx.extra.setdefault("step_slowdown", []).append(
            {
                "mean_step_s_without": mean_base,
                "mean_step_s_during_save": mean_during,
                "median_step_s_without": statistics.median(base),
                "median_step_s_during_save": statistics.median(during),
                "steps_without": len(base),
                "steps_during_save": len(during),
                "intra_op_threads": torch.get_num_threads(),
                "others_cpu_share_without": others_base,
                "others_cpu_share_during_save": others_during,
                "confounded": confounded,
                "slowdown": slow,
            }
        )
        flag = (
            f" CONFOUNDED: other processes used {others_base:.0%} of the CPU without the "
            f"save, {others_during:.0%} during it"
            if confounded
            else ""
        )
        log(
            f"  {self.name:<16} step {mean_base * 1e3:.2f} ms -> {mean_during * 1e3:.2f} ms "
            f"during save ({len(during)} steps): {slow:+.0%}{flag}"
        )

"""The commit protocol's fixed costs and metadata at scale: deep verify of a cold
checkpoint, a few-KB save next to the fsync floor, a save on a big store vs an empty one,
and steps/latest_step/plan_prune/``ckptstore ls`` on a store of many checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchkit import harness
from benchkit.disk import fsync_dir, remove
from benchkit.harness import Contender, Ctx, log
from ckptstore import CheckpointManager, KeepBest, KeepEvery, KeepLast, RetentionPolicy
from ckptstore.layout import MANIFEST_NAME, step_dirname


class Verify(Contender):
    name = "verify"

    def setup(self, ctx: Ctx) -> None:
        self.root = ctx.newdir("verify")
        self.mgr = CheckpointManager(self.root, keep=None)
        self.mgr.save(1, ctx.state())

    def round(self, ctx: Ctx, r: int) -> None:
        ctx.drop(self.root)
        harness.settle()
        t0 = time.perf_counter()
        rep = self.mgr.verify(1, deep=True)
        ctx.record(self.name, "verify", time.perf_counter() - t0)
        if not rep.ok:
            msg = f"verify found problems in a fresh checkpoint: {rep.problems}"
            raise RuntimeError(msg)
        ctx.extra["verify_bytes_checked"] = rep.bytes_checked

    def teardown(self, ctx: Ctx) -> None:
        self.mgr.close()
        remove(self.root)


class Protocol(Contender):
    """The fixed cost of a save: a few-KB state, next to the disk's own fsync floor."""

    name = "protocol"
    per_round = 10

    def setup(self, ctx: Ctx) -> None:
        self.root = ctx.newdir("protocol")
        self.floor = ctx.newdir("fsync-floor")
        self.mgr = CheckpointManager(self.root / "store", keep=3)
        self.tiny = {"w": torch.randn(256), "b": torch.zeros(16), "step": 0, "lr": 1e-4}
        self.step = 0
        self.mgr.save(self.next_step(), self.tiny)  # the first save also takes the lock

    def next_step(self) -> int:
        self.step += 1
        self.tiny["step"] = self.step
        return self.step

    def round(self, ctx: Ctx, r: int) -> None:
        harness.settle()
        data = os.urandom(1024)
        for i in range(self.per_round):
            t0 = time.perf_counter()
            self.mgr.save(self.next_step(), self.tiny)
            ctx.times.setdefault((self.name, "tiny-save"), []).append(time.perf_counter() - t0)
            path = self.floor / f"f{r}-{i}"
            t0 = time.perf_counter()
            with open(path, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.floor)
            ctx.times.setdefault((self.name, "fsync-floor"), []).append(time.perf_counter() - t0)
        tiny = statistics.median(ctx.times[(self.name, "tiny-save")][-self.per_round :])
        floor = statistics.median(ctx.times[(self.name, "fsync-floor")][-self.per_round :])
        log(f"  {self.name:<16} tiny save {tiny * 1e3:.2f} ms, fsync floor {floor * 1e3:.2f} ms")

    def teardown(self, ctx: Ctx) -> None:
        self.mgr.close()
        remove(self.root)
        remove(self.floor)


class Scale(Contender):
    """A save's cost must not grow with the steps in the store: big store vs empty store."""

    name = "scale"
    per_round = 10
    stride = 100  # the big store's steps are multiples of it: KeepEvery keeps them all

    def setup(self, ctx: Ctx) -> None:
        self.count = ctx.args.scale_count
        self.keep: list[RetentionPolicy] = [
            KeepLast(3),
            KeepEvery(self.stride),
            KeepBest(3, "val_loss"),
        ]
        self.tiny = {"w": torch.randn(256), "b": torch.zeros(16), "step": 0, "lr": 1e-4}
        empty, big = ctx.newdir("scale-empty") / "store", ctx.newdir("scale-big") / "store"
        t0 = time.perf_counter()
        with CheckpointManager(big, keep=None) as mgr:
            mgr.save(self.stride, self.tiny, metrics={"val_loss": 1.0})
        grow_store(big, self.stride, self.count * self.stride, self.stride, self.stride)
        grown = time.perf_counter() - t0
        self.mgrs = {
            "save-empty": CheckpointManager(empty, keep=self.keep),
            "save-big": CheckpointManager(big, keep=self.keep),
        }
        self.next = {"save-empty": 1, "save-big": self.count * self.stride + 1}
        # The first save of a manager lists the store once (and reads the manifests KeepBest
        # needs, from the listing cache): a one-time cost, not in the medians.
        first = {op: self.save(op) for op in self.mgrs}
        ctx.extra["scale"] = {
            "count": self.count,
            "policy": repr(self.keep),
            "create_s": grown,
            "first_save_s": first,
        }
        log(f"  scale: {self.count} steps made in {grown:.1f}s; first saves {first}")

    def save(self, op: str) -> float:
        step = self.next[op]
        self.next[op] += 1
        self.tiny["step"] = step
        t0 = time.perf_counter()
        self.mgrs[op].save(step, self.tiny, metrics={"val_loss": float(step % 7)})
        return time.perf_counter() - t0

    def round(self, ctx: Ctx, r: int) -> None:
        harness.settle()
        order = list(self.mgrs) if r % 2 == 0 else list(reversed(self.mgrs))
        for _ in range(self.per_round):
            for op in order:
                ctx.times.setdefault((self.name, op), []).append(self.save(op))
        med = {
            op: statistics.median(ctx.times[(self.name, op)][-self.per_round :]) * 1e3
            for op in self.mgrs
        }
        log(
            f"  {self.name:<16} few-KB save: empty store {med['save-empty']:.2f} ms, "
            f"{self.count} steps {med['save-big']:.2f} ms"
        )

    def teardown(self, ctx: Ctx) -> None:
        for mgr in self.mgrs.values():
            mgr.close()
            remove(Path(mgr.root).parent)


_LS_SCRIPT = """
import json, sys, time
from ckptstore import list_store
t0 = time.perf_counter()
res = list_store(sys.argv[1], {})
print(json.dumps({"seconds": time.perf_counter() - t0, "steps": len(res.steps)}))
"""


def time_ls_subprocess(root: Path, timeout: float) -> dict[str, Any]:
    """``ckptstore ls``'s work (ckptstore.list_store), timed inside a child we can give up on."""
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            [sys.executable, "-c", _LS_SCRIPT, str(root)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"seconds": None, "timed_out": True, "timeout_s": timeout}
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        return {"seconds": None, "error": res.stderr.strip().splitlines()[-1:]}
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


def grow_store(root: Path, template: int, upto: int, have: int, stride: int = 1) -> None:
    """Copy checkpoint ``template`` to steps have+stride..upto: hard links, fresh manifests."""
    src = root / step_dirname(template)
    with CheckpointManager(root) as mgr:
        manifest = mgr.manifest(template)
    names = [p.name for p in src.iterdir() if p.name != MANIFEST_NAME]
    for s in range(have + stride, upto + 1, stride):
        d = root / step_dirname(s)
        d.mkdir()
        for n in names:
            os.link(src / n, d / n)
        m = dataclasses.replace(manifest, step=s, metrics={"val_loss": float((s * 7919) % 1000)})
        (d / MANIFEST_NAME).write_bytes(m.to_bytes())


def bench_ls(work: Path, count: int, repeats: int, timeout: float) -> dict[str, Any]:
    root = work / "ls-store"
    out: dict[str, Any] = {"count": count, "cache": "warm (metadata just written)"}
    with CheckpointManager(root, keep=None) as mgr:
        mgr.save(1, {"w": torch.randn(256), "step": 1}, metrics={"val_loss": 1.0})
    t0 = time.perf_counter()
    probe = min(1000, count)
    grow_store(root, 1, probe, 1)
    if probe < count:
        out["ls_at_probe"] = {"count": probe, **time_ls_subprocess(root, timeout)}
        log(f"  ls10k: `ckptstore ls` on {probe}: {out['ls_at_probe']}")
    grow_store(root, 1, count, probe)
    out["create_s"] = time.perf_counter() - t0
    ops: dict[str, Callable[[CheckpointManager], Any]] = {
        "steps": lambda m: m.steps(),
        "latest_step": lambda m: m.latest_step(),
        "plan_keep_last": lambda m: m.plan_prune(),
        "plan_keep_best": lambda m: m.plan_prune(),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for r in range(repeats):
        for name, fn in ops.items():
            keep: Any = (
                [KeepLast(3), KeepBest(3, "val_loss")] if name == "plan_keep_best" else KeepLast(3)
            )
            mgr = CheckpointManager(root, keep=keep)
            t0 = time.perf_counter()
            res = fn(mgr)
            times[name].append(time.perf_counter() - t0)
            mgr.close()
            if name == "latest_step" and res != count:
                msg = f"latest_step() is {res}, expected {count}"
                raise RuntimeError(msg)
        log(f"  ls10k round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()))
    out["ops"] = {k: {"times_s": v, "median_s": statistics.median(v)} for k, v in times.items()}
    ls = time_ls_subprocess(root, timeout)
    out["ops"]["ls"] = {"median_s": ls.get("seconds"), **ls}
    log(f"  ls10k: `ckptstore ls` on {count}: {ls}")
    remove(root)
    return out

"""Plain save/restore contenders: the raw disk (O_DIRECT, buffered), torch.save,
safetensors, DCP in one process, ckptstore's synchronous manager in each format, I/O mode
and compression, and the peak RSS of a restore (a child process)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchkit.disk import (
    ALIGN,
    CHUNK,
    dma_buffer,
    fill_buffer,
    fsync_dir,
    fsync_file,
    fsync_tree,
    odirect_write,
    remove,
)
from benchkit.harness import Contender, Ctx, Pair, log
from benchkit.state import tensor_bytes
from benchkit.units import GB
from ckptstore import CheckpointManager

TOOLS = Path(__file__).resolve().parent.parent
REPO = TOOLS.parent


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total time covered by possibly overlapping (start, end) spans."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@contextlib.contextmanager
def timed_payload(sink: list[tuple[float, float]]) -> Iterator[None]:
    """Record the spans ckptstore spends in payload writing (write + crc + fsync) in ``sink``.

    Instruments ``ckptstore.codec.payload.write_group``, which the manager looks up at call
    time; everything else in a save is the commit protocol (encode, state.json, manifest,
    directory fsyncs, rename, retention). Spans, not sums, so parallel writers count once.
    """
    from ckptstore.codec import payload

    orig = getattr(payload, "write_group", None)
    if orig is None:
        yield
        return

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            sink.append((t0, time.perf_counter()))

    payload.write_group = wrapper
    try:
        yield
    finally:
        payload.write_group = orig


class DiskODirect(Pair):
    name = "disk-odirect"

    def setup(self, ctx: Ctx) -> None:
        self.buf = dma_buffer(CHUNK)  # page-aligned, on huge pages where given (see there)
        # Bytes of the real state, so nothing downstream could compress or dedupe zeros.
        fill_buffer(self.buf, (t for _, t in ctx.tensors()))
        self.nbytes = -(-ctx.state_bytes // ALIGN) * ALIGN

    def teardown(self, ctx: Ctx) -> None:
        self.buf.close()

    def save(self, ctx: Ctx, d: Path) -> None:
        odirect_write(d / "raw.bin", self.buf, self.nbytes)
        fsync_dir(d)

    def restore(self, ctx: Ctx, d: Path) -> None:
        fd = os.open(d / "raw.bin", os.O_RDONLY | os.O_DIRECT)
        got = 0
        try:
            while n := os.readv(fd, [self.buf]):
                got += n
        finally:
            os.close(fd)
        if got != self.nbytes:
            msg = f"O_DIRECT read {got} bytes, expected {self.nbytes}"
            raise OSError(msg)


class DiskBuffered(Pair):
    name = "disk-buffered"

    def setup(self, ctx: Ctx) -> None:
        self.buf = bytearray(CHUNK)

    def save(self, ctx: Ctx, d: Path) -> None:
        with open(d / "raw.bin", "xb", buffering=0) as f:
            for _, t in ctx.tensors():
                mv = tensor_bytes(t)
                pos = 0
                while pos < len(mv):
                    pos += f.write(mv[pos : pos + CHUNK]) or 0
            os.fsync(f.fileno())
        fsync_dir(d)

    def restore(self, ctx: Ctx, d: Path) -> None:
        fd = os.open(d / "raw.bin", os.O_RDONLY)
        got = 0
        try:
            while n := os.readv(fd, [self.buf]):
                got += n
        finally:
            os.close(fd)
        if got != ctx.state_bytes:
            msg = f"read {got} bytes, expected {ctx.state_bytes}"
            raise OSError(msg)


class TorchSave(Pair):
    name = "torch"

    def save(self, ctx: Ctx, d: Path) -> None:
        path = d / "ckpt.pt"
        torch.save({"model": ctx.model.state_dict(), "optimizer": ctx.opt.state_dict()}, path)
        fsync_file(path)
        fsync_dir(d)

    def restore(self, ctx: Ctx, d: Path) -> None:
        obj = torch.load(d / "ckpt.pt", weights_only=True, map_location="cpu")
        ctx.model.load_state_dict(obj["model"])
        ctx.opt.load_state_dict(obj["optimizer"])


class SafetensorsSave(Pair):
    name = "safetensors"

    def save(self, ctx: Ctx, d: Path) -> None:
        from safetensors.torch import save_file

        flat = dict(ctx.tensors())
        groups = json.dumps(ctx.opt.state_dict()["param_groups"])
        path = d / "ckpt.safetensors"
        save_file(flat, str(path), metadata={"param_groups": groups})
        del flat
        fsync_file(path)
        fsync_dir(d)

    def restore(self, ctx: Ctx, d: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = str(d / "ckpt.safetensors")
        with safe_open(path, "pt") as f:
            groups = json.loads(f.metadata()["param_groups"])
        flat = load_file(path)
        # load_file maps the file (MAP_PRIVATE, torch.UntypedStorage.from_file) and reads
        # nothing: the optimizer's tensors are adopted as they are, so their bytes would be
        # read from the disk (and copied on write) by whatever touches them next, i.e. the
        # next contender. Touch every page here, inside the timed region: a restore has the
        # state in memory when it returns.
        for v in flat.values():
            b = v.reshape(-1).view(torch.uint8)
            if len(b):
                b[::4096].sum()
        model_sd = {k[6:]: v for k, v in flat.items() if k.startswith("model.")}
        opt_state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in flat.items():
            if k.startswith("optimizer."):
                _, i, name = k.split(".", 2)
                opt_state.setdefault(int(i), {})[name] = v
        ctx.model.load_state_dict(model_sd)
        ctx.opt.load_state_dict({"state": opt_state, "param_groups": groups})

    def end(self, ctx: Ctx, d: Path) -> None:
        # Untimed: the optimizer's state now lives in private mappings of a file about to be
        # deleted; give it ordinary memory again so the next contender starts as this one did.
        with torch.no_grad():
            for st in ctx.opt.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        st[k] = v.clone()


class DCPSave(Pair):
    name = "dcp"

    def save(self, ctx: Ctx, d: Path) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as save_dcp

        sd = {"model": ctx.model.state_dict(), "optimizer": ctx.opt.state_dict()}
        save_dcp(sd, storage_writer=FileSystemWriter(str(d), sync_files=True))
        fsync_tree(d)  # .metadata and the directory too: durable like every other contender

    def restore(self, ctx: Ctx, d: Path) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load as load_dcp

        osd = ctx.opt.state_dict()
        load_dcp(
            {"model": ctx.model.state_dict(), "optimizer": osd},
            storage_reader=FileSystemReader(str(d)),
        )
        ctx.opt.load_state_dict(osd)  # tensors were filled in place; this applies the groups


class CkptSync(Pair):
    def __init__(
        self,
        name: str,
        fmt: str,
        compression: str | None,
        *,
        in_place: bool | None = None,
        io: str | None = None,
    ) -> None:
        self.name = name
        self.fmt = fmt
        self.compression = compression
        self.in_place = in_place
        self.io = io
        self.mgr: CheckpointManager | None = None

    def _open(self, d: Path) -> CheckpointManager:
        opts = {"io": self.io} if self.io else None
        return CheckpointManager(
            d, keep=None, format=self.fmt, compression=self.compression, storage_options=opts
        )

    def begin_save(self, ctx: Ctx, d: Path) -> None:
        self.mgr = self._open(d)
        self.payload: list[tuple[float, float]] = []

    def save(self, ctx: Ctx, d: Path) -> None:
        assert self.mgr is not None
        with timed_payload(self.payload):
            t0 = time.perf_counter()
            self.mgr.save(1, ctx.state())
            total = time.perf_counter() - t0
        if self.payload:
            ctx.extra.setdefault("save_breakdown", {}).setdefault(self.name, []).append(
                {"total_s": total, "payload_s": union_length(self.payload)}
            )

    def begin_restore(self, ctx: Ctx, d: Path) -> None:
        assert self.mgr is not None
        self.mgr.close()
        self.mgr = self._open(d)  # a fresh manager, as after a restart

    def restore(self, ctx: Ctx, d: Path) -> None:
        assert self.mgr is not None
        self.mgr.restore(ctx.state(), step=1, in_place=self.in_place)

    def end(self, ctx: Ctx, d: Path) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None


_RSS_CHILD = r"""
import gc, json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from benchkit import disk, plain, state
from pathlib import Path
flavor, d = sys.argv[2], Path(sys.argv[3])
model, opt, _ = state.build_state(int(sys.argv[4]), int(sys.argv[5]))
state_bytes = sum(t.numel() * t.element_size() for _, t in state.state_tensors(model, opt))
if flavor == "safetensors":
    from safetensors.torch import save_file
    flat = dict(state.state_tensors(model, opt))
    groups = json.dumps(opt.state_dict()["param_groups"])
    save_file(flat, str(d / "ckpt.safetensors"), metadata={"param_groups": groups})
    del flat
else:
    from ckptstore import CheckpointManager
    with CheckpointManager(d, keep=None) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
opt.zero_grad(set_to_none=True)
gc.collect()
for f in disk.tree_files(d):
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
t0 = time.perf_counter()
if flavor == "safetensors":
    ctx = type("C", (), {})()
    ctx.model, ctx.opt = model, opt
    plain.SafetensorsSave().restore(ctx, d)
else:
    from ckptstore import CheckpointManager
    with CheckpointManager(d, keep=None) as mgr:
        mgr.restore({"model": model, "optimizer": opt}, step=1,
                    in_place=False if flavor == "ckpt-st-copy" else None)
dt = time.perf_counter() - t0
peak = status("VmHWM")
print(json.dumps({"flavor": flavor, "state_bytes": state_bytes, "rss_before": base,
                  "peak": peak, "extra": peak - base, "seconds": dt}))
"""


class RestoreRSS(Contender):
    """Peak resident memory of a restore, in a child process (its peak is the restore's)."""

    name = "restore-rss"
    FLAVORS = ("ckpt-st", "ckpt-st-copy", "safetensors")

    def round(self, ctx: Ctx, r: int) -> None:
        if r:  # one measurement per flavor: memory does not vary like time does
            return
        wanted = [f for f in str(ctx.args.rss_flavors).split(",") if f]
        unknown = sorted(set(wanted) - set(self.FLAVORS))
        if unknown:
            raise ValueError(f"--rss-flavors: unknown {unknown}; known: {self.FLAVORS}")
        for flavor in [f for f in self.FLAVORS if f in wanted]:
            d = ctx.newdir(f"rss-{flavor}")
            try:
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join(
                    [str(REPO), str(REPO / "tools"), env.get("PYTHONPATH", "")]
                )
                cmd = [sys.executable, "-c", _RSS_CHILD, str(REPO / "tools"), flavor, str(d)]
                proc = subprocess.run(
                    [*cmd, str(ctx.args.size), str(ctx.args.layers)],
                    capture_output=True,
                    text=True,
                    timeout=1800,
                    check=False,
                    env=env,
                )
                if proc.returncode != 0:
                    log(f"  restore-rss {flavor}: failed: {proc.stderr[-2000:]}")
                    continue
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                # RSS of everything else (torch, Python) is rss_before - state_bytes: the
                # peak over the state is (state + what the restore added) / state.
                got["peak_over_state"] = 1 + got["extra"] / got["state_bytes"]
                ctx.extra.setdefault("restore_rss", {})[flavor] = got
                log(
                    f"  restore-rss {flavor:<14} +{got['extra'] / GB:.2f} GB over "
                    f"{got['state_bytes'] / GB:.2f} GB of state: peak {got['peak_over_state']:.2f}x"
                    f" the state ({got['seconds']:.2f} s)"
                )
            finally:
                remove(d)

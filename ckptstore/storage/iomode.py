"""Buffered or ``O_DIRECT``: which one a device is faster with, measured, not assumed.

Disks differ: an NVMe drive with a deep queue reads fastest with ``O_DIRECT`` (no copy
through the page cache), while a virtual disk or a network block device often reads faster
through the page cache, whose readahead keeps more requests in flight. The first large file
a process reads from a device is read half one way, half the other (a probe of real reads,
no extra I/O); the faster mode is remembered for that device (``st_dev``) for the life of the
process, and every later large read there uses it. Writes are probed the same way, once per
device, with a small file written both ways and fsynced (:func:`write_mode`).

``LocalStorage(io="direct" | "buffered")`` (or ``storage_options={"io": ...}`` for a local
path) forces a mode; ``"auto"`` (the default) measures.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import uuid

from .._log import logger as log

__all__ = ["IO_MODES", "forget", "read_mode", "record_read_probe", "write_mode"]

#: The values of ``LocalStorage(io=...)``.
IO_MODES = ("auto", "direct", "buffered")

_lock = threading.Lock()
_read: dict[int, str] = {}
_write: dict[int, str] = {}
#: A mode must be this much faster to be chosen over buffered I/O (which also works where
#: O_DIRECT does not, and leaves the file in the page cache for a second reader).
_MARGIN = 1.05


def read_mode(dev: int) -> str | None:
    """The read mode measured for device ``dev``, or ``None`` before its first probe."""
    return _read.get(dev)


def record_read_probe(dev: int, direct_bps: float, buffered_bps: float) -> str:
    """Remember which read mode was faster on ``dev``; returns it."""
    mode = "direct" if direct_bps > buffered_bps * _MARGIN else "buffered"
    with _lock:
        _read.setdefault(dev, mode)
        mode = _read[dev]
    log.debug(
        "read probe on device %#x: O_DIRECT %.2f GB/s, buffered %.2f GB/s: %s",
        dev,
        direct_bps / 1e9,
        buffered_bps / 1e9,
        mode,
    )
    return mode


def forget() -> None:
    """Drop every measured mode (tests; a process that moved to other disks)."""
    with _lock:
        _read.clear()
        _write.clear()


#: Size of each of the two probe files of :func:`write_mode` (written once per device).
WRITE_PROBE_BYTES = 32 << 20


def write_mode(directory: str) -> str:
    """The faster durable write mode on the device of ``directory``, probed once.

    The probe writes :data:`WRITE_PROBE_BYTES` with ``O_DIRECT`` and the same buffered, each
    fsynced, into hidden files of ``directory`` (removed at once), and keeps the faster: a
    few hundred milliseconds once per device per process. Where ``O_DIRECT`` is refused, or
    the probe fails, ``"buffered"``.
    """
    dev = os.stat(directory).st_dev
    mode = _write.get(dev)
    if mode is not None:
        return mode
    with _lock:
        mode = _write.get(dev)
        if mode is None:
            mode = _probe_write(directory)
            _write[dev] = mode
    return mode


def _probe_write(directory: str) -> str:
    from .directio import _O_DIRECT, ALIGN

    if not _O_DIRECT:
        return "buffered"
    buf = mmap.mmap(-1, WRITE_PROBE_BYTES)
    try:
        mv = memoryview(buf)
        for i in range(0, WRITE_PROBE_BYTES, 1 << 20):  # not zeros: no dedup or compression
            mv[i : i + 16] = os.urandom(16)
        speeds: dict[str, float] = {}
        for mode in ("direct", "buffered", "direct", "buffered"):
            path = os.path.join(directory, f".ckptstore-probe-{uuid.uuid4().hex}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            try:
                fd = os.open(path, flags | (_O_DIRECT if mode == "direct" else 0), 0o600)
            except OSError:
                return "buffered"  # O_DIRECT refused (tmpfs)
            try:
                t0 = time.perf_counter()
                done = 0
                while done < WRITE_PROBE_BYTES:
                    n = os.pwrite(fd, mv[done : done + (16 << 20)], done)
                    if n <= 0 or n % ALIGN:
                        return "buffered"
                    done += n
                os.fsync(fd)
                bps = WRITE_PROBE_BYTES / (time.perf_counter() - t0)
                speeds[mode] = max(speeds.get(mode, 0.0), bps)
            except OSError:
                return "buffered"
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
        mv.release()
    finally:
        buf.close()
    mode = "direct" if speeds["direct"] > speeds["buffered"] * _MARGIN else "buffered"
    log.debug(
        "write probe in %s: O_DIRECT %.2f GB/s, buffered %.2f GB/s: %s",
        directory,
        speeds["direct"] / 1e9,
        speeds["buffered"] / 1e9,
        mode,
    )
    return mode

"""Buffered or ``O_DIRECT``: which one a device is faster with, measured, not assumed.

Disks differ: an NVMe drive with a deep queue reads fastest with ``O_DIRECT`` (no copy
through the page cache), while a virtual disk or a network block device often reads faster
through the page cache, whose readahead keeps more requests in flight. The first large file
a process reads from a device is read half one way, half the other (a probe of real reads,
no extra I/O); the faster mode is remembered for that device (``st_dev``) for the life of the
process, and every later large read there uses it. Writes are measured on the files being
saved too (:func:`write_mode`, :func:`record_write`): each mode once, then the faster, the
other tried again now and then, since a small probe file says little of how the page cache
copes with gigabytes (on the shared test machine, buffered writes of a 64 MB probe kept up
with O_DIRECT while 3 GB saves ran at a fifth of its speed).

``LocalStorage(io="direct" | "buffered")`` (or ``storage_options={"io": ...}`` for a local
path) forces a mode; ``"auto"`` (the default) measures.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .._log import logger as log

__all__ = [
    "IO_MODES",
    "decisions",
    "forget",
    "read_mode",
    "record_read_probe",
    "record_write",
    "write_mode",
]

#: The values of ``LocalStorage(io=...)``.
IO_MODES = ("auto", "direct", "buffered")

_lock = threading.Lock()
_read: dict[int, str] = {}
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
        _history.append(
            {
                "op": "read-probe",
                "dev": dev,
                "direct_bytes_per_s": direct_bps,
                "buffered_bytes_per_s": buffered_bps,
                "mode": mode,
            }
        )
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
        _wstats.clear()
        _wcount.clear()
        _history.clear()


#: Files at least this large report their write speed (smaller ones say little of the disk).
MEASURED_WRITE_BYTES = 64 << 20
#: Every this many large files, the mode that is not the best is tried again: conditions
#: change (other writers, the page cache filling), so an old verdict is refreshed.
EXPLORE_EVERY = 8

_wstats: dict[int, dict[str, float]] = {}
_wcount: dict[int, int] = {}
_history: list[dict[str, object]] = []


def write_mode(directory: str) -> str:
    """The write mode for the next large file on the device of ``directory``.

    Chosen from the speeds real saves reached there (:func:`record_write`): each mode is
    tried once first, then the faster one is used, and every :data:`EXPLORE_EVERY`-th file
    the other is tried again. No extra I/O: the files being saved are the measurement.
    """
    dev = os.stat(directory).st_dev
    with _lock:
        stats = _wstats.setdefault(dev, {})
        n = _wcount[dev] = _wcount.get(dev, 0) + 1
        untried = [m for m in ("buffered", "direct") if m not in stats]
        if untried:
            mode = untried[0] if n % 2 else untried[-1]
        else:
            best = "direct" if stats["direct"] > stats["buffered"] * _MARGIN else "buffered"
            other = "buffered" if best == "direct" else "direct"
            mode = other if n % EXPLORE_EVERY == 0 else best
    return mode


def record_write(directory: str, mode: str, nbytes: int, seconds: float) -> None:
    """Fold a durable write of ``nbytes`` in ``seconds`` (open to fsync) into the stats."""
    if nbytes < MEASURED_WRITE_BYTES or seconds <= 0:
        return
    with contextlib.suppress(OSError):
        dev = os.stat(directory).st_dev
        bps = nbytes / seconds
        with _lock:
            stats = _wstats.setdefault(dev, {})
            old = stats.get(mode)
            stats[mode] = bps if old is None else (old + bps) / 2
            _history.append({"op": "write", "dev": dev, "mode": mode, "bytes_per_s": bps})
            del _history[:-1000]


def decisions() -> list[dict[str, object]]:
    """What was measured and chosen so far in this process (for benchmarks and debugging)."""
    with _lock:
        return list(_history)

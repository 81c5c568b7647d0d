"""Buffered or ``O_DIRECT``: which one a device is faster with, measured, not assumed.

Disks differ: an NVMe drive with a deep queue reads fastest with ``O_DIRECT`` (no copy
through the page cache), while a virtual disk or a network block device often reads faster
through the page cache, whose readahead keeps more requests in flight; and the page cache
copes worse once other processes fill it. So the files being read and saved are the
measurement, per device (``st_dev``), for the life of the process: the first large files
(at least :data:`MEASURED_BYTES`) try each mode once, later ones use the faster (by bytes
over the time from open to the last byte consumed, or to fsync), and every
:data:`EXPLORE_EVERY`-th file tries the other again, since conditions change. No extra I/O.

Why not a probe: on the shared test machine, a probe read of 3 x 32 MiB each way (the first
slices of a file) chose buffered reads, which then ran the 3 GB state at half O_DIRECT's
speed; a 64 MB write+fsync probe kept buffered writes level with O_DIRECT while 3 GB saves
ran buffered at a fifth of its speed.

The speeds measured are kept across processes (:mod:`~ckptstore.storage.iocache`): a new
process starts on a known device with the mode found faster there, not with a try of the
slower one, and its explorations keep the cached verdict current.

``LocalStorage(io="direct" | "buffered")`` (or ``storage_options={"io": ...}`` for a local
path) forces a mode; ``"auto"`` (the default) measures.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from .._log import logger as log
from . import iocache

__all__ = [
    "IO_MODES",
    "decisions",
    "forget",
    "read_mode",
    "record_read",
    "record_write",
    "side_by_side",
    "write_mode",
]

#: The values of ``LocalStorage(io=...)``.
IO_MODES = ("auto", "direct", "buffered")

_lock = threading.Lock()
#: A mode must be this much faster to be chosen over buffered I/O (which also works where
#: O_DIRECT does not, and leaves the file in the page cache for a second reader).
_MARGIN = 1.05


def read_mode(dev: int) -> str:
    """The read mode for the next large file on device ``dev`` (see :func:`write_mode`)."""
    return _next(_rstats, _rcount, "read", dev)


def record_read(dev: int, mode: str, nbytes: int, seconds: float) -> None:
    """Fold a read of ``nbytes`` in ``seconds`` (open to last byte consumed) into the stats."""
    _record(_rstats, "read", dev, mode, nbytes, seconds)


def _seed(table: dict[int, dict[str, float]], op: str, dev: int) -> None:
    """On first use of ``dev`` in this process, start from what earlier ones measured."""
    if dev in table:
        return
    cached = iocache.load(dev, op)
    with _lock:
        if dev not in table:
            table[dev] = cached
            if cached:
                log.debug("%s on device %#x: cached speeds %s", op, dev, cached)


def _next(table: dict[int, dict[str, float]], counts: dict[int, int], op: str, dev: int) -> str:
    _seed(table, op, dev)
    with _lock:
        stats = table.setdefault(dev, {})
        n = counts[dev] = counts.get(dev, 0) + 1
        untried = [m for m in ("direct", "buffered") if m not in stats]
        if untried:
            return untried[0]
        best = "direct" if stats["direct"] > stats["buffered"] * _MARGIN else "buffered"
        other = "buffered" if best == "direct" else "direct"
        # A mode measured at under half the other's speed is re-tried far less often: one
        # such file costs several times its own write (buffered writes ran at 0.25-0.3 GB/s
        # where O_DIRECT reached 1.4 on the idle test VM, and one tried 1 GB file in eight
        # spread a 3 GB save's time over 3x between rounds).
        far = stats[other] * FAR_BEHIND < stats[best]
        every = EXPLORE_EVERY * (FAR_EXPLORE_FACTOR if far else 1)
        return other if n % every == 0 else best


def _record(  # noqa: PLR0917 - private, two call sites
    table: dict[int, dict[str, float]], op: str, dev: int, mode: str, nbytes: int, seconds: float
) -> None:
    if nbytes < MEASURED_BYTES or seconds <= 0:
        return
    bps = nbytes / seconds
    _seed(table, op, dev)
    with _lock:
        stats = table.setdefault(dev, {})
        old = stats.get(mode)
        stats[mode] = bps if old is None else (old + bps) / 2
        _history.append({"op": op, "dev": dev, "mode": mode, "bytes_per_s": bps})
        del _history[:-1000]
        snapshot = dict(stats)
    iocache.store(dev, op, snapshot)
    log.debug("%s on device %#x: %s %.2f GB/s", op, dev, mode, bps / 1e9)


def forget() -> None:
    """Drop every measured mode (tests; a process that moved to other disks)."""
    with _lock:
        _rstats.clear()
        _rcount.clear()
        _wstats.clear()
        _wcount.clear()
        _history.clear()
    iocache.forget()


#: Files at least this large report their speed (smaller ones say little of the disk).
MEASURED_BYTES = 64 << 20
#: Every this many large files, the mode that is not the best is tried again: conditions
#: change (other writers, the page cache filling), so an old verdict is refreshed.
EXPLORE_EVERY = 8
#: A mode this many times slower than the best is re-tried only every
#: ``EXPLORE_EVERY * FAR_EXPLORE_FACTOR``-th file.
FAR_BEHIND = 2.0
FAR_EXPLORE_FACTOR = 8

_rstats: dict[int, dict[str, float]] = {}
_rcount: dict[int, int] = {}
_wstats: dict[int, dict[str, float]] = {}
_wcount: dict[int, int] = {}
_history: list[dict[str, object]] = []


def write_mode(directory: str) -> str:
    """The write mode for the next large file on the device of ``directory``.

    Chosen from the speeds real transfers reached there (:func:`record_write`): each mode
    is tried once first, then the faster one is used, and every :data:`EXPLORE_EVERY`-th
    file the other is tried again. No extra I/O: the files being saved are the measurement.
    Inside :func:`side_by_side` the settled mode is used and nothing is tried.
    """
    dev = os.stat(directory).st_dev
    with _lock:
        side = _side_by_side > 0
    if side:
        _seed(_wstats, "write", dev)
        return _settled(_wstats, dev)
    return _next(_wstats, _wcount, "write", dev)


def record_write(directory: str, mode: str, nbytes: int, seconds: float) -> None:
    """Fold a durable write of ``nbytes`` in ``seconds`` (open to fsync) into the stats.

    Writes finished inside :func:`side_by_side` are not folded in (see there).
    """
    with _lock:
        if _side_by_side > 0:
            return
    with contextlib.suppress(OSError):
        _record(_wstats, "write", os.stat(directory).st_dev, mode, nbytes, seconds)


def _settled(table: dict[int, dict[str, float]], dev: int) -> str:
    """The faster measured mode of ``dev``, ``"direct"`` where both are not measured yet."""
    with _lock:
        stats = table.get(dev, {})
        if "direct" not in stats or "buffered" not in stats:
            return "direct"
        return "direct" if stats["direct"] > stats["buffered"] * _MARGIN else "buffered"


#: How many :func:`side_by_side` blocks are open in this process.
_side_by_side = 0


@contextlib.contextmanager
def side_by_side() -> Iterator[None]:
    """Large files written concurrently (a rank's shard parts): no trial, no measurement.

    Each file of a group written side by side shares the device with the others, so its
    speed says little of its mode; and one file that tries the other mode holds up the
    whole group (the save waits for its slowest file). Measured on the shared 2-core VM: a
    2-rank FSDP2 save whose 4 part files a rank all tried buffered writes (every process's
    second save, since the first one's parts all started before any had reported) took
    3.2 s instead of 1.3 s. Inside this block every large file gets the settled mode (the
    faster measured one, ``"direct"`` until both are measured) and reports nothing.
    """
    global _side_by_side  # one counter per process, changed under _lock
    with _lock:
        _side_by_side += 1
    try:
        yield
    finally:
        with _lock:
            _side_by_side -= 1


def decisions() -> list[dict[str, object]]:
    """What was measured and chosen so far in this process (for benchmarks and debugging)."""
    with _lock:
        return list(_history)

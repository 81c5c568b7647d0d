"""Buffered or ``O_DIRECT``: which one a device is faster with, measured, not assumed.

Disks differ: an NVMe drive with a deep queue reads fastest with ``O_DIRECT`` (no copy
through the page cache), while a virtual disk or a network block device often reads faster
through the page cache, whose readahead keeps more requests in flight; and the page cache
copes worse once other processes fill it. So the files being read and saved are the
measurement, per device (``st_dev``), for the life of the process: the first large files
(at least :data:`MEASURED_BYTES`) try each mode once, later ones use the faster (by bytes
over the time from open to the last byte consumed, or to fsync), and every
:data:`EXPLORE_EVERY`-th file tries the other again, since conditions change; so does the
first file after a figure grew older than :data:`REFRESH_S` (a far-behind one: older than
:data:`FAR_REFRESH_S`). Files written side by side (a rank's shard parts,
:func:`side_by_side`) are one file to this: one mode, one figure. No extra I/O.

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
import contextvars
import os
import threading
import time
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
#: Reads: O_DIRECT must be this much faster to be chosen over buffered reads (which also
#: work where O_DIRECT does not, and leave the file in the page cache for a second reader).
_MARGIN = 1.05
#: Writes: buffered writes must be this much faster to be chosen over O_DIRECT. A saved
#: payload is not read back soon, and its copy through the page cache costs CPU the job
#: needs: a 2-rank FSDP2 save on the test VM spent 767-812 ms of CPU a rank writing 384 MB
#: buffered against 247-324 ms with O_DIRECT, at speeds within 15% of each other, so that
#: the noise of two close figures flipped the sharded bench's saves to buffered writes.
_WRITE_MARGIN = 1.25


def _best(table: _Table, stats: dict[str, float]) -> str:
    """The faster of two measured modes (each op's tie going to the mode that costs less)."""
    if table is _writes:
        return "buffered" if stats["buffered"] > stats["direct"] * _WRITE_MARGIN else "direct"
    return "direct" if stats["direct"] > stats["buffered"] * _MARGIN else "buffered"


def read_mode(dev: int) -> str:
    """The read mode for the next large file on device ``dev`` (see :func:`write_mode`)."""
    return _next(_reads, "read", dev)


def record_read(dev: int, mode: str, nbytes: int, seconds: float) -> None:
    """Fold a read of ``nbytes`` in ``seconds`` (open to last byte consumed) into the stats."""
    _record(_reads, "read", dev, mode, nbytes, seconds)


class _Table:
    """What one operation ("read" or "write") measured, per device, in this process."""

    def __init__(self) -> None:
        self.speeds: dict[int, dict[str, float]] = {}  # bytes/s per mode
        self.times: dict[int, dict[str, float]] = {}  # when each speed was measured
        self.counts: dict[int, int] = {}  # large files (or groups) chosen for
        self.refreshing: set[tuple[int, str]] = set()  # stale figures being re-tried

    def clear(self) -> None:
        self.speeds.clear()
        self.times.clear()
        self.counts.clear()
        self.refreshing.clear()


def _seed(table: _Table, op: str, dev: int) -> None:
    """On first use of ``dev`` in this process, start from what earlier ones measured."""
    if dev in table.speeds:
        return
    speeds, times = iocache.load_with_times(dev, op)
    with _lock:
        if dev not in table.speeds:
            table.speeds[dev] = speeds
            table.times[dev] = times
            if speeds:
                log.debug("%s on device %#x: cached speeds %s", op, dev, speeds)


def _next(table: _Table, op: str, dev: int) -> str:
    _seed(table, op, dev)
    with _lock:
        stats = table.speeds.setdefault(dev, {})
        n = table.counts[dev] = table.counts.get(dev, 0) + 1
        untried = [m for m in ("direct", "buffered") if m not in stats]
        if untried:
            return untried[0]
        best = _best(table, stats)
        other = "buffered" if best == "direct" else "direct"
        # A mode measured at under half the other's speed is re-tried far less often: one
        # such file costs several times its own write (buffered writes ran at 0.25-0.3 GB/s
        # where O_DIRECT reached 1.4 on the idle test VM, and one tried 1 GB file in eight
        # spread a 3 GB save's time over 3x between rounds).
        far = stats[other] * FAR_BEHIND < stats[best]
        # A figure measured long ago (in an earlier process, read from the cache) is tried
        # again now, once, and the new figure replaces it: one slow measurement (a disk
        # busy with another job) would otherwise decide for every process that saves fewer
        # files than the count below before it exits. A far-behind figure grows old sooner
        # (FAR_REFRESH_S): it is the one a busy disk leaves, and the one the count re-tries
        # least.
        times = table.times.setdefault(dev, {})
        limit = FAR_REFRESH_S if far else REFRESH_S
        if _stale(times, other, limit) and (dev, other) not in table.refreshing:
            table.refreshing.add((dev, other))  # tried now: the next file need not try it
            return other
        every = EXPLORE_EVERY * (FAR_EXPLORE_FACTOR if far else 1)
        return other if n % every == 0 else best


def _record(  # noqa: PLR0917 - private, three call sites
    table: _Table, op: str, dev: int, mode: str, nbytes: int, seconds: float
) -> None:
    if nbytes < MEASURED_BYTES or seconds <= 0:
        return
    bps = nbytes / seconds
    _seed(table, op, dev)
    with _lock:
        stats = table.speeds.setdefault(dev, {})
        times = table.times.setdefault(dev, {})
        old = stats.get(mode)
        # A figure older than REFRESH_S, or one being re-tried as stale (a far-behind one
        # after FAR_REFRESH_S), is replaced, however this file came to run in its mode:
        # averaged, a figure from a busy disk hours ago would still weigh half.
        stale = _stale(times, mode) or (dev, mode) in table.refreshing
        stats[mode] = bps if old is None or stale else (old + bps) / 2
        table.refreshing.discard((dev, mode))
        times[mode] = time.time()  # the only place a figure gets a time: when measured
        _history.append({"op": op, "dev": dev, "mode": mode, "bytes_per_s": bps})
        del _history[:-1000]
        snapshot, at = dict(stats), dict(times)
    iocache.store(dev, op, snapshot, at)
    log.debug("%s on device %#x: %s %.2f GB/s", op, dev, mode, bps / 1e9)


def _stale(times: dict[str, float], mode: str, limit: float | None = None) -> bool:
    """Whether ``mode``'s figure is older than ``limit`` seconds (or has no known time).

    ``limit`` defaults to :data:`REFRESH_S`.
    """
    return time.time() - times.get(mode, 0.0) > (REFRESH_S if limit is None else limit)


def forget() -> None:
    """Drop every measured mode (tests; a process that moved to other disks)."""
    with _lock:
        _reads.clear()
        _writes.clear()
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
#: A figure measured more than this many seconds ago (wall clock, kept in the cache) is
#: re-tried at the next large file, whatever the count, and replaced by what it measures.
REFRESH_S = 24 * 3600.0
#: A figure more than FAR_BEHIND times slower than the other mode's is re-tried once it is
#: this old. Such a figure is what one file measured while another job loaded the disk
#: leaves: on the test VM a cache holding O_DIRECT reads at 0.24 GB/s (six hours old) kept
#: every process reading buffered, its sharded restores' read phase at 1.27 s where
#: O_DIRECT took 0.60 s (2026-11-30). A mode truly that slow costs one file of a process an
#: hour (its new figure, in the cache, is fresh for the processes after it).
FAR_REFRESH_S = 3600.0

_reads = _Table()
_writes = _Table()
_history: list[dict[str, object]] = []


def write_mode(directory: str) -> str:
    """The write mode for the next large file on the device of ``directory``.

    Chosen from the speeds real transfers reached there (:func:`record_write`): each mode
    is tried once first, then the faster one is used, and every :data:`EXPLORE_EVERY`-th
    file the other is tried again. No extra I/O: the files being saved are the measurement.
    Inside :func:`side_by_side` the files of the group share one mode per device, chosen
    (and explored) once for the group.
    """
    dev = os.stat(directory).st_dev
    group = _current.get()
    with _lock:
        # A file of no group while a group writes (another thread's save) shares the disk
        # with it: no trial, as inside a group that is not measured.
        settled = bool(_groups) if group is None else not group.measuring(len(_groups))
    if settled:
        _seed(_writes, "write", dev)
        return _settled(_writes, dev)
    if group is None:
        return _next(_writes, "write", dev)
    with group.lock:  # the group's first file on ``dev`` chooses for all of them
        mode = group.modes.get(dev)
        if mode is None:
            mode = group.modes[dev] = _next(_writes, "write", dev)
    return mode


def record_write(directory: str, mode: str, nbytes: int, seconds: float) -> None:
    """Fold a durable write of ``nbytes`` in ``seconds`` (open to fsync) into the stats.

    Inside :func:`side_by_side` the write is added to its group's, which is measured as
    one when the block ends.
    """
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return
    end = time.perf_counter()
    group = _current.get()
    with _lock:
        if group is not None:
            if group.measuring(len(_groups)):
                group.add(dev, mode, nbytes, end - seconds, end)
            return
        if _groups:  # beside a group (another thread's): each confounds the other's figure
            for other in _groups:
                other.confounded = True
            return
    _record(_writes, "write", dev, mode, nbytes, seconds)


def _settled(table: _Table, dev: int) -> str:
    """The faster measured mode of ``dev``, ``"direct"`` where both are not measured yet."""
    with _lock:
        stats = table.speeds.get(dev, {})
        if "direct" not in stats or "buffered" not in stats:
            return "direct"
        return _best(table, stats)


class _Group:
    """The files of one :func:`side_by_side` block: one mode per device, one measurement."""

    def __init__(self, measure: bool) -> None:
        self.measure = measure
        self.confounded = False  # another group overlapped this one
        self.lock = threading.Lock()
        self.modes: dict[int, str] = {}
        # (device, mode) -> [bytes, first open, last fsync] of the files that finished
        self.done: dict[tuple[int, str], list[float]] = {}

    def measuring(self, open_groups: int) -> bool:
        return self.measure and not self.confounded and open_groups == 1

    def add(self, dev: int, mode: str, nbytes: int, start: float, end: float) -> None:
        acc = self.done.setdefault((dev, mode), [0.0, start, end])
        acc[0] += nbytes
        acc[1] = min(acc[1], start)
        acc[2] = max(acc[2], end)

    def results(self) -> list[tuple[int, str, int, float]]:
        """(device, mode, bytes, seconds from first open to last fsync), one per device.

        A device whose files ran in two modes (one was refused ``O_DIRECT``) has none.
        """
        devs = [dev for dev, _ in self.done]
        return [
            (dev, mode, int(acc[0]), acc[2] - acc[1])
            for (dev, mode), acc in self.done.items()
            if devs.count(dev) == 1
        ]


#: The :func:`side_by_side` blocks open in this process, in the order they were opened.
_groups: list[_Group] = []
#: The block the calling code runs in (``directio.run_all`` and the copies' threads run in
#: their caller's context): a file on another thread is none of its files.
_current: contextvars.ContextVar[_Group | None] = contextvars.ContextVar(
    "ckptstore_write_group", default=None
)


@contextlib.contextmanager
def side_by_side(*, measure: bool = True) -> Iterator[None]:
    """Large files written concurrently (a rank's shard parts): one mode and one measurement.

    Each file of a group written side by side shares the device with the others, so its
    own speed says little of its mode; and one file that tries the other mode holds up the
    whole group (the save waits for its slowest file). Measured on the shared 2-core VM: a
    2-rank FSDP2 save whose 4 part files a rank all tried buffered writes while others
    wrote with O_DIRECT took 3.2 s instead of 1.3 s. So the group is one file to the
    choice: its first large file on a device chooses (and explores, as a file alone would)
    for all of the group's files there, and when the block ends without an exception their
    bytes over the time from the first open to the last fsync are one measurement.

    ``measure=False`` (copies, written as fast as their source is read): every file gets
    the settled mode (the faster measured one, ``"direct"`` until both are measured) and
    nothing is recorded. Nor is anything while two groups overlap (each confounds the
    other's figure); the files then get the settled mode too.
    """
    group = _Group(measure)
    with _lock:
        for other in _groups:
            other.confounded = True
        group.confounded = bool(_groups)
        _groups.append(group)
    token = _current.set(group)
    ok = False
    try:
        yield
        ok = True
    finally:
        _current.reset(token)
        with _lock:
            _groups.remove(group)
            results = group.results() if ok and group.measure and not group.confounded else []
        for dev, mode, nbytes, seconds in results:
            _record(_writes, "write", dev, mode, nbytes, seconds)


def decisions() -> list[dict[str, object]]:
    """What was measured and chosen so far in this process (for benchmarks and debugging)."""
    with _lock:
        return list(_history)

"""The I/O modes measured per device, kept across processes (a small JSON file).

:mod:`~ckptstore.storage.iomode` measures buffered and ``O_DIRECT`` transfers on the files
being read and saved; without a memory across processes, every new process would try the
slower mode once on its first large file (a restore of a 256 MB shard at half speed, at
every resume). So the speeds it measured are kept here, per device, and a new process
starts from them: the faster mode first, the other re-tried every
:data:`~ckptstore.storage.iomode.EXPLORE_EVERY`-th file as before, whose result updates the
file (conditions change; a cached verdict is re-validated, never trusted for good). Each
speed is kept with the time it was measured (``<op>_at``): a figure older than
:data:`~ckptstore.storage.iomode.REFRESH_S` is re-tried by the next process that reads it
(a process that saves a few times and exits never reaches its own count of files).

Where: ``$CKPTSTORE_IO_CACHE`` (a file; empty or ``off`` disables the cache), else
``$XDG_CACHE_HOME/ckptstore/io-modes.json``, else ``~/.cache/ckptstore/io-modes.json``.
Devices are keyed by ``major:minor`` of ``st_dev`` with the filesystem type and source
from ``/proc/self/mountinfo``: a device number given to another disk after a reboot does
not inherit the old disk's verdict.

The file is a hint, never trusted: read with bounds (at most :data:`MAX_BYTES`, a regular
file, a fixed schema, finite positive speeds), ignored with a warning when it is not
what this module writes, and replaced atomically (a temporary file, fsync, rename) so a
reader never sees half of it. Any error reading or writing it costs only the cache.

Written off the caller's path: :func:`store` hands the speeds to one background thread of
the process, which merges whatever is pending into one write; a read of the file in this
process (:func:`load`) and the process's exit wait for it first (:func:`flush`). Written
inline, the update (read, merge, write, ``fsync``, rename) cost every restore and every
large plain save 2-10 ms on its critical path, measured on the test VM (an ``fsync``
beside the job's own I/O).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import stat
import threading
import time
from typing import Any

from .._log import logger as log

__all__ = [
    "MAX_BYTES",
    "cache_path",
    "device_key",
    "document",
    "flush",
    "forget",
    "load",
    "load_with_times",
    "store",
]

#: Most bytes of a cache file read; a larger one is ignored (a real one is a few KB).
MAX_BYTES = 256 << 10
#: Most devices kept (the least recently measured are dropped).
MAX_DEVICES = 64
#: Speeds outside (0, this] bytes/s are not measurements.
_MAX_SPEED = 1e13
_VERSION = 1
_OPS = ("read", "write")
_MODES = ("direct", "buffered")

_lock = threading.Lock()
_keys: dict[int, str] = {}
_warned: set[str] = set()


def cache_path() -> str | None:
    """The cache file's path, or None when the cache is off."""
    env = os.environ.get("CKPTSTORE_IO_CACHE")
    if env is not None:
        return None if env.strip() in ("", "off") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptstore", "io-modes.json")


def device_key(dev: int) -> str:
    """``major:minor:fstype:source`` of device ``dev`` (``major:minor`` where unknown)."""
    with _lock:
        key = _keys.get(dev)
    if key is not None:
        return key
    majmin = f"{os.major(dev)}:{os.minor(dev)}"
    key = majmin
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f.read(4 << 20).splitlines():
                fields = line.split()
                if len(fields) > 2 and fields[2] == majmin and " - " in line:
                    after = line.split(" - ", 1)[1].split()
                    key = ":".join([majmin, *after[:2]])
                    break
    except OSError:
        pass
    with _lock:
        _keys[dev] = key
    return key


#: Latest time a cache entry may claim (the year 5138): beyond, or NaN, it is not a time.
_MAX_TIME = 1e11


def _warn(path: str, why: str) -> None:
    if why not in _warned:  # once per process and reason, not at every large file
        _warned.add(why)
        log.warning("ignoring the I/O mode cache %s: %s; the modes are measured anew", path, why)


def _read(path: str) -> dict[str, Any] | None:
    """The cache document, or None (absent: silently; anything wrong: with a warning)."""
    try:
        # Non-blocking: a FIFO planted at the path must not hang the restore.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(path, f"cannot open it ({e})")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _warn(path, "not a regular file")
            return None
        if st.st_size > MAX_BYTES:
            _warn(path, f"{st.st_size} bytes, more than the {MAX_BYTES} it may hold")
            return None
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as e:
        _warn(path, f"cannot read it ({e})")
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        _warn(path, f"more than the {MAX_BYTES} bytes it may hold")
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # RecursionError: hostile nesting
        _warn(path, f"not JSON ({type(e).__name__})")
        return None
    try:
        why = _invalid(doc)
    except Exception as e:
        why = f"not a valid cache ({type(e).__name__})"
    if why:
        _warn(path, why)
        return None
    return doc  # type: ignore[no-any-return]


def document() -> dict[str, Any] | None:
    """The cache file's document, checked as every reader checks it (None: none, or refused)."""
    path = cache_path()
    return _read(path) if path else None


def _is_time(t: Any) -> bool:
    """A number (not a bool) from 0 to :data:`_MAX_TIME`: NaN and huge integers are not."""
    ok = isinstance(t, int | float) and not isinstance(t, bool)
    return ok and 0 <= t <= _MAX_TIME


def _invalid(doc: Any) -> str:
    """What is wrong with a cache document ("" when nothing is)."""
    if not isinstance(doc, dict) or doc.get("version") != _VERSION:
        return f"not a version {_VERSION} cache"
    devices = doc.get("devices")
    if not isinstance(devices, dict) or len(devices) > MAX_DEVICES:
        return f"'devices' is not a table of at most {MAX_DEVICES} devices"
    for key, entry in devices.items():
        if not isinstance(key, str) or len(key) > 512 or not isinstance(entry, dict):
            return "a device entry is malformed"
        if not _is_time(entry.get("t", 0)):
            return f"device {key[:64]!r}: 't' is not a time"
        for op in _OPS:
            speeds = entry.get(op, {})
            if not isinstance(speeds, dict) or not set(speeds) <= set(_MODES):
                return f"device {key[:64]!r}: {op!r} is not a table of modes"
            for mode, bps in speeds.items():
                ok = isinstance(bps, int | float) and not isinstance(bps, bool)
                # The range first: math.isfinite raises OverflowError on a huge JSON
                # integer, and comparing one to a float does not.
                if not ok or not 0 < bps <= _MAX_SPEED or not math.isfinite(bps):
                    return f"device {key[:64]!r}: {op} {mode} speed {bps!r} is not a speed"
            times = entry.get(f"{op}_at", {})
            if not isinstance(times, dict) or not set(times) <= set(_MODES):
                return f"device {key[:64]!r}: {op + '_at'!r} is not a table of modes"
            for mode, at in times.items():
                if not _is_time(at):
                    return f"device {key[:64]!r}: {op} {mode} time {at!r} is not a time"
    return ""


def load(dev: int, op: str) -> dict[str, float]:
    """The speeds (bytes/s per mode) cached for ``op`` ("read" or "write") on ``dev``.

    Empty when the cache is off, absent, has nothing for the device, or is not valid
    (then with a warning, once per process).
    """
    return load_with_times(dev, op)[0]


def load_with_times(dev: int, op: str) -> tuple[dict[str, float], dict[str, float]]:
    """The speeds cached for ``op`` on ``dev`` and when each was measured (``time.time()``).

    A speed without a time (a file an older version wrote) has none in the second table.
    """
    path = cache_path()
    if path is None:
        return {}, {}
    flush()  # what this process measured comes first
    doc = _read(path)
    if doc is None:
        return {}, {}
    entry = doc["devices"].get(device_key(dev), {})
    speeds = {m: float(v) for m, v in entry.get(op, {}).items()}
    times = {m: float(v) for m, v in entry.get(f"{op}_at", {}).items() if m in speeds}
    return speeds, times


def store(
    dev: int, op: str, speeds: dict[str, float], times: dict[str, float] | None = None
) -> None:
    """Record ``speeds`` for ``op`` on ``dev`` (measured at ``times``) in the cache file.

    The file is replaced atomically by the process's writer thread, merged with what it
    holds (other processes' devices and operations); a file that is not valid is replaced.
    Errors are logged and otherwise ignored. :func:`flush` waits for the write.
    """
    path = cache_path()
    if path is None:
        return
    key = device_key(dev)
    kept = {m: float(v) for m, v in speeds.items() if m in _MODES}
    at = {m: float(v) for m, v in (times or {}).items() if m in kept}
    _writer.put(path, key, op, (kept, at))


def flush(timeout: float = 10.0) -> None:
    """Wait (at most ``timeout`` seconds) until every :func:`store` so far is written."""
    _writer.flush(timeout)


#: What :func:`store` hands the writer: the speeds of one operation and their times.
_Update = tuple[dict[str, float], dict[str, float]]


def _write(path: str, updates: dict[tuple[str, str], _Update]) -> None:
    """Merge ``updates`` ((device key, op) -> (speeds, times)) into the file at ``path``."""
    tmp = f"{path}.{os.getpid()}.tmp"  # one writer thread a process
    try:
        doc = _read(path) or {"version": _VERSION, "devices": {}}
        devices: dict[str, Any] = doc["devices"]
        for (key, op), (speeds, times) in updates.items():
            entry = devices.setdefault(key, {})
            entry[op] = speeds
            entry[f"{op}_at"] = times
            entry["t"] = time.time()
        for old in sorted(devices, key=lambda k: devices[k].get("t", 0))[:-MAX_DEVICES]:
            del devices[old]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # O_EXCL | O_NOFOLLOW: a symlink (or anything) planted at the temp path is
        # neither followed nor overwritten; the update is skipped instead.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644)
        try:
            os.write(fd, json.dumps(doc, indent=1, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        # The rename makes it whole or absent to a reader; the directory is not
        # fsynced: losing the last update in a crash costs one measurement.
        os.replace(tmp, path)
    except FileExistsError as e:  # not ours: leave it where it is
        log.debug("could not write the I/O mode cache %s: %s", path, e)
    except OSError as e:
        log.debug("could not write the I/O mode cache %s: %s", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


class _Writer:
    """The process's one thread that writes the cache file (see the module docstring).

    Updates wait in ``pending`` (the latest speeds per file, device and operation) and are
    written together; a forked child starts with none and a thread of its own.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: dict[str, dict[tuple[str, str], _Update]] = {}
        self.busy = False  # a write is in progress on the thread
        self.thread: threading.Thread | None = None

    def put(self, path: str, key: str, op: str, update: _Update) -> None:
        with self.cond:
            self.pending.setdefault(path, {})[(key, op)] = update
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="ckptstore-iocache", daemon=True
                )
                self.thread.start()
            self.cond.notify_all()

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.pending or self.busy:
                left = deadline - time.monotonic()
                if left <= 0 or self.thread is None or not self.thread.is_alive():
                    return
                self.cond.wait(left)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                work, self.pending = self.pending, {}
                self.busy = True
            try:
                for path, updates in work.items():
                    _write(path, updates)
            except Exception as e:  # the cache is a hint: never let its thread die
                log.debug("could not write the I/O mode cache: %s", e)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def after_fork(self) -> None:
        self.cond = threading.Condition()
        self.pending = {}
        self.busy = False
        self.thread = None


_writer = _Writer()
atexit.register(flush)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_writer.after_fork)


def forget() -> None:
    """Forget the device keys and warnings of this process, once its writes are done (tests)."""
    flush()
    with _lock:
        _keys.clear()
        _warned.clear()

"""Fault injection below ckptstore: count every storage operation, make the k-th one fail.

An :class:`Injector` is installed with :func:`injected`. It wraps the primitive operations of
the storage backends (``Storage._mkdir``, ``_open_write``, ``_finish_write``, ``_put_small``,
``_rename``, ``_fsync_dir``, ``_remove``, ``_rmtree``, ``_open_read``, ``_stream``) and the
system calls under them that move bytes or make them durable (``os.pwrite``, which the
local backend's ``DirectWriter`` writes with, and ``os.fsync``), plus ``write`` on the file
objects a backend hands out when they are not ``DirectWriter`` s (fsspec files: the path
through ``CRCWriter``). Each call is one numbered operation.

A run with ``fail_at=None`` only counts; a run with ``fail_at=k`` raises at the k-th call,
before it does anything, an ``OSError`` of the chosen kind (``ENOSPC``, ``EIO``, ``EACCES``)
naming the file it was about, as the kernel would. Kind ``"short"`` counts only writes and
makes the k-th one write half of what it was given and return that count, as ``write(2)``
does when a disk fills up or a signal arrives: the code above must write the rest or fail,
and never commit a truncated file.

``op``/``target`` narrow what is counted: only operations of that name (``"_rename"``) and
whose target contains that text (a file name), so a test can fail "the first write of
``state.json``" on one rank without counting everything else that rank does.

Queries (``_list``, ``_exists``, ``_is_regular_file``, ``_size``) are not injected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import threading
from collections.abc import Iterator
from typing import Any

from ckptstore.storage.directio import DirectWriter
from ckptstore.storage.local import LocalStorage
from ckptstore.storage.remote import FsspecStorage

#: Error kinds and their errno (``short`` is a partial write, not an error).
KINDS: dict[str, int | None] = {
    "ENOSPC": errno.ENOSPC,
    "EIO": errno.EIO,
    "EACCES": errno.EACCES,
    "short": None,
}
#: What a message must say for each kind: our phrase or the system's (either is clear).
MEANINGS: dict[str, tuple[str, ...]] = {
    "ENOSPC": ("disk is full", os.strerror(errno.ENOSPC).lower()),
    "EIO": ("i/o error", os.strerror(errno.EIO).lower()),
    "EACCES": ("permission denied", os.strerror(errno.EACCES).lower()),
}
#: The primitive operations of a backend that are counted.
PRIMITIVES = (
    "_mkdir",
    "_open_write",
    "_finish_write",
    "_put_small",
    "_rename",
    "_fsync_dir",
    "_remove",
    "_rmtree",
    "_open_read",
    "_stream",
)
BACKENDS = (LocalStorage, FsspecStorage)


@dataclasses.dataclass(frozen=True)
class Op:
    """One counted operation."""

    index: int
    name: str
    target: str
    thread: str

    def __str__(self) -> str:
        return f"#{self.index} {self.name}({self.target}) [{self.thread}]"


class Injector:
    """Counts operations; fails the ``fail_at``-th one with ``kind``."""

    def __init__(
        self,
        fail_at: int | None = None,
        kind: str = "EIO",
        *,
        op: str | None = None,
        target: str | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        self.fail_at = fail_at
        self.op = op
        self.target = target
        self.kind = kind
        self.writes_only = kind == "short"
        self.ops: list[Op] = []
        self.fired: Op | None = None
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.ops)

    def hit(self, name: str, target: str, *, write: bool = False) -> bool:
        """Count one operation; raise if it is the chosen one. True: make this write short."""
        if self.writes_only and not write:
            return False
        if (self.op is not None and name != self.op) or (
            self.target is not None and self.target not in target
        ):
            return False
        with self._lock:
            op = Op(len(self.ops) + 1, name, target, threading.current_thread().name)
            self.ops.append(op)
            if op.index != self.fail_at:
                return False
            self.fired = op
        code = KINDS[self.kind]
        if code is None:
            return True
        raise OSError(code, os.strerror(code), target)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


class CountingFile:
    """A backend's file object whose ``write`` calls are counted (and may come up short).

    It has no ``crc``/``nbytes``, so ``Pending.open`` checksums through ``CRCWriter``.
    """

    def __init__(self, raw: Any, injector: Injector, target: str) -> None:
        self._raw = raw
        self._inj = injector
        self._target = target

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        if self._inj.hit("write", self._target, write=True):
            half = len(mv) // 2
            self._raw.write(mv[:half])
            return half
        self._raw.write(mv)
        return len(mv)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _wrap_primitive(cls: type, name: str, inj: Injector) -> Any:
    real = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        rel = str(args[1] if name == "_finish_write" else args[0])
        target = f"{self.root}/{rel}" if rel else self.root
        if name == "_rename":
            target += f" -> {args[1]}"
        inj.hit(name, target)
        result = real(self, *args, **kwargs)
        if name == "_open_write" and not isinstance(result, DirectWriter):
            return CountingFile(result, inj, target)
        return result

    wrapper.__name__ = name
    return wrapper


@contextlib.contextmanager
def injected(inj: Injector) -> Iterator[Injector]:
    """Install ``inj`` on every backend class and on ``os.pwrite``/``os.fsync``."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, value)

    real_pwrite = os.pwrite
    real_fsync = os.fsync

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if inj.hit("pwrite", _fd_path(fd), write=True):
            mv = memoryview(data).cast("B")
            return real_pwrite(fd, mv[: len(mv) // 2], offset)
        return real_pwrite(fd, data, offset)

    def fsync(fd: Any) -> None:
        inj.hit("fsync", _fd_path(fd if isinstance(fd, int) else fd.fileno()))
        real_fsync(fd)

    try:
        for cls in BACKENDS:
            for name in PRIMITIVES:
                patch(cls, name, _wrap_primitive(cls, name, inj))
        patch(os, "pwrite", pwrite)
        patch(os, "fsync", fsync)
        yield inj
    finally:
        for owner, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


class _Absent:
    pass


_ABSENT = _Absent()

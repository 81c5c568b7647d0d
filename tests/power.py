"""Power-loss simulation of a local store: what a cut at any moment leaves on the disk.

:class:`PowerModel` traces the system calls of the local backend (``ckptstore.storage.local``
and ``ckptstore.storage.directio``: their ``os``, ``shutil`` and ``open`` are replaced by
tracing proxies for the duration) while they run for real, and keeps a model of the store
with two views, after POSIX (fsync(2), rename(2)) and the way ext4/xfs behave on a crash:

- the **live** view: what every process sees now;
- the **durable** view: what survives a power cut. A file's bytes are durable once the file
  is fsynced. A directory entry (a new file or directory, a rename into or out of it, an
  unlink) is durable once *that directory* is fsynced. Nothing else is: a power cut drops
  every change that was not made durable this way, the most a cut may drop.

After each traced call (each step of a save, a prune...) the model takes three snapshots,
extremes of what a cut may leave (a real crash lies in between):

- ``"strict"``: only what was made durable: the tree of entries reachable from the root
  through durable entries, with the durable bytes of each file;
- ``"metadata"``: every directory change survives (journaled metadata, as ext4's default
  ``data=ordered`` may leave it), but file bytes only where fsynced;
- ``"root-stale"``: every directory change survives except the root's own: POSIX orders
  nothing between directories, so the unlinks inside a directory may reach the disk while
  the rename that moved that directory out of the root does not.

``rmtree`` is modelled as the unlinks it makes, one cut point after each, ``manifest.json``
last in each directory (rmtree's real order is the filesystem's; this one leaves a
directory looking committed the longest).

:func:`materialize` writes a snapshot out as a directory, which is then opened as a store:
exactly the disk the machine would come back to.

``skip_fsync`` turns chosen fsync calls into no-ops in the model (the real call still runs),
to show that the checks fail when the protocol loses one of its fsyncs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ckptstore.storage import directio as directio_mod
from ckptstore.storage import local as local_mod

#: A durable snapshot: relative path -> None for a directory, bytes for a file.
Snapshot = dict[str, bytes | None]
#: The extremes of what a power cut may leave (see the module docstring).
VIEWS = ("strict", "metadata", "root-stale")


class Node:
    """A file or directory of the model; the same object wherever it is linked (an inode)."""

    def __init__(self, is_dir: bool, data: bytes = b"") -> None:
        self.is_dir = is_dir
        self.data = bytearray(data)  # files: the live bytes
        self.durable = bytes(data)  # files: the bytes that survive a cut
        self.entries: dict[str, Node] = {}  # directories: the live entries
        self.durable_entries: dict[str, Node] = {}  # ... and those that survive a cut


class PowerModel:
    """Traces a local store's system calls; snapshots its durable state after each one.

    Every traced call becomes an *event* (``("open", key, rel, flags)``, ``("pwrite", key,
    offset, bytes)``, ``("fsync", key)``, ``("rename", a, b)``...; ``key`` is ``(pid, fd)``)
    applied to the model. With ``log=True`` the events are also kept, stamped with
    ``time.monotonic_ns()`` (one clock for every process of the machine), and with
    ``snapshots=False`` nothing else is done: each rank of a multi-process save records its
    own calls, and :meth:`replay` rebuilds the whole machine's disk from the merged logs.
    Events that are causally ordered (a rank fsyncs its shard, then tells rank 0, which then
    renames the directory) keep their order in the merge: each is stamped after its system
    call returned and before the process did anything else.

    ``root`` is the directory modelled (every path outside it is ignored); ``stores`` are the
    store roots inside it (relative, ``""`` for ``root`` itself) whose own entries the
    ``"root-stale"`` view keeps stale.
    """

    def __init__(
        self,
        root: str,
        skip_fsync: Callable[[str, bool], bool] | None = None,
        *,
        start: Snapshot | None = None,
        stores: tuple[str, ...] = ("",),
        snapshots: bool = True,
        log: bool = False,
    ) -> None:
        self.root = os.path.abspath(root)
        self.skip_fsync = skip_fsync or (lambda rel, is_dir: False)
        self.stores = frozenset(stores)
        self.top = self._scan(self.root) if start is None else _tree(start)
        self._fds: dict[tuple[int, int], tuple[Node, str]] = {}
        self._fd_rel: dict[int, str] = {}  # this process's fds opened inside root
        self._lock = threading.RLock()
        self._snapshots_on = snapshots
        #: (label of the call, {view: snapshot after it}), in order; [0] is the start.
        self.snapshots: list[tuple[str, dict[str, Snapshot]]] = []
        self.markers: list[tuple[int, str]] = []
        #: With ``log=True``: (monotonic ns, pid, sequence, event), in this process's order.
        self.events: list[tuple[int, int, int, tuple[Any, ...]]] | None = [] if log else None
        self._record("start")

    @classmethod
    def replay(
        cls,
        start: Snapshot,
        logs: list[list[tuple[int, int, int, tuple[Any, ...]]]],
        *,
        stores: tuple[str, ...] = ("",),
        skip_fsync: Callable[[str, bool], bool] | None = None,
    ) -> PowerModel:
        """The model of a disk that held ``start`` and then saw every process's events.

        The logs (``events`` of each process's recording model, relative to the same root)
        are merged by time; a snapshot is taken after each event, as a live model does.
        """
        model = cls("/nonexistent-replay-root", skip_fsync, start=start, stores=stores)
        merged = sorted((e for log in logs for e in log), key=lambda e: (e[0], e[1], e[2]))
        for _, _, _, event in merged:
            model._apply(event)
        return model

    # ---- the model ------------------------------------------------------------------

    def _scan(self, path: str) -> Node:
        """The store as it is on disk now, all of it durable (the starting point)."""
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            node = Node(True)
            for name in os.listdir(path):
                child = os.path.join(path, name)
                if stat.S_ISDIR(os.lstat(child).st_mode) or stat.S_ISREG(os.lstat(child).st_mode):
                    node.entries[name] = self._scan(child)
            node.durable_entries = dict(node.entries)
            return node
        with open(path, "rb") as f:
            return Node(False, f.read())

    def _rel(self, path: Any) -> str | None:
        if not isinstance(path, str | bytes | os.PathLike):
            return None
        p = os.path.abspath(os.fsdecode(path))
        if p == self.root:
            return ""
        if p.startswith(self.root + os.sep):
            return p[len(self.root) + 1 :]
        return None

    def _lookup(self, rel: str) -> Node | None:
        node: Node | None = self.top
        for part in [p for p in rel.split(os.sep) if p]:
            if node is None or not node.is_dir:
                return None
            node = node.entries.get(part)
        return node

    def _parent(self, rel: str) -> tuple[Node | None, str]:
        head, _, name = rel.rpartition(os.sep)
        return self._lookup(head), name

    def durable_view(self, view: str = "strict") -> Snapshot:
        """What a power cut now leaves: one of :data:`VIEWS` (see the module doc)."""
        assert view in VIEWS, view
        out: Snapshot = {}

        def walk(node: Node, prefix: str) -> None:
            here = prefix[:-1]
            stale = view == "strict" or (view == "root-stale" and here in self.stores)
            entries = node.durable_entries if stale else node.entries
            for name, child in sorted(entries.items()):
                rel = f"{prefix}{name}"
                if child.is_dir:
                    out[rel] = None
                    walk(child, rel + "/")
                else:
                    out[rel] = child.durable

        walk(self.top, "")
        return out

    def _record(self, label: str) -> None:
        if self._snapshots_on:
            self.snapshots.append((label, {v: self.durable_view(v) for v in VIEWS}))

    def mark(self, label: str) -> None:
        """Note that ``label`` happened after the last traced call (e.g. a commit returned)."""
        self._event(("mark", label))

    # ---- events -----------------------------------------------------------------------

    def _event(self, event: tuple[Any, ...]) -> None:
        """A traced call happened (its system call returned): log it, apply it."""
        with self._lock:
            if self.events is not None:
                self.events.append((time.monotonic_ns(), os.getpid(), len(self.events), event))
            if self._snapshots_on:
                self._apply(event)

    def _apply(self, event: tuple[Any, ...]) -> None:
        op = event[0]
        if op == "mark":
            self.markers.append((len(self.snapshots) - 1, event[1]))
        elif op == "open":
            self._on_open(*event[1:])
        elif op == "close":
            self._fds.pop(event[1], None)
        elif op == "pwrite":
            self._on_write(*event[1:])
        elif op == "append":
            self._on_write(event[1], None, event[2])
        elif op == "fsync":
            self._on_fsync(event[1])
        elif op == "mkdir":
            if self._created(event[1], True) is not None:
                self._record(f"mkdir {event[1]}")
        elif op == "rename":
            self._on_rename(event[1], event[2])
        elif op == "unlink":
            self._unlinked(event[1], "unlink")
        elif op == "rmtree":
            node = self._lookup(event[1])
            if node is not None and node.is_dir:
                self._empty(node, event[1])
            self._unlinked(event[1], "rmtree")
        else:  # pragma: no cover
            raise AssertionError(f"unknown event {event!r}")

    def _created(self, rel: str, is_dir: bool) -> Node | None:
        parent, name = self._parent(rel)
        if parent is None:
            return None
        node = Node(is_dir)
        parent.entries[name] = node
        return node

    def _on_open(self, key: tuple[int, int], rel: str, flags: int) -> None:
        self._fds.pop(key, None)  # a number reused: forget what it was
        node = self._lookup(rel)
        if node is None and flags & os.O_CREAT:
            node = self._created(rel, False)
            self._record(f"create {rel}")
        elif node is not None and not node.is_dir and flags & os.O_TRUNC:
            node.data = bytearray()
            self._record(f"truncate {rel}")
        if node is not None:
            self._fds[key] = (node, rel)

    def _on_write(self, key: tuple[int, int], offset: int | None, chunk: bytes) -> None:
        hit = self._fds.get(key)
        if hit is None or not chunk:
            return
        node, rel = hit
        at = len(node.data) if offset is None else offset
        if len(node.data) < at:
            node.data += bytes(at - len(node.data))
        node.data[at : at + len(chunk)] = chunk
        self._record(f"write {rel} [{at}, {at + len(chunk)})")

    def _on_fsync(self, key: tuple[int, int]) -> None:
        hit = self._fds.get(key)
        if hit is None:
            return
        node, rel = hit
        if self.skip_fsync(rel, node.is_dir):
            self._record(f"fsync {rel or '.'} (skipped)")
            return
        if node.is_dir:
            node.durable_entries = dict(node.entries)
        else:
            node.durable = bytes(node.data)
        self._record(f"fsync {rel or '.'}")

    def _on_rename(self, a: str, b: str) -> None:
        pa, na = self._parent(a)
        pb, nb = self._parent(b)
        if pa is not None and pb is not None and na in pa.entries:
            pb.entries[nb] = pa.entries.pop(na)
            self._record(f"rename {a} -> {b}")

    def _empty(self, node: Node, rel: str) -> None:
        """The unlinks of an rmtree below ``node``, one cut point each, the manifest last."""
        for name in sorted(node.entries, key=lambda n: (n == "manifest.json", n)):
            child = node.entries[name]
            if child.is_dir:
                self._empty(child, f"{rel}/{name}")
            del node.entries[name]
            self._record(f"rmtree: unlink {rel}/{name}")

    def _unlinked(self, rel: str, what: str) -> None:
        parent, name = self._parent(rel)
        if parent is not None and parent.entries.pop(name, None) is not None:
            self._record(f"{what} {rel}")

    # ---- traced calls ---------------------------------------------------------------

    def _key(self, fd: int) -> tuple[int, int]:
        return (os.getpid(), fd)

    def _rel_at(self, path: Any, dir_fd: int | None) -> str | None:
        """The root-relative path of ``path``, opened relative to ``dir_fd`` or not."""
        if dir_fd is None:
            return self._rel(path)
        head = self._fd_rel.get(dir_fd)
        if head is None or not isinstance(path, str) or "/" in path:
            return None
        return f"{head}/{path}" if head else path

    def open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        with self._lock:
            rel = self._rel_at(path, dir_fd)
            if rel is None:
                self._fd_rel.pop(fd, None)
                self._event(("close", self._key(fd)))
                return fd
            self._fd_rel[fd] = rel
            self._event(("open", self._key(fd), rel, flags))
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._fd_rel.pop(fd, None)
            self._event(("close", self._key(fd)))
        os.close(fd)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        n = os.pwrite(fd, data, offset)
        if n > 0 and fd in self._fd_rel:
            self._event(("pwrite", self._key(fd), offset, bytes(memoryview(data).cast("B")[:n])))
        return n

    def fsync(self, fd: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        os.fsync(fd)
        if fd in self._fd_rel:
            self._event(("fsync", self._key(fd)))

    def mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        os.mkdir(path, mode, dir_fd=dir_fd)
        rel = self._rel(path) if dir_fd is None else None
        if rel is not None:
            self._event(("mkdir", rel))

    def makedirs(self, path: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
        rel = self._rel(path)
        if rel is None or rel == "" or os.path.isdir(path):
            os.makedirs(path, mode, exist_ok=exist_ok)
            return
        head = os.path.dirname(os.path.abspath(os.fsdecode(path)))
        if not os.path.isdir(head):
            self.makedirs(head, mode, exist_ok=True)
        self.mkdir(path, mode)

    def rename(self, src: Any, dst: Any) -> None:
        os.rename(src, dst)
        a, b = self._rel(src), self._rel(dst)
        if a is not None and b is not None:
            self._event(("rename", a, b))

    def unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        rel = self._rel_at(path, dir_fd)
        os.unlink(path, dir_fd=dir_fd)
        if rel is not None:
            self._event(("unlink", rel))

    def rmtree(self, path: Any, *args: Any, **kwargs: Any) -> None:
        shutil.rmtree(path, *args, **kwargs)
        rel = self._rel(path)
        if rel is not None:
            self._event(("rmtree", rel))

    def builtin_open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = open(file, mode, *args, **kwargs)  # noqa: SIM115 - returned to the caller
        rel = self._rel(file) if not isinstance(file, int) else None
        if rel is None or ("x" not in mode and "w" not in mode):
            return f
        return _TracedFile(self, f, rel, os.O_CREAT | (os.O_TRUNC if "w" in mode else 0))

    # ---- installation ---------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[PowerModel]:
        """Trace the local backend's system calls while the block runs."""
        os_proxy = _Proxy(
            os,
            open=self.open,
            close=self.close,
            pwrite=self.pwrite,
            fsync=self.fsync,
            mkdir=self.mkdir,
            makedirs=self.makedirs,
            rename=self.rename,
            unlink=self.unlink,
        )
        shutil_proxy = _Proxy(shutil, rmtree=self.rmtree)
        saved = (local_mod.os, local_mod.shutil, directio_mod.os)
        local_mod.os = os_proxy  # type: ignore[assignment]
        local_mod.shutil = shutil_proxy  # type: ignore[assignment]
        directio_mod.os = os_proxy  # type: ignore[assignment]
        local_mod.open = self.builtin_open  # type: ignore[attr-defined]
        try:
            yield self
        finally:
            local_mod.os, local_mod.shutil, directio_mod.os = saved  # type: ignore[assignment]
            del local_mod.open  # type: ignore[attr-defined]


class _TracedFile:
    """A file opened with ``open(path, "xb")`` (small files): writes go into the model."""

    def __init__(self, model: PowerModel, f: Any, rel: str, flags: int) -> None:
        self._model = model
        self._f = f
        self._fd = int(f.fileno())
        with model._lock:
            model._fd_rel[self._fd] = rel
            model._event(("open", model._key(self._fd), rel, flags))

    def write(self, data: Any) -> int:
        n = int(self._f.write(data))
        if n > 0:
            chunk = bytes(memoryview(data).cast("B")[:n])
            self._model._event(("append", self._model._key(self._fd), chunk))
        return n

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        with self._model._lock:
            if self._model._fd_rel.get(self._fd) is not None:
                self._model._fd_rel.pop(self._fd, None)
                self._model._event(("close", self._model._key(self._fd)))
        self._f.close()

    def __enter__(self) -> _TracedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Proxy:
    """A module whose chosen functions are replaced; everything else is the module's own."""

    def __init__(self, module: Any, **overrides: Any) -> None:
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def materialize(snapshot: Snapshot, dest: str) -> None:
    """Write a durable snapshot out as the directory ``dest``."""
    os.makedirs(dest)
    for rel, data in sorted(snapshot.items()):
        p = os.path.join(dest, rel)
        if data is None:
            os.makedirs(p, exist_ok=True)
        else:
            with open(p, "wb") as f:
                f.write(data)


def snapshot_of(root: str) -> Snapshot:
    """The tree under ``root`` as it is now (directories and regular files), as a snapshot."""
    return PowerModel(root, snapshots=False).durable_view("metadata")


def _tree(snapshot: Snapshot) -> Node:
    """The model of a disk that holds ``snapshot``, all of it durable."""
    top = Node(True)
    for rel, data in sorted(snapshot.items()):
        head, _, name = rel.rpartition("/")
        parent = top
        for part in [p for p in head.split("/") if p]:
            parent = parent.entries[part]
        parent.entries[name] = Node(data is None, b"" if data is None else data)
    stack = [top]
    while stack:
        node = stack.pop()
        node.durable_entries = dict(node.entries)
        stack.extend(c for c in node.entries.values() if c.is_dir)
    return top

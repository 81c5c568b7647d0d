"""The Storage interface: the commit protocol lives here, backends supply primitives.

The order that makes a checkpoint whole-or-invisible is owned by this base class and by it
alone: payloads written and made durable, ``manifest.json`` last, then the step made visible
(an atomic rename where the backend has one, the manifest put itself where it does not), and
only then retention. Backends implement the primitive operations (``_open_write``,
``_rename``, ``_fsync_dir``, ...) and say whether they have an atomic rename.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import time
from collections.abc import Callable, Mapping
from typing import IO, ClassVar

from ..errors import (
    CommitError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    StepExistsError,
    StoreUnreachableError,
)
from ..integrity import crc32c_of, format_crc
from ..layout import (
    MANIFEST_NAME,
    PIN_NAME,
    is_store_entry,
    is_tmp_name,
    old_dirname,
    parse_old_dirname,
    parse_step_dirname,
    step_dirname,
    tmp_dirname,
    trash_dirname,
)
from ..manifest import MAX_JSON_FILE_BYTES, FileEntry, Manifest, validate_file_name
from . import manifests
from .blockgate import READ_CHUNK, BlockGate, Consumer
from .deletion import _deleter, wait_for_deletions
from .pending import Pending
from .protocols import WriterLock
from .ranges import RangeReader
from .rootstate import RootState, split_root

__all__ = [
    "BlockGate",
    "Pending",
    "RootState",
    "Storage",
    "WriterLock",
    "step_exists_message",
    "step_gone",
    "wait_for_deletions",
]

from .._log import logger as log

#: How many entries of a directory that is not a store its messages name.
_SAMPLE = 3
#: Listings of the root started again when a step vanished under one (see Storage.scan).
_SCAN_TRIES = 5
#: How long a pin looks for its marker after writing it (``Storage._confirm_pin``): a
#: deleter that spares pins puts a step it renamed away back within a rename or two.
_PIN_CONFIRM_TRIES = 20
_PIN_CONFIRM_WAIT = 0.05


def step_gone(storage: Storage, step: int) -> bool:
    """Whether ``step`` is no longer committed (deleted while it was read, not corrupt).

    False where the store cannot be listed (an ``OSError``): the read's own error stands.
    """
    try:
        return step not in storage.list_steps()
    except OSError:
        return False


def step_exists_message(storage: Storage, step: int) -> str:
    """What :class:`StepExistsError` says: what happened and the two ways to delete it."""
    root = storage.root.rstrip("/")
    return (
        f"{storage.describe(step)} is already committed; steps are write-once. Save under a "
        f"new step, or delete this one first: `ckptstore rm {root} --step {step}` or "
        f"mgr.delete({step})"
    )


class Storage(abc.ABC):
    """A checkpoint store at one root; see the module docstring for the division of labour.

    Paths given to the primitives are relative to the root and ``/``-separated.
    """

    #: Whether ``_rename`` of a directory is atomic (POSIX); if not, manifest-last commits.
    atomic_rename: ClassVar[bool] = False
    #: Whether the writer lock is enforced (local filesystems only).
    lockable: ClassVar[bool] = False
    #: Whether listing the root costs no request (local): its checks then run at every open.
    cheap_listing: ClassVar[bool] = False

    def __init__(self, root: str) -> None:
        self.root = root

    # ---- primitives, implemented by backends ------------------------------------------

    @abc.abstractmethod
    def _list(self, rel: str) -> list[str]:
        """Names directly under ``rel`` (empty if it does not exist)."""

    @abc.abstractmethod
    def _exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (a symlink counts, and is never followed)."""

    @abc.abstractmethod
    def _is_regular_file(self, rel: str) -> bool:
        """Whether ``rel`` is a regular file (not a directory, not a symlink)."""

    @abc.abstractmethod
    def _size(self, rel: str) -> int:
        """Size in bytes of the regular file ``rel``."""

    @abc.abstractmethod
    def _mkdir(self, rel: str) -> None:
        """Create the directory ``rel`` (and the root if needed); fail if it exists."""

    @abc.abstractmethod
    def _open_write(self, rel: str) -> IO[bytes]:
        """Open a new file for writing; fail if it exists."""

    @abc.abstractmethod
    def _finish_write(self, f: IO[bytes], rel: str) -> None:
        """Make a written file durable (flush, fsync) and close it."""

    @abc.abstractmethod
    def _open_read(self, rel: str) -> IO[bytes]:
        """Open a regular file for reading, refusing symlinks."""

    @abc.abstractmethod
    def _remove(self, rel: str) -> None:
        """Remove one file."""

    @abc.abstractmethod
    def _rmtree(self, rel: str) -> None:
        """Remove a directory and everything under it, never following symlinks."""

    def _rename(self, src: str, dst: str) -> None:
        """Atomically rename a directory; only where :attr:`atomic_rename`."""
        raise NotImplementedError

    def _fsync_dir(self, rel: str) -> None:  # noqa: B027 - optional primitive
        """Make the entries of directory ``rel`` durable (no-op where meaningless)."""

    def _is_plain_dir(self, rel: str) -> bool:
        """Whether ``rel`` is a directory itself, not a symlink to one.

        Stores without symlinks (object stores) have nothing to refuse: True.
        """
        return True

    def _exchange(self, a: str, b: str) -> None:
        """Swap two directories atomically; ``NotImplementedError`` where impossible."""
        raise NotImplementedError

    def _link(self, src: str, dst: str) -> None:
        """Give the committed file ``src`` a second name ``dst`` (a copy where no links)."""
        self._copy(src, dst)

    def _copy(self, src: str, dst: str) -> None:
        """Copy one file durably (object stores: server-side where they can)."""
        with self._open_read(src) as f:
            out = self._open_write(dst)
            try:
                while chunk := f.read(READ_CHUNK):
                    out.write(chunk)
                self._finish_write(out, dst)
            except BaseException:
                with contextlib.suppress(OSError):
                    abort = getattr(out, "abort", None)
                    (abort or out.close)()
                raise

    def _put_small(self, rel: str, data: bytes) -> None:
        """Write a small file in one request, durably."""
        f = self._open_write(rel)
        try:
            f.write(data)
            self._finish_write(f, rel)
        except BaseException:
            with contextlib.suppress(OSError):
                abort = getattr(f, "abort", None)
                (abort or f.close)()  # never fsync or finish a file that failed
            raise

    # ---- the store ------------------------------------------------------------------

    def describe(self, step: int | None = None, name: str | None = None) -> str:
        """A human-readable location for messages."""
        parts = [self.root.rstrip("/")]
        if step is not None:
            parts.append(step_dirname(step))
        if name is not None:
            parts.append(name)
        return "/".join(parts)

    def list_steps(self) -> list[int]:
        """Committed steps (those with a manifest), ascending by number."""
        return self.scan()[0]

    def list_garbage(self) -> list[str]:
        """Root entries that are not committed checkpoints: tmp, trash, manifest-less steps."""
        return self.scan()[1]

    def entry_age(self, name: str) -> float | None:
        """Seconds since anything under the root entry ``name`` was last written.

        None where the store cannot say (or the entry is gone): callers then take it for
        one still being written.
        """
        return None

    def scan(self) -> tuple[list[int], list[str]]:
        """One pass over the root: ``(committed steps ascending, garbage names sorted)``.

        A step directory that vanished between the listing and the look at its manifest
        (retention renamed it away) makes the pass start again: a directory read while
        entries are renamed in and out may miss the new ones (readdir(3) leaves that
        unspecified), and a writer saving fast could otherwise leave a reader with an empty
        listing of a store that never was empty.
        """
        for _ in range(_SCAN_TRIES):
            vanished = False

            def has_manifest(name: str) -> bool:
                nonlocal vanished
                if self._exists(f"{name}/{MANIFEST_NAME}"):
                    return True
                if not self._exists(name):
                    vanished = True
                return False

            found = split_root(self._list(""), has_manifest)
            if not vanished:
                break
        return found

    # ---- is this a store? ----------------------------------------------------------

    def _root_kind(self) -> str:
        """What the root itself is: ``"missing"``, ``"file"``, ``"dir"`` or ``"blocked"``.

        ``"blocked"``: a file is where one of its parent directories should be.
        """
        if self._is_regular_file(""):
            return "file"
        return "dir" if self._list("") else "missing"

    def root_state(self) -> RootState:
        """Whether the root is a store, and if not, what it is instead.

        A store is a directory holding at least one entry ckptstore makes (``step-*``, a save
        in flight or being deleted, ``.ckptstore.*``). Costs one listing of the root.
        """
        kind = self._root_kind()
        if kind != "dir":
            return RootState(kind)
        names = self._list("")
        if not names:
            return RootState("empty")
        if any(is_store_entry(n) for n in names):
            return RootState("store")
        return RootState("other", tuple(sorted(names)[:_SAMPLE]), len(names))

    def probable_store(self) -> str:
        """The store a wrong root (a file, a checkpoint) was probably meant to name.

        The parent, or the grandparent when the parent is a checkpoint itself (the root was
        a payload file of a step). Worked out from the path alone.
        """
        parent = self.root.rstrip("/").rpartition("/")[0] or "/"
        head, _, name = parent.rpartition("/")
        if parse_step_dirname(name) is not None and head:
            return head
        return parent

    def check_root(self, *, create: bool = True) -> None:
        """Refuse a root that cannot be the store meant; warn about a suspicious one.

        A checkpoint directory (``.../step-000000000100``) is refused from its name alone.
        Backends with :attr:`cheap_listing` (local) also refuse a regular file and warn
        about a non-empty directory that is not a store (it works: the store is made beside
        what is there). With ``create=False`` anything but an existing store is refused,
        on every backend (one listing); nothing is created either way.

        Raises:
            NoCheckpointError: the root is a checkpoint, a file, or (``create=False``) no
                store; the message names the store it probably meant where there is one.
        """
        root = self.root.rstrip("/")
        step = parse_step_dirname(root.rpartition("/")[2])
        if step is not None:
            store = self.probable_store()
            raise NoCheckpointError(
                f"{root} is a checkpoint (step {step}) of the store {store}, not a store itself; "
                f"give the store's directory: CheckpointManager({store!r}) "
                f"(restore(state, step={step}) loads this step)"
            )
        if create and not self.cheap_listing:
            return
        state = self.root_state()
        if state.kind == "file":
            raise NoCheckpointError(
                f"{root} is a file, not a checkpoint store (a store is a directory of step-* "
                f"checkpoints); did you mean the store {self.probable_store()}?"
            )
        if state.kind == "blocked":
            raise NoCheckpointError(
                f"{root} cannot be a checkpoint store: part of its path is a file, not a "
                "directory; give the path of a directory (it is created if missing)"
            )
        if state.kind == "store":
            return
        if not create:
            why = {
                "missing": "nothing is there" if not self.cheap_listing else "no such directory",
                "empty": "the directory is empty",
            }.get(state.kind)
            if why is None:
                why = f"it holds no checkpoints, only {state.sample_text()}"
            raise NoCheckpointError(f"no store at {root}: {why}; check the path")
        if state.kind == "other":
            log.warning(
                "%s is not a checkpoint store but holds %s: the store will be created beside "
                "them. If you meant another directory, check the path",
                root,
                state.sample_text(),
            )

    def read_manifest(self, step: int, *, table: bool = True) -> Manifest:
        """Read and validate the manifest of ``step``, and its rank table (format 4).

        ``table=False`` leaves a format-4 manifest's rank table unread (``files`` then lists
        the files of no rank: see :func:`ckptstore.ranktable.lean`).

        Raises:
            NoCheckpointError-like ManifestError: absent, unreadable, malformed or hostile.
        """
        return manifests.read(self, step, table=table)

    def read_manifests(
        self, steps: list[int], *, complete: bool = False
    ) -> dict[int, Manifest | ManifestError]:
        """The manifests of many steps for a listing: each one, or why it cannot be read.

        ``complete`` says ``steps`` is every committed step (a backend with a listing
        cache may then rewrite it). Restore and verify never use this: they read and
        validate the manifest itself.
        """
        out: dict[int, Manifest | ManifestError] = {}
        for s in steps:
            try:
                out[s] = self.read_manifest(s)
            except ManifestError as e:
                out[s] = e
        return out

    def is_pinned(self, step: int) -> bool:
        """Whether the checkpoint carries a pin marker."""
        return self._exists(f"{step_dirname(step)}/{PIN_NAME}")

    def _put_marker(self, rel: str, data: bytes) -> None:
        """Create a small file that counts by its presence alone (nothing reads its bytes).

        Its directory entry is made durable by the caller (``_fsync_dir``); its bytes need
        not be. Backends without an fsync to save write it as any small file.
        """
        self._put_small(rel, data)

    def set_pinned(self, step: int, pinned: bool) -> None:
        """Add or remove the pin marker of a committed checkpoint.

        Raises:
            CommitError: the step's entry is a symlink (or not a directory): ckptstore never
                writes or removes anything through a link, which may lead out of the store.
            OSError: the marker could not be written or removed.
        """
        d = step_dirname(step)
        if not self._is_plain_dir(d):
            what = "pin" if pinned else "unpin"
            raise CommitError(
                f"{self.describe(step)} is a symlink or not a directory; ckptstore does not "
                f"{what} it, as it never writes through a link (readers refuse it too). "
                "Replace the link with the checkpoint directory itself, or remove it"
            )
        rel = f"{d}/{PIN_NAME}"
        if pinned and not self._exists(rel):
            self._put_marker(rel, b"pinned\n")
            self._fsync_dir(d)
            self._confirm_pin(step, rel)
        elif not pinned and self._exists(rel):
            self._remove(rel)
            self._fsync_dir(d)

    def _confirm_pin(self, step: int, rel: str) -> None:
        """Check that a pin marker just written is still in place.

        A deleter may have renamed the step away as it was written (a pin takes no lock).
        One that spares pins puts the step back within moments (:meth:`delete`); otherwise
        the pin failed.

        Raises:
            CommitError: the step was deleted as it was being pinned.
        """
        # Without a rename, a deleter removes the manifest and leaves the marker for its
        # background sweep: the step is there while its manifest is (one that spares pins
        # puts a removed manifest back when it finds the marker, see delete).
        manifest = None if self.atomic_rename else f"{step_dirname(step)}/{MANIFEST_NAME}"
        for _ in range(_PIN_CONFIRM_TRIES):
            if self._exists(rel) and (manifest is None or self._exists(manifest)):
                return
            time.sleep(_PIN_CONFIRM_WAIT)
        if manifest is not None:
            with contextlib.suppress(OSError):
                self._remove(rel)  # ours, in a step being deleted
        raise CommitError(
            f"{self.describe(step)} was deleted as it was being pinned; nothing is pinned"
        )

    def _stream(
        self,
        rel: str,
        consume: Consumer | None,
        *,
        crc: bool = True,
        pace: Callable[[], None] | None = None,
    ) -> tuple[int, int]:
        """Read ``rel`` front to back in large slices; returns ``(bytes, crc32c)``.

        ``consume(offset, chunk)`` sees every slice in order (the view is only valid during
        the call). With ``crc=False`` the whole-file CRC is not computed (0 is returned):
        the caller checks every block instead. ``pace()`` is called on the calling thread
        before each read is issued (a background copy waits there while a save runs, so it
        issues no read meanwhile). Backends may override this with a faster path (local:
        O_DIRECT).
        """
        buf = bytearray(READ_CHUNK)
        mv = memoryview(buf)
        total_crc = 0
        total = 0
        with self._open_read(rel) as f:
            while True:
                if pace is not None:
                    pace()
                n = f.readinto(mv)  # type: ignore[attr-defined]
                if not n:
                    break
                chunk = mv[:n]
                if crc:
                    total_crc = crc32c_of(chunk, total_crc)
                if consume is not None:
                    consume(total, chunk)
                total += n
        return total, total_crc

    def stream_file(
        self,
        step: int,
        name: str,
        entry: FileEntry,
        consume: Consumer | None = None,
        *,
        pace: Callable[[], None] | None = None,
    ) -> None:
        """Stream a file of a committed checkpoint, checking size and CRC32C against ``entry``.

        ``pace()``, where given, is called on this thread before each read is issued (a
        background upload passes its gate: no read of it competes with a save).

        The size is checked before reading (a file that lies about its size is refused
        unread). When ``entry`` has per-block CRCs (``FileEntry.blocks``), ``consume`` sees
        a byte only after the CRC of its block passed: a corrupt block raises before any of
        its bytes are passed on (earlier, verified blocks were). Without them (files of one
        block, old manifests) the checksum is checked when the last byte has been read, so
        a consumer must not trust what it received until this returns.

        Raises:
            IntegrityError: missing, not a regular file, wrong size, or checksum mismatch
                (naming the block, where the file has block CRCs).
        """
        validate_file_name(name)
        rel = f"{step_dirname(step)}/{name}"
        where = self.describe(step, name)
        try:
            if not self._is_regular_file(rel):
                raise IntegrityError(f"{where}: missing or not a regular file")
            size = self._size(rel)
            if size != entry.bytes:
                raise IntegrityError(
                    f"{where}: file has {size} bytes, manifest says {entry.bytes}; "
                    "it is truncated or replaced"
                )
            gate = None if entry.blocks is None else BlockGate(entry, where, consume)
            if gate is None:
                got, crc = self._stream(rel, consume, pace=pace)
            else:  # every block is checked: no whole-file CRC pass on top
                got, crc = self._stream(rel, gate, crc=False, pace=pace)
            if gate is not None:
                gate.finish(got)
        except StoreUnreachableError:  # an object store failed the request, not the file
            raise
        except OSError as e:
            raise IntegrityError(f"{where}: unreadable ({e})") from None
        if got != entry.bytes:
            raise IntegrityError(
                f"{where}: read {got} bytes, manifest says {entry.bytes}; it changed while read"
            )
        if gate is None and crc != entry.crc32c:
            raise IntegrityError(
                f"{where}: crc32c {format_crc(crc)} does not match the manifest's "
                f"{format_crc(entry.crc32c)}; the file is corrupt"
            )

    def read_file(self, step: int, name: str, entry: FileEntry) -> bytearray:
        """Read a whole file into memory, checking its size and CRC32C against ``entry``.

        Raises:
            IntegrityError: missing, wrong size, or checksum mismatch.
        """
        # Allocated at the first chunk, once stream_file has checked the file's size against
        # the manifest: a hostile manifest claiming 2**49 bytes is an IntegrityError, not a
        # MemoryError (or the OOM killer). A JSON file is never larger than a save writes.
        if entry.codec == "json" and entry.bytes > MAX_JSON_FILE_BYTES:
            raise IntegrityError(
                f"{self.describe(step, name)}: {entry.bytes} bytes of JSON, more than a save "
                f"writes ({MAX_JSON_FILE_BYTES}); the manifest is corrupt or hostile"
            )
        bufs: list[bytearray] = []

        def into(offset: int, chunk: memoryview) -> None:
            if not bufs:
                bufs.append(bytearray(entry.bytes))
            end = offset + len(chunk)
            if end <= len(bufs[0]):  # longer files are refused by stream_file
                memoryview(bufs[0])[offset:end] = chunk

        self.stream_file(step, name, entry, into)
        return bufs[0] if bufs else bytearray(entry.bytes)  # empty: no chunk came

    def range_reader(self, step: int, files: Mapping[str, FileEntry]) -> RangeReader:
        """A reader of byte ranges of ``step``'s files (see :class:`RangeReader`)."""
        return RangeReader(self, step, files)

    def checksum_file(self, step: int, name: str) -> tuple[int, int]:
        """Stream a file and return ``(bytes, crc32c)`` without keeping it in memory."""
        return self._stream(f"{step_dirname(step)}/{name}", None)

    def open_file(self, step: int, name: str) -> IO[bytes]:
        """Open a payload file of a committed checkpoint for reading (no symlinks)."""
        validate_file_name(name)
        return self._open_read(f"{step_dirname(step)}/{name}")

    def file_size(self, step: int, name: str) -> int | None:
        """Size of a regular payload file, or ``None`` when missing or not a regular file."""
        validate_file_name(name)
        rel = f"{step_dirname(step)}/{name}"
        if not self._is_regular_file(rel):
            return None
        return self._size(rel)

    # ---- the commit protocol --------------------------------------------------------

    def begin(self, step: int, *, replace: bool = False) -> Pending:
        """Start writing checkpoint ``step``.

        Args:
            step: the step to write.
            replace: ``step`` is committed but corrupt, and this save replaces it. The old
                one is left as it is until the new one commits, so a save that fails keeps
                it (its verification may have failed only transiently).

        Raises:
            StepExistsError: ``step`` is already committed (and ``replace`` is not set).
        """
        final = step_dirname(step)
        if not replace and self._exists(f"{final}/{MANIFEST_NAME}"):
            raise StepExistsError(step_exists_message(self, step))
        if self.atomic_rename or replace:
            # Without a rename, a replacement is written beside the old checkpoint and
            # copied into place at commit: its payload names are those of the old one.
            dirname = tmp_dirname(step)
        else:
            dirname = final
            if self._exists(final):  # manifest-less leftovers of a crashed save: garbage
                self._rmtree(final)
        self._mkdir(dirname)
        return Pending(self, step, dirname, replace=replace)

    def commit(self, pending: Pending, manifest: Manifest) -> None:
        """Make ``pending`` the committed checkpoint described by ``manifest``.

        Payloads are already durable (``Pending.open`` fsyncs each file). The manifest goes
        last; on a POSIX filesystem the directory is then fsynced, renamed into place and
        the root fsynced, so after a crash the step is either fully there or absent. On a
        store without rename every payload is first listed at its size
        (:meth:`_check_payloads`).

        Raises:
            CommitError: (no rename) a payload was removed or changed since it was written.
            OSError: writing the manifest, an fsync or the rename failed.
        """
        body = manifest.to_bytes()
        if not self.atomic_rename:
            self._check_payloads(pending, manifest)
        if not self.atomic_rename and pending.replace:
            self._replace_by_copy(pending, body)
            return
        if not self.atomic_rename:
            self._put_manifest(pending, body)
            return  # the manifest put was the commit
        self.prepare(pending, manifest)
        self.publish(pending)

    def _put_manifest(self, pending: Pending, body: bytes) -> None:
        """The commit of a store without rename: put ``step-N/manifest.json``.

        A put that failed may have landed all the same (its answer lost): the manifest is
        read back, and if it is there the step is committed, not aborted (which removed the
        payloads of a visible step). One cut short by an interrupt runs on in the client's
        thread: the step is ``in_doubt`` and ``abort`` leaves it as it is.

        Raises:
            OSError: the put failed and its manifest is not there.
        """
        rel = f"{pending.dirname}/{MANIFEST_NAME}"
        try:
            self._put_small(rel, body)
        except OSError:
            if not self._holds(rel, body):
                raise
            log.warning("%s: its manifest put failed but the manifest landed", rel)
        except BaseException:
            pending.in_doubt = True
            raise

    def _holds(self, rel: str, body: bytes) -> bool:
        """Whether ``rel`` exists and holds exactly ``body`` (False where it cannot be read)."""
        try:
            with self._open_read(rel) as f:
                return bool(f.read(len(body) + 1) == body)
        except Exception:  # cannot tell: the put's own error stands
            return False

    def _check_payloads(self, pending: Pending, manifest: Manifest) -> None:
        """Before the manifest put of a store without rename: every payload is there whole.

        An object store has no writer lock: another process cleaning the prefix
        (``ckptstore gc``, a second manager's start) takes an uncommitted step's objects for
        garbage. A manifest put after that would commit a step whose files are gone, which
        an upload would then call safe (and local retention delete the only copy). One
        listing of the step's objects (one request on S3) shows it first.

        Raises:
            CommitError: a payload is missing or not at its size; nothing is committed.
        """
        sizes = self._sizes(pending.dirname)
        for name, entry in manifest.files.items():
            size = sizes.get(name)
            if size != entry.bytes:
                # Asked of the object itself before it is called gone: a store whose
                # listings lag behind its writes would otherwise fail a whole save.
                try:
                    size = self._size(f"{pending.dirname}/{name}")
                except FileNotFoundError:
                    size = None
            if size != entry.bytes:
                held = "is gone" if size is None else f"holds {size} bytes"
                raise CommitError(
                    f"{self.describe(pending.step, name)} was written ({entry.bytes} bytes) "
                    f"but {held} at the commit: something else removed or wrote it meanwhile "
                    "(one writer per prefix: was `ckptstore gc`, or another manager, run on "
                    "it?); nothing was committed"
                )

    def _sizes(self, rel: str) -> dict[str, int]:
        """The regular files directly under ``rel``, with their sizes (one listing if it can)."""
        return {n: self._size(f"{rel}/{n}") for n in self._list(rel)}

    def prepare(self, pending: Pending, manifest: Manifest) -> None:
        """The first half of :meth:`commit` on a store with rename: nothing becomes visible.

        The manifest is written into the tmp directory and the directory fsynced, so what
        :meth:`publish` renames into place is durable. Between the two the step is still
        invisible (a ``.tmp-`` directory: :meth:`abort` or ``gc`` removes it). Node-local
        roots use the split so that no node publishes before every node has prepared.

        Raises:
            ValueError: the store has no atomic rename (its manifest put is the commit).
            OSError: writing the manifest or the fsync failed.
        """
        if not self.atomic_rename:
            raise ValueError(f"{self.root}: a store without rename cannot prepare a commit")
        self._put_small(f"{pending.dirname}/{MANIFEST_NAME}", manifest.to_bytes())
        # fsync the tmp directory so its entries (payloads, manifest) survive power loss
        # before the rename publishes them.
        self._fsync_dir(pending.dirname)

    def publish(self, pending: Pending) -> None:
        """The second half of :meth:`commit`: rename the prepared ``pending`` into place.

        On failure nothing of it is visible (a rename whose root fsync failed is taken back)
        and ``pending`` is left for :meth:`abort`.

        Raises:
            StepExistsError: the step was committed concurrently.
            OSError: the rename or the root's fsync failed.
        """
        final = step_dirname(pending.step)
        if self._exists(final):
            if self._exists(f"{final}/{MANIFEST_NAME}"):
                if not pending.replace:
                    raise StepExistsError(
                        f"{self.describe(pending.step)} was committed concurrently"
                    )
                self._carry_pin(final, pending.dirname)
                self._swap_in(pending, final)
                return
            self._discard(final)  # a manifest-less step directory is garbage
        self._rename(pending.dirname, final)
        # fsync the root: the rename itself is only durable once the parent directory is.
        try:
            self._fsync_dir("")
        except OSError:
            # Not durable, so not committed: take the rename back, so that the caller's
            # error ("nothing of it is visible") is true and the step can be saved again.
            with contextlib.suppress(OSError):
                self._rename(final, pending.dirname)
            raise

    def _carry_pin(self, old: str, new: str) -> None:
        """Pin the step directory ``new`` if ``old`` (the one it replaces) is pinned.

        A replacement (a corrupt step saved again, or fetched from the replica) is the same
        step: the user's pin stays with it, durably (the directory is fsynced), or retention
        would delete the step after the next restart.
        """
        if self._exists(f"{old}/{PIN_NAME}") and not self._exists(f"{new}/{PIN_NAME}"):
            self._put_marker(f"{new}/{PIN_NAME}", b"pinned\n")
            self._fsync_dir(new)

    def _swap_in(self, pending: Pending, final: str) -> None:
        """Put the written ``pending`` in place of the committed (corrupt) ``final``.

        With an atomic exchange of the two directories (Linux ``renameat2``
        ``RENAME_EXCHANGE``), a crash at any point leaves the old or the new checkpoint as
        ``step-N``. Without one (NFS, say) the old one is first renamed to
        ``.old-step-N-<uuid>``, then the new one into place: a crash between the two renames
        leaves neither as ``step-N`` until the next writer's :meth:`gc` renames the old one
        back. Either way the old one is deleted only once the new one is durable.
        """
        aside = pending.dirname
        try:
            self._exchange(pending.dirname, final)  # the old checkpoint is now at `aside`
        except NotImplementedError:
            aside = old_dirname(pending.step)
            self._rename(final, aside)
            try:
                self._rename(pending.dirname, final)
            except OSError:
                with contextlib.suppress(OSError):
                    self._rename(aside, final)  # (a crash here is undone by gc)
                raise
        try:
            self._fsync_dir("")
        except OSError:
            # Not durable, so not committed: put the old one back, so that the caller's
            # error ("nothing of it is visible") is true; the new one is at pending.dirname.
            with contextlib.suppress(OSError):
                if aside == pending.dirname:
                    self._exchange(final, aside)
                else:
                    self._rename(final, pending.dirname)
                    self._rename(aside, final)
            raise
        try:
            # A pin put on the old one while the new one was swapped in stays too.
            self._carry_pin(aside, final)
        except OSError as e:
            log.warning("could not carry the pin of %s over: %s", aside, e)
        try:
            trash = trash_dirname(pending.step)
            self._rename(aside, trash)
            _deleter.submit(self, trash, fsync_root=True)
        except OSError as e:  # the new one is committed; gc removes what is left
            log.warning("could not remove the replaced %s: %s; `ckptstore gc` will", aside, e)

    def _replace_by_copy(self, pending: Pending, body: bytes) -> None:
        """Commit a replacement on a store without rename (see :meth:`begin`).

        The old checkpoint goes only now that the new one is completely written: its
        manifest first (it vanishes whole), then its files; the new files are copied into
        ``step-N/`` and the manifest put last, as in any commit. A crash before that put
        leaves no ``step-N`` (restore falls back to the step before); the new files stay in
        the ``.tmp-`` prefix until ``gc``. A pinned step's pin is put back before the
        manifest (a crash before that leaves no step, the pin then pins nothing visible).
        """
        final = step_dirname(pending.step)
        pinned = self._exists(f"{final}/{PIN_NAME}")  # the replacement keeps the step's pin
        with contextlib.suppress(FileNotFoundError):
            self._remove(f"{final}/{MANIFEST_NAME}")
        with contextlib.suppress(FileNotFoundError):
            self._rmtree(final)
        self._mkdir(final)
        if pinned:
            self._put_marker(f"{final}/{PIN_NAME}", b"pinned\n")
        for name in sorted(pending.files):
            self._copy(f"{pending.dirname}/{name}", f"{final}/{name}")
        self._put_small(f"{final}/{MANIFEST_NAME}", body)
        _deleter.submit(self, pending.dirname)

    def abort(self, pending: Pending) -> None:
        """Throw away a save in flight; best effort (``gc`` removes what is left).

        Not once its manifest put was issued (``pending.in_doubt``): the put may still land
        (it runs on in the client's own thread after a Ctrl-C, or landed before its answer
        was lost), and removing the payloads then left a visible step without them.
        """
        if pending.in_doubt:
            log.warning(
                "%s: the save stopped while its manifest was being put; the step is left as it "
                "is: committed whole if the put landed, else invisible and cleaned up like any "
                "unfinished save (`ckptstore gc --pending`)",
                self.describe(pending.step),
            )
            return
        try:
            self._rmtree(pending.dirname)
        except OSError as e:
            log.warning("could not remove %s: %s; `ckptstore gc` will", pending.dirname, e)

    def delete(
        self,
        step: int,
        *,
        background: bool = True,
        durable: bool = False,
        spare_pinned: bool = False,
    ) -> bool:
        """Delete a committed checkpoint so that it vanishes whole, at once.

        With ``spare_pinned`` a step that carries a pin marker is kept, and False returned.
        A pin takes no lock, so a deleter's earlier look at the marker proves nothing: here
        the marker is looked for after the rename, in the renamed directory (a pin written
        before the rename moved with it), and the step renamed back where it has one; a pin
        written after the rename finds no step and fails (:meth:`set_pinned`). Object
        stores have no rename: the marker is looked for before the manifest goes and again
        after, and a marker found then puts the manifest back (its bytes read first); a pin
        written after that second look finds no manifest and fails.

        Local: rename to ``.trash-...`` (atomic); in the background, fsync the root and only
        then remove the files (a power cut before that fsync brings the whole checkpoint
        back, never a half-removed one; its return is harmless, retention deletes it again).
        With ``durable`` the root is fsynced before returning, so the deletion survives a
        power cut from then on (an explicit delete; retention leaves it to the background).
        Object stores: remove the manifest first (the checkpoint is gone from that moment),
        then the rest in the background, or now with ``background=False`` (before the same
        step is written again: a late background delete would remove the new files).
        """
        final = step_dirname(step)
        if self.atomic_rename:
            trash = trash_dirname(step)
            self._rename(final, trash)
            if spare_pinned and self._exists(f"{trash}/{PIN_NAME}"):
                self._rename(trash, final)  # pinned meanwhile: back, as it was
                self._fsync_dir("")
                return False
            if durable:
                self._fsync_dir("")
            _deleter.submit(self, trash, fsync_root=not durable)
        else:
            if spare_pinned and self.is_pinned(step):
                return False
            rel = f"{final}/{MANIFEST_NAME}"
            body = None
            if spare_pinned:  # to put back; an unreadable one fails the deletion (OSError)
                with contextlib.suppress(ManifestError):
                    body = manifests.read_bytes(self, rel, self.describe(step, MANIFEST_NAME))
            with contextlib.suppress(FileNotFoundError):
                self._remove(rel)
            # A pin takes no lock: one written between the look above and the removal
            # would be lost while `ckptstore pin` said it held (found by review). Seen now,
            # the step comes back whole: its other files are still all there. Where the
            # second look fails, the step comes back too (a pin may be there), and the
            # error is raised: a manifest-less step would be garbage to `gc`.
            if body is not None:
                try:
                    pinned = self.is_pinned(step)
                except BaseException:
                    self._put_small(rel, body)
                    raise
                if pinned:
                    self._put_small(rel, body)
                    return False
            elif spare_pinned and self.is_pinned(step):
                # The manifest was larger than any manifest, so it was not read and cannot
                # be put back: the step goes. A pinner
                # confirming after the removal is told it failed; one that confirmed before
                # was told it held, and this warning is what says otherwise.
                log.warning(
                    "%s was pinned as it was deleted, and its manifest could not be put "
                    "back (it is larger than any manifest): the step is deleted, the pin with it",
                    self.describe(step),
                )
            if background:
                _deleter.submit(self, final)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self._rmtree(final)
        return True

    def _discard(self, rel: str) -> None:
        if self.atomic_rename:
            step = parse_step_dirname(rel)
            trash = trash_dirname(step if step is not None else 0)
            self._rename(rel, trash)
            _deleter.submit(self, trash)
        else:
            _deleter.submit(self, rel)

    def gc(self, *, include_tmp: bool = True) -> list[str]:
        """Remove garbage entries now; returns their names.

        Only safe for ``.tmp-`` entries while no save is in flight: callers hold the writer
        lock, or pass ``include_tmp=False``.
        """
        removed = []
        if include_tmp:
            removed += self._recover_old()
        for name in self.list_garbage():
            if is_tmp_name(name) and not include_tmp:
                continue
            try:
                if is_tmp_name(name) and self.atomic_rename:
                    # Out of the way first: an uploader to a replica holds no lock of it,
                    # and its commit renamed a .tmp- directory that rmtree was emptying
                    # into a step with files missing (found by review). Renamed, the
                    # uploader's writes and commit fail instead, and nothing is published.
                    trash = trash_dirname(0)
                    self._rename(name, trash)
                    self._rmtree(trash)
                else:
                    self._rmtree(name)
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:
                    continue
                raise
            removed.append(name)
        if removed:
            self._fsync_dir("")
        return removed

    def _recover_old(self) -> list[str]:
        """Finish replacements cut short between their two renames (see :meth:`_swap_in`).

        An ``.old-step-N-…`` entry is the checkpoint a save was replacing: renamed back to
        ``step-N`` when that is absent (the new one never got there), removed otherwise.
        """
        removed = []
        for name in sorted(self._list("")):
            step = parse_old_dirname(name)
            if step is None:
                continue
            final = step_dirname(step)
            if not self._exists(final):
                self._rename(name, final)
                self._fsync_dir("")
                log.warning("restored %s, which an interrupted save was replacing", final)
            else:
                self._rmtree(name)
                removed.append(name)
        return removed

    def abort_incomplete_uploads(
        self, older_than: float | None = None, keep: Callable[[str], bool] | None = None
    ) -> int:
        """Abort multipart uploads left under the root by a crash; returns how many.

        ``older_than``: only those begun at least that many seconds ago; ``keep``: given the
        root entry one is under, whether to leave it.

        Only object stores have them (billed until aborted); elsewhere there is nothing to do.
        """
        return 0

    # ---- locking (local only) -------------------------------------------------------

    def writer_lock(self) -> WriterLock | None:
        """A non-blocking writer lock object, or ``None`` where locking is not enforced."""
        return None

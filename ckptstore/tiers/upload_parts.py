"""Per-rank uploads of a sharded step: each rank its own files, the manifest once all are in.

Under torch.distributed every rank's uploader uploads the files its rank wrote (rank 0 also
the files of no rank: the plain state, the chunk index) into the step's pending area on the
replica (``step-N/`` on an object store, a ``.tmp-step-N-<tag>/`` named for the manifest on a
filesystem), each checked as :func:`~ckptstore.tiers.copy.copy_files` checks it. Then it puts a
small "done" object there, ``upload.rankRRRRR.<tag>.done`` (the manifest's tag in its name,
the table of the files it uploaded inside), and lists the done objects: the uploader whose
listing shows one for every rank with files in the manifest reads them (each must list
what the manifest says that rank wrote), checks each file of the step at its size, and puts
the manifest, last, in one request. Several may find them all at once; they put the same
bytes, which is harmless. Completing is idempotent: on a filesystem the uploaders share the
pending directory, so the second may find the manifest already written there (the same
bytes: it publishes too, and one rename wins) or the directory already renamed into place;
an uploader that finds this very save committed reports the step committed, whatever step
of the completion it was at. No collective runs on an uploader's thread, and a rank that
dies during its upload leaves no manifest: the step is not visible on the replica. The done
objects stay in the step's directory (no manifest lists them; they say who uploaded what).

A step the replica holds as another save (saved again after both tiers' copies failed) is
taken out of sight before the new save's files are written: on an object store its old
manifest is removed (the new files are written under the same prefix, and no reader may see
the old manifest over them), on a filesystem the old directory is renamed away, and put back
if it turns out to be this very save (another uploader committed it meanwhile).

Cleanup when several uploaders share one prefix (:func:`clean`): a pending step is removed
only when it is older than the newest step committed on the replica (nothing will complete
it usefully: resume takes the newer one), and incomplete multipart uploads are aborted only
by rank 0 while every rank is in the manager's constructor (no uploader of this job runs).
A pending step at or above the newest committed one is kept, done objects included: the
ranks' uploaders finish it after a restart (each re-uploads its own part; the parts already
there are overwritten with the same bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import time
from collections.abc import Callable
from typing import Any

from .._log import logger as log
from ..errors import CkptStoreError, IntegrityError
from ..layout import (
    MANIFEST_NAME,
    is_garbage_name,
    parse_step_dirname,
    step_dirname,
    trash_dirname,
)
from ..manifest import FileEntry, Manifest
from ..storage import Pending, Storage
from .nodes import ranks_with_files

__all__ = ["clean", "files_of", "held", "is_per_rank", "remove", "upload_part"]

_DONE_RE = re.compile(r"upload\.rank([0-9]{5,})\.([0-9a-f]{32})\.done")
_TMP_STEP_RE = re.compile(r"\.(?:tmp|trash)-step-([0-9]+)-")


def is_per_rank(manifest: Manifest) -> bool:
    """Whether ``manifest`` is uploaded rank by rank (a sharded step of several ranks)."""
    return manifest.sharded and manifest.world_size > 1


def files_of(manifest: Manifest, rank: int) -> dict[str, FileEntry]:
    """The files ``rank`` uploads: those it wrote, and for rank 0 the files of no rank."""
    return {
        n: e for n, e in manifest.files.items() if e.rank == rank or (e.rank is None and rank == 0)
    }


def _tag(manifest: Manifest) -> str:
    return hashlib.md5(manifest.to_bytes(), usedforsecurity=False).hexdigest()


def pending_dirname(replica: Storage, step: int, manifest: Manifest) -> str:
    """The step's pending area on the replica, the same for every rank's uploader."""
    if not replica.atomic_rename:
        return step_dirname(step)  # invisible until its manifest is put
    return f".tmp-step-{step:012d}-{_tag(manifest)}"


def done_name(rank: int, manifest: Manifest) -> str:
    """The name of ``rank``'s done object for ``manifest`` in a step's pending area.

    The manifest's tag is in the name, so one listing tells an uploader which ranks are
    done with this very save (an earlier save of the same step number left others).
    """
    return f"upload.rank{rank:05d}.{_tag(manifest)}.done"


def upload_part(
    local: Storage,
    replica: Storage,
    step: int,
    manifest: Manifest,
    *,
    rank: int,
    copy: Callable[..., None],
) -> bool:
    """Upload ``rank``'s files of ``step``, mark them done, and commit if every rank's are.

    ``copy`` is :func:`~ckptstore.tiers.copy.copy_files` with the uploader's settings bound.

    Returns:
        Whether the step is now committed on the replica (by this call or another's).

    Raises:
        IntegrityError: a local file does not match the manifest, or a file another rank
            marked done is not on the replica at its size.
        OSError: the replica refused a write; nothing of the step is visible there.
    """
    if committed(replica, step, manifest):
        return True  # every rank's files are in (a retry, or another uploader was faster)
    _put_out_of_sight(replica, step, manifest)
    dirname = pending_dirname(replica, step, manifest)
    if not replica._exists(dirname):
        with contextlib.suppress(FileExistsError):
            replica._mkdir(dirname)
    pending = Pending(replica, step, dirname)
    if replica.atomic_rename and replica._exists(f"{dirname}/{MANIFEST_NAME}"):
        # Another uploader found every rank's part in and is publishing it: the files are
        # all there (and must not be touched), only the rename may be left to do.
        return _commit_if_complete(replica, step, manifest, pending)
    mine = files_of(manifest, rank)
    if replica.atomic_rename:
        if _part_in(replica, dirname, rank, manifest):
            # Done by an earlier run of this rank's uploader (a job killed before the step
            # was complete): redoing it would remove files that another rank's uploader,
            # which found every done object, may be renaming into place at this moment.
            return _commit_if_complete(replica, step, manifest, pending)
        # A filesystem writes no file twice: a retry starts afresh, its done object first
        # (no uploader commits without it).
        for name in [done_name(rank, manifest), *mine]:
            with contextlib.suppress(FileNotFoundError):
                replica._remove(f"{dirname}/{name}")
    copy(local, replica, step, manifest, only=mine, into=pending)
    done = {
        "rank": rank,
        "manifest": _tag(manifest),
        "files": {n: [e.bytes, e.crc32c] for n, e in sorted(mine.items())},
    }
    replica._put_small(f"{dirname}/{done_name(rank, manifest)}", json.dumps(done).encode() + b"\n")
    return _commit_if_complete(replica, step, manifest, pending)


def committed(replica: Storage, step: int, manifest: Manifest) -> bool:
    """Whether the replica holds ``step`` committed as this very save (``manifest``)."""
    try:
        return replica.read_manifest(step).to_bytes() == manifest.to_bytes()
    except (OSError, CkptStoreError):
        return False


def _put_out_of_sight(replica: Storage, step: int, manifest: Manifest) -> None:
    """Take another save of ``step`` committed on the replica out of readers' sight.

    See the module docstring. The check and the removal are not one atomic step: another
    uploader may commit this save in between. On an object store the manifest it put is
    then removed, and the step is committed again by this uploader's own completion (every
    rank's done objects are there); on a filesystem the directory taken away is read and,
    being this save, renamed back.
    """
    final = step_dirname(step)
    try:
        if not replica._exists(f"{final}/{MANIFEST_NAME}") or committed(replica, step, manifest):
            return
    except OSError:
        return
    log.warning("replica %s holds another save of step %d: replacing it", replica.root, step)
    if not replica.atomic_rename:
        with contextlib.suppress(FileNotFoundError):
            replica._remove(f"{final}/{MANIFEST_NAME}")
        return
    aside = trash_dirname(step)
    try:
        replica._rename(final, aside)
    except FileNotFoundError:
        return  # another uploader took it away first
    try:
        with replica._open_read(f"{aside}/{MANIFEST_NAME}") as f:
            mine = f.read(len(manifest.to_bytes()) + 1) == manifest.to_bytes()
    except OSError:
        mine = False
    if mine and not replica._exists(final):
        replica._rename(aside, final)  # this very save, committed meanwhile: keep it
        return
    replica._fsync_dir("")
    with contextlib.suppress(OSError):
        replica._rmtree(aside)


def _listed_done(replica: Storage, dirname: str, manifest: Manifest) -> dict[int, str]:
    """Rank -> name of its done object for this very manifest, from one listing."""
    tag = _tag(manifest)
    out = {}
    for name in replica._list(dirname):
        m = _DONE_RE.fullmatch(name)
        if m is not None and m.group(2) == tag:
            out[int(m.group(1))] = name
    return out


def _done_ranks(
    replica: Storage, dirname: str, names: dict[int, str], manifest: Manifest
) -> set[int]:
    """Those ranks of ``names`` whose done object says what the manifest says they wrote.

    Read only by an uploader that listed every rank's done object (the one that commits),
    so each step costs O(ranks) reads once, not once per rank.
    """
    tag = _tag(manifest)
    out = set()
    for r, name in names.items():
        try:
            with replica._open_read(f"{dirname}/{name}") as f:
                data: Any = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("manifest") != tag:
            continue  # left by an earlier save of the same step number
        want = {n: [e.bytes, e.crc32c] for n, e in sorted(files_of(manifest, r).items())}
        if data.get("files") == want:
            out.add(r)
    return out


def _part_in(replica: Storage, dirname: str, rank: int, manifest: Manifest) -> bool:
    """Whether ``rank``'s part of this manifest is in ``dirname``, whole.

    Its done object is there and says what the manifest says, and every file is at its size.
    """
    name = done_name(rank, manifest)
    if not replica._exists(f"{dirname}/{name}"):
        return False
    if rank not in _done_ranks(replica, dirname, {rank: name}, manifest):
        return False
    for file, entry in files_of(manifest, rank).items():
        try:
            if replica._size(f"{dirname}/{file}") != entry.bytes:
                return False
        except FileNotFoundError:
            return False
    return True


def _commit_if_complete(replica: Storage, step: int, manifest: Manifest, pending: Pending) -> bool:
    need = set(ranks_with_files(manifest))
    listed = _listed_done(replica, pending.dirname, manifest)
    have = set(listed)
    if need <= have:
        have = _done_ranks(replica, pending.dirname, {r: listed[r] for r in need}, manifest)
    if not need <= have:
        if committed(replica, step, manifest):  # another uploader completed it meanwhile
            return True
        log.info(
            "step %d: uploaded this rank's files; waiting for rank(s) %s",
            step,
            sorted(need - have),
        )
        return False
    try:
        for name, entry in manifest.files.items():
            try:
                size = replica._size(f"{pending.dirname}/{name}")
            except FileNotFoundError:
                size = None
            if size != entry.bytes:
                raise IntegrityError(
                    f"{replica.describe(step, name)}: marked uploaded, but the replica holds "
                    f"{size} bytes, the manifest says {entry.bytes}"
                )
        _commit(replica, pending, manifest)
    except (OSError, CkptStoreError):
        # Another uploader completing this save at the same moment (a filesystem: the
        # same pending directory) renamed the files away under this one's checks: the
        # step is committed, which is all this call had to do.
        if not _committed_soon(replica, step, manifest):
            raise
        log.info("step %d: committed by another rank's uploader at the same moment", step)
        return True
    log.info("step %d: every rank's files are on the replica; manifest put", step)
    return True


def _commit(replica: Storage, pending: Pending, manifest: Manifest) -> None:
    """Commit ``pending`` (idempotent among the uploaders completing one save).

    On a filesystem a manifest already in the pending directory (the same bytes, written by
    another uploader completing this save) is published as if this one wrote it.
    """
    if not replica.atomic_rename:
        replica.commit(pending, manifest)  # the same bytes by each completer: harmless
        return
    try:
        replica.prepare(pending, manifest)
    except FileExistsError:
        with replica._open_read(f"{pending.dirname}/{MANIFEST_NAME}") as f:
            there = f.read(len(manifest.to_bytes()) + 1)
        if there != manifest.to_bytes():
            raise
        replica._fsync_dir(pending.dirname)
    replica.publish(pending)


def _committed_soon(replica: Storage, step: int, manifest: Manifest) -> bool:
    """Whether this save is committed, or becomes so within a moment (a rename in flight)."""
    for delay in (0.0, 0.05, 0.2, 0.5):
        time.sleep(delay)
        if committed(replica, step, manifest):
            return True
    return False


def clean(replica: Storage, idle: float | None = None) -> list[str]:
    """Remove the pending steps older than the newest committed one; returns their names.

    The rule when several uploaders share a prefix (see the module docstring): a pending
    step at or above the newest committed step may still be finished by the ranks'
    uploaders, so it stays (:func:`held` names those). ``idle``: only those nothing was
    written to for that many seconds (:meth:`~ckptstore.storage.Storage.entry_age`; an age
    the store cannot tell keeps the step): an older step may still be uploading, another
    process's backlog. A step whose manifest appeared meanwhile is committed, and stays.
    """
    return remove(replica, _pending(replica)[0], idle)


def remove(replica: Storage, names: list[str], idle: float | None = None) -> list[str]:
    """Remove the garbage entries ``names`` of ``replica`` (see :func:`clean`); the removed.

    ``idle``: only those nothing was written to for that many seconds. An entry whose
    manifest appeared since it was listed is committed, and stays.
    """
    removed = []
    for name in names:
        if idle is not None:
            age = replica.entry_age(name)
            if age is None or age < idle:
                continue
        try:
            if replica._exists(f"{name}/{MANIFEST_NAME}"):
                continue  # committed since the listing: a step now, not garbage
            replica._rmtree(name)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


def held(replica: Storage) -> list[str]:
    """The pending entries :func:`clean` keeps: at or above the newest committed step.

    An uploader may still be writing them (or finish them after a restart); with no step
    committed yet, every pending entry is one of those.
    """
    return _pending(replica)[1]


def _pending(replica: Storage) -> tuple[list[str], list[str]]:
    """The garbage names of ``replica``: (older than the newest committed step, the rest)."""
    steps, garbage = replica.scan()
    newest = steps[-1] if steps else None
    older: list[str] = []
    rest: list[str] = []
    for name in garbage:
        s = parse_step_dirname(name)
        if s is None and is_garbage_name(name):
            m = _TMP_STEP_RE.match(name)
            s = int(m.group(1)) if m else None
        if s is None or newest is None or s >= newest:
            rest.append(name)
        else:
            older.append(name)
    return older, rest

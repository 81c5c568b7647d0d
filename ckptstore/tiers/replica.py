"""Two tiers: committed local steps copied to a replica store in the background.

The local store commits at disk speed; a :class:`Replicator` then copies each committed step
to the replica (any fsspec URL) with the object-store commit protocol of
:class:`~ckptstore.storage.base.Storage`: the payloads first, several at once, each streamed
from the local file with its CRC32C checked against the local manifest on the way out and
checked by the replica on receipt (S3) or read back from it once published; the manifest
last, in one request, and only when every file is there and verified. A process killed at
any moment therefore leaves the replica holding only complete, verifying steps (a step
without its manifest is garbage), and the next :class:`Replicator` on the same roots aborts
the crashed multipart uploads, removes the partial steps and uploads what is missing, newest
first.

A step is *safe* on a replica when that replica holds this very save of it (its manifest is
the local manifest, byte for byte) and the copy verified there: checked on its way in by the
upload, or, when nothing records that (another uploader put it, an old marker), by
``verify``'s check of the replica's copy. Safety is recorded per replica in the step's local
``replicated`` marker, ``{"safe_on": {REPLICA: SHA-256 of the manifest}}``; it is never carried
over from another replica, nor from an earlier save of the same step number (a step saved
again locally has a new directory, without the marker). The marker serves ``ckptstore ls``,
and keeps a step the replica's retention deleted from being uploaded again. A step the
replica holds as another save (a re-save after both tiers' copies failed) is uploaded and
replaces that copy with the replica's own commit protocol (an object store: the old
manifest is removed first, the new one put last).

Reading back costs a download of every byte uploaded. On S3 it is not needed: the writer
(:mod:`ckptstore.storage.s3upload`) has the store check every request's body against the
very buffers whose CRC32C is compared with the local manifest, the cheapest honest way the
store allows (found once by a probe): S3 refuses a body whose CRC32C header is not its own
(no MD5 needed); moto, which checks no header, computes the CRC32C of what it received when
asked and answers it, which is compared; a store that does neither gets the body's MD5
(Content-MD5) and its ETag is compared with it. A reply that lacks the check leaves the file
unverified, and it is read back. Stores that do not check (every other fsspec filesystem)
are read back; ``read_back=True`` reads back everything.

A save closes the uploader's gate (:class:`~ckptstore.tiers.uploadgate.UploadGate`) for its
blocking section: the copy threads stop before their next slice of a local file, the
request bodies in flight before their next slice, and the bookkeeping after an upload
(markers, retention) waits, so a save does not compete with the uploads of earlier steps.

:func:`fetch_step` is the other direction: a replica step copied into the local store with
the local commit protocol (restore from either tier reads it from there).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._log import logger as log
from ..errors import (
    CkptStoreError,
    ClosedError,
    ConfigError,
    IntegrityError,
    ManifestError,
    ReplicaError,
    ReplicaTimeoutError,
    ReplicaUnavailableError,
    StepExistsError,
    StoreUnreachableError,
)
from ..layout import is_garbage_name, parse_step_dirname
from ..manifest import Manifest
from ..retention import CheckpointInfo, RetentionPolicy, plan_deletions
from ..storage import Storage
from ..storage.reach import is_unreachable
from . import nodes, upload_parts
from .copy import _ATTEMPTS, _BACKOFF, DEFAULT_THREADS, _lower_priority, copy_files, fetch_step
from .safety import (
    LEGACY,
    forget_replicated,
    manifest_digest,
    mark_replicated,
    read_replica_url,
    replica_key,
    safe_on,
    write_replica_url,
)
from .uploadgate import UploadGate

__all__ = ["ReplicaError", "Replicator", "fetch_step", "list_within"]

#: Seconds the uploader's thread waits at a closed gate before it looks for lookups again.
_GATE_POLL = 0.2
#: A manifest-less step or a multipart upload on the replica is taken for what a crashed
#: upload left (removed, aborted) only once nothing was written to it for this long. A
#: second manager on the prefix cleaned it at once: it deleted the step another process was
#: uploading, whose manifest landed between the listing and the delete (recorded safe,
#: then on neither tier), and aborted its multipart uploads in flight. A day: the shortest
#: AbortIncompleteMultipartUpload rule S3 takes; a crashed upload's leftovers cost storage
#: until then, and the step's next upload writes over them.
STALE_UPLOAD_S = 24 * 3600.0
#: Seconds :meth:`Replicator.close` waits for its thread once it is stopped (after the
#: queued uploads, or at once without waiting): a stopped upload ends within about a second
#: (its copy threads and S3 requests look at the stop that often); a request the stop
#: cannot cancel (a listing, a delete: the client's own calls) is not waited for past this.
#: The thread is a daemon: left alone, it ends with that request, or with the process.
STOP_JOIN = 2.0


class Replicator:
    """Uploads committed local steps to a replica store on one background thread.

    Args:
        local: the local store (the training job's root).
        replica: the replica store.
        policy: the replica's retention, applied after each upload (``None``: keep all).
        threads: files uploaded at once.
        read_back: check every uploaded file by reading it back (True), only those the store
            did not check on receipt (None: on S3 the server checks each request's MD5), or
            none (False); see the module docstring.
        on_safe: called with each step once it is safe on the replica (from the thread).
        retention: apply ``policy`` to the replica (only one uploader of a replica should).
        url: the replica's URL, recorded in the local root once it holds a step (for
            ``ckptstore ls``); default: the replica store's root.
        rank: under torch.distributed, this process's rank: sharded steps of several ranks
            are uploaded rank by rank (this uploader sends its rank's files, see
            :mod:`ckptstore.tiers.upload_parts`), other steps by rank 0 alone. ``None``: this
            uploader sends whole steps (one process, or the sidecar).
        world: with ``rank``, the job's world size. A sharded step saved by more ranks than
            the job has (resumed on fewer) is still uploaded whole: this uploader sends the
            files of ``rank``, ``rank + world``, ``rank + 2 * world``... (default: the
            step's own world size, each rank its own files only).
        every: ``"all"`` (default): every step is uploaded, and local retention keeps each
            step until it is itself safe on the replica (what the replica's retention
            promises holds). ``"latest"``: when uploads fall behind only the newest step is
            uploaded; a local step older than one safe on the replica may be deleted without
            reaching it (logged).
        timeout: seconds (about) an upload keeps trying a replica that cannot be reached;
            after that the step fails (it stays local), and the other queued steps fail at
            once with the same error until the next :meth:`submit`.

    Call :meth:`recover` once before :meth:`submit`: it cleans what a crash left on the
    replica and queues the local steps it lacks. Steps are uploaded newest first.
    """

    def __init__(
        self,
        local: Storage,
        replica: Storage,
        *,
        policy: RetentionPolicy | None = None,
        threads: int = DEFAULT_THREADS,
        read_back: bool | None = None,
        on_safe: Callable[[int], None] | None = None,
        retention: bool = True,
        url: str | None = None,
        rank: int | None = None,
        world: int | None = None,
        every: str = "all",
        timeout: float = 60.0,
    ) -> None:
        if every not in ("all", "latest"):
            msg = f"replica_every must be 'all' or 'latest', got {every!r}"
            raise ConfigError(msg)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            msg = f"replica threads must be an int >= 1, got {threads!r}"
            raise ConfigError(msg)
        self.local = local
        self.replica = replica
        self.policy = policy
        self.threads = threads
        self.read_back = read_back
        self.on_safe = on_safe
        self.retention = retention
        self.rank = rank
        self.world = world
        self.every = every
        self.timeout = float(timeout)
        #: The error that showed the replica cannot be reached, until the next submit():
        #: the other queued steps fail with it at once instead of each trying in turn.
        self._down: BaseException | None = None
        #: Steps whose part this uploader sent rank by rank -> the names of its files.
        self.parts: dict[int, list[str]] = {}
        #: Step -> digest of the save whose part this uploader sent (see :meth:`refresh`).
        self._part_of: dict[int, str] = {}
        #: Steps this uploader uploaded (or, rank by rank, committed), in upload order.
        self.uploaded: list[int] = []
        self._url = url or replica.root
        self._url_recorded = False
        #: Steps known to be committed and verified on the replica as the local save of
        #: them (once; retention there may have deleted some since, which a newer safe step
        #: justifies). Which save: ``_safe_as`` (step -> manifest digest).
        self.safe: set[int] = set()
        self._safe_as: dict[int, str] = {}
        self._pending: set[int] = set()
        self._busy: int | None = None
        #: Steps local retention held whose safety the replica's listing may show (per-rank
        #: uploads): looked up on this uploader's thread, never on the training thread.
        self._lookups: set[int] = set()
        self._looking = False
        self._failed: dict[int, BaseException] = {}
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        #: Closed while a save runs or while paused: the copy threads wait there before
        #: each slice they read, the S3 request bodies before each slice they send.
        self.gate = UploadGate()
        self.uploaded_bytes = 0
        #: Local retention held back a step for the replica (see :meth:`deletable`).
        self.holding = False
        #: The steps the replica held at this uploader's last full listing, with those it
        #: committed since and less those its retention deleted (None: never listed).
        self._seen: set[int] | None = None
        #: Steps recorded safe whose copy :meth:`recover` found gone from the replica with
        #: nothing newer there: their records are not to be trusted until uploaded again.
        self._lost: set[int] = set()

    # ---- the gate (pause/resume) -------------------------------------------------------

    def pause(self) -> None:
        """Hold uploads: the one in flight stops before its next slice of bytes.

        For tests and for jobs that want the network to themselves for a while; nothing is
        lost, :meth:`resume` goes on where it stopped. :meth:`wait` raises meanwhile
        instead of waiting for uploads that cannot go on.
        """
        self.gate.pause()
        with self._cond:
            self._cond.notify_all()  # a wait() in progress raises

    def resume(self) -> None:
        """Let uploads go on after :meth:`pause`."""
        self.gate.resume()

    def held(self) -> contextlib.AbstractContextManager[None]:
        """Hold uploads while the block runs (a save: its writes go first). Nests.

        The requests in flight stop too, between two slices of their bodies (see
        :mod:`ckptstore.tiers.uploadgate`): the save does not compete with them.
        """
        return self.gate.held()

    # ---- state -----------------------------------------------------------------------

    def is_safe(self, step: int) -> bool:
        """Whether ``step`` was committed and verified on the replica (as the local save)."""
        with self._cond:
            return step in self.safe

    @property
    def url(self) -> str:
        """The replica's URL, as the job named it."""
        return self._url

    def seen_there(self) -> set[int] | None:
        """The committed steps the replica was last seen to hold (None: never listed).

        From this uploader's last full listing of the replica (:meth:`recover`, then each
        later one), with the steps it committed there since and less those its retention
        deleted: what a restore or an admitted save takes the replica to hold when a
        listing of it fails.
        """
        with self._cond:
            return None if self._seen is None else set(self._seen)

    def list_replica(self) -> list[int]:
        """The replica's committed steps, listed now (remembered for :meth:`seen_there`).

        Given up after :attr:`timeout` seconds (``StoreUnreachableError``), as every
        listing of the uploader: see :func:`list_within`.
        """
        steps = list_within(self.replica, self.timeout)
        with self._cond:
            self._seen = set(steps)
        return steps

    def pending(self) -> list[int]:
        """Steps waiting for (or in) their upload, newest first."""
        with self._cond:
            out = set(self._pending)
            if self._busy is not None:
                out.add(self._busy)
            return sorted(out, reverse=True)

    def deletable(self, doomed: Iterable[int]) -> list[int]:
        """Those of ``doomed`` (local retention's plan) that may go now.

        A step goes when it is safe on the replica; with ``every="latest"`` also when a newer
        step is (which is logged: this step never reached the replica). The others are held
        until they are (or, "latest", a newer one is). Safe means
        the step's manifest is on the replica: with per-rank uploads another rank's uploader
        may have put it, so the replica is listed again before a step is held.
        """
        doomed = list(doomed)
        for s in doomed:
            try:
                manifest = self.local.read_manifest(s)
            except (OSError, CkptStoreError):
                continue  # unreadable here: what the uploader knows decides
            digest = manifest_digest(manifest)
            with self._cond:
                if self._safe_as.get(s, digest) != digest:
                    # Safe as another save of the step: the upload of the one this save
                    # replaced (deleted, saved again) finished after it. This one is not.
                    self.safe.discard(s)
                    del self._safe_as[s]
                known = s in self.safe
            # Fetched from the replica by a restore (or safe by a record of an uploader of
            # these roots): the local marker says this very save is there, verified. This
            # uploader never uploaded it, so it kept the step for the whole job.
            with contextlib.suppress(OSError, CkptStoreError):
                if not known and self._recorded(s, manifest) == "yes":
                    self._set_safe(s, manifest)
        with self._cond:
            unsure = [s for s in doomed if s not in self.safe]
        if unsure and self.rank is not None:
            if threading.current_thread() is self._thread:
                self.refresh(unsure)
            else:
                # Retention after a save runs on the training thread: a replica that
                # accepts connections and does not answer held each save there for ~90 s
                # (botocore's read timeout and attempts). The uploader's thread lists it
                # and lets retention go on once the steps are safe (``on_safe``).
                with self._cond:
                    if not self._stop:
                        self._lookups.update(unsure)
                        self._cond.notify_all()
                if not self._stop:
                    self._start()
        with self._cond:
            newest_safe = max(self.safe, default=None)
            out = []
            for s in doomed:
                if s in self.safe:
                    out.append(s)
                elif self.every == "latest" and newest_safe is not None and newest_safe > s:
                    log.warning(
                        "retention deletes local step %d, which never reached the replica: the "
                        "newer step %d is safe there",
                        s,
                        newest_safe,
                    )
                    out.append(s)
                else:
                    self.holding = True
                    log.info("retention keeps local step %d until it is safe on the replica", s)
            return out

    def refresh(self, steps: Iterable[int] | None = None) -> None:
        """Take ``steps`` (default: every local step) as safe where another uploader put them.

        With per-rank uploads another rank's uploader may commit a step whose part this one
        sent: it is safe once the replica holds that very save (its manifest is the local
        one) and this uploader sent its part of that save, or a record says so. Any other
        copy there is not taken as safe. An unreachable replica changes nothing.
        """
        try:
            remote = set(self.list_replica())
            mine = set(self.local.list_steps() if steps is None else steps)
        except Exception as e:  # botocore's errors are no OSError
            log.debug("could not list the replica %s: %s", self.replica.root, e)
            return
        for s in sorted(mine & remote):
            with self._cond:
                if s in self.safe:
                    continue
            try:
                manifest = self.local.read_manifest(s)
                there = self.replica.read_manifest(s)
            except Exception as e:  # unreadable on either side: not known to be safe
                log.debug("step %d: %s", s, e)
                continue
            if there.to_bytes() != manifest.to_bytes():
                continue
            digest = manifest_digest(manifest)
            if self._part_of.get(s) == digest or self._recorded(s, manifest) == "yes":
                self._set_safe(s, manifest)
                mark_replicated(self.local, s, self.replica, manifest)

    def _recorded(self, step: int, manifest: Manifest) -> str:
        """What the local marker says of this save on this replica: "yes", "legacy", "no".

        "no" for a step :meth:`recover` found lost there: its record is not to be trusted
        (should dropping it have failed) until the step is uploaded again.
        """
        with self._cond:
            if step in self._lost:
                return "no"
        rec = safe_on(self.local, step)
        if rec is None:
            return "no"
        if rec.get(replica_key(self.replica)) == manifest_digest(manifest):
            return "yes"
        if LEGACY in rec:
            recorded = read_replica_url(self.local)
            if recorded is not None and replica_key(recorded) == replica_key(self.replica):
                return "legacy"
        return "no"

    def _set_safe(self, step: int, manifest: Manifest) -> None:
        with self._cond:
            self.safe.add(step)
            self._safe_as[step] = manifest_digest(manifest)
            self._lost.discard(step)

    # ---- work --------------------------------------------------------------------------

    def clean(self) -> None:
        """Clean what a crash left on the replica (see :meth:`recover`).

        Only what nothing was written to for :data:`STALE_UPLOAD_S`: any process may share
        the prefix (the job's other nodes, an evaluation job opening the same replica, a
        ``ckptstore replicate`` sidecar), and what it is uploading is a manifest-less step
        and multipart uploads too. With per-rank uploads (``rank`` set) only pending steps
        older than the newest committed one are removed
        (:func:`ckptstore.tiers.upload_parts.clean`); call it on one rank while no uploader
        of the job runs (the manager: rank 0, in its constructor).
        """
        ages: dict[str, float | None] = {}

        def busy(entry: str) -> bool:
            """Whether ``entry`` got an object within STALE_UPLOAD_S (its uploads stay)."""
            if entry not in ages:
                ages[entry] = self.replica.entry_age(entry) if entry else None
            age = ages[entry]
            return age is not None and age < STALE_UPLOAD_S

        aborted = self.replica.abort_incomplete_uploads(older_than=STALE_UPLOAD_S, keep=busy)
        if self.rank is None:
            # Manifest-less steps, tmp and trash entries; never a replacement cut short
            # (``.old-step-N``: the checkpoint itself where step N is absent, gc's to mend).
            garbage = [
                n
                for n in self.replica.list_garbage()
                if parse_step_dirname(n) is not None or is_garbage_name(n)
            ]
            removed = upload_parts.remove(self.replica, garbage, idle=STALE_UPLOAD_S)
        else:
            removed = upload_parts.clean(self.replica, idle=STALE_UPLOAD_S)
        if aborted or removed:
            log.warning(
                "replica %s: aborted %d incomplete upload(s), removed %s left by an "
                "interrupted upload",
                self.replica.root,
                aborted,
                ", ".join(removed) or "nothing",
            )

    def recover(self, local_steps: Iterable[int] | None = None, *, clean: bool = True) -> list[int]:
        """Clean what a crash left on the replica and queue what it lacks; returns the queue.

        With ``clean``, incomplete multipart uploads under the replica's root are aborted and
        manifest-less steps removed (:meth:`clean`); local steps not recorded safe on this
        replica as this very save are queued, newest first (a step recorded safe that the
        replica no longer has was deleted by its retention, which a newer step there
        shows: not uploaded again). A step recorded safe that is gone with nothing newer
        there was lost (the prefix emptied, the bucket made anew): retention never deletes
        the newest step known safe. Its record is dropped and it is queued again. A queued
        step the replica already holds is checked there, not uploaded again, when it
        verifies.
        """
        if clean:
            self.clean()
        remote = set(self.list_replica())
        newest_there = max(remote, default=-1)
        steps = list(self.local.list_steps() if local_steps is None else local_steps)
        todo = []
        for s in steps:
            try:
                manifest = self.local.read_manifest(s)
            except (OSError, CkptStoreError):
                todo.append(s)  # its upload says what is wrong with it
                continue
            # Safe: recorded as this save on this replica (the replica's retention may have
            # deleted it since). An old marker counts only for a step the replica no longer
            # has; a copy it has is checked by the upload (upload_step), as is any other.
            said = self._recorded(s, manifest)
            if said != "no" and s not in remote and s > newest_there:
                log.warning(
                    "replica %s: step %d is recorded safe there, but the replica no longer "
                    "holds it nor any newer step (its retention keeps the newest one known "
                    "safe: the replica lost it); uploading it again",
                    self.replica.root,
                    s,
                )
                with self._cond:
                    self._lost.add(s)
                forget_replicated(self.local, s, self.replica)
                if not (self.rank is None and self._partial(s)):  # a node's copy: see below
                    todo.append(s)
            elif said == "yes" or (said == "legacy" and s not in remote):
                self._set_safe(s, manifest)
            elif self.rank is None and s not in remote and self._partial(s):
                # A node's partial copy (node-local roots) is uploaded by the job's own
                # uploaders, each rank its part; one process cannot, and queueing it would
                # only turn into an error at close() for a step this process never saved.
                log.info(
                    "replica %s: step %d here holds only some ranks' files; the job's "
                    "uploaders upload it, not this process",
                    self.replica.root,
                    s,
                )
            else:
                todo.append(s)
        with self._cond:
            self._pending.update(todo)
            self._cond.notify_all()
        if steps and not self._url_recorded:
            write_replica_url(self.local, self._url)
            self._url_recorded = True
        if todo:
            self._start()
            log.info("replica %s: %d step(s) to upload: %s", self.replica.root, len(todo), todo)
        return sorted(todo, reverse=True)

    def _partial(self, step: int) -> bool:
        """Whether the local copy of ``step`` holds only some ranks' files (a node's copy)."""
        try:
            return nodes.local_ranks(self.local, step) is not None
        except (OSError, CkptStoreError):
            return True  # a damaged marker: only a node's copy has one

    def submit(self, step: int) -> None:
        """Queue the committed local ``step`` for upload."""
        with self._cond:
            if self._stop:
                raise ClosedError("the uploader is closed")
            known = self._safe_as.get(step)
        if known is not None:
            # Safe as which save? A step saved again (after its copies failed) is another.
            try:
                same = manifest_digest(self.local.read_manifest(step)) == known
            except (OSError, CkptStoreError):
                same = False
            if same:
                return
        with self._cond:
            if known is not None and self._safe_as.get(step) == known:
                self.safe.discard(step)
                del self._safe_as[step]
            self._pending.add(step)
            self._failed.pop(step, None)
            self._down = None  # a new step: the replica is tried again
            self._cond.notify_all()
        # Recorded before the first upload ends: `ckptstore prune` and `rm` hold the steps
        # not yet safe on the replica the root records (a job preempted with its uploads
        # behind left none, and they deleted steps no replica held).
        self._record_url()
        self._start()

    def failed(self, error: BaseException) -> None:
        """Record ``error`` for :meth:`wait` to raise (a failure outside an upload)."""
        with self._cond:
            self._error = error

    def retry(self) -> None:
        """Queue again the steps whose upload failed."""
        with self._cond:
            self._pending.update(self._failed)
            self._failed.clear()
            self._down = None
            self._cond.notify_all()
        self._start()

    def _start(self) -> None:
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="ckptstore-replica", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                while not self._pending and not self._lookups and not self._stop:
                    self._cond.wait()
                lookups, self._lookups = self._lookups, set()
                self._looking = bool(lookups)
            if lookups:
                self._look_up(lookups)
                continue
            if not self._stop and not self.gate.wait_open(_GATE_POLL):
                # A step is chosen only once the gate opens: the steps saved while it was
                # closed (paused, or held by saves) are all queued by then, and the newest
                # goes first. Chosen before, the oldest of them waited at the gate and went
                # first. Looked at again now and then for lookups and a stop.
                continue
            with self._cond:
                if not self._pending:
                    return
                step = max(self._pending)  # newest first: it is the one a restore wants
                self._pending.discard(step)
                # wait() sleeps until the queue drains: a step skipped below changes it too,
                # and without this a wait() that began before the skip never woke up.
                self._cond.notify_all()
                newest_safe = max(self.safe, default=None)
                if self.every == "latest" and newest_safe is not None and step < newest_safe:
                    # Uploads fell behind: a newer step is safe there, this one is skipped.
                    log.info("replica_every='latest': step %d is not uploaded", step)
                    continue
                down = self._down
                if down is not None:  # unreachable a moment ago: fail at once, stay local
                    self._failed[step] = down
                    self._error = self._error or down
                    continue
                self._busy = step
            try:
                self._upload(step)
            except BaseException as e:  # kept for wait(); the step stays safe locally
                if self.gate.stopped:  # close() without waiting, or interrupted
                    log.info("upload of step %d to %s stopped: %s", step, self.replica.root, e)
                else:
                    log.error("upload of step %d to %s failed: %s", step, self.replica.root, e)
                with self._cond:
                    self._failed[step] = e
                    self._error = e
                    if isinstance(e, StoreUnreachableError) or _store_failed(e):
                        # The steps queued behind it fail at once (a new step tries
                        # again): each went through every attempt and the client's own
                        # retries, so close() under a store answering 503 took ~12 s a
                        # queued step, whatever replica_timeout said.
                        self._down = e
            else:
                self._after_success()
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _after_success(self) -> None:
        """The replica answers again: queue the steps the store failed before.

        They were kept locally (retention holds them until they are safe there), and nothing
        tried them again: an outage of a few saves pinned those steps on the local disk for
        the rest of the job (found by review). A step that failed for its own reason (a bad
        local copy) is not tried again.
        """
        with self._cond:
            again = [s for s, e in self._failed.items() if _store_failed(e) or is_unreachable(e)]
            for s in again:
                del self._failed[s]
                self._pending.add(s)
            if again and self._error is not None and self._error not in self._failed.values():
                self._error = None  # its steps are queued again: wait() raises what they do
            if again:
                log.info("the replica answers again: steps %s are queued again", sorted(again))

    def _look_up(self, steps: set[int]) -> None:
        """Look up on this thread whether ``steps``, held by local retention, are safe now.

        Another rank's uploader may have committed them there; retention then goes on
        (``on_safe``).
        """
        try:
            self.refresh(steps)
            with self._cond:
                now = sorted(s for s in steps if s in self.safe)
            if now and self.on_safe is not None:
                try:
                    self.on_safe(now[-1])
                except Exception as e:  # a callback never stops the uploader
                    log.warning("after the replica's listing of steps %s: %s", now, e)
        finally:
            with self._cond:
                self._looking = False
                self._cond.notify_all()

    def _upload(self, step: int) -> None:
        t0 = time.monotonic()
        for attempt in range(_ATTEMPTS):
            try:
                self.upload_step(step)
                return
            except (IntegrityError, ManifestError, ReplicaError):
                raise  # a bad local copy or a stop: trying again changes nothing
            except (OSError, CkptStoreError) as e:
                # An endpoint that does not answer is tried for about half the timeout (a
                # request that cannot connect fails within a third of it: see
                # twotier.bounded_options), so wait()/close() raise within the timeout.
                late = time.monotonic() - t0 > self.timeout / 2
                if attempt == _ATTEMPTS - 1 or self._stop or (is_unreachable(e) and late):
                    raise
                log.warning("upload of step %d failed (%s); trying again", step, e)
                time.sleep(_BACKOFF * 2**attempt)

    def _replica_holds(self, step: int) -> bool:
        """Whether the replica holds ``step`` and it verifies there (deep)."""
        from ..ops.verify import verify_checkpoint  # ops imports the tiers

        try:
            if step not in list_within(self.replica, self.timeout):
                return False
            return verify_checkpoint(self.replica, step, deep=True).ok
        except (OSError, CkptStoreError):
            return False

    def upload_step(self, step: int) -> bool:
        """Upload one committed local step now, in the caller's thread.

        A copy the replica already holds counts only when it is this save (the same
        manifest) and verifies there (a record of this uploader's, or ``verify`` now);
        another save of the step, or a copy that fails, is replaced with the replica's
        commit protocol.

        Returns:
            True when it was uploaded; False when there was nothing to do (this save is on
            the replica and verifies, or the step was deleted locally meanwhile).

        Raises:
            IntegrityError: the local copy does not match its manifest (it stays local).
            OSError: the replica refused it; nothing of it is visible there.
        """
        self.gate.wait()  # not even its first requests while a save runs
        try:
            manifest = self.local.read_manifest(step)
        except (FileNotFoundError, CkptStoreError) as e:
            if step not in self.local.list_steps():
                log.info("step %d was deleted locally before its upload", step)
                return False
            if self._replica_holds(step):
                # A damaged local copy of a step the replica holds whole: nothing to upload
                # (a restore repairs the local copy from it). Raised, it failed the next
                # wait()/close() of a job whose restore had just repaired the step.
                log.warning(
                    "the local copy of step %d is damaged (%s); the replica holds the step, "
                    "so it is not uploaded (a restore repairs the local copy from it)",
                    step,
                    e,
                )
                return False
            raise ReplicaError(f"cannot upload {self.local.describe(step)}: {e}") from e
        if self.rank is not None and upload_parts.is_per_rank(manifest):
            return self._upload_parts(step, manifest)
        present = nodes.local_ranks(self.local, step)
        if present is not None:
            # A node's partial copy is uploaded only by the job's uploaders, rank by rank,
            # each rank's files checked on the way and the manifest put after all: this very
            # save there is safe on their checks (no download of every node's files here).
            if upload_parts.committed(self.replica, step, manifest):
                self._safe(step, manifest)
                return False
            raise ReplicaError(
                f"{self.local.describe(step)} holds only rank(s) {present}'s files (node-local "
                "roots): it is uploaded by the job's own uploaders, each rank its part "
                "(CheckpointManager(..., replica=...)), not by one process"
            )
        if self.rank not in (None, 0):
            return False  # a step rank 0 wrote alone: rank 0 uploads it
        replace = self._held_there(step, manifest)
        if replace is None:
            return False
        t0 = time.perf_counter()
        try:
            copy_files(
                self.local,
                self.replica,
                step,
                manifest,
                replace=replace,
                threads=self.threads,
                read_back=self.read_back,
                gate=self.gate,
                lowest=True,
            )
        except StepExistsError:
            # Committed by another uploader meanwhile: safe only if it is this save, verified.
            if self._held_there(step, manifest) is None:
                return False
            raise
        except (FileNotFoundError, IntegrityError):
            if step not in self.local.list_steps():
                log.info("step %d was deleted locally during its upload", step)
                return False
            raise
        nbytes = manifest.total_bytes
        self.uploaded_bytes += nbytes
        self.uploaded.append(step)
        dt = time.perf_counter() - t0
        log.info(
            "uploaded step %d to %s: %d bytes in %.2fs (%.1f MB/s)",
            step,
            self.replica.root,
            nbytes,
            dt,
            nbytes / max(dt, 1e-9) / 1e6,
        )
        self._safe(step, manifest)
        return True

    def _held_there(self, step: int, manifest: Manifest) -> bool | None:
        """Whether the replica holds ``step``, and as what: what the upload must do.

        Returns:
            None: it holds this save and it verifies (recorded, or checked now): it is
            safe, nothing to upload. False: it holds no ``step``: upload. True: it holds
            another save of it, or this one corrupt: upload, replacing that copy.
        """
        if step not in list_within(self.replica, self.timeout):
            return False
        try:
            there = self.replica.read_manifest(step)
        except ManifestError as e:
            log.warning("replica %s: %s; uploading step %d again", self.replica.root, e, step)
            return True
        if there.to_bytes() != manifest.to_bytes():
            log.warning(
                "replica %s holds another save of step %d (created %s; the local one %s): "
                "replacing it with the local save",
                self.replica.root,
                step,
                there.created or "?",
                manifest.created or "?",
            )
            return True
        if self._recorded(step, manifest) == "yes":
            self._safe(step, manifest)
            return None
        # This save, put by another uploader (or recorded by an old marker): what ``verify``
        # says of the replica's copy is what "safe" rests on.
        from ..ops.verify import verify_checkpoint

        self.gate.wait()
        report = verify_checkpoint(self.replica, step, deep=True)
        if report.ok:
            self._safe(step, manifest)
            return None
        log.warning(
            "replica %s: its copy of step %d does not verify (%s); uploading it again",
            self.replica.root,
            step,
            "; ".join(report.problems[:3]),
        )
        return True

    def ranks_of(self, manifest: Manifest) -> list[int]:
        """The ranks whose files of the sharded step of ``manifest`` this uploader sends.

        Its own rank's; and where the step was saved by more ranks than the job now has (a
        job resumed on fewer ranks), those of ``rank + world``, ``rank + 2 * world``...: no
        other uploader would send them, and the step would never be committed there (nor
        ever be deleted locally, as it would never be safe).
        """
        assert self.rank is not None
        world = self.world if self.world else manifest.world_size
        return list(range(self.rank, manifest.world_size, world)) or [self.rank]

    def _part_there(self, step: int, manifest: Manifest, rank: int) -> bool:
        """Whether the replica holds this save of ``step`` with this rank's files intact.

        Raises:
            ReplicaError: it holds this save, but a file of this rank's does not verify
                there (rank by rank, a committed step is not uploaded again in part).
        """
        if step not in list_within(self.replica, self.timeout):
            return False
        try:
            there = self.replica.read_manifest(step)
        except ManifestError:
            return False  # upload_part takes it for another save and replaces it
        if there.to_bytes() != manifest.to_bytes():
            return False
        if self._recorded(step, manifest) == "yes" or self._part_of.get(step) == (
            manifest_digest(manifest)
        ):
            return True
        for name, entry in upload_parts.files_of(manifest, rank).items():
            try:
                self.replica.stream_file(step, name, entry)
            except IntegrityError as e:
                raise ReplicaError(
                    f"the replica's copy of {self.replica.describe(step)} does not verify: {e}; "
                    "delete it there (`ckptstore rm`) so that the job's uploaders upload it "
                    "again"
                ) from e
        return True

    def _upload_parts(self, step: int, manifest: Manifest) -> bool:
        """Upload the parts of :meth:`ranks_of` of a sharded step, and commit it once in all.

        The manifest goes there once every rank's part is in, by this uploader or another's.
        Returns whether any part was uploaded (False: this save is there already, each part
        of ours verifying, or the step was deleted locally meanwhile).
        """
        sent: list[str] = []
        committed = False
        for rank in self.ranks_of(manifest):
            if self._part_there(step, manifest, rank):
                committed = True  # this very save is committed there
                continue
            done = self._upload_part(step, manifest, rank, sent)
            if done is None:
                return False
            committed = done
        if sent:
            self.parts[step] = sorted(sent)
            self._part_of[step] = manifest_digest(manifest)
        if committed:
            if sent:
                self.uploaded.append(step)
            self._safe(step, manifest)
        return bool(sent)

    def _upload_part(
        self, step: int, manifest: Manifest, rank: int, sent: list[str]
    ) -> bool | None:
        """Upload ``rank``'s files of a sharded step (their names go into ``sent``).

        Returns whether the step is now committed there, or None where it was deleted
        locally during the upload.
        """
        copy = functools.partial(
            copy_files, threads=self.threads, read_back=self.read_back, gate=self.gate, lowest=True
        )
        mine = upload_parts.files_of(manifest, rank)
        t0 = time.perf_counter()
        try:
            committed = upload_parts.upload_part(
                self.local, self.replica, step, manifest, rank=rank, copy=copy
            )
        except (FileNotFoundError, IntegrityError):
            if step not in self.local.list_steps():
                log.info("step %d was deleted locally during its upload", step)
                return None
            raise
        nbytes = sum(e.bytes for e in mine.values())
        self.uploaded_bytes += nbytes
        sent += mine
        # A node whose ranks never put a manifest (another node's uploader did) still
        # records where its steps go.
        self._record_url()
        log.info(
            "uploaded rank %d's part of step %d to %s: %d bytes in %.2fs",
            rank,
            step,
            self.replica.root,
            nbytes,
            time.perf_counter() - t0,
        )
        return committed

    def _record_url(self) -> None:
        """Record the replica's URL in the local root once (``ckptstore ls`` shows tiers)."""
        if not self._url_recorded:
            write_replica_url(self.local, self._url)
            self._url_recorded = True

    def _safe(self, step: int, manifest: Manifest) -> None:
        self._set_safe(step, manifest)
        with self._cond:
            if self._seen is not None:
                self._seen.add(step)
        # The local marker, the replica's retention and the callback (local retention)
        # write and delete: they wait while a save runs (a stopping uploader goes on).
        with contextlib.suppress(ReplicaError):
            self.gate.wait()
        self._record_url()
        mark_replicated(self.local, step, self.replica, manifest)
        if self.retention:
            try:
                self.prune_replica(just=step, known={step: manifest})
            except (OSError, CkptStoreError, ValueError) as e:
                log.warning("replica retention after step %d failed: %s", step, e)
        if self.on_safe is not None:
            try:
                self.on_safe(step)
            except Exception as e:  # a callback never stops the uploader
                log.warning("after the upload of step %d: %s", step, e)

    def prune_replica(
        self, *, just: int | None = None, known: Mapping[int, Manifest] | None = None
    ) -> list[int]:
        """Apply the replica's retention policy; returns the deleted steps.

        Never deletes the newest step, a pinned one, or the newest of the steps known safe
        there (``just``, the step just uploaded and verified, or a newer one). An older step
        uploaded after newer ones (uploads go newest first) is pruned as the policy says:
        kept because it was just uploaded, the replica held more than ``replica_keep``
        (found by review).
        """
        if self.policy is None:
            return []
        steps = self.list_replica()
        metrics: dict[int, Mapping[str, float]] = {}
        if self.policy.needs_metrics:
            for s, m in self.replica.read_manifests(steps).items():
                metrics[s] = {} if isinstance(m, ManifestError) else m.metrics
        for s, m in (known or {}).items():
            metrics[s] = m.metrics
        infos = [CheckpointInfo(s, metrics.get(s, {})) for s in steps]
        with self._cond:
            good = max((s for s in steps if s in self.safe), default=just)
        if just is not None and (good is None or just > good):
            good = just
        doomed = plan_deletions(infos, self.policy, last_good=good)
        deleted = []
        for s in doomed:
            if self.replica.is_pinned(s):
                continue
            try:
                if not self.replica.delete(s, spare_pinned=True):
                    continue  # pinned meanwhile
            except FileNotFoundError:
                pass
            deleted.append(s)
        with self._cond:
            if self._seen is not None:
                self._seen.difference_update(deleted)
        if deleted:
            log.info("replica retention deleted steps %s from %s", deleted, self.replica.root)
        return deleted

    # ---- waiting ---------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued upload has finished; raise the first failure since.

        Raises:
            ReplicaError: an upload failed (its step is still in the local store), or the
                uploads are paused (:meth:`pause`) with steps still to upload.
            TimeoutError: ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._busy is not None or self._lookups or self._looking) and (
                self._thread is not None and self._thread.is_alive()
            ):
                if self.gate.paused and (self._pending or self._busy is not None):
                    # Paused uploads never finish: this wait would never return.
                    raise ReplicaError(
                        f"uploads to {self.replica.root} are paused (replica.pause()): steps "
                        f"{self.pending()} wait for replica.resume(); nothing was lost, and "
                        "close() resumes them before it waits"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ReplicaTimeoutError(
                        f"uploads to {self.replica.root} still running after {timeout}s: "
                        f"steps {self.pending()}"
                    )
                self._cond.wait(left)
            err, self._error = self._error, None
        if err is not None:
            if isinstance(err, ReplicaError):
                raise err
            if is_unreachable(err):
                with self._cond:
                    held = sorted(self._failed)
                raise ReplicaUnavailableError(
                    f"the replica {self._url} cannot be reached: {err}; steps {held} were not "
                    f"uploaded and stay in the local store {self.local.root} (retention keeps "
                    "them), and the next manager (or `ckptstore replicate`) uploads them"
                ) from err
            raise ReplicaError(
                f"uploading to the replica {self.replica.root} failed: {err}; the steps stay in "
                f"the local store {self.local.root}, and the next manager (or `ckptstore "
                "replicate`) uploads them"
            ) from err

    def close(self, *, wait: bool = True) -> None:
        """Stop the thread, first finishing the queued uploads unless ``wait`` is False.

        Without ``wait`` the upload in flight is abandoned (nothing of it is visible on the
        replica; the next uploader on these roots does it again): its copy threads stop
        before their next slice and its S3 requests are cancelled. An interrupt while this
        waits (Ctrl-C: any exception but an upload's failure) takes that path too, so it
        stops at once instead of after every queued upload (found by review). No step is
        recorded safe that was not uploaded whole and checked. The thread is waited for at
        most :data:`STOP_JOIN` seconds after the stop (a request the client cannot cancel,
        a listing, waits on its timeouts; the thread is a daemon and goes on alone).
        """
        stopped_before = self._stop  # a second close(): the first waited for the thread
        try:
            if wait and not stopped_before:
                self.resume()  # a paused uploader would never finish
                try:
                    self.wait()
                except ReplicaError:
                    raise  # an upload failed: the queue was drained all the same
                except BaseException:
                    wait = False  # interrupted (Ctrl-C): drop what is left, see below
                    raise
        finally:
            with self._cond:
                self._stop = True
                self.gate.stop()
                if not wait and not stopped_before:
                    left = set(self._pending)
                    if self._busy is not None:
                        left.add(self._busy)
                    if left:
                        log.warning(
                            "the uploader to %s was closed without waiting: steps %s were not "
                            "uploaded (they stay in the local store %s; the next manager, or "
                            "`ckptstore replicate`, uploads them)",
                            self.replica.root,
                            sorted(left, reverse=True),
                            self.local.root,
                        )
                    self._pending.clear()
                    self._lookups.clear()
                self._cond.notify_all()
            t = self._thread
            if t is not None and t is not threading.current_thread() and not stopped_before:
                t.join(STOP_JOIN)
                if t.is_alive():
                    log.warning(
                        "the uploader to %s did not stop within %gs (a request to the replica "
                        "waits on its timeouts); it is left to end on its own",
                        self.replica.root,
                        STOP_JOIN,
                    )


def list_within(replica: Storage, timeout: float | None) -> list[int]:
    """``replica.list_steps()``, given up after ``timeout`` seconds (None: no bound).

    The listing runs on a daemon thread of its own, as the manager's probe does
    (``twotier.probe_replica``): an endpoint that accepts a connection and never answers
    held one listing for the client's read timeouts and attempts (6 connections, 35 s at a
    5 s read timeout), so a resume whose steps were all local took 3 minutes and close()
    93 s with ``replica_timeout=10`` (found by review). A listing given up goes on alone
    until the client gives up too.

    Raises:
        StoreUnreachableError: no answer within ``timeout`` seconds.
        Exception: what the listing raised.
    """
    if timeout is None:
        return replica.list_steps()
    box: list[tuple[bool, Any]] = []

    def look() -> None:
        try:
            box.append((True, replica.list_steps()))
        except BaseException as e:  # handed to the caller's thread
            box.append((False, e))

    t = threading.Thread(target=look, name="ckptstore-replica-list", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise StoreUnreachableError(
            f"{replica.root}: no answer within {timeout:g}s (replica_timeout); check the "
            "endpoint_url storage option, the network, and that the service is up"
        )
    ok, value = box[0]
    if not ok:
        raise value
    return list(value)


def _store_failed(e: BaseException) -> bool:
    """Whether an upload's error is the replica's, not a bad local copy or a stop.

    A request the store failed after the client's retries (a 5xx: s3fs raises a plain
    ``OSError``).
    """
    return (
        isinstance(e, OSError)
        and not isinstance(e, FileNotFoundError | CkptStoreError)
        and not isinstance(e, ReplicaError)
    )

"""CheckpointManager: the facade of the store, its two pipelines and its operations.

The public methods check their arguments and hand the work to a pipeline: a save to
:class:`~ckptstore.save.pipeline.Saver` (admit -> encode -> plan -> stage -> write ->
commit -> after-commit, one module each under ``save/``), a restore to
:class:`~ckptstore.restore.reader.Reader` (select -> plan -> read + check -> load, under
``restore/``), retention, deletion and gc to :mod:`ckptstore.save.after_commit`. What the
manager knows of its store (the lock, the known good and bad steps, the retention
planner) is the :class:`~ckptstore.session.Session` both pipelines share.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import threading
from collections.abc import Iterable, Mapping, MutableMapping
from types import EllipsisType
from typing import Any

import torch

from ._log import logger as log
from .codec.strictjson import deeper_than
from .dist import Coordinator
from .errors import ConfigError, ConfigTypeError, ManifestError, NoCheckpointError
from .integrity import VerifyReport
from .manifest import MAX_MANIFEST_DEPTH, Manifest
from .ops.verify import verify_unless_deleted
from .restore.reader import Reader
from .retention import RetentionPolicy, as_policy
from .save import after_commit
from .save.jobs import SaveOptions
from .save.pipeline import Saver
from .save.staging import SaveHandle
from .session import Session
from .storage import Storage, open_storage, wait_for_deletions
from .storage.base import step_gone
from .tiers import nodes
from .tiers import twotier as tiers
from .tiers.replica import Replicator

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """An atomic, verified checkpoint store for one training run.

    Args:
        root: a local directory, or any fsspec URL (``s3://bucket/run1``, ``memory://x``).
        keep: retention: an int (``KeepLast(n)``), a policy, a list of policies (their
            union), or ``None`` to keep everything.
        format: ``"safetensors"`` (default) or ``"torch"`` (``torch.save`` zip payloads).
        compression: ``None`` or ``"zstd"``.
        async_save: return from ``save`` after one memory copy; write in the background.
        barrier_timeout: seconds for every distributed wait ckptstore makes; it must cover
            the longest save, since other ranks wait while rank 0 writes.
        storage_options: passed to fsspec for URLs.
        allow_pickle: store (and load) objects other than tensors and plain data via
            pickle. Off by default: a pickle can run code when loaded.
        distributed: take part in torch.distributed when it is initialized (constructing
            the manager, ``save`` and ``restore`` are then collective). ``False``: act as a
            single process even under torch.distributed, starting no collective; for code
            that runs on one rank only (a Lightning ``CheckpointIO`` saves on rank 0 alone).
        create: ``False``: ``root`` must already be a store (a directory holding checkpoints
            or ckptstore's own files); anything else (missing, empty, a file, a directory of
            other things) raises ``NoCheckpointError`` ("no store at ROOT: ...") before
            anything is created. For tools that inspect or clean existing stores
            (``ckptstore ls``, ``gc``, ``prune``, ``rm``, ``pin``).
        replica: a second tier: any fsspec URL (``s3://bucket/run1``). ``save`` commits to
            ``root`` as without it; each committed step is then uploaded in the background
            (payloads, then the manifest; every file checked on its way up: by the server
            where it checks the bytes it receives, as S3 does, else read back). Local
            retention keeps a step until it is safe there (with
            ``replica_every="latest"``: until it or a newer one is); ``resume``/``restore``
            take the newest step that verifies in either tier (a replica step is fetched
            into ``root`` first); ``wait``/``close`` wait for the uploads.
        replica_keep: the replica's retention, as ``keep`` (default: the same as ``keep``).
        replica_options: fsspec storage options for ``replica``. Under torch.distributed
            every rank uploads its own files of sharded steps; the replica's manifest is put
            by the uploader that finds every rank's part there (``upload_parts``).
        replica_every: ``"all"`` (default): every step is uploaded, and local retention
            keeps a step until it is safe on the replica itself (so the replica holds what
            ``replica_keep`` promises, and a replica that fails keeps every later step
            local). ``"latest"``: when uploads fall behind only the newest step is uploaded,
            and a local step may be deleted once a newer one is safe there (logged).
        replica_timeout: seconds (default 60) the constructor waits for the replica to
            answer (once its client is made: an S3 client's start-up is not counted), and
            about the longest ``wait``/``close`` keep trying one that cannot be reached
            before ``ReplicaUnavailableError`` (on S3 it also bounds botocore's connect
            timeout and attempts unless ``replica_options`` set them).

    Under torch.distributed each rank may pass its own local ``root`` (a disk per node):
    the constructor finds which ranks share a store (a probe, see ``nodes.peers``), and
    sharded saves then commit a copy per node.

    A root that is a checkpoint directory (``.../step-000000000100``) or a regular file is
    refused whatever ``create`` says, naming the store it probably meant; a local directory
    that holds other things and no store is used with a warning (the store is made beside
    them). ``gc()`` and ``prune()`` create nothing (not even the writer lock) in a directory
    that holds no store.

    Raises:
        ValueError: an argument is invalid; the message names it.
        NoCheckpointError: ``root`` is a checkpoint or a file, or (``create=False``) no store.
        ReplicaUnavailableError: the replica cannot be reached, or its bucket does not
            exist (nothing was saved); the message names the URL and what to check.
        ReplicaConfigError: the replica is the local store itself, under another name.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep: int | RetentionPolicy | Iterable[RetentionPolicy] | None = None,
        *,
        format: str = "safetensors",
        compression: str | None = None,
        async_save: bool = False,
        barrier_timeout: float = 600.0,
        storage_options: Mapping[str, Any] | None = None,
        allow_pickle: bool = False,
        distributed: bool = True,
        create: bool = True,
        replica: str | None = None,
        replica_keep: int | RetentionPolicy | Iterable[RetentionPolicy] | EllipsisType | None = ...,
        replica_options: Mapping[str, Any] | None = None,
        replica_every: str = "all",
        replica_timeout: float = tiers.DEFAULT_REPLICA_TIMEOUT,
    ) -> None:
        _check_choice("format", format, ("safetensors", "torch"), "'safetensors' or 'torch'")
        _check_choice("compression", compression, (None, "zstd"), "None or 'zstd'")
        _check_seconds("barrier_timeout", barrier_timeout)
        _check_choice("replica_every", replica_every, tiers.REPLICA_EVERY, "'all' or 'latest'")
        _check_seconds("replica_timeout", replica_timeout)
        self.policy = as_policy(keep)
        self.format = format
        self.compression = compression
        self.async_save = bool(async_save)
        self.barrier_timeout = float(barrier_timeout)
        self.allow_pickle = bool(allow_pickle)
        self.storage: Storage = open_storage(root, storage_options)
        self.root = self.storage.root
        # Before the group is made: a wrong root fails here, on every rank alike (they see
        # the same path), instead of after a collective.
        self.storage.check_root(create=bool(create))
        self.coord = Coordinator(self.barrier_timeout, enabled=bool(distributed))
        # The ranks sharing this rank's store (a probe, collective): the lowest writes it.
        peers, links = nodes.peers(self.storage, self.coord)
        leader = self.coord.rank == min(peers)
        self._session = Session(
            storage=self.storage,
            coord=self.coord,
            policy=self.policy,
            peers=peers,
            split=len(peers) < self.coord.world_size,
            links=links,
            lock=self.storage.writer_lock() if leader else None,
        )
        self._saver = Saver(
            self._session,
            SaveOptions(
                fmt=self.format,
                compression=self.compression,
                async_save=self.async_save,
                allow_pickle=self.allow_pickle,
                barrier_timeout=self.barrier_timeout,
            ),
        )
        self._reader = Reader(
            self._session, allow_pickle=self.allow_pickle, raise_bg_error=self._saver.raise_bg_error
        )
        # Read by tests and tools: the node-local topology, the lock, the staging buffers.
        self._peers, self._split = peers, self._session.split
        self._lock, self._staging = self._session.lock, self._saver.staging
        self._one_save = threading.Lock()
        #: The replica tier (``replica=``): its uploader on the rank that uploads, else None.
        self.replica: Replicator | None = None
        self.replica_storage: Storage | None = None
        if replica is not None:
            keep_there = self.policy if replica_keep is ... else as_policy(replica_keep)
            self.replica_storage, self.replica = tiers.open_replica(
                self.storage,
                replica,
                replica_options,
                keep_there,
                rank=self.coord.rank if self.coord.enabled else None,
                world=self.coord.world_size if self.coord.enabled else None,
                barrier=functools.partial(self.coord.barrier, "init:replica"),
                every=replica_every,
                timeout=float(replica_timeout),
                agree=self._agree_on_replica if self.coord.enabled else None,
            )
            self._session.replica = self.replica
            self._session.replica_storage = self.replica_storage
            if self.replica is not None:
                self.replica.on_safe = functools.partial(after_commit.replica_safe, self._session)

    # ---- what the pipelines keep, as the manager's attributes ---------------------------

    @property
    def last_save_phases(self) -> dict[str, float]:
        """Seconds per phase of the last synchronous save on this rank (see ``phases``)."""
        return self._saver.last_save_phases

    @property
    def last_save_cpu(self) -> dict[str, float]:
        """CPU seconds of this process per phase of that save."""
        return self._saver.last_save_cpu

    @property
    def last_restore_phases(self) -> dict[str, float]:
        """Seconds per phase of the last ``restore`` (or ``resume``) that returned on this rank.

        ``x:enter``, ``x:choose``, then (summed over the steps tried) ``x:kind`` (node-local
        roots), ``fetch`` (from the replica, or rank 0's broadcast), ``state``, ``check``,
        ``x:check``, ``plan`` and ``read`` (DTensor leaves), ``decode``, ``failed`` (a step's
        work up to its failure), ``x:load``, ``x:replica``, ``x:vanished``, ``x:rechoose``,
        ``apply``, ``x:applied``; a resume's begin with its ``x:resume`` and ``x:list`` (alone
        on an empty store). An ``x:`` phase waits in an exchange with the other ranks.
        """
        return self._reader.last_restore_phases

    @property
    def last_restore_cpu(self) -> dict[str, float]:
        """CPU seconds of this process per phase of that restore."""
        return self._reader.last_restore_cpu

    @property
    def last_blocked_s(self) -> float:
        """Seconds the last ``save`` call blocked its caller."""
        return self._saver.last_blocked_s

    @property
    def _save_plan(self) -> tuple[Any, Any, Any, Any, Any] | None:
        return self._saver.plan_cache.entry

    @_save_plan.setter
    def _save_plan(self, value: tuple[Any, Any, Any, Any, Any] | None) -> None:
        self._saver.plan_cache.entry = value

    # ---- small queries ----------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (by number, never as text)."""
        return self._session.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` for an empty store."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest).

        Raises:
            NoCheckpointError: no such committed step, or it was deleted while it was read
                (without ``step``, the newest is then chosen again).
            ManifestError: the manifest is unreadable or hostile.
        """
        attempt = 0
        while True:
            s = self._session.resolve(step)
            try:
                return self.storage.read_manifest(s)
            except ManifestError:
                # Deleted while it was read (a running job's retention): not unreadable.
                if not step_gone(self.storage, s):
                    raise
                if step is not None or attempt == 2:
                    raise NoCheckpointError(
                        f"{self.storage.describe(s)} was deleted while its manifest was read "
                        "(a running job's retention, `ckptstore prune` or `rm`); it was not "
                        "corrupt"
                    ) from None
            attempt += 1

    # ---- save ------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[Any, Any],
        *,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        sharded: bool = False,
        allow_older: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as checkpoint ``step``; collective under torch.distributed.

        Replicated (default): rank 0 serializes and commits, then tells every rank the
        outcome, so all return or all raise the same error. Sharded: every rank writes its
        own files into the shared tmp directory; rank 0 gathers their file tables (or
        errors), writes the manifest and commits; a failure anywhere aborts the whole
        checkpoint. On node-local roots (each node its own ``root``, found by the
        constructor) every rank writes into its own store's tmp directory and every node
        commits a copy holding its ranks' files, rank 0's plain files and the full manifest
        (see ``nodes``); a replicated save is committed on rank 0's node only. With
        ``async_save`` the call returns after one memory copy (sharded saves always complete
        before returning).

        Args:
            step: the training step (an int >= 0); each step is saved at most once.
            state: names -> modules, optimizers, schedulers, EMA, RNGState, plain data.
            metrics: numbers kept in the manifest (``KeepBest`` ranks by them).
            metadata: free JSON-serializable data kept in the manifest.
            sharded: every rank writes its own files (FSDP/ZeRO); else rank 0 writes.
            allow_older: save a step older than the newest committed one (which is refused
                otherwise: training that restarted without ``resume()`` would have its
                checkpoints deleted by retention or passed over by the next resume).

        Returns:
            A :class:`SaveHandle`; for a synchronous save it is already done.

        Raises:
            ValueError: ``metrics`` lack the metric of a ``KeepBest`` policy (unless it says
                ``missing="keep"``), or ``step`` is older than the newest committed step that
                is not known to be corrupt (unless ``allow_older``); rank 0 decides, every
                rank raises it, and nothing was written.
            StepExistsError: ``step`` is already committed.
            UnsafeCheckpointError: ``state`` holds an object that needs pickle.
            CommitError: writing failed (disk full, permissions, ...); nothing is visible
                and the previous checkpoint is intact.
            StoreLockedError: another process writes this store.
            BarrierTimeout: a rank did not join the save in time.
        """
        self._session.check_open()
        refused: ConfigError | ConfigTypeError | None = None
        try:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                msg = f"step must be an int >= 0, got {step!r}"
                raise ConfigError(msg)
            if not isinstance(state, Mapping):
                msg = f"state must be a mapping of names to objects, got {type(state).__name__}"
                raise ConfigTypeError(msg)
            metrics_d = _check_metrics(metrics)
            metadata_d = _check_metadata(metadata)
        except (ConfigError, ConfigTypeError) as e:
            if self._session.coord.world_size == 1:
                raise
            # Raised here alone, this rank skipped the save's first exchange, and every
            # later call of the job met another rank's next one (a loss gone NaN on one
            # rank): it goes to 'save:enter' instead, which raises it on every rank.
            refused, metrics_d, metadata_d = e, {}, {}
            if not isinstance(step, int) or isinstance(step, bool):
                step = -1
            state = {}
        # One save at a time: two threads' saves staged into the one staging pool while
        # the writer still read it, and committed steps holding each other's tensors
        # under matching checksums (found by review). A second thread's save waits here.
        with self._one_save:
            self.wait_save()  # at most one save in flight
            # The save's writes go before the uploads of earlier steps (which wait at their
            # next slice of bytes); an async save keeps them waiting until it commits.
            with self.replica.held() if self.replica is not None else contextlib.nullcontext():
                return self._saver.save(
                    step, state, metrics_d, metadata_d, sharded, allow_older, refused=refused
                )

    def restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        broadcast: bool = False,
        in_place: bool | None = None,
    ) -> int:
        """Load a checkpoint into ``state`` in place; collective under torch.distributed.

        Rank 0 picks the step (the newest that verifies, or exactly ``step``) and every rank
        loads that one: each reads the files itself (shared storage), or with
        ``broadcast=True`` rank 0 reads them and sends them to the others (node-local
        disks). Every byte is checked against its checksum before it reaches ``state``; a
        checkpoint that fails on any rank is skipped by all (when ``step`` is None), while
        one deleted as it was read (a running job's retention) is not taken for corrupt: the
        newest is chosen again. Tensors go to CPU, then into each target's own device.

        By default payloads stream straight into the tensors of the modules, optimizers and
        EMA in ``state`` (where dtype, shape and layout match), each 4 MiB block checked
        before its bytes are copied: no second copy of the state in memory. Names, shapes
        and dtypes are checked before anything is read. The price: a block that fails is
        found after the blocks before it were copied. The fallback to an older checkpoint
        then overwrites every tensor the failed one wrote (if it holds no value for one of
        them, ``IntegrityError`` says which); when no checkpoint verifies, the
        ``NoCheckpointError`` leaves those tensors holding a mix of verified bytes of the
        steps tried and their previous values (see the README, "What a failed restore
        leaves").

        ``in_place=False`` keeps every target unchanged until the whole step has been read
        and checked (a full second copy of the state in memory); ``in_place=True`` also
        streams straight into the targets from old checkpoints whose manifests have no block
        CRCs (checked when each file's last byte is in).

        Returns:
            The restored step.

        Raises:
            NoCheckpointError: the store is empty, or nothing verifies.
            IntegrityError: the requested ``step`` is corrupt.
            StateMismatchError: the checkpoint does not fit the objects in ``state``; nothing
                in ``state`` changed.
            CommitError: the previous async save failed (raised on every rank).
            BarrierTimeout: a rank did not join in time.
        """
        self._session.check_open()
        self.wait_save()
        return self._reader.restore(
            state, step, strict=strict, broadcast=broadcast, in_place=in_place
        )

    def resume(
        self,
        state: MutableMapping[Any, Any],
        *,
        strict: bool = True,
        broadcast: bool = False,
        in_place: bool | None = None,
    ) -> int:
        """Restore the newest good checkpoint if there is one (collective).

        Returns:
            0 on an empty store, else the restored step + 1 (the next step to run).

        Raises:
            CommitError: the previous async save failed (raised on every rank).
            StateMismatchError, BarrierTimeout: as :meth:`restore`.
        """
        self._session.check_open()
        self.wait_save()
        return self._reader.resume(state, strict=strict, broadcast=broadcast, in_place=in_place)

    def load(
        self,
        step: int | None = None,
        *,
        rank: int | None = None,
        keys: Iterable[Any] | None = None,
    ) -> dict[Any, Any]:
        """The stored state as plain data (modules as state dicts, tensors on CPU).

        Not collective. Without ``step``, the newest checkpoint that verifies (chosen again
        if the one being read is deleted meanwhile). ``rank`` picks the shard of a sharded
        checkpoint (default: this process's rank).

        ``keys`` asks for some top-level entries only (``keys=["model"]`` for evaluation):
        only the files they need are read, and of a file that also holds tensors of other
        entries only the byte ranges of theirs, each range checked against the manifest's
        per-block CRCs before it is used (locally, and as ranged GETs on object stores).
        A step is then judged by what was read: a corrupt file of an entry not asked for
        goes unnoticed (``verify`` checks everything).

        Raises:
            NoCheckpointError: nothing committed (or nothing that verifies).
            IntegrityError: the requested ``step`` is corrupt.
            StateMismatchError: an entry of ``keys`` is not in the checkpoint.
            TypeError: ``keys`` is a string (one entry is ``keys=["model"]``).
        """
        if isinstance(keys, str | bytes):
            msg = f"keys= takes a list of top-level entries, e.g. keys=[{keys!r}], not a string"
            raise ConfigTypeError(msg)
        return self._reader.load(step, rank, None if keys is None else list(keys))

    def _agree_on_replica(self, error: BaseException | None) -> BaseException | None:
        """Collective: the first rank's error probing the replica, the same on every rank."""
        return self.coord.reduce(error, _first_error, "init:replica-probe")  # type: ignore[no-any-return]

    # ---- waits, checks, retention, deletion -------------------------------------------

    def wait_save(self) -> None:
        """Wait for the in-flight async save, if any (its error is raised by :meth:`wait`)."""
        self._saver.wait_save()

    def wait(self) -> None:
        """Wait for the in-flight save, uploads and deletions; raise a background error.

        Raises:
            CommitError: the last async save failed.
            ReplicaError: an upload failed (the step stays in the local store), or uploads
                are paused (``replica.pause()``) with steps still to upload.
        """
        self.wait_save()
        if self.replica is not None:
            self.replica.wait()
        wait_for_deletions()
        self._saver.raise_bg_error()

    def verify(self, step: int | None = None, *, deep: bool = True) -> VerifyReport:
        """Check a checkpoint (default: the newest committed one).

        ``deep`` computes every file's checksum and every zip member's CRC; otherwise the
        manifest, presence, sizes and headers are checked. A step deleted while it is
        checked (a running job's retention) comes back with ``deleted`` set and no problem;
        without ``step``, the newest step is then chosen again.
        """
        for _ in range(3):
            s = self._session.resolve(step)
            # A step retention deleted while it was read is ``deleted``, not failed: it was
            # reported FAILED and recorded known bad (found by review). The newest is
            # chosen again, as the CLI does.
            report = verify_unless_deleted(self.storage, s, deep)
            if not report.deleted or step is not None:
                break
        if deep and not report.deleted:  # a quick check passes a flipped byte
            self._session.verified(s, report.ok)
        return report

    def pin(self, step: int) -> None:
        """Protect ``step`` from retention (a ``pinned`` marker in its directory).

        Raises:
            CommitError: the marker could not be written (read-only store, disk full).
        """
        after_commit.set_pinned(self._session, step, True)

    def unpin(self, step: int) -> None:
        """Let retention delete ``step`` again."""
        after_commit.set_pinned(self._session, step, False)

    def plan_prune(self) -> list[int]:
        """The steps :meth:`prune` would delete now.

        On node-local roots (a disk per node) it is collective, as :meth:`prune`.

        Raises:
            ValueError: no committed step has the metric of a ``KeepBest`` policy (a typo
                would otherwise make retention delete the best checkpoints); nothing is
                deleted. The message lists the metrics the store has.
        """
        return after_commit.plan_prune(self._session, agree=True)

    def prune(self) -> list[int]:
        """Apply the retention policy now; returns the deleted steps.

        Deletion renames a checkpoint away atomically and frees its space in the
        background. Never deletes the newest, a pinned one, or the newest that verifies.
        In a directory without checkpoints it does nothing and creates nothing.

        On node-local roots (a disk per node) it is collective: call it on every rank. A
        step counts as verifying only if it verifies on every node (each holds a part of
        it); the nodes agree on that in one exchange, delete the same steps, and every rank
        returns them. Otherwise only the rank that writes the store (the lowest of those
        sharing it) deletes anything; on the others it returns ``[]``.

        Raises:
            StoreLockedError: another process writes the store.
            ValueError: as :meth:`plan_prune`.
            CommitError: a checkpoint could not be deleted.
            BarrierTimeout: node-local roots: a rank did not call it (named).
        """
        return after_commit.prune(self._session, agree=True)

    def delete(self, step: int, *, force: bool = False) -> None:
        """Delete one committed checkpoint now, atomically (as retention does).

        Locally it is renamed to ``.trash-...`` (it vanishes whole, at once), the root is
        fsynced, and its files are removed in the background; on object stores its manifest
        goes first. Takes the writer lock (so not while another job writes the store) and
        waits for this manager's own save in flight. Not collective: under
        torch.distributed call it on one rank.

        Args:
            step: the committed step to delete.
            force: delete it even if it is pinned, or the only checkpoint that verifies.

        Raises:
            NoCheckpointError: ``step`` is not committed (nothing is created or deleted).
            StepProtectedError: ``step`` is pinned, or no other checkpoint verifies (it
                would leave nothing to resume from); ``force=True`` deletes it anyway.
            StoreLockedError: another process writes the store.
            CommitError: it could not be deleted; it is still there.
        """
        self._session.check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            msg = f"step must be an int >= 0, got {step!r}"
            raise ConfigError(msg)
        self.wait_save()
        after_commit.delete(self._session, step, force=force)

    def gc(self) -> list[str]:
        """Remove stale ``.tmp-``/``.trash-`` entries and manifest-less step directories.

        In a directory that is not a store it does nothing and creates nothing. Under
        torch.distributed only the rank that writes the store (the lowest of those sharing
        it) removes anything (another cannot know which ``.tmp-`` is a save in flight); on
        the others it returns ``[]``.
        """
        self._session.check_open()
        self.wait_save()  # our own save in flight is not stale: its .tmp- must stay
        return after_commit.gc(self._session)

    # ---- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Finish the in-flight save and uploads, release the writer lock and the group.

        Raises:
            CommitError: the last async save failed.
            ReplicaError: an upload failed (the step stays in the local store; the next
                manager on it uploads it).
        """
        self._saver.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        """Close the manager; where the block raised, that exception goes on.

        A save's or an upload's failure that ``close`` raises is then logged and added to it
        as a note: raised, it replaced the user's own error (which only showed as its
        ``__context__``). A block left by a Ctrl-C (``KeyboardInterrupt``) does not wait for
        the replica's uploads: the in-flight save still commits locally, the queued uploads
        are dropped with a warning naming them, and the next manager on these roots uploads
        them (it waited for every one, and a second Ctrl-C was needed to stop).
        """
        if exc is None:
            self.close()
            return
        try:
            self._saver.close(uploads=not isinstance(exc, KeyboardInterrupt))
        except Exception as e:
            log.error("closing %s after %s: %s", self.root, type(exc).__name__, e)
            exc.add_note(f"ckptstore: closing {self.root} also failed: {e}")

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, format={self.format!r}, policy={self.policy!r})"


def _check_choice(name: str, value: object, allowed: Iterable[object], spelled: str) -> None:
    if value not in tuple(allowed):
        raise ConfigError(f"{name} must be {spelled}, got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            msg = f"metrics keys must be str, got {k!r}"
            raise ConfigError(msg)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, int | float):
            try:
                v = float(v)
            except (TypeError, ValueError):
                msg = f"metrics[{k!r}] must be a number, got {type(v).__name__}"
                raise ConfigError(msg) from None
        out[k] = float(v)
    return out


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    # Readers refuse a manifest nested deeper than MAX_MANIFEST_DEPTH as hostile; its
    # metadata sits two levels down. Checked first, iteratively: the copy below recurses.
    if deeper_than(dict(metadata or {}), MAX_MANIFEST_DEPTH - 2):
        msg = f"metadata must not nest lists and objects more than {MAX_MANIFEST_DEPTH - 2} levels"
        raise ConfigError(msg)
    # A deep copy: an async save writes the manifest later, and what the caller changes
    # after save returns must not end up in it.
    d = copy.deepcopy(dict(metadata or {}))
    try:
        json.dumps(d, allow_nan=False)
    except (TypeError, ValueError) as e:
        msg = f"metadata must be JSON-serializable (no NaN): {e}"
        raise ConfigError(msg) from None
    return d


def _first_error(every: list[BaseException | None]) -> BaseException | None:
    """The first rank's error, or None: rank 0's verdict for every rank."""
    return next((e for e in every if e is not None), None)

"""CheckpointManager: orchestration of the store, codecs, retention and coordination.

The mechanics live elsewhere: the commit protocol in ``storage``, encoding in ``codec``,
loading into modules in ``state``/``modules``, retention planning in ``retention``, waits in
``dist``. This module decides who does what, in which order, and what to tell the user;
the read side (restore, resume, load) is in ``reader``.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import EllipsisType
from typing import Any

import torch

from .codec import payload as payload_codec
from .codec import safetensors as safetensors_codec
from .codec.tree import TreeEncoder, tensor_key
from .dist import Coordinator
from .errors import (
    BarrierTimeout,
    CkptStoreError,
    CommitError,
    ManifestError,
    NoCheckpointError,
    ReplicaError,
    StepExistsError,
    StepProtectedError,
    UnsafeCheckpointError,
)
from .integrity import VerifyReport
from .layout import state_file
from .manifest import DTENSOR_FORMAT_VERSION, FORMAT_VERSION, FileEntry, Manifest, utc_now
from .ops.verify import verify_checkpoint
from .restore.reader import STATE_FORMAT, Reader
from .retention import (
    CheckpointInfo,
    RetentionPlanner,
    RetentionPolicy,
    as_policy,
    keep_best_policies,
)
from .save.phases import PhaseClock
from .save.staging import BackgroundWriter, SaveHandle, StagingPool
from .sharded import plan as sharding
from .sharded.chunks import INDEX_FILE
from .state.capture import capture, kind_of
from .state.modules import EMA, RNGState
from .storage import Pending, Storage, open_storage, wait_for_deletions
from .storage.base import step_exists_message
from .storage.directio import run_all
from .tiers import node_commit, nodes
from .tiers import twotier as tiers
from .tiers.replica import Replicator

__all__ = ["CheckpointManager"]

from ._log import logger as log

_GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def _versions() -> dict[str, str]:
    from . import __version__

    out = {"ckptstore": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        import safetensors

        out["safetensors"] = safetensors.__version__
    return out


def group_name(key: Any, index: int) -> str:
    """The payload group (file stem) of a top-level key.

    The key itself when it is a safe name, else ``_<index>`` (never a valid key name).
    """
    if isinstance(key, str) and _GROUP_RE.fullmatch(key):
        return key
    return f"_{index}"


class CheckpointManager(Reader):
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
            (payloads, then the manifest; every file read back and checked). Local retention
            keeps a step until it, or a newer one, is safe there; ``resume``/``restore``
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
            answer, and about the longest ``wait``/``close`` keep trying one that cannot be
            reached before ``ReplicaUnavailableError`` (on S3 it also bounds botocore's
            connect timeout and attempts unless ``replica_options`` set them).

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
        if format not in ("safetensors", "torch"):
            msg = f"format must be 'safetensors' or 'torch', got {format!r}"
            raise ValueError(msg)
        if compression not in (None, "zstd"):
            msg = f"compression must be None or 'zstd', got {compression!r}"
            raise ValueError(msg)
        if (
            isinstance(barrier_timeout, bool)
            or not isinstance(barrier_timeout, int | float)
            or not (math.isfinite(barrier_timeout) and barrier_timeout > 0)
        ):
            msg = f"barrier_timeout must be a positive number of seconds, got {barrier_timeout!r}"
            raise ValueError(msg)
        if replica_every not in tiers.REPLICA_EVERY:
            msg = f"replica_every must be 'all' or 'latest', got {replica_every!r}"
            raise ValueError(msg)
        if (
            isinstance(replica_timeout, bool)
            or not isinstance(replica_timeout, int | float)
            or not (math.isfinite(replica_timeout) and replica_timeout > 0)
        ):
            msg = f"replica_timeout must be a positive number of seconds, got {replica_timeout!r}"
            raise ValueError(msg)
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
        # The background writer's own group, for the commit of async DTensor saves.
        self._bg_coord: Coordinator | None = None
        # (DTensor layout key, this rank's part of the global save plan, its metadata, the
        # box specs of that part, the DTensors' layouts): reused while the key is equal.
        self._save_plan: tuple[Any, Any, Any, Any, Any] | None = None
        #: Seconds per phase of the last synchronous save on this rank (see ``phases``).
        self.last_save_phases: dict[str, float] = {}
        #: CPU seconds of this process per phase of that save.
        self.last_save_cpu: dict[str, float] = {}
        self._clock: PhaseClock | None = None
        #: The ranks whose local store is this rank's (all of them on a shared filesystem;
        #: one node's on node-local disks): the lowest of them writes that store.
        self._peers = nodes.peers(self.storage, self.coord)
        self._node_leader = self.coord.rank == min(self._peers)
        #: Node-local roots: the ranks of a sharded save commit a copy per store.
        self._split = len(self._peers) < self.coord.world_size
        self._lock = self.storage.writer_lock() if self._node_leader else None
        self._closed = False
        self._writer: BackgroundWriter | None = None
        self._staging = StagingPool()
        self._inflight: SaveHandle | None = None
        self._bg_error: BaseException | None = None
        self._mutex = threading.RLock()
        self._known_good: set[int] = set()
        #: Steps found not to verify (restore skipped them, verify or retention failed them).
        self._known_bad: set[int] = set()
        self._metrics: dict[int, Mapping[str, float]] = {}
        #: Whether this process is the store's writer: it holds the writer lock (local), or
        #: it is rank 0 and has begun to write (object stores, which have no lock).
        self._claimed = False
        #: While claimed: the committed steps, their metrics and the retention plan, kept up
        #: to date by this manager's own commits and deletions (no other process writes), so
        #: a save touches O(1) entries of the store however many steps it holds.
        self._planner: RetentionPlanner | None = None
        self.last_blocked_s = 0.0
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
                barrier=functools.partial(self.coord.barrier, "init:replica"),
                every=replica_every,
                timeout=float(replica_timeout),
                agree=self._agree_on_replica if self.coord.enabled else None,
            )
            if self.replica is not None:
                self.replica.on_safe = self._replica_safe

    # ---- small queries ----------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (by number, never as text)."""
        return self.storage.list_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` for an empty store."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest).

        Raises:
            NoCheckpointError: no such committed step.
            ManifestError: the manifest is unreadable or hostile.
        """
        step = self._resolve(step)
        return self.storage.read_manifest(step)

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise NoCheckpointError(
                    f"{self.root}: no committed checkpoint; check the path, or start from scratch "
                    "(resume() returns 0 on an empty store)"
                )
            return steps[-1]
        if step not in steps:
            have = f"{steps[0]}..{steps[-1]} ({len(steps)} steps)" if steps else "none"
            raise NoCheckpointError(
                f"{self.storage.describe(step)}: no committed checkpoint (have {have}); "
                "`ckptstore ls` lists them"
            )
        return step

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
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            msg = f"step must be an int >= 0, got {step!r}"
            raise ValueError(msg)
        if not isinstance(state, Mapping):
            msg = f"state must be a mapping of names to objects, got {type(state).__name__}"
            raise TypeError(msg)
        metrics_d = _check_metrics(metrics)
        metadata_d = _check_metadata(metadata)
        self.wait_save()  # at most one save in flight
        # The save's writes go before the uploads of earlier steps (which wait at their next
        # slice of bytes); an async save keeps them waiting until it commits.
        with self.replica.held() if self.replica is not None else contextlib.nullcontext():
            return self._save_now(step, state, metrics_d, metadata_d, sharded, allow_older)

    def _save_now(  # noqa: PLR0917 - private, one call site
        self,
        step: int,
        state: Mapping[Any, Any],
        metrics_d: dict[str, float],
        metadata_d: dict[str, Any],
        sharded: bool,
        allow_older: bool,
    ) -> SaveHandle:
        """:meth:`save` once its arguments are checked and no save is in flight."""
        t0 = time.perf_counter()
        clock = self._clock = PhaseClock()
        # The first exchange of a save (its barrier names the ranks that never called save,
        # at 'save:enter'): an async failure is raised on every rank, not only where it
        # happened; DTensor leaves on any rank make the save sharded on all of them; and
        # rank 0, which holds the store's listing, says whether the save may go ahead at
        # all (the same error on every rank, before anything is written).
        refusal: BaseException | None = None
        replace = False
        if self.coord.is_leader:
            refusal, replace = self._admit(step, metrics_d, allow_older)
        mine = (self._take_bg_error(), sharding.has_dtensors(state), refusal)
        clock.mark("admit")
        gathered = self.coord.all_gather(mine, "save:enter", step)
        clock.mark("x:enter")
        prev = next((e for e, _, _ in gathered if e is not None), None)
        if prev is not None:
            raise prev if isinstance(prev, CkptStoreError) else CommitError(str(prev))
        refused = gathered[0][2]
        if refused is not None:
            raise refused
        dtensor = any(flag for _, flag, _ in gathered)
        # Per-rank generators are gathered so each rank resumes its own random stream.
        rng = {
            key: self.coord.gather(value.state_dict(), "save:rng", step)
            for key, value in state.items()
            if isinstance(value, RNGState) and self.coord.enabled and (dtensor or not sharded)
        }
        clock.mark("x:rng")
        if sharded or dtensor:
            done = self._save_sharded(step, state, metrics_d, metadata_d, rng, dtensor, replace)
            if isinstance(done, SaveHandle):
                self.last_blocked_s = time.perf_counter() - t0
                return done
            return self._done(step, done, t0)
        job: dict[str, Any] | None = None
        error: BaseException | None = None
        if self.coord.is_leader:
            try:
                job = self._prepare(
                    step, state, metrics_d, metadata_d, rank=None, rng=rng, replace=replace
                )
            except BaseException as e:  # reported to every rank below
                error = e
        if not self.async_save:
            manifest = self._commit_replicated(job, error, step)
            return self._done(step, manifest, t0)
        # Async: rank 0 has copied the state into staging buffers; the rest is background.
        failure = self.coord.broadcast(error, "save:staged", step)
        if failure is not None:
            raise failure if isinstance(failure, CkptStoreError) else CommitError(str(failure))
        self.last_blocked_s = time.perf_counter() - t0
        if not self.coord.is_leader:
            return SaveHandle(step, result=None)
        assert job is not None
        if self._writer is None:
            self._writer = BackgroundWriter()
        blocked = self.last_blocked_s

        def run() -> Manifest:
            m = self._commit_job(job)
            self._after_commit(step)
            self._log_summary(step, m, time.perf_counter() - t0, blocked)
            return m

        return self._in_background(step, run)

    def _in_background(self, step: int, work: Callable[[], Manifest]) -> SaveHandle:
        """Run an async save's ``work`` on the writer; a failure is kept for the next call."""
        assert self._writer is not None

        held = self.replica.held() if self.replica is not None else contextlib.nullcontext()
        held.__enter__()  # uploads wait until this save commits

        def run() -> Manifest:
            try:
                return work()
            except BaseException as e:
                log.error("async save of step %d failed: %s", step, e)
                self._bg_error = e
                raise
            finally:
                held.__exit__(None, None, None)

        try:
            future = self._writer.submit(run)
        except BaseException:
            held.__exit__(None, None, None)
            raise
        self._inflight = SaveHandle(step, future, on_error=self._error_seen)
        return self._inflight

    def _done(self, step: int, manifest: Manifest, t0: float) -> SaveHandle:
        self.last_blocked_s = time.perf_counter() - t0
        if self._clock is not None:
            self._clock.mark("done")
            self.last_save_phases = dict(self._clock.phases)
            self.last_save_cpu = dict(self._clock.cpu)
            log.debug("step %d save phases: %s", step, self._clock.describe())
            self._clock = None
        if self.coord.is_leader:
            self._log_summary(step, manifest, self.last_blocked_s, self.last_blocked_s)
        return SaveHandle(step, result=manifest)

    def _acquire(self) -> None:
        """Become the store's writer (rank 0): take its lock where it has one.

        Raises:
            StoreLockedError: another process writes the store.
        """
        if self._claimed:
            return
        if self._lock is not None:
            self._lock.acquire()
        self._claimed = self._node_leader

    def _take_lock(self) -> None:
        """Become the writer before a save; a lock just taken also clears crashed saves."""
        fresh = self._lock is not None and not self._lock.is_locked
        self._acquire()
        if fresh:
            # We are now the only writer: leftovers of crashed saves are garbage.
            with contextlib.suppress(OSError):
                for name in self.storage.gc(include_tmp=True):
                    log.info("removed stale %s", name)

    def _known(self) -> RetentionPlanner:
        """The committed steps as retention sees them.

        While this manager is the store's writer the answer is kept up to date by its own
        commits and deletions (one listing, and one read of the manifests retention needs,
        per manager); otherwise the store is listed afresh, since others may write it.
        """
        if self._planner is not None:
            return self._planner
        steps = self.storage.list_steps()
        if self.policy.needs_metrics:
            # A committed manifest never changes: read each once per manager.
            misses = [s for s in steps if s not in self._metrics]
            if misses:
                got = self.storage.read_manifests(misses, complete=len(misses) == len(steps))
                for s, m in got.items():
                    self._metrics[s] = {} if isinstance(m, ManifestError) else m.metrics
        planner = RetentionPlanner(
            self.policy, (CheckpointInfo(s, self._metrics.get(s, {})) for s in steps)
        )
        if self._claimed:
            self._planner = planner
        return planner

    def _admit(
        self, step: int, metrics: Mapping[str, float], allow_older: bool
    ) -> tuple[BaseException | None, bool]:
        """Rank 0: may ``step`` be saved? Takes the writer lock; nothing is written.

        Returns:
            ``(error, replace)``: the error every rank raises (or ``None``), and whether the
            save replaces a committed step that does not verify.
        """
        try:
            self._check_policy_metrics(step, metrics)
            self._take_lock()
            with self._mutex:
                known = self._known()
                if not allow_older:
                    self._check_order(step, known)
                return None, self._claim_step(step, known)
        except BaseException as e:  # raised on every rank by save()
            if _plain_oserror(e):  # listing the store or taking its lock failed
                return _commit_error(e, self.storage.describe(step), None), False
            return e, False

    def _check_policy_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """A save must carry the metric of every ``KeepBest`` (or the policy allows it)."""
        lacking = [b for b in keep_best_policies(self.policy) if b.metric not in metrics]
        if not lacking:
            return
        got = ", ".join(repr(k) for k in sorted(metrics)) or "none"
        refused = [b for b in lacking if b.missing == "error"]
        if refused:
            b = refused[0]
            msg = (
                f"refusing to save step {step} in {self.root}: its metrics lack {b.metric!r}, "
                f"which {b!r} ranks checkpoints by (got metrics: {got}); nothing was written. "
                "Without it retention would keep only the newest steps and delete the best. "
                f"Pass metrics={{{b.metric!r}: ...}}, fix the metric's name, or use "
                f"KeepBest(..., missing='keep') to keep such steps"
            )
            raise ValueError(msg)
        for b in lacking:
            log.warning(
                "step %d has no metric %r (got metrics: %s): %r keeps it for good; retention "
                "never deletes it for lacking the metric (mgr.delete(%d) does)",
                step,
                b.metric,
                got,
                b,
                step,
            )

    def _check_order(self, step: int, known: RetentionPlanner) -> None:
        """Refuse a step older than the newest committed one not known to be corrupt.

        Restarting training without ``resume()`` saves steps below those in the store:
        retention would delete them at once (they are not the newest) and the next resume
        would pass them over. A step restore skipped as corrupt does not count, so training
        that resumed before it saves it (and the ones after it) again.
        """
        newest = next((s for s in reversed(known) if s not in self._known_bad), None)
        if newest is None or step >= newest:
            return
        have = list(known)
        held = f"{len(have)} step{'s' * (len(have) != 1)}, {have[0]}..{have[-1]}"
        msg = (
            f"refusing to save step {step} in {self.root}: the store already holds newer "
            f"checkpoints ({held}; newest {newest}); nothing was written. Training probably "
            "restarted without resume(): call mgr.resume(state) before training to continue "
            f"after step {newest}, or save(..., allow_older=True) to save it anyway "
            "(retention may delete it at once: it is not the newest)"
        )
        raise ValueError(msg)

    def _encode(
        self,
        state: Mapping[Any, Any],
        rng: Mapping[Any, Any] | None = None,
        dtensors: sharding.DTensorCollector | None = None,
    ) -> tuple[bytes, dict[str, dict[str, torch.Tensor]]]:
        """``state.json`` bytes and the tensor groups of a state (staged if async).

        With ``dtensors`` (a sharded DTensor save) DTensor leaves are collected there instead
        of becoming payload tensors, and optimizers are stored keyed by parameter name.
        """
        enc = TreeEncoder(allow_pickle=self.allow_pickle, dtensor=dtensors)
        keys: list[Any] = []
        vals: list[Any] = []
        for i, (key, value) in enumerate(state.items()):
            if isinstance(key, bool) or not isinstance(key, str | int):
                msg = f"state keys must be str or int, got {key!r}"
                raise UnsafeCheckpointError(msg)
            kind = kind_of(value)
            owner = None
            if dtensors is not None and isinstance(value, torch.optim.Optimizer):
                owner = sharding.owner_of(value, state)
                if owner is None:
                    msg = (
                        f"state[{key!r}]: the optimizer's parameters are not all in one module "
                        "of the state; add the model to the state, so its sharded state can be "
                        "keyed by parameter name"
                    )
                    raise UnsafeCheckpointError(msg)
                model = state[owner]
                kind = "optimizer"
                data = sharding.named_optimizer_state(
                    value, model.module if isinstance(model, EMA) else model
                )
            else:
                data = capture(value)
            if rng and key in rng and rng[key] is not None:
                data = {"per_rank": rng[key]}
            node = enc.encode(data, group=group_name(key, i), path=(key,))
            if kind is not None:
                node = {"t": "stateful", "kind": kind, "v": node}
                if owner is not None:
                    node["owner"] = owner
            keys.append(key)
            vals.append(node)
        groups = enc.finish(tensor_key, contiguous=not self.async_save)
        if self.async_save:
            self._staging.begin()
            groups = {g: self._stage_group(g, tensors) for g, tensors in groups.items()}
            self._staging.end()
        tree = {"ckptstore_state": STATE_FORMAT, "root": {"t": "dict", "keys": keys, "vals": vals}}
        return json.dumps(tree, separators=(",", ":"), allow_nan=False).encode(), groups

    def _stage_group(
        self, group: str, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Copy one group into staging buffers.

        For plain safetensors each tensor is placed where its bytes line up with its place
        in the file, so the writer sends it to the disk without a bounce copy.
        """
        offsets: dict[str, int] = {}
        if self.format == "safetensors" and self.compression is None:
            head, order = safetensors_codec.build_header(tensors)
            pos = len(head)
            for name, t in order:
                offsets[name] = pos
                pos += t.numel() * t.element_size()
        return {
            k: self._staging.stage(f"{group}/{k}", t, offsets.get(k)) for k, t in tensors.items()
        }

    def _prepare(
        self,
        step: int,
        state: Mapping[Any, Any],
        metrics: dict[str, float],
        metadata: dict[str, Any],
        *,
        rank: int | None,
        rng: Mapping[Any, Any] | None = None,
        replace: bool = False,
    ) -> dict[str, Any]:
        """Capture and encode the state in the caller's thread (the one copy if async)."""
        tree, groups = self._encode(state, rng)
        return {
            "step": step,
            "groups": groups,
            "tree": tree,
            "metrics": metrics,
            "metadata": metadata,
            "rank": rank,
            "replace": replace,
        }

    def _claim_step(self, step: int, known: RetentionPlanner) -> bool:
        """Make sure ``step`` may be written: absent, or committed but corrupt (replaced).

        After ``restore`` skipped a corrupt newest checkpoint, training reaches that step
        again; refusing the save then would stop the job for good. A committed step that
        verifies is never overwritten. A corrupt one is replaced only when the new save
        commits (``Storage.begin(replace=True)``): if its verification failed transiently
        and the new save fails, it is still there.

        Returns:
            Whether the save replaces a committed (corrupt) step.

        Raises:
            StepExistsError: ``step`` is committed and verifies.
        """
        if step not in known:
            return False
        report = verify_checkpoint(self.storage, step, deep=True)
        if report.ok:
            raise StepExistsError(step_exists_message(self.storage, step))
        log.warning(
            "%s is committed but does not verify (%s); this save replaces it when it commits",
            self.storage.describe(step),
            "; ".join(report.problems),
        )
        self._known_good.discard(step)
        return True

    def _write_files(self, pending: Pending, job: Mapping[str, Any]) -> None:
        """Write every payload file and the state tree; each is durable on return.

        Files are written concurrently (the model and the optimizer, say): while one thread
        copies into its buffers, another's checksum or write runs, since both release the GIL.
        """
        rank = job["rank"]

        def write(group: str, tensors: Mapping[str, torch.Tensor]) -> None:
            name = payload_codec.payload_name(group, self.format, self.compression, rank)
            payload_codec.write_group(
                pending, name, tensors, fmt=self.format, compression=self.compression, rank=rank
            )

        def write_tree() -> None:
            pending.write_bytes(state_file(rank), job["tree"], codec="json", rank=rank)

        # Largest first; state.json alongside, so its fsync overlaps the payloads' too.
        groups = sorted(job["groups"].items(), key=lambda kv: -_group_bytes(kv[1]))
        calls: list[Callable[[], None]] = [functools.partial(write, g, t) for g, t in groups]
        calls.append(write_tree)
        if sum(_group_bytes(t) for _, t in groups) < _INLINE_WRITE_BYTES:
            # A few KB to a few MB: starting threads (and handing the GIL around) costs more
            # than the writes; ext4 commits them in one journal transaction either way.
            for call in calls:
                call()
            return
        errors = run_all(calls, max_workers=_WRITE_THREADS)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _make_manifest(
        self,
        step: int,
        files: Mapping[str, FileEntry],
        job: Mapping[str, Any],
        sharded: bool,
        dtensor: bool = False,
    ) -> Manifest:
        return Manifest(
            step=step,
            files=dict(files),
            created=utc_now(),
            format=self.format,
            world_size=self.coord.world_size,
            sharded=sharded or dtensor,
            dtensor=dtensor,
            metrics=job["metrics"],
            metadata=job["metadata"],
            versions=_versions(),
            format_version=DTENSOR_FORMAT_VERSION if dtensor else FORMAT_VERSION,
        )

    def _write_job(self, job: dict[str, Any]) -> tuple[Pending, Manifest]:
        """Write payloads and state.json durably into a pending checkpoint (rank 0 only).

        Everything but the commit itself, so the caller can check that every rank is still
        there before the checkpoint becomes visible.
        """
        step = job["step"]
        where = self.storage.describe(step)
        try:
            pending = self.storage.begin(step, replace=job.get("replace", False))
        except OSError as e:
            raise _commit_error(e, where, self._previous(step)) from e
        try:
            self._write_files(pending, job)
            manifest = self._make_manifest(step, pending.files, job, sharded=False)
        except BaseException as e:
            self.storage.abort(pending)
            if _plain_oserror(e):
                raise _commit_error(e, where, self._previous(step)) from e
            raise
        return pending, manifest

    def _publish(self, pending: Pending, manifest: Manifest) -> None:
        """Commit a fully written checkpoint; on failure nothing of it stays visible."""
        try:
            self.storage.commit(pending, manifest)
        except BaseException as e:
            self.storage.abort(pending)
            if _plain_oserror(e):
                where = self.storage.describe(pending.step)
                raise _commit_error(e, where, self._previous(pending.step)) from e
            raise
        self._committed(manifest)

    def _committed(self, manifest: Manifest) -> None:
        """Rank 0 committed ``manifest``: what the manager knows of the store follows."""
        step = manifest.step
        with self._mutex:
            self._known_good.add(step)
            self._known_bad.discard(step)
            self._metrics[step] = manifest.metrics
            if self._planner is not None:
                self._planner.add(step, manifest.metrics)

    def _forget(self, step: int) -> None:
        """``step`` was deleted (by this manager, or found gone)."""
        with self._mutex:
            self._known_good.discard(step)
            self._known_bad.discard(step)
            self._metrics.pop(step, None)
            if self._planner is not None:
                self._planner.remove(step)

    def _commit_job(self, job: dict[str, Any]) -> Manifest:
        """Write and commit in one go (the async writer, which has no one to wait for)."""
        pending, manifest = self._write_job(job)
        self._publish(pending, manifest)
        return manifest

    def _previous(self, step: int) -> int | None:
        try:
            older = [s for s in self.steps() if s != step]
        except OSError:
            return None
        return older[-1] if older else None

    def _commit_replicated(
        self, job: dict[str, Any] | None, error: BaseException | None, step: int
    ) -> Manifest:
        """Rank 0 writes; once every rank is known to be alive it commits; all learn how.

        The "save:write" wait sits between writing and committing (arrive/commit/depart),
        so a rank that died during the save leaves nothing visible.
        """
        pending: Pending | None = None
        manifest: Manifest | None = None
        written: tuple[str, Any] = ("ok", None)
        if self.coord.is_leader:
            if error is None:
                assert job is not None
                try:
                    pending, manifest = self._write_job(job)
                except BaseException as e:
                    written = ("error", e)
            else:
                written = ("error", error)
        try:
            status, value = self.coord.broadcast(written, "save:write", step)
        except BarrierTimeout:
            if pending is not None:
                self.storage.abort(pending)
            raise
        if status == "error":
            raise value if isinstance(value, BaseException) else CommitError(str(value))
        outcome: tuple[str, Any] = ("ok", b"")
        if self.coord.is_leader:
            assert pending is not None
            assert manifest is not None
            try:
                self._publish(pending, manifest)
                outcome = ("ok", self._outgoing(manifest))
            except BaseException as e:
                outcome = ("error", e)
        return self._announce(outcome, step)

    def _outgoing(self, manifest: Manifest) -> Manifest | bytes:
        """The committed manifest as other ranks receive it: its bytes, re-validated there."""
        return manifest.to_bytes() if self.coord.enabled else manifest

    def _announce(
        self, outcome: tuple[str, Any], step: int, coord: Coordinator | None = None
    ) -> Manifest:
        """Broadcast rank 0's commit outcome; every rank returns the manifest or raises it."""
        status, value = (coord or self.coord).broadcast(outcome, "save:commit", step)
        if coord is None or coord is self.coord:
            self._mark("x:commit")
        if status == "error":
            raise value if isinstance(value, BaseException) else CommitError(str(value))
        self._after_commit(step)
        if coord is None or coord is self.coord:
            self._mark("after_commit")
        return value if isinstance(value, Manifest) else Manifest.from_bytes(value)

    def _save_sharded(  # noqa: PLR0917 - private, one call site
        self,
        step: int,
        state: Mapping[Any, Any],
        metrics: dict[str, float],
        metadata: dict[str, Any],
        rng: Mapping[Any, Any],
        dtensor: bool,
        replace: bool,
    ) -> Manifest | SaveHandle:
        """Two-phase commit: every rank writes its shard, rank 0 gathers and commits.

        Per-rank state (``sharded=True``): every rank writes its own tree and payloads.
        DTensor state: every rank writes the DTensor boxes the global plan gives it, rank 0
        the rest of the state once, and rank 0 adds the chunk index before the manifest.
        With ``async_save`` a DTensor save returns once every rank has staged its boxes;
        the writes and the commit (with its collectives, on a group of their own) go on in
        the background.
        """
        rank = self.coord.rank
        meta = {"metrics": metrics, "metadata": metadata}
        mine: tuple[str, Any]
        if dtensor:
            # Rank 0 opens the tmp directory before planning, and says so in the plan
            # exchange: one collective less than an exchange of its own.
            pending, mine = self._plan_dtensor(state, step, rng, replace)
        else:
            pending = self._open_everywhere(step, replace)
        try:
            if dtensor:
                if mine[0] == "ok" and self.async_save:
                    return self._submit_sharded(pending, mine[1], step, meta)
                if mine[0] == "ok":
                    mine = self._write_dtensor(pending, mine[1])
                    self._mark("write")
            else:
                job = {"groups": {}, "tree": b"", "rank": rank}
                tree, groups = self._encode_sync(state)
                job.update(tree=tree, groups=groups)
                self._write_files(pending, job)
                mine = ("ok", {"files": {n: e for n, e in pending.files.items() if e.rank == rank}})
        except BarrierTimeout:
            if self._node_leader:
                self.storage.abort(pending)
            raise
        except BaseException as e:
            log.error("rank %d failed to write its shard of step %d: %s", rank, step, e)
            mine = ("error", e)
        return self._finish_sharded(pending, mine, step, meta, dtensor, self.coord)

    def _open_everywhere(self, step: int, replace: bool) -> Pending:
        """Phase 0 of a sharded save: rank 0 opens the tmp directory every rank writes into.

        On node-local roots the lowest rank of each node opens one in its own store (a
        node's copy is replaced when rank 0 replaces its own, or when it holds the step).
        """
        opened, pending = self._open_here(step, replace)
        self._mark("begin")
        every = self.coord.all_gather(opened, "save:begin", step)
        self._mark("x:begin")
        return self._opened(pending, every, step)

    def _open_here(self, step: int, replace: bool) -> tuple[tuple[str, Any], Pending | None]:
        """The lowest rank of this store opens the tmp directory of ``step``.

        Returns what to tell the others (``("ok", dirname)``, ``("error", e)``; ``("ok",
        None)`` on the other ranks) and the pending checkpoint where this rank opened it.
        """
        if not self._node_leader:
            return ("ok", None), None
        try:
            if self._split and not self.coord.is_leader:
                self._take_lock()
                replace = step in self.storage.list_steps()
            pending = self.storage.begin(step, replace=replace)
        except BaseException as e:
            where = self.storage.describe(step)
            err = _commit_error(e, where, self._previous(step)) if _plain_oserror(e) else e
            return ("error", err), None
        return ("ok", pending.dirname), pending

    def _opened(self, pending: Pending | None, every: list[tuple[str, Any]], step: int) -> Pending:
        """The pending checkpoint on this rank, once every rank said how opening went.

        ``every`` holds each rank's :meth:`_open_here` answer: a failure anywhere (on
        node-local roots, in any node's store) aborts this rank's directory and is raised.
        """
        failed = [v for st, v in every if st == "error"]
        if failed:
            if pending is not None:
                self.storage.abort(pending)
            value = failed[0]
            raise value if isinstance(value, BaseException) else CommitError(str(value))
        value = every[min(self._peers)][1]
        return pending if pending is not None else Pending(self.storage, step, value)

    def _finish_sharded(  # noqa: PLR0917 - private
        self,
        pending: Pending,
        mine: tuple[str, Any],
        step: int,
        meta: Mapping[str, Any],
        dtensor: bool,
        coord: Coordinator,
    ) -> Manifest:
        """Phase 2: rank 0 gathers every rank's files and commits only if all succeeded."""
        where = self.storage.describe(step)
        md = mine[1].pop("md", None) if dtensor and mine[0] == "ok" else None
        try:
            tables = coord.gather(mine, "save:gather", step)
            if coord is self.coord:
                self._mark("x:gather")
        except BarrierTimeout:
            if self._node_leader:
                self.storage.abort(pending)
            raise
        outcome: tuple[str, Any] = ("ok", b"")
        if coord.is_leader:
            assert tables is not None
            failed = [(r, v) for r, (s, v) in enumerate(tables) if s == "error"]
            if failed or any(s != "ok" for s, _ in tables):
                self.storage.abort(pending)
                outcome = ("error", _shard_error(failed, where, self._previous(step)))
            else:
                files: dict[str, FileEntry] = {}
                for _, table in tables:
                    files.update(table["files"])
                try:
                    if dtensor:
                        index = sharding.index_bytes(md, [t["packed"] for _, t in tables])
                        pending.write_bytes(INDEX_FILE, index, codec="json")
                        files[INDEX_FILE] = pending.files[INDEX_FILE]
                    manifest = self._make_manifest(step, files, meta, sharded=True, dtensor=dtensor)
                    if coord is self.coord:
                        self._mark("index")
                    if self._split:  # every node commits its copy: _commit_split
                        outcome = ("ok", (manifest.to_bytes(), nodes.plain_blobs(pending, files)))
                    else:
                        self.storage.commit(pending, manifest)
                        if coord is self.coord:
                            self._mark("commit")
                        self._committed(manifest)
                        outcome = ("ok", self._outgoing(manifest))
                except BaseException as e:
                    self.storage.abort(pending)
                    err = _commit_error(e, where, self._previous(step)) if _plain_oserror(e) else e
                    outcome = ("error", err)
        if self._split:
            return self._commit_split(pending, outcome, step, coord)
        return self._announce(outcome, step, coord)

    def _commit_split(
        self, pending: Pending, prepared: tuple[str, Any], step: int, coord: Coordinator
    ) -> Manifest:
        """Phase 3 on node-local roots: every node commits its copy of the step, or none.

        Rank 0 sends the manifest and its files of no rank (the plain state, the chunk
        index) to every rank. Then two rounds (:mod:`ckptstore.tiers.node_commit`): every node
        leader prepares its copy (those files, the ``local-ranks`` marker, the manifest,
        fsynced, still a ``.tmp-`` directory), and only once every node reports prepared
        do they publish it (the rename). A node failing to prepare aborts every node's copy
        (the previous step stays the newest everywhere); a node failing its rename makes
        the nodes that renamed take their copy back. Either way every rank raises an error
        naming the rank(s) whose store failed.
        """
        where = self.storage.describe(step)
        status, value = coord.broadcast(prepared, "save:prepared", step)
        if status == "error":
            if self._node_leader and not coord.is_leader:
                self.storage.abort(pending)
            raise value if isinstance(value, BaseException) else CommitError(str(value))
        body, blobs = value
        manifest = Manifest.from_bytes(body)
        previous = self._previous(step)
        node_commit.commit_everywhere(
            self.storage,
            pending,
            manifest,
            blobs,
            coord,
            leader=self._node_leader,
            peers=self._peers,
            previous=previous,
            explain=lambda e: _commit_error(e, where, previous) if _plain_oserror(e) else e,
        )
        if self._node_leader:
            self._committed(manifest)
        self._after_commit(step)  # only now the uploader learns of the step
        return manifest

    def _encode_sync(
        self,
        state: Mapping[Any, Any],
        rng: Mapping[Any, Any] | None = None,
        dtensors: sharding.DTensorCollector | None = None,
    ) -> tuple[bytes, dict[str, dict[str, torch.Tensor]]]:
        """Encode without staging: sharded saves complete before ``save`` returns."""
        was, self.async_save = self.async_save, False
        try:
            return self._encode(state, rng, dtensors)
        finally:
            self.async_save = was

    def _plan_dtensor(
        self, state: Mapping[Any, Any], step: int, rng: Mapping[Any, Any], replace: bool
    ) -> tuple[Pending, tuple[str, Any]]:
        """Open the tmp directory, encode the state, agree on who writes which DTensor box.

        Collective. Rank 0 opens the tmp directory every rank writes into; every rank
        encodes the state (the same tree, so the same DTensor names) and makes a local
        plan; the plans (and rank 0's directory) are exchanged, and every rank computes the
        same deduplicated global plan from them. A rank that fails before the exchange
        still takes part in it, so no rank waits for it. With ``async_save`` the boxes and
        rank 0's plain tensors are copied into staging buffers here: the one copy the
        caller waits for.

        Returns:
            The pending checkpoint, and ``("ok", job)``, ``("error", e)`` where this rank
            failed, ``("aborted", None)`` where another rank did (and says why).

        Raises:
            BarrierTimeout: a rank did not join the exchange (rank 0's directory is gone).
            Exception: rank 0 could not open the directory (raised on every rank).
        """
        rank = self.coord.rank
        collector = sharding.DTensorCollector()
        planned: tuple[str, Any]
        tree: bytes = b""
        groups: dict[str, dict[str, torch.Tensor]] = {}
        opened, pending = self._open_here(step, replace)
        self._mark("begin")
        key: Any = None
        local: Any = None
        try:
            if self.compression is not None:
                msg = (
                    f"compression={self.compression!r} cannot be used with DTensor state: "
                    "ranks read byte ranges of the shards; save with compression=None"
                )
                raise UnsafeCheckpointError(msg)
            tree, groups = self._encode_sync(state, rng, collector)
            self._mark("encode")
            key = sharding.layout_key(collector.flat)
            # The same layout as the last save on every rank: its global plan still holds,
            # and the exchange carries one flag instead of every rank's plan.
            hit = self._save_plan is not None and self._save_plan[0] == key
            local = None if hit else sharding.save_plans(collector.flat, self.coord.is_leader)
            planned = ("ok", local)
        except BaseException as e:
            log.error("rank %d could not plan its shard of step %d: %s", rank, step, e)
            planned = ("error", e)
        self._mark("plan")
        try:
            plans = self.coord.all_gather((*planned, opened), "save:plan", step)
        except BarrierTimeout:
            if pending is not None:
                self.storage.abort(pending)
            raise
        self._mark("x:plan")
        pending = self._opened(pending, [p[2] for p in plans], step)
        if planned[0] != "ok":
            return pending, planned
        if any(s != "ok" for s, _, _ in plans):
            return pending, ("aborted", None)
        try:
            others = [p for _, p, _ in plans]
            job = self._agree(collector, others, step, key=key, local=local, parts=(tree, groups))
        except BarrierTimeout:
            if self._node_leader:
                self.storage.abort(pending)
            raise
        except BaseException as e:
            log.error("rank %d could not plan its shard of step %d: %s", rank, step, e)
            return pending, ("error", e)
        return pending, ("ok", job)

    def _agree(
        self,
        collector: sharding.DTensorCollector,
        plans: list[Any],
        step: int,
        *,
        key: Any,
        local: Any,
        parts: tuple[bytes, dict[str, dict[str, torch.Tensor]]],
    ) -> dict[str, Any]:
        """The global plan from every rank's local plan (or the cached one): this rank's job.

        ``plans`` holds ``None`` for a rank whose layout key equals its cached plan's.
        """
        rank = self.coord.rank
        tree, groups = parts
        if any(p is None for p in plans) and any(p is not None for p in plans):
            # Some ranks kept their layout, others did not: plan again, all of them.
            local = local or sharding.save_plans(collector.flat, self.coord.is_leader)
            plans = [p for _, p in self.coord.all_gather(("ok", local), "save:plan", step)]
        if all(p is None for p in plans):
            assert self._save_plan is not None
            _, mine, md, specs, layout = self._save_plan
        else:
            final, md = sharding.global_plan(plans)
            mine = final[rank]
            specs = sharding.box_specs(mine)
            layout = sharding.layouts(collector.flat)  # what the layout key also holds
            self._save_plan = (key, mine, md, specs, layout)
        self._mark("global_plan")
        boxes = sharding.local_boxes(mine, collector.flat, specs)
        if self.async_save:
            self._staging.begin()
            offsets = sharding.box_file_offsets({k: t for k, (_, _, t) in boxes.items()})
            boxes = {
                k: (n, o, self._staging.stage(f"_shards/{k}", t, offsets[k]))
                for k, (n, o, t) in boxes.items()
            }
            if self.coord.is_leader:
                groups = {g: self._stage_group(g, t) for g, t in groups.items()}
            self._staging.end()
        job = {"boxes": boxes, "layout": layout, "md": md, "tree": tree, "groups": groups}
        self._mark("boxes")
        return job

    def _write_dtensor(self, pending: Pending, job: Mapping[str, Any]) -> tuple[str, Any]:
        """Phase 1 of a DTensor save: this rank's boxes, and rank 0 the rest of the state."""
        rank = self.coord.rank
        plain = None
        if self.coord.is_leader:
            # Rank 0's plain part is written alongside its shards, not after them.
            plain = functools.partial(
                self._write_files,
                pending,
                {"groups": job["groups"], "tree": job["tree"], "rank": None},
            )
        table = sharding.write_shards(pending, rank, job["boxes"], job["layout"], also=plain)
        files = {
            n: e
            for n, e in pending.files.items()
            if e.rank == rank or (self.coord.is_leader and e.rank is None)
        }
        # Rank 0 keeps the global metadata (it is not sent: _finish_sharded takes it out).
        md = job["md"] if self.coord.is_leader else None
        return ("ok", {"files": files, "packed": sharding.pack_table(table), "md": md})

    def _submit_sharded(
        self, pending: Pending, job: Mapping[str, Any], step: int, meta: Mapping[str, Any]
    ) -> SaveHandle:
        """Write and commit a staged DTensor save in the background on every rank.

        The commit's collectives run on a second group of ckptstore's own, used only by the
        background writer (one save in flight at most), so they never interleave with the
        training thread's; they are bounded by ``barrier_timeout`` like every other.
        """
        if self._bg_coord is None:
            self._bg_coord = Coordinator(self.barrier_timeout, enabled=self.coord.enabled)
        bg = self._bg_coord
        if self._writer is None:
            self._writer = BackgroundWriter()
        t0 = time.perf_counter()

        def run() -> Manifest:
            try:
                mine = self._write_dtensor(pending, job)
            except BaseException as e:
                log.error("rank %d failed to write its shard of step %d: %s", bg.rank, step, e)
                mine = ("error", e)
            m = self._finish_sharded(pending, mine, step, meta, True, bg)
            if bg.is_leader:
                self._log_summary(step, m, time.perf_counter() - t0, self.last_blocked_s)
            return m

        return self._in_background(step, run)

    def _agree_on_replica(self, error: BaseException | None) -> BaseException | None:
        """Collective: the first rank's error probing the replica, the same on every rank."""
        every = self.coord.all_gather(error, "init:replica-probe")
        return next((e for e in every if e is not None), None)

    def _replica_safe(self, step: int) -> None:
        """The uploader's callback: ``step`` is safe on the replica.

        Local steps that retention held back for the replica may go now (on the uploader's
        thread: retention takes the manager's lock, the training thread does not wait).
        """
        if self.replica is not None and self.replica.holding and self._claimed:
            self.replica.holding = False
            self.prune()

    def _after_commit(self, step: int) -> None:
        """Retention runs only after a commit; its failure never fails the save.

        With a replica, the step is queued for upload first (on the uploading rank).
        """
        if self.replica is not None:
            self.replica.submit(step)
        if not self._node_leader:
            return
        try:
            self.prune()
        except (CkptStoreError, OSError, ValueError) as e:
            log.warning("retention after step %d failed: %s", step, e)

    def _mark(self, phase: str) -> None:
        """End ``phase`` of the synchronous save in progress (see :mod:`ckptstore.save.phases`)."""
        if self._clock is not None:
            self._clock.mark(phase)

    def _log_summary(self, step: int, manifest: Manifest, seconds: float, blocked: float) -> None:
        nbytes = manifest.total_bytes
        log.info(
            "saved step %d: %d bytes in %.3fs (%.2f GB/s), blocked %.1f ms",
            step,
            nbytes,
            seconds,
            nbytes / max(seconds, 1e-9) / 1e9,
            blocked * 1e3,
        )

    # ---- async bookkeeping ----------------------------------------------------------

    def _take_bg_error(self) -> BaseException | None:
        err, self._bg_error = self._bg_error, None
        if err is None or isinstance(err, CkptStoreError):
            return err
        return CommitError(f"the previous async save failed: {err}")

    def _error_seen(self, err: BaseException) -> None:
        """The caller got ``err`` from ``SaveHandle.wait``: it is not raised a second time."""
        if self._bg_error is err:
            self._bg_error = None

    def _raise_bg_error(self) -> None:
        err = self._take_bg_error()
        if err is not None:
            raise err

    def wait_save(self) -> None:
        """Wait for the in-flight async save, if any (its error is raised by :meth:`wait`)."""
        h, self._inflight = self._inflight, None
        if h is not None:
            h._settle()  # its error stays pending until raised (once) to the caller

    def wait(self) -> None:
        """Wait for the in-flight save, uploads and deletions; raise a background error.

        Raises:
            CommitError: the last async save failed.
            ReplicaError: an upload failed (the step stays in the local store).
        """
        self.wait_save()
        if self.replica is not None:
            self.replica.wait()
        wait_for_deletions()
        self._raise_bg_error()

    def verify(self, step: int | None = None, *, deep: bool = True) -> VerifyReport:
        """Check a checkpoint (default: the newest committed one).

        ``deep`` computes every file's checksum and every zip member's CRC; otherwise the
        manifest, presence, sizes and headers are checked.
        """
        s = self._resolve(step)
        report = verify_checkpoint(self.storage, s, deep=deep)
        if deep:  # a quick check passes a flipped byte: retention needs deep
            with self._mutex:
                (self._known_good if report.ok else self._known_bad).add(s)
                (self._known_bad if report.ok else self._known_good).discard(s)
        return report

    def pin(self, step: int) -> None:
        """Protect ``step`` from retention (a ``pinned`` marker in its directory).

        Raises:
            CommitError: the marker could not be written (read-only store, disk full).
        """
        self._set_pinned(step, True)

    def unpin(self, step: int) -> None:
        """Let retention delete ``step`` again."""
        self._set_pinned(step, False)

    def _set_pinned(self, step: int, pinned: bool) -> None:
        s = self._resolve(step)
        try:
            self.storage.set_pinned(s, pinned)
        except OSError as e:
            if not _plain_oserror(e):
                raise
            what = "pin" if pinned else "unpin"
            raise CommitError(f"could not {what} {self.storage.describe(s)}: {e}") from e
        with self._mutex:
            if self._planner is not None:
                self._planner.set_pinned(s, pinned)

    def plan_prune(self) -> list[int]:
        """The steps :meth:`prune` would delete now.

        Raises:
            ValueError: no committed step has the metric of a ``KeepBest`` policy (a typo
                would otherwise make retention delete the best checkpoints); nothing is
                deleted. The message lists the metrics the store has.
        """
        with self._mutex:
            known = self._known()
            if not len(known):
                return []
            self._check_store_metrics(known)
            if not known.incremental:
                # A policy of the user's own may look at pins: give it every step's.
                for s in known:
                    known.set_pinned(s, self.storage.is_pinned(s))
            doomed = known.plan(last_good=self._last_good(known))
            if self.replica is not None:  # a step not yet safe on the replica is held
                doomed = self.replica.deletable(doomed)
            # Built-in policies are planned without reading every step's pin (a pin only
            # ever keeps a step; another process may have pinned one): read the doomed ones'.
            out = []
            for s in doomed:
                if self.storage.is_pinned(s):
                    known.set_pinned(s, True)
                else:
                    out.append(s)
            return out

    def _check_store_metrics(self, known: RetentionPlanner) -> None:
        for b in keep_best_policies(self.policy):
            if b.missing != "error" or known.metric_count(b.metric):
                continue
            have = ", ".join(repr(m) for m in known.metric_names()) or "none"
            msg = (
                f"{b!r}: no checkpoint in {self.root} has the metric {b.metric!r} (the store's "
                f"metrics: {have}); nothing was deleted. Check the metric's name"
            )
            raise ValueError(msg)

    def _last_good(self, known: RetentionPlanner) -> int | None:
        for s in reversed(known):
            if s in self._known_good:
                return s
            # Deep: a quick check (sizes, headers) passes a flipped byte, and retention
            # would then delete the only checkpoint that still loads.
            report = verify_checkpoint(self.storage, s, deep=True)
            if report.ok:
                self._known_good.add(s)
                return s
            self._known_bad.add(s)
            log.warning(
                "retention keeps an older step: step %d does not verify: %s",
                s,
                "; ".join(report.problems),
            )
        return None

    def prune(self) -> list[int]:
        """Apply the retention policy now; returns the deleted steps.

        Deletion renames a checkpoint away atomically and frees its space in the
        background. Never deletes the newest, a pinned one, or the newest that verifies.
        In a directory without checkpoints it does nothing and creates nothing.

        Raises:
            StoreLockedError: another process writes the store.
            ValueError: as :meth:`plan_prune`.
            CommitError: a checkpoint could not be deleted.
        """
        self._check_open()
        with self._mutex:
            if not self._claimed:
                if not self.storage.list_steps():
                    return []  # nothing to delete: take (create) no lock here
                self._acquire()
            doomed = self.plan_prune()
            deleted = []
            for s in doomed:
                try:
                    self.storage.delete(s)
                except FileNotFoundError:
                    self._forget(s)
                    continue
                except OSError as e:
                    raise CommitError(f"could not delete {self.storage.describe(s)}: {e}") from e
                self._forget(s)
                deleted.append(s)
            if deleted:
                log.info("retention deleted steps %s", deleted)
            return deleted

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
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            msg = f"step must be an int >= 0, got {step!r}"
            raise ValueError(msg)
        self.wait_save()
        with self._mutex:
            if not self._claimed:
                if step not in self.storage.list_steps():
                    self._resolve(step)  # raises NoCheckpointError; takes (creates) no lock
                self._acquire()
            known = self._known()
            if step not in known:
                self._resolve(step)
            where = self.storage.describe(step)
            root = self.root.rstrip("/")
            if not force:
                if self.storage.is_pinned(step):
                    raise StepProtectedError(
                        f"{where} is pinned; nothing was deleted. Unpin it first "
                        f"(mgr.unpin({step}), `ckptstore unpin {root} --step {step}`), or "
                        f"delete it anyway with force=True (`ckptstore rm {root} --step "
                        f"{step} --force`)"
                    )
                if not self._another_good(known, step):
                    report = verify_checkpoint(self.storage, step, deep=True)
                    if report.ok:
                        others = len(known) - 1
                        raise StepProtectedError(
                            f"{where} is the only checkpoint in {root} that verifies "
                            f"({others} other step{'s' * (others != 1)}); deleting it would "
                            "leave nothing to resume from, so nothing was deleted. Delete "
                            f"it anyway with force=True (`ckptstore rm {root} --step {step} "
                            "--force`)"
                        )
            try:
                # Durable on return; on object stores the files go now, not later, so a
                # new save of the same step cannot lose its files to a late deletion.
                self.storage.delete(step, background=False, durable=True)
            except FileNotFoundError:
                pass  # gone meanwhile: what was asked is done
            except OSError as e:
                raise CommitError(f"could not delete {where}: {e}; it is still there") from e
            self._forget(step)
            log.info("deleted %s", where)

    def _another_good(self, known: RetentionPlanner, step: int) -> bool:
        """Whether a committed step other than ``step`` verifies (newest first, deep)."""
        for s in reversed(known):
            if s == step or s in self._known_bad:
                continue
            if s in self._known_good:
                return True
            if verify_checkpoint(self.storage, s, deep=True).ok:
                self._known_good.add(s)
                return True
            self._known_bad.add(s)
        return False

    def gc(self) -> list[str]:
        """Remove stale ``.tmp-``/``.trash-`` entries and manifest-less step directories.

        In a directory that is not a store it does nothing and creates nothing.
        """
        self._check_open()
        self.wait_save()  # our own save in flight is not stale: its .tmp- must stay
        with self._mutex:
            if not self._claimed:
                if self.storage.root_state().kind != "store":
                    return []  # take (create) no lock in a directory that is no store
                self._acquire()
            removed = self.storage.gc(include_tmp=True)
            # gc may bring back a step an interrupted replacement had moved aside: list anew.
            self._planner = None
        wait_for_deletions()
        return removed

    # ---- lifecycle ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            msg = "this CheckpointManager is closed"
            raise RuntimeError(msg)

    def close(self) -> None:
        """Finish the in-flight save and uploads, release the writer lock and the group.

        Raises:
            CommitError: the last async save failed.
            ReplicaError: an upload failed (the step stays in the local store; the next
                manager on it uploads it).
        """
        if self._closed:
            return
        try:
            self.wait_save()
            if self._writer is not None:
                self._writer.shutdown()
            upload_error: ReplicaError | None = None
            if self.replica is not None:
                try:
                    self.replica.close()
                except ReplicaError as e:
                    upload_error = e
            self._raise_bg_error()
            if upload_error is not None:
                raise upload_error
        finally:
            if self.replica is not None:
                self.replica.close(wait=False)  # a no-op once closed above
            self._closed = True
            self._claimed = False
            self._planner = None
            if self._lock is not None:
                self._lock.release()
            if self._bg_coord is not None:
                self._bg_coord.close()
            self.coord.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, format={self.format!r}, policy={self.policy!r})"


def _commit_error(e: BaseException, where: str, previous: int | None) -> CommitError:
    reason = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "the filesystem is read-only",
        errno.EIO: "an I/O error",
    }.get(getattr(e, "errno", None) or 0, type(e).__name__)
    prev = (
        f"step {previous} is still the newest checkpoint"
        if previous is not None
        else "nothing was committed"
    )
    return CommitError(
        f"saving {where} failed: {reason} ({e}); nothing of it is visible and {prev}"
    )


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            msg = f"metrics keys must be str, got {k!r}"
            raise ValueError(msg)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, int | float):
            try:
                v = float(v)
            except (TypeError, ValueError):
                msg = f"metrics[{k!r}] must be a number, got {type(v).__name__}"
                raise ValueError(msg) from None
        out[k] = float(v)
    return out


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    # A deep copy: an async save writes the manifest later, and what the caller changes
    # after save returns must not end up in it.
    d = copy.deepcopy(dict(metadata or {}))
    try:
        json.dumps(d, allow_nan=False)
    except (TypeError, ValueError) as e:
        msg = f"metadata must be JSON-serializable (no NaN): {e}"
        raise ValueError(msg) from None
    return d


#: Payload files written at once; more only adds contention on 2-4 cores per rank.
_WRITE_THREADS = 3
#: Below this many payload bytes a save writes its files one after another on the caller's
#: thread (a thread start costs ~0.5 ms here, longer than writing a few small files).
_INLINE_WRITE_BYTES = 4 << 20


def _group_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _plain_oserror(e: BaseException) -> bool:
    return isinstance(e, OSError) and not isinstance(e, CkptStoreError)


def _shard_error(
    failed: list[tuple[int, Any]], where: str, previous: int | None
) -> CommitError | UnsafeCheckpointError:
    """The error every rank raises when some ranks could not write their part of a save.

    A state that cannot be saved at all (it needs pickle, compression with DTensors, a
    Partial placement, an optimizer without its model) stays an ``UnsafeCheckpointError``,
    as in a replicated save; a failure to write is a ``CommitError``.
    """
    prev = (
        f"step {previous} is still the newest checkpoint"
        if previous is not None
        else "nothing was committed"
    )
    detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
    ranks = ", ".join(str(r) for r, _ in failed)
    if failed and all(isinstance(e, UnsafeCheckpointError) for _, e in failed):
        return UnsafeCheckpointError(
            f"sharded save of {where} refused by rank(s) {ranks} ({detail}); nothing of it is "
            f"visible and {prev}"
        )
    return CommitError(
        f"sharded save of {where} aborted: rank(s) {ranks} failed to write their shard ({detail}); "
        f"nothing of it is visible and {prev}"
    )

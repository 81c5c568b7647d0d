"""What one manager holds and knows of its store, shared by the save and restore pipelines.

Not a stage: the storage and coordinator, the node-local topology, the writer lock (and
whether this process has claimed the store), and what the manager has learnt of the steps
(known good and bad, their metrics, the retention planner). The stages of ``save/`` and
``restore/`` take it as their first argument; nothing here imports a stage or the manager.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ._log import logger as log
from .dist import Coordinator
from .errors import ClosedError, CommitError, ManifestError, NoCheckpointError, StoreLockedError
from .manifest import Manifest
from .retention import CheckpointInfo, RetentionPlanner, RetentionPolicy
from .storage import Storage
from .storage.base import WriterLock
from .tiers.replica import Replicator

__all__ = ["Session"]


@dataclass(eq=False)
class Session:
    """The store one :class:`~ckptstore.manager.CheckpointManager` works on, and its state."""

    storage: Storage
    coord: Coordinator
    policy: RetentionPolicy
    #: The ranks whose local store is this rank's (all of them on a shared filesystem;
    #: one node's on node-local disks): the lowest of them writes that store.
    peers: list[int]
    #: Node-local roots: the ranks of a sharded save commit a copy per store.
    split: bool
    lock: WriterLock | None
    #: Node-local roots: this node leader's parent and children in the tree of node leaders
    #: (``tiers.nodes.leader_links``); None on a shared store and on other ranks.
    links: tuple[int | None, tuple[int, ...]] | None = None
    #: The replica tier (``replica=``): its uploader on the rank that uploads, else None.
    replica: Replicator | None = None
    replica_storage: Storage | None = None
    mutex: threading.RLock = field(default_factory=threading.RLock)
    #: Held while this process takes or tests the writer lock: two threads of one manager
    #: each took it, and the second was refused as "another writer" (found by review).
    claim_mutex: threading.RLock = field(default_factory=threading.RLock)
    #: Steps that verify (on node-local roots: on every node; committed by every node, read
    #: by a restore on every rank, or agreed by ``prune``).
    known_good: set[int] = field(default_factory=set)
    #: Steps found not to verify (restore skipped them, verify or retention failed them).
    known_bad: set[int] = field(default_factory=set)
    metrics: dict[int, Mapping[str, float]] = field(default_factory=dict)
    #: Whether this process is the store's writer: it holds the writer lock (local), or
    #: it is rank 0 and has begun to write (object stores, which have no lock).
    claimed: bool = False
    #: While claimed: the committed steps, their metrics and the retention plan, kept up
    #: to date by this manager's own commits and deletions (no other process writes), so
    #: a save touches O(1) entries of the store however many steps it holds.
    planner: RetentionPlanner | None = None
    closed: bool = False

    @property
    def root(self) -> str:
        """The store's root, as the storage spells it."""
        return self.storage.root

    @property
    def node_leader(self) -> bool:
        """Whether this rank is the lowest of those sharing its store (the one that writes it)."""
        return self.coord.rank == min(self.peers)

    def steps(self) -> list[int]:
        """Committed steps, ascending (by number, never as text)."""
        return self.storage.list_steps()

    def resolve(self, step: int | None) -> int:
        """``step`` if it is committed, the newest one for None; else ``NoCheckpointError``."""
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

    def previous(self, step: int) -> int | None:
        """The newest committed step other than ``step`` (None: none, or unlistable)."""
        try:
            older = [s for s in self.steps() if s != step]
        except OSError:
            return None
        return older[-1] if older else None

    def check_open(self) -> None:
        """Raise ``RuntimeError`` once the manager is closed."""
        if self.closed:
            msg = "this CheckpointManager is closed"
            raise ClosedError(msg)

    def acquire(self) -> None:
        """Become the store's writer (rank 0): take its lock where it has one.

        Raises:
            StoreLockedError: another process writes the store.
        """
        with self.claim_mutex:
            if self.claimed:
                return
            if self.lock is not None:
                # A maintenance command (`ckptstore prune` from cron) at work is waited for,
                # within the other ranks' wait for this one's verdict (``barrier_timeout``).
                self.lock.acquire(maintenance_wait=self.coord.timeout / 2)
            self.claimed = self.node_leader

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """Hold the store's writer lock, where it is free, while the block fetches a step.

        A restore's fetch from the replica (``tiers.ensure_local``) writes a ``.tmp-``
        directory into the root, and ``gc`` (the CLI's, or a job's first save) takes one
        that no writer's lock covers for the leftover of a crashed save: it removed the
        fetch under way, and the restore failed with a raw ``FileNotFoundError``. A lock
        this manager does not hold yet is taken for the block only (a restore-only manager
        stays no writer). One another process holds is left to it: that process is the
        store's writer (the CLI's ``gc`` refuses to run while it holds it).
        """
        lock = self.lock
        took = False
        with self.claim_mutex:
            if lock is not None and not lock.is_locked:
                try:
                    lock.acquire()
                    took = True
                except (StoreLockedError, CommitError) as e:
                    log.debug("fetching into %s without its writer lock: %s", self.storage.root, e)
        try:
            yield
        finally:
            with self.claim_mutex:
                if took and lock is not None and not self.claimed:
                    lock.release()

    def take_lock(self) -> None:
        """Become the writer before a save; a lock just taken also clears crashed saves."""
        with self.claim_mutex:
            fresh = self.lock is not None and not self.lock.is_locked
            self.acquire()
        if fresh:
            # We are now the only writer: leftovers of crashed saves are garbage.
            with contextlib.suppress(OSError):
                for name in self.storage.gc(include_tmp=True):
                    log.info("removed stale %s", name)

    def known(self) -> RetentionPlanner:
        """The committed steps as retention sees them.

        While this manager is the store's writer the answer is kept up to date by its own
        commits and deletions (one listing, and one read of the manifests retention needs,
        per manager); otherwise the store is listed afresh, since others may write it.
        """
        if self.planner is not None:
            return self.planner
        steps = self.storage.list_steps()
        if self.policy.needs_metrics:
            # A committed manifest never changes: read each once per manager.
            misses = [s for s in steps if s not in self.metrics]
            if misses:
                got = self.storage.read_manifests(misses, complete=len(misses) == len(steps))
                for s, m in got.items():
                    self.metrics[s] = {} if isinstance(m, ManifestError) else m.metrics
        planner = RetentionPlanner(
            self.policy, (CheckpointInfo(s, self.metrics.get(s, {})) for s in steps)
        )
        if self.claimed:
            self.planner = planner
        return planner

    def verified(self, step: int, ok: bool) -> None:
        """A deep verification of ``step`` on this rank's store passed (``ok``) or failed.

        On node-local roots a pass says nothing of the other nodes' parts of the step:
        ``known_good`` holds only steps good on every node (see ``save/after_commit``).
        """
        with self.mutex:
            if ok and self.split:
                return
            (self.known_good if ok else self.known_bad).add(step)
            (self.known_bad if ok else self.known_good).discard(step)

    def committed(self, manifest: Manifest) -> None:
        """Rank 0 committed ``manifest``: what the manager knows of the store follows."""
        step = manifest.step
        with self.mutex:
            self.known_good.add(step)
            self.known_bad.discard(step)
            self.metrics[step] = manifest.metrics
            if self.planner is not None:
                self.planner.add(step, manifest.metrics)

    def forget(self, step: int) -> None:
        """``step`` was deleted (by this manager, or found gone)."""
        with self.mutex:
            self.known_good.discard(step)
            self.known_bad.discard(step)
            self.metrics.pop(step, None)
            if self.planner is not None:
                self.planner.remove(step)

"""Listing stores: every committed step with its manifest, pins and stale entries.

What ``ckptstore ls`` prints, for Python: :func:`list_store` lists one store,
:func:`list_stores` a store or the stores inside a directory (Lightning's ``dirpath``, one
store per ``*.ckpt`` name). Only manifests are read (a local store answers from its listing
cache), and nothing imports torch. A node's partial copy of a step (node-local roots: the
``local-ranks`` marker) is listed with the ranks whose files it holds.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from .._fmt import created_json, metric_json
from ..errors import CkptStoreError, IntegrityError
from ..manifest import Manifest
from ..storage import Storage, open_storage
from ..tiers.nodes import local_ranks
from ..tiers.safety import read_replica_url, replicated_steps
from .stores import find_stores, open_store, reaching

__all__ = ["Listings", "StepInfo", "StoreListing", "list_store", "list_stores"]


@dataclasses.dataclass
class StepInfo:
    """One committed step, or one whose manifest is broken (``error`` says why).

    ``error`` beside a ``manifest``: the step's ``local-ranks`` marker is damaged.
    """

    step: int
    pinned: bool
    manifest: Manifest | None = None
    error: str | None = None
    #: With a replica: where the step is (``"local"``, ``"replica"``), else None.
    tiers: tuple[str, ...] | None = None
    #: With a replica: whether the local step's upload is done (None without a replica,
    #: or for a step that is only on the replica).
    uploaded: bool | None = None
    #: A node's partial copy (node-local roots): the ranks whose files this store holds;
    #: None where it holds every rank's files.
    local_ranks: list[int] | None = None

    @property
    def partial(self) -> bool:
        """Whether this store holds only some ranks' files of the step (node-local roots)."""
        return self.local_ranks is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``ckptstore ls --json``)."""
        m = self.manifest
        return {
            "step": self.step,
            "created": created_json(m) if m else None,
            "bytes": m.total_bytes if m else None,
            "files": len(m.files) if m else None,
            "metrics": {k: metric_json(v) for k, v in m.metrics.items()} if m else None,
            "pinned": self.pinned,
            "format": m.format if m else None,
            "world_size": m.world_size if m else None,
            "sharded": m.sharded if m else None,
            "sharding": m.sharding_kind if m else None,
            "error": self.error,
            "tiers": list(self.tiers) if self.tiers is not None else None,
            "uploaded": self.uploaded,
            "local_ranks": self.local_ranks,
        }


@dataclasses.dataclass
class StoreListing:
    """The committed steps of one store and its stale entries (``ckptstore gc`` removes them)."""

    root: str
    steps: list[StepInfo]
    garbage: list[str]
    #: The replica this local store uploads to (recorded by the manager), or None.
    replica: str | None = None

    @property
    def broken(self) -> bool:
        """Whether a step's manifest cannot be read."""
        return any(s.error for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        """JSON form of one store among several."""
        return {
            "root": self.root,
            "steps": [s.to_dict() for s in self.steps],
            "garbage": list(self.garbage),
            "replica": self.replica,
        }


@dataclasses.dataclass
class Listings:
    """What :func:`list_stores` found: one store, or the stores inside a directory."""

    root: str
    stores: list[StoreListing]
    #: True when ``root`` is not a store itself but holds the ``stores``.
    nested: bool


def _one_line(message: str) -> str:
    parts = [p.strip() for p in message.splitlines() if p.strip()]
    return " | ".join(parts) if parts else message


def _listing(storage: Storage) -> StoreListing:
    with reaching(storage.root):
        steps, garbage = storage.scan()
        # One read per step from the storage, not a manager's manifest(): that re-lists the
        # store per step, quadratic on an object store; a local store answers from its cache.
        manifests = storage.read_manifests(steps, complete=True)
        if any(isinstance(m, CkptStoreError) for m in manifests.values()):
            # A step whose manifest could not be read may have been deleted since the scan
            # (a running job's retention): listed again, one that is gone is left out, not
            # shown BROKEN (ls exited 1 on a healthy store while its job saved).
            still = set(storage.list_steps())
            steps = [s for s in steps if s in still or not isinstance(manifests[s], CkptStoreError)]
        infos = []
        for step in steps:
            pinned = storage.is_pinned(step)
            m = manifests[step]
            if isinstance(m, CkptStoreError):
                infos.append(StepInfo(step, pinned, error=_one_line(str(m))))
            else:
                # Only a sharded step of several ranks on a local disk (an object store is
                # shared by every rank) can be a node's partial copy: one lookup for those.
                split = storage.atomic_rename and m.sharded and m.world_size > 1
                ranks, error = None, None
                if split:
                    try:
                        ranks = local_ranks(storage, step, m)
                    except IntegrityError as e:  # a damaged marker: the step is corrupt
                        ranks, error = [], _one_line(str(e))
                infos.append(StepInfo(step, pinned, manifest=m, error=error, local_ranks=ranks))
    return StoreListing(storage.root, infos, garbage)


def _with_tiers(
    res: StoreListing, storage: Storage, replica: str | None, options: Mapping[str, Any] | None
) -> StoreListing:
    """Add each step's tiers and upload state to the listing of a local store.

    From the ``replicated`` markers, or the replica's own listing when its URL is given
    (``ls --replica URL``).
    """
    url = replica or read_replica_url(storage)
    if url is None:
        return res
    # Recorded safe on this very replica as these very saves (never on another URL's word).
    done = replicated_steps(
        storage,
        [s.step for s in res.steps],
        url,
        {s.step: s.manifest for s in res.steps if s.manifest is not None},
    )
    remote: set[int] = set()
    if replica is not None:
        with reaching(replica):
            remote = set(open_storage(replica, options).list_steps())
    for s in res.steps:
        # The replica's own listing, where given, is the truth: a marker records what was
        # safe there once, and the replica's retention may have deleted the step since.
        s.uploaded = s.step in remote if replica is not None else s.step in done
        s.tiers = ("local", "replica") if s.uploaded else ("local",)
    have = {s.step for s in res.steps}
    res.steps.extend(StepInfo(s, False, tiers=("replica",)) for s in remote - have)
    res.steps.sort(key=lambda s: s.step)
    res.replica = url
    return res


def list_store(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> StoreListing:
    """Every committed step of the store at ``root`` with its manifest (or why it is broken).

    Args:
        root: a local directory or an fsspec URL.
        storage_options: fsspec options for a URL.

    Returns:
        The steps in ascending order, and the stale entries of interrupted saves.

    Raises:
        NoCheckpointError: there is no store at ``root``.
        CkptStoreError: an object store cannot be reached (the message says what to check).
    """
    return _listing(open_store(root, storage_options))


def list_stores(
    root: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    replica: str | None = None,
) -> Listings:
    """List the store at ``root``, or each store directly inside it.

    A Lightning checkpoint directory (``ModelCheckpoint(dirpath=...)`` with the
    ``CkptStoreIO`` plugin) holds one store per ``*.ckpt`` name: each is listed.

    A local store that uploads to a replica (``CheckpointManager(..., replica=URL)``) has
    each step's tiers and upload state filled in from its ``replicated`` markers; with
    ``replica`` that store is listed too (``storage_options`` are then its options), and
    steps only there are added.

    Raises:
        NoCheckpointError: ``root`` is neither a store nor holds any.
        CkptStoreError: an object store cannot be reached (the message says what to check).
    """
    storage, stores = find_stores(root, storage_options if replica is None else None)
    nested = stores != [storage]
    out = [
        _with_tiers(_listing(s), s, replica if not nested else None, storage_options)
        for s in stores
    ]
    return Listings(storage.root, out, nested)

"""Listing stores: every committed step with its manifest, pins and stale entries.

What ``ckptstore ls`` prints, for Python: :func:`list_store` lists one store,
:func:`list_stores` a store or the stores inside a directory (Lightning's ``dirpath``, one
store per ``*.ckpt`` name). Only manifests are read (a local store answers from its listing
cache), and nothing imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ._fmt import created_json, metric_json
from .errors import CkptStoreError
from .manifest import Manifest
from .storage import Storage
from .stores import find_stores, open_store, reaching

__all__ = ["Listings", "StepInfo", "StoreListing", "list_store", "list_stores"]


@dataclasses.dataclass
class StepInfo:
    """One committed step, or one whose manifest is broken (``error`` says why)."""

    step: int
    pinned: bool
    manifest: Manifest | None = None
    error: str | None = None

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
        }


@dataclasses.dataclass
class StoreListing:
    """The committed steps of one store and its stale entries (``ckptstore gc`` removes them)."""

    root: str
    steps: list[StepInfo]
    garbage: list[str]

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
        infos = []
        for step in steps:
            pinned = storage.is_pinned(step)
            m = manifests[step]
            if isinstance(m, CkptStoreError):
                infos.append(StepInfo(step, pinned, error=_one_line(str(m))))
            else:
                infos.append(StepInfo(step, pinned, manifest=m))
    return StoreListing(storage.root, infos, garbage)


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
        NoCheckpointError: there is no store at ``root`` (see :func:`ckptstore.stores.open_store`).
        CkptStoreError: an object store cannot be reached (the message says what to check).
    """
    return _listing(open_store(root, storage_options))


def list_stores(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Listings:
    """List the store at ``root``, or each store directly inside it.

    A Lightning checkpoint directory (``ModelCheckpoint(dirpath=...)`` with the
    ``CkptStoreIO`` plugin) holds one store per ``*.ckpt`` name: each is listed.

    Raises:
        NoCheckpointError: ``root`` is neither a store nor holds any.
        CkptStoreError: an object store cannot be reached (the message says what to check).
    """
    storage, stores = find_stores(root, storage_options)
    nested = stores != [storage]
    return Listings(storage.root, [_listing(s) for s in stores], nested)

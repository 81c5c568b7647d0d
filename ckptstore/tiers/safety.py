"""What a step is safe on: the ``replicated`` marker and the replica URL record.

A step is safe on a replica when that replica holds this very save of it (its manifest's
SHA-256 is recorded per replica URL in the step's local ``replicated`` marker, see
:mod:`ckptstore.tiers.replica`); never carried over from another replica nor from an
earlier save of the same step number.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .._log import logger as log
from ..errors import (
    CkptStoreError,
)
from ..layout import REPLICA_NAME, REPLICATED_NAME, step_dirname
from ..manifest import Manifest
from ..storage import Storage

__all__ = [
    "LEGACY",
    "forget_replicated",
    "manifest_digest",
    "mark_replicated",
    "read_replica_url",
    "replica_key",
    "replicated_steps",
    "safe_on",
    "write_replica_url",
]


def manifest_digest(manifest: Manifest) -> str:
    """The SHA-256 of ``manifest``'s bytes: which save of a step a record is about."""
    return hashlib.sha256(manifest.to_bytes()).hexdigest()


def replica_key(where: Storage | str) -> str:
    """How a replica is named in the ``replicated`` markers: its store's normalized root.

    A URL is normalized as :func:`~ckptstore.storage.open_storage` does (a trailing slash
    dropped; a local path or ``file://`` URL made absolute), so two spellings of one replica
    share a record; a spelling that still differs only costs a check of the replica's copy.
    """
    if isinstance(where, Storage):
        return where.root
    protocol, sep, rest = where.partition("://")
    if not sep:
        protocol, rest = "", where
    if protocol in ("", "file", "local"):
        return os.path.abspath(os.path.expanduser(rest))
    return where.rstrip("/")


#: A ``replicated`` marker without a record (written by an older version, or unreadable):
#: the step was once uploaded to the replica recorded in the root, which save is unknown.
LEGACY = "legacy"


def safe_on(local: Storage, step: int) -> dict[str, str] | None:
    """The replicas ``step``'s local copy is recorded safe on: replica key -> manifest digest.

    ``None`` without a marker; ``{LEGACY: ""}`` for a marker that records nothing (an older
    version's, or one whose bytes were lost): the caller checks the replica itself.
    """
    rel = f"{step_dirname(step)}/{REPLICATED_NAME}"
    try:
        if not local._exists(rel):
            return None
        with local._open_read(rel) as f:
            data: Any = json.loads(f.read(1 << 16))
    except OSError:
        return None
    except ValueError:
        return {LEGACY: ""}
    rec = data.get("safe_on") if isinstance(data, dict) else None
    if not isinstance(rec, dict):
        return {LEGACY: ""}
    return {k: v for k, v in rec.items() if isinstance(k, str) and isinstance(v, str)}


def mark_replicated(local: Storage, step: int, replica: Storage | str, manifest: Manifest) -> None:
    """Record in the local ``step`` that ``replica`` holds this save of it, verified.

    Best effort: a record that is lost (a crash while it is rewritten, a full disk) only
    makes the next uploader check the replica's copy again.
    """
    d = step_dirname(step)
    rel = f"{d}/{REPLICATED_NAME}"
    key, digest = replica_key(replica), manifest_digest(manifest)
    try:
        # The local copy must be this save (a step saved again meanwhile is another one).
        if local.read_manifest(step).to_bytes() != manifest.to_bytes():
            return
        rec = {k: v for k, v in (safe_on(local, step) or {}).items() if k != LEGACY}
        if rec.get(key) == digest:
            return
        rec[key] = digest
        body = json.dumps({"safe_on": rec}, sort_keys=True).encode() + b"\n"
        with contextlib.suppress(FileNotFoundError):
            local._remove(rel)
        local._put_small(rel, body)  # its bytes are read back: written durably
        local._fsync_dir(d)
    except (OSError, CkptStoreError) as e:  # deleted meanwhile, the disk full, another rank
        log.debug("could not mark %s replicated: %s", local.describe(step), e)


def forget_replicated(local: Storage, step: int, replica: Storage | str) -> None:
    """Drop the record that ``replica`` holds the local ``step`` (it was found gone there).

    Best effort, as :func:`mark_replicated`: a record that stays is distrusted by the
    uploader that found the step gone, and the next one finds it gone again. An old marker
    that names no replica goes whole.
    """
    d = step_dirname(step)
    rel = f"{d}/{REPLICATED_NAME}"
    key = replica_key(replica)
    try:
        rec = safe_on(local, step)
        if rec is None:
            return
        rest = {k: v for k, v in rec.items() if k not in (key, LEGACY)}
        if rest == rec:
            return
        with contextlib.suppress(FileNotFoundError):
            local._remove(rel)
        if rest:
            body = json.dumps({"safe_on": rest}, sort_keys=True).encode() + b"\n"
            local._put_small(rel, body)
        local._fsync_dir(d)
    except (OSError, CkptStoreError) as e:  # deleted meanwhile, the disk full
        log.debug("could not drop the replica record of %s: %s", local.describe(step), e)


def replicated_steps(
    local: Storage,
    steps: Iterable[int],
    replica: Storage | str | None = None,
    manifests: Mapping[int, Manifest] | None = None,
) -> set[int]:
    """Those of ``steps`` recorded safe on ``replica`` (default: the one the root records).

    With ``manifests`` (the local ones) a record counts only for that save of the step; an
    old marker that records no replica counts for the replica the root records.
    """
    recorded = read_replica_url(local)
    url = replica if replica is not None else recorded
    if url is None:
        return set()
    key = replica_key(url)
    legacy_ok = recorded is not None and replica_key(recorded) == key
    out = set()
    for s in steps:
        rec = safe_on(local, s)
        if rec is None:
            continue
        if LEGACY in rec:
            if legacy_ok:
                out.add(s)
            continue
        want = manifests.get(s) if manifests is not None else None
        if key in rec and (want is None or rec[key] == manifest_digest(want)):
            out.add(s)
    return out


def write_replica_url(local: Storage, url: str) -> None:
    """Record the replica's URL in the local root (``ckptstore ls`` shows the tiers)."""
    body = json.dumps({"replica": url}).encode() + b"\n"
    try:
        if local._exists(REPLICA_NAME):
            with local._open_read(REPLICA_NAME) as f:
                if f.read(4096) == body:
                    return
            local._remove(REPLICA_NAME)
        local._put_small(REPLICA_NAME, body)
    except FileExistsError:
        pass  # another rank of this node recorded it at the same moment (the same bytes)
    except OSError as e:
        log.warning("could not record the replica URL in %s: %s", local.root, e)


def read_replica_url(local: Storage) -> str | None:
    """The replica URL recorded in the local root, or ``None``."""
    try:
        if not local._is_regular_file(REPLICA_NAME):
            return None
        with local._open_read(REPLICA_NAME) as f:
            data = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    url = data.get("replica") if isinstance(data, dict) else None
    return url if isinstance(url, str) else None

"""Two tiers as the manager sees them: opening the replica, and steps from either tier.

The uploader itself is :mod:`ckptstore.tiers.replica`. Here: the replica store opened next to the
local one (and its uploader, on the rank that uploads), the union of both tiers' steps that
``resume``/``restore`` choose from, and a replica step brought into the local store so the
ordinary read path (checksums included) restores it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .._log import logger as log
from ..errors import CkptStoreError, IntegrityError, NoCheckpointError, ReplicaConfigError
from ..retention import RetentionPolicy
from ..storage import LocalStorage, Storage, open_storage
from . import node_fill
from .replica import Replicator, fetch_step

__all__ = ["all_steps", "check_distinct", "ensure_local", "open_replica"]


def _identity(path: str) -> tuple[str, tuple[int, int] | None]:
    """A local directory as the filesystem knows it: its resolved path, device and inode.

    The device and inode are None where it does not exist (yet): the resolved path of what
    does exist then decides (a symlink in the middle is followed all the same).
    """
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return real, None
    return real, (st.st_dev, st.st_ino)


def check_distinct(local: Storage, replica: Storage, url: str) -> None:
    """Refuse a replica that is the local store itself, however it is spelled.

    Two local stores (a path, a symlink to it, a ``file://`` URL, a bind mount) are the
    same when their device and inode are, or their resolved paths where one does not exist
    yet; other backends compare their roots. The replica's retention would otherwise delete
    local steps, and every local step would count as "safe" there.

    Raises:
        ReplicaConfigError: (a ``ValueError``) they are one store.
    """
    if isinstance(local, LocalStorage) and isinstance(replica, LocalStorage):
        (a_path, a_id), (b_path, b_id) = _identity(local.root), _identity(replica.root)
        same = a_id == b_id if a_id is not None and b_id is not None else a_path == b_path
    else:
        same = replica.root.rstrip("/") == local.root.rstrip("/")
    if same:
        msg = (
            f"replica {url!r} is the local store itself ({local.root}); give another "
            "store as the replica (its retention would delete the local steps)"
        )
        raise ReplicaConfigError(msg)


def open_replica(
    local: Storage,
    url: str,
    options: Mapping[str, Any] | None,
    policy: RetentionPolicy,
    *,
    rank: int | None = None,
    barrier: Callable[[], None] | None = None,
) -> tuple[Storage, Replicator]:
    """Open the replica store at ``url`` and its recovered uploader.

    The uploader first cleans what a crashed upload left on the replica and queues the local
    steps the replica lacks (:meth:`Replicator.recover`). Under torch.distributed (``rank``
    given) every rank has an uploader (each uploads its own files of sharded steps): rank 0
    alone cleans, while every rank is in the manager's constructor (so no uploader of this
    job runs), then ``barrier`` (collective) before any rank queues its uploads.

    Raises:
        ValueError: ``url`` is not a string.
        ReplicaConfigError: (a ``ValueError``) ``url`` is the local store itself, under
            whatever name (:func:`check_distinct`).
        ImportError: the fsspec backend for ``url`` is not installed.
    """
    if not isinstance(url, str) or not url:
        msg = f"replica must be an fsspec URL string (e.g. 's3://bucket/run1'), got {url!r}"
        raise ValueError(msg)
    replica = open_storage(url, options)
    check_distinct(local, replica, url)
    replica.check_root(create=True)
    up = Replicator(local, replica, policy=policy, url=url, rank=rank, retention=rank in (None, 0))
    try:
        if rank == 0:
            up.clean()
    except (OSError, CkptStoreError) as e:
        log.error("could not clean the replica %s: %s", url, e)
    if rank is not None and barrier is not None:
        barrier()
    try:
        up.recover(clean=rank is None)
    except (OSError, CkptStoreError) as e:
        # The replica being unreachable must not stop training (nor, under torch.distributed,
        # leave a rank out of the next collective): the local tier works, the error is
        # raised by wait()/close(), and the next manager recovers.
        log.error("could not recover the replica %s: %s; saving locally only for now", url, e)
        up.failed(e)
    return replica, up


def all_steps(local: Storage, replica: Storage | None) -> list[int]:
    """The committed steps of both tiers, ascending.

    A replica that fails to list is skipped with a warning: the local steps still restore.
    """
    steps = set(local.list_steps())
    if replica is not None:
        try:
            steps.update(replica.list_steps())
        except Exception as e:  # botocore's errors are no OSError; the local tier still works
            log.warning("could not list the replica %s: %s; using the local steps", replica.root, e)
    return sorted(steps)


def on_replica(replica: Storage | None, step: int) -> bool:
    """Whether ``step`` is committed on the replica (False without one, or unreachable)."""
    if replica is None:
        return False
    try:
        return step in replica.list_steps()
    except Exception:  # unreachable (botocore's errors are no OSError): not to be had there
        return False


def ensure_local(local: Storage, replica: Storage, step: int, *, replace: bool = False) -> bool:
    """Bring the replica's ``step`` into the local store unless it is there already.

    With ``replace`` the local copy (which failed its checks) is replaced by the replica's;
    a node's partial copy (node-local roots) is completed with the files it lacks
    (:func:`ckptstore.tiers.node_fill.fill`) instead of fetched whole.

    Returns:
        Whether it was fetched.

    Raises:
        NoCheckpointError, ManifestError, IntegrityError: the replica's copy is missing or
            does not verify (nothing local changed).
        OSError: the local disk refused it.
    """
    here = step in local.list_steps()
    if not replace and here:
        return False
    try:
        # A node's partial copy (node-local roots) takes only the files it lacks.
        if here and node_fill.fill(local, replica, step) is not None:
            return True
        fetch_step(replica, local, step, replace=here)
    except NoCheckpointError as e:  # deleted there meanwhile: this step is not to be had
        raise IntegrityError(f"step {step} is in neither tier any more: {e}") from e
    return True

"""Two tiers as the manager sees them: opening the replica, and steps from either tier.

The uploader itself is :mod:`ckptstore.tiers.replica`. Here: the replica store opened next to the
local one (and its uploader, on the rank that uploads), the union of both tiers' steps that
``resume``/``restore`` choose from, and a replica step brought into the local store so the
ordinary read path (checksums included) restores it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .._log import logger as log
from ..errors import (
    CkptStoreError,
    ConfigError,
    IntegrityError,
    NoCheckpointError,
    ReplicaConfigError,
    ReplicaUnavailableError,
)
from ..retention import RetentionPolicy
from ..storage import LocalStorage, Storage, open_storage
from . import node_fill
from .replica import Replicator, fetch_step, list_within

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "REPLICA_EVERY",
    "all_steps",
    "bounded_options",
    "check_distinct",
    "ensure_local",
    "open_bounded",
    "open_replica",
    "probe_replica",
]

#: Seconds the manager's constructor waits for the replica to answer, and about the longest
#: ``wait()``/``close()`` keep trying a replica that cannot be reached (``replica_timeout=``).
DEFAULT_REPLICA_TIMEOUT = 60.0
#: What ``replica_every=`` takes: upload every step (local ones held back until they are
#: uploaded), or only the newest when uploads fall behind.
REPLICA_EVERY = ("all", "latest")
#: Attempts of one request to an S3 replica, by botocore and by s3fs each (both default 5,
#: with back-off): with the connect timeout below, one request that cannot connect fails
#: within about ``replica_timeout / 3``.
_S3_ATTEMPTS = 2
#: The shortest read timeout :func:`bounded_options` sets: a healthy store under load (a
#: large part checked and stored) may take seconds to answer.
_READ_TIMEOUT_MIN = 5.0
#: Seconds the probe allows an S3 replica's client to be made (imports, a session, the
#: service model: local work, seconds on a loaded host) before ``replica_timeout`` starts.
CLIENT_START_MAX = 120.0


def bounded_options(url: str, options: Mapping[str, Any] | None, timeout: float) -> dict[str, Any]:
    """``options`` for an S3 replica, bounded so an endpoint that does not answer fails fast.

    botocore's ``connect_timeout`` (``min(5, timeout / 12)`` s), ``read_timeout``
    (``timeout / 4``, at least 5 and at most 60 s: botocore's own is 60 s, and a request
    to an endpoint that took it and never answers waited that long on each of its attempts,
    so ``close()`` took 93 s with ``replica_timeout=10``) and its attempts (2, standard
    mode) are set unless the options set them (``config_kwargs``); s3fs's own retry loop is
    bounded after the filesystem is made (:func:`_bound_fs`). Other URLs' options are
    returned as given.
    """
    out = dict(options or {})
    if url.partition("://")[0] not in ("s3", "s3a"):
        return out
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("connect_timeout", min(5.0, timeout / 12))
    config.setdefault("read_timeout", min(60.0, max(_READ_TIMEOUT_MIN, timeout / 4)))
    config.setdefault("retries", {"max_attempts": _S3_ATTEMPTS, "mode": "standard"})
    out["config_kwargs"] = config
    return out


def _bound_fs(replica: Storage) -> None:
    # s3fs retries a request that could not connect 5 times with back-off, on top of
    # botocore's attempts; it takes no option for it, only this attribute. The instance is
    # the replica's own (its bounded config_kwargs are part of fsspec's cache key).
    fs = getattr(replica, "fs", None)
    if fs is not None and isinstance(getattr(fs, "retries", None), int):
        fs.retries = min(fs.retries, _S3_ATTEMPTS)


#: What the manager's constructor says to do about a replica it refuses.
MANAGER_HINT = (
    "nothing was saved; fix it, or construct the manager without replica= to save locally only"
)


def probe_replica(replica: Storage, url: str, timeout: float, *, hint: str = MANAGER_HINT) -> None:
    """Check that the replica answers (a listing, and its bucket exists) within ``timeout``.

    What can be known before a step is saved: a bucket that does not exist, no or bad
    credentials, access denied, an endpoint that does not answer. ``hint`` ends each
    message (what to do next).

    Raises:
        ReplicaUnavailableError: one line naming ``url`` and what to check; the client's
            error is the cause.
    """
    from ..ops.stores import missing_bucket  # ops imports the tiers; not the other way

    box: list[BaseException | str | None] = []
    # The timeout is for the replica's answer: an S3 client is made first (s3fs's connect:
    # a session and its client, local work unless credentials must be fetched), and its
    # start-up, which a loaded host slows down, is not counted against it.
    connect = None
    if url.partition("://")[0] in ("s3", "s3a"):
        connect = getattr(getattr(replica, "fs", None), "connect", None)
    started = threading.Event()

    def look() -> None:
        try:
            if callable(connect):
                connect()
        except BaseException as e:
            box.append(e)
            return
        finally:
            started.set()
        try:
            replica.list_steps()
            bucket = missing_bucket(replica)
            box.append(None if bucket is None else f"the bucket {bucket!r} does not exist")
        except BaseException as e:  # handed to the caller's thread
            box.append(e)

    t = threading.Thread(target=look, name="ckptstore-replica-probe", daemon=True)
    t.start()
    start_max = max(timeout, CLIENT_START_MAX)
    if not started.wait(start_max):
        raise ReplicaUnavailableError(
            f"replica {url}: its client did not start within {start_max:g}s; "
            f"check the storage options; {hint}"
        )
    t.join(timeout)
    if not box:
        raise ReplicaUnavailableError(
            f"replica {url}: no answer within {timeout:g}s (replica_timeout); check the "
            f"endpoint_url storage option, the network, and that the service is up; {hint}"
        )
    got = box[0]
    if isinstance(got, str):
        raise ReplicaUnavailableError(
            f"replica {url}: {got}; check the bucket name (and the endpoint_url and region "
            f"storage options); {hint}"
        )
    if isinstance(got, BaseException):
        text = " ".join(str(got).split()) or type(got).__name__
        if not text.startswith(replica.root):  # remote_error's lines name the store first
            text = f"{replica.root}: {text}"
        raise ReplicaUnavailableError(f"replica {text}; {hint}") from got


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


def open_bounded(
    local: Storage, url: str, options: Mapping[str, Any] | None, timeout: float
) -> Storage:
    """The replica store at ``url``, its client bounded by ``timeout`` (not probed yet).

    :func:`bounded_options`, :func:`_bound_fs`, and a request body the endpoint stops
    taking fails its upload after ``timeout`` seconds (``upload_stall``): what the manager
    and ``ckptstore replicate`` open a replica with.

    Raises:
        ReplicaConfigError: ``url`` is the local store itself (:func:`check_distinct`).
    """
    replica = open_storage(url, bounded_options(url, options, timeout))
    check_distinct(local, replica, url)
    _bound_fs(replica)
    if hasattr(replica, "upload_stall"):
        replica.upload_stall = timeout  # a body the endpoint stops taking fails the upload
    return replica


def open_replica(
    local: Storage,
    url: str,
    options: Mapping[str, Any] | None,
    policy: RetentionPolicy,
    *,
    rank: int | None = None,
    world: int | None = None,
    barrier: Callable[[], None] | None = None,
    every: str = "all",
    timeout: float = DEFAULT_REPLICA_TIMEOUT,
    agree: Callable[[BaseException | None], BaseException | None] | None = None,
) -> tuple[Storage, Replicator]:
    """Open the replica store at ``url`` and its recovered uploader.

    The uploader first cleans what a crashed upload left on the replica and queues the local
    steps the replica lacks (:meth:`Replicator.recover`). Under torch.distributed (``rank``
    given) every rank has an uploader (each uploads its own files of sharded steps): rank 0
    alone cleans, while every rank is in the manager's constructor (so no uploader of this
    job runs), then ``barrier`` (collective) before any rank queues its uploads.

    The replica is probed first (:func:`probe_replica`, within ``timeout`` seconds): one that
    cannot be reached or has no bucket is refused before anything is saved. ``every`` is
    ``replica_every=`` (:class:`Replicator`'s ``every``).

    Raises:
        ReplicaUnavailableError: the replica cannot be reached, or its bucket does not
            exist (``agree``: any rank's, on every rank).
        ValueError: ``url`` is not a string.
        ReplicaConfigError: (a ``ValueError``) ``url`` is the local store itself, under
            whatever name (:func:`check_distinct`).
        ImportError: the fsspec backend for ``url`` is not installed.
    """
    if not isinstance(url, str) or not url:
        msg = f"replica must be an fsspec URL string (e.g. 's3://bucket/run1'), got {url!r}"
        raise ConfigError(msg)
    replica = open_bounded(local, url, options, timeout)
    # Refused here, before a step is saved, on every rank alike (``agree``): a replica that
    # cannot be written would otherwise cost local steps or surface only at close().
    problem: BaseException | None = None
    try:
        replica.check_root(create=True)
        probe_replica(replica, url, timeout)
    except (OSError, CkptStoreError) as e:
        problem = e
    if agree is not None:
        problem = agree(problem)
    if problem is not None:
        raise problem
    up = Replicator(
        local,
        replica,
        policy=policy,
        url=url,
        rank=rank,
        world=world,
        retention=rank in (None, 0),
        every=every,
        timeout=timeout,
    )
    try:
        if rank == 0:
            up.clean()
    except Exception as e:  # any: the other ranks wait in the barrier below for rank 0
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


def all_steps(
    local: Storage,
    replica: Storage | None,
    seen: set[int] | None = None,
    *,
    timeout: float | None = None,
) -> list[int]:
    """The committed steps of both tiers, ascending.

    A replica that fails to list (or does not answer within ``timeout`` seconds:
    :func:`~ckptstore.tiers.replica.list_within`) counts as holding ``seen``, the steps it
    was last seen to hold (:meth:`~ckptstore.tiers.replica.Replicator.seen_there`), with a
    warning; a step of those not local is then fetched, and the fetch says whether the
    replica answers.

    Raises:
        ReplicaUnavailableError: the replica does not list and was never seen to: its
            steps may be newer than the local ones, and a restore from the local tier
            alone would silently go back (a new node's empty disk: to step 0).
    """
    steps = set(local.list_steps())
    if replica is not None:
        try:
            steps.update(list_within(replica, timeout))
        except Exception as e:  # botocore's errors are no OSError
            if seen is None:
                newest = max(steps, default=None)
                have = "no step" if newest is None else f"steps up to {newest}"
                raise ReplicaUnavailableError(
                    f"could not list the replica {replica.root}: {e}; it may hold newer steps "
                    f"than the local store {local.root} ({have}), so none is chosen: retry "
                    "once the replica answers, or open the local store without replica= to "
                    "restore from it alone"
                ) from e
            log.warning(
                "could not list the replica %s: %s; taking it to hold the steps it was last "
                "seen to (%s)",
                replica.root,
                e,
                sorted(seen)[-8:] or "none",
            )
            steps.update(seen)
    return sorted(steps)


def on_replica(
    replica: Storage | None,
    step: int,
    seen: set[int] | None = None,
    *,
    timeout: float | None = None,
) -> bool:
    """Whether ``step`` is committed on the replica (False without one).

    A replica that fails to list (or does not answer within ``timeout`` seconds) holds
    ``step`` if it was last seen to (``seen``): the fetch that follows says whether it
    answers.
    """
    if replica is None:
        return False
    try:
        return step in list_within(replica, timeout)
    except Exception as e:  # botocore's errors are no OSError
        log.warning("could not list the replica %s: %s", replica.root, e)
        return seen is not None and step in seen


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

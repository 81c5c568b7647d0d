"""``ckptstore replicate``: a local store's committed steps uploaded from outside the job.

One pass, or a watch that uploads each new step as it commits, with the
:class:`~ckptstore.tiers.replica.Replicator` that a manager runs in the background.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from typing import Any

from .._log import logger as log
from ..errors import ReplicaError, ReplicaTimeoutError
from ..retention import RetentionPolicy
from .copy import DEFAULT_THREADS
from .replica import Replicator
from .twotier import DEFAULT_REPLICA_TIMEOUT

__all__ = ["ReplicateResult", "replicate"]


@dataclasses.dataclass
class ReplicateResult:
    """What :func:`replicate` did.

    Attributes:
        uploaded: steps uploaded by this call, in upload order.
        safe: every local step that is now safe on the replica, ascending.
        failed: steps whose upload failed, with why.
    """

    uploaded: list[int]
    safe: list[int]
    failed: dict[int, str]


#: Seconds between two looks at the stop flag while ``--watch`` waits for its uploads.
_STOP_POLL = 0.2
#: What ``ckptstore replicate`` says to do about a replica it refuses.
_HINT = "nothing was uploaded; fix it and run `ckptstore replicate` again"


def replicate(
    local_root: str | os.PathLike[str],
    url: str,
    replica_options: Mapping[str, Any] | None = None,
    *,
    keep: RetentionPolicy | None = None,
    watch: bool = False,
    interval: float = 10.0,
    stop: threading.Event | None = None,
    threads: int = DEFAULT_THREADS,
    timeout: float = DEFAULT_REPLICA_TIMEOUT,
) -> ReplicateResult:
    """Upload a local store's committed steps to a replica, from outside the training job.

    The same uploader as ``CheckpointManager(..., replica=url)``, its replica opened the same
    way (:func:`~ckptstore.tiers.twotier.open_bounded`: the client's timeouts and attempts
    bounded by ``timeout``, probed first, a body the endpoint stops taking failing its
    upload): what a crash left on the replica is cleaned first, then the steps it lacks are
    uploaded newest first. With ``watch``, the local store is listed again every
    ``interval`` seconds and new steps are uploaded until ``stop`` is set (or the process is
    interrupted); once it is set, the upload in flight is abandoned (the next run does it
    again) and the queued steps are left, within about a second. It never deletes a local
    step; ``keep`` is the replica's retention (None: keep every step there).

    Raises:
        NoCheckpointError: ``local_root`` is not a store.
        ReplicaConfigError: ``url`` is the local store itself (under whatever name).
        ReplicaUnavailableError: the replica does not answer within ``timeout`` seconds,
            or its bucket does not exist.
        ReplicaError: (without ``watch``) an upload failed.
    """
    from ..storage import open_storage
    from .twotier import open_bounded, probe_replica

    local = open_storage(local_root)
    local.check_root(create=False)
    replica = open_bounded(local, url, replica_options, timeout)
    replica.check_root(create=True)
    probe_replica(replica, url, timeout, hint=_HINT)
    failed: dict[int, str] = {}
    up = Replicator(
        local,
        replica,
        policy=keep,
        threads=threads,
        retention=keep is not None,
        url=url,
        timeout=timeout,
    )
    stop = stop or threading.Event()
    try:
        up.recover()
        while not stop.is_set():
            try:
                # In short waits: a stop (SIGINT, SIGTERM) is seen at once, not once the
                # whole queue is uploaded (found by review: 24 s for 3 steps on a slow link).
                up.wait(_STOP_POLL)
            except ReplicaTimeoutError:
                continue
            except ReplicaError as e:
                if not watch:
                    raise
                log.error("%s", e)
            with up._cond:
                failed.update({s: str(e) for s, e in up._failed.items()})
            if not watch or stop.wait(interval):
                break
            for s in local.list_steps():
                if not up.is_safe(s) and s not in up._failed:
                    up.submit(s)
    finally:
        up.close(wait=False)
    safe = sorted(s for s in local.list_steps() if up.is_safe(s))
    return ReplicateResult(list(up.uploaded), safe, failed)

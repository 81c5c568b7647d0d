"""The gate background uploads pass through: closed while a save runs, or while paused.

A :class:`~ckptstore.tiers.replica.Replicator` owns one :class:`UploadGate`. Its copy threads call
:meth:`UploadGate.wait` before each slice of a local file they read, and the bodies of its
S3 requests (:mod:`ckptstore.storage.s3upload`) call :meth:`UploadGate.admit` on the upload
event loop before each slice of bytes they hand to the socket. A save closes the gate for
its blocking section (:meth:`UploadGate.held`, which nests), so the save never competes
with the uploads of earlier steps for the CPU, the disk or the network: the requests in
flight stop between two slices and go on when the gate opens.

A request body may not stall for ever (S3 drops a connection idle for about 20 s): a body
held longer than :attr:`UploadGate.max_stall` seconds sends its next slice anyway, and those
bytes are counted in :attr:`UploadGate.sent_while_held`. The counters (:attr:`sent`,
:attr:`sent_while_held`) are what the tests and the bench read to show that an upload did
no work during a save.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from ..errors import ReplicaError

__all__ = ["MAX_STALL", "STOPPED", "UploadGate"]

#: Seconds a request body waits at a closed gate before it sends its next slice anyway.
MAX_STALL = 10.0
#: What a copy thread at a stopped gate raises (a :class:`~ckptstore.errors.ReplicaError`).
STOPPED = "the uploader was stopped; the step's upload is abandoned"


class UploadGate:
    """Open unless paused or held; counts the request bytes admitted through it.

    Thread-safe: held and paused from the training thread, waited on by copy threads and
    by the upload event loop.
    """

    def __init__(self, max_stall: float = MAX_STALL) -> None:
        self.max_stall = max_stall
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._paused = False
        self._holds = 0
        #: Set when the uploader stops: a thread waiting at the gate raises.
        self.stopped = False
        #: Request-body bytes admitted so far.
        self.sent = 0
        #: Of those, bytes sent while the gate was closed (a stall past ``max_stall``).
        self.sent_while_held = 0
        #: Futures of event loops waiting for the gate to open (woken, not polling: a
        #: thread at nice 19 that wakes while a save runs may be preempted holding the GIL).
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ---- closing and opening ------------------------------------------------------------

    def pause(self) -> None:
        """Close the gate until :meth:`resume`."""
        with self._lock:
            self._paused = True
            self._update()

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` closed the gate (a save's hold aside)."""
        return self._paused

    def resume(self) -> None:
        """Undo :meth:`pause` (the gate stays closed while a hold is in place)."""
        with self._lock:
            self._paused = False
            self._update()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the gate closed while the block runs. Nests."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        """Close the gate until the matching :meth:`release` (for holds that span calls)."""
        with self._lock:
            self._holds += 1
            self._update()

    def release(self) -> None:
        """End one :meth:`hold`."""
        with self._lock:
            self._holds -= 1
            self._update()

    def stop(self) -> None:
        """The uploader stops: every later :meth:`wait` raises, open gate or not.

        The upload in flight is abandoned there (its copy threads raise before their next
        slice; its S3 requests are cancelled by the writer,
        :class:`~ckptstore.storage.s3upload.S3Upload`): a ``close()`` without waiting, a
        Ctrl-C in ``close()``, or a stopped ``ckptstore replicate --watch`` ends at once
        instead of after the step's upload (found by review).
        """
        with self._lock:
            self.stopped = True
            self._wake()

    def _update(self) -> None:
        if self._paused or self._holds:
            self._open.clear()
        else:
            self._open.set()
            self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile
                loop.call_soon_threadsafe(_resolve, fut)

    @property
    def is_open(self) -> bool:
        """Whether uploads may go on now."""
        return self._open.is_set()

    # ---- passing -------------------------------------------------------------------------

    def wait(self) -> None:
        """Block the calling thread while the gate is closed.

        Raises:
            ReplicaError: the uploader was stopped (before or meanwhile).
        """
        while True:
            if self.stopped:
                raise ReplicaError(STOPPED)
            if self._open.wait(0.5):
                if self.stopped:  # stopped while it waited, the gate open or not
                    raise ReplicaError(STOPPED)
                return

    def wait_open(self, timeout: float) -> bool:
        """Block at most ``timeout`` seconds while the gate is closed; whether it is open.

        Never raises: for a caller that has other things to look at between two waits.
        """
        return self._open.wait(timeout)

    async def admit(self, nbytes: int) -> None:
        """Wait on the event loop until ``nbytes`` of a request body may be sent.

        Counted in :attr:`sent` atomically with the look at the gate, so a slice is either
        sent before a hold began or after it ended, or counted in :attr:`sent_while_held`
        (a stall past :attr:`max_stall`, or the uploader stopped).
        """
        deadline: float | None = None
        while True:
            with self._lock:
                if self._open.is_set():
                    self.sent += nbytes
                    return
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.max_stall
                if now >= deadline or self.stopped:
                    self.sent += nbytes
                    self.sent_while_held += nbytes
                    return
            await self.opened(deadline - now)

    async def opened(self, timeout: float) -> None:
        """Wait on the event loop until the gate opens (or stops), at most ``timeout`` s.

        Woken by the thread that opens the gate: no wake-up while it stays closed.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._open.is_set() or self.stopped:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, fut))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(fut, max(timeout, 0.0))


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)

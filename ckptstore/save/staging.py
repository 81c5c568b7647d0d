"""Staging buffers and the background writer of async saves.

An async save blocks the caller for one memory copy: every tensor to be stored is copied into
a staging buffer that is allocated once and reused by later saves (pinned when CUDA is there,
so device-to-host copies run at full speed). One background thread then writes and commits,
and at most one save is in flight.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..storage.directio import (
    ALIGN,
    HUGE_MIN,
    lower_priority,
    mark_huge,
    new_buffer,
    unmark_huge,
)

__all__ = ["BackgroundWriter", "SaveHandle", "StagingPool"]

from .._log import logger as log
from ..errors import CommitError


class StagingPool:
    """Reusable host buffers keyed by the tensor's name in the checkpoint."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._devices: set[torch.device] = set()
        self.allocated_bytes = 0

    def begin(self) -> None:
        """Start staging a new save."""
        self._used = set()
        self._devices = set()

    def stage(self, key: str, t: torch.Tensor, file_offset: int | None = None) -> torch.Tensor:
        """A contiguous CPU copy of ``t`` in a reused buffer.

        With ``file_offset`` (where the tensor's bytes will sit in its payload file) the
        copy is placed at an address congruent to it modulo the block size, so the writer
        can send it to the disk with O_DIRECT straight from this memory
        (``DirectWriter.write_segment``): no second copy, no CPU taken from training.
        """
        nbytes = t.numel() * t.element_size()
        room = nbytes + (_BLOCK if file_offset is not None else 0)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() != room:
            pin = torch.cuda.is_available()
            if pin or room < HUGE_MIN:
                buf = torch.empty(room, dtype=torch.uint8, pin_memory=pin)
            else:
                buf = _huge_buffer(room)
            self._bufs[key] = buf
            self.allocated_bytes += room
        self._used.add(key)
        start = 0 if file_offset is None else (file_offset - buf.data_ptr()) % _BLOCK
        out = buf[start : start + nbytes].view(t.dtype).view(t.shape)
        if t.device.type == "cuda":
            self._devices.add(t.device)
        out.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        return out

    def end(self) -> None:
        """Wait until every copy has landed; forget buffers this save did not use."""
        for k in list(self._bufs):
            if k not in self._used:
                del self._bufs[k]
        # A non_blocking copy runs on the current stream of its source device: the writer
        # must not checksum a buffer before it lands. torch.cuda.synchronize() alone waits
        # for the current device only, and a model spread over GPUs has tensors elsewhere.
        for device in sorted(self._devices, key=lambda d: d.index or 0):
            torch.cuda.synchronize(device)
        self._devices = set()


#: O_DIRECT's alignment unit (directio.ALIGN).
_BLOCK = ALIGN


def _huge_buffer(nbytes: int) -> torch.Tensor:
    """A new CPU byte tensor on memory of its own advised onto huge pages (``new_buffer``).

    The writer sends staged bytes to the disk straight from here, in requests as large as
    the device takes (``directio.segment_capped``); the range is recorded (``mark_huge``)
    until the tensor is freed.
    """
    mapping = new_buffer(nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "non-writable buffer": this one is writable
        t = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    mark_huge(t.data_ptr(), nbytes)
    weakref.finalize(t, unmark_huge, t.data_ptr())
    return t


class SaveHandle:
    """The outcome of a save: already done for a synchronous save, pending for an async one."""

    def __init__(
        self,
        step: int,
        future: concurrent.futures.Future[Any] | None = None,
        result: Any = None,
        *,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.step = step
        self._future = future
        self._result = result
        # Told when wait() hands the save's error to the caller: the manager then does not
        # raise it a second time from the next save.
        self._on_error = on_error
        if future is not None and not future.done():
            _pending.add(self)

    def done(self) -> bool:
        """Whether the checkpoint is committed (or failed)."""
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until committed; returns the :class:`~ckptstore.manifest.Manifest`.

        ``None`` on a rank that writes nothing (a replicated save, on ranks other than 0).

        Raises:
            CommitError: the save failed. Once raised here, the manager's ``wait`` and
                ``close`` do not raise it again, nor does its next ``save``, ``restore``
                or ``resume`` where every rank has raised it (under torch.distributed a
                rank that has not is told there, and every rank raises it then).
        """
        if self._future is None:
            return self._result
        try:
            _until_done(self._future, timeout)
            return self._future.result(0)
        except BaseException as e:
            f = self._future
            if self._on_error is not None and f.done() and not f.cancelled() and f.exception() is e:
                self._on_error(e)
            raise

    def _settle(self) -> None:
        """Wait until the save is over, raising nothing (its error stays with the manager)."""
        if self._future is not None:
            _until_done(self._future, None)

    @property
    def manifest(self) -> Any:
        """The committed manifest (waits for an async save)."""
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"SaveHandle(step={self.step}, {state})"


_live: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


#: How often a wait for an async save looks whether it is over (``_until_done``).
_POLL = 0.002


def _until_done(future: concurrent.futures.Future[Any], timeout: float | None) -> None:
    """Return once ``future`` is done, or ``timeout`` seconds passed (then TimeoutError).

    Polled, never ``Condition.wait``: a KeyboardInterrupt that lands inside a condition
    wait of the training thread can leave the future's lock released under the writer,
    whose ``set_result`` then raised "release unlocked lock" and killed the writer
    thread; every later wait hung, and saves queued behind it were dropped at exit
    without a word (found by review, with real SIGINTs).
    """
    end = None if timeout is None else time.monotonic() + timeout
    while not future.done():
        if end is not None and time.monotonic() >= end:
            raise concurrent.futures.TimeoutError
        time.sleep(_POLL)


class BackgroundWriter:
    """One thread of its own that runs save jobs in order.

    Not a ``ThreadPoolExecutor``: its worker thread dies on any exception raised while it
    completes a future (see :func:`_until_done`), and the pool then queues work no thread
    runs. This loop survives anything a job or its future raises, and a job is given its
    future by the caller, who records it before the job can run (``Saver._in_background``).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="ckptstore-writer", daemon=True)
        self._thread.start()
        _live.add(self)

    def _loop(self) -> None:
        lower_priority()
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(*item)
            # Nothing of the job is kept while the thread waits for the next: the loop held
            # the last job's closure (the saver, its session and writer lock, the staging
            # buffers), so a manager dropped without close() kept its lock for good.
            del item

    @staticmethod
    def _run(future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
        try:
            if not future.set_running_or_notify_cancel():
                return  # cancelled before it started (see submit_to)
            result = fn()
        except BaseException as e:  # handed to the future
            with contextlib.suppress(BaseException):
                future.set_exception(e)
        else:
            with contextlib.suppress(BaseException):
                future.set_result(result)

    def submit_to(self, future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
        """Run ``fn`` in the background; its outcome goes to ``future``.

        Raises:
            CommitError: the writer was shut down, or its thread is gone.
        """
        with self._lock:
            if self._stopped or not self._thread.is_alive():
                raise CommitError("the background writer is stopped; the save was not started")
            self._queue.put((future, fn))

    def shutdown(self, *, wait: bool = True) -> None:
        """Finish queued work and stop the thread (with ``wait``, joined)."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


#: Async saves not known to be over (see :func:`_forget_in_child`).
_pending: weakref.WeakSet[SaveHandle] = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a forked child, fail the parent's async saves: they are not the child's.

    They run on the parent's writer thread, which the child lacks; waiting for one
    (``wait()``, ``close()``, leaving a ``with`` block, the next save) hung for good (found
    by review). Each now fails in the child at once, and the child's manager starts a
    writer of its own.
    """
    parent = os.getppid()
    for h in list(_pending):
        if h._future is not None and not h._future.done():
            failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
            failed.set_exception(
                CommitError(
                    f"step {h.step}: this async save runs in the process this one was forked "
                    f"from (pid {parent}); a forked child cannot wait for it"
                )
            )
            h._future = failed
            h._on_error = None
    _pending.clear()
    _live.clear()  # the parent's writers: their threads are not in this process


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _finish_in_flight() -> None:
    # An in-flight save is finished at interpreter exit rather than abandoned half-written
    # (it would be invisible anyway, but the user asked for it to be saved).
    for w in list(_live):
        try:
            w.shutdown()
        except Exception as e:  # pragma: no cover - reported, never raised at exit
            log.error("finishing an in-flight checkpoint at exit failed: %s", e)

"""Memory advice: a restore's targets faulted in ahead of the reads; buffers on huge pages.

A restore into new tensors (a fresh optimizer's moments, a model made with ``to_empty``)
makes the kernel fault in every page it fills, 4 KiB at a time: 0.27-0.5 s of kernel CPU
for 768 MB on the 2-core test VM. Each fault is taken by the thread that fills the page,
inside its read, between two of its requests, so the disk waits while that thread faults.
:class:`Prefaulter` has one thread of its own fault the pages in first, in the order the
reads will fill them (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+): the reading threads
find their pages mapped, and the faults run on a core the reads leave idle.

``MADV_POPULATE_WRITE`` maps each page writable "as if written" without writing it: the
memory's contents never change, so any range of a live tensor may be given. Where the
kernel lacks it (``EINVAL`` on a probe page), or outside Linux, nothing is done. A range
that fails (unmapped since, locked, poisoned) is skipped: the reads fault it as before.
Memory that is already in place (a trained model's, an optimizer's that took a step) has
nothing to fault in, yet populating it still walks every page: 30-60 ms of CPU for 768 MB
on the test VM. Each step is first asked about with ``mincore`` (~3 ms for 768 MB) and
populated only where a page of it is missing.

:func:`advise_huge` asks for transparent huge pages under a new buffer
(``MADV_HUGEPAGE``): the ``O_DIRECT`` buffers of ``storage.directio``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from types import TracebackType

from ._libc import libc_function
from ._log import logger as log

__all__ = [
    "MIN_BYTES",
    "STEP",
    "Prefaulter",
    "advise_huge",
    "populate",
    "resident",
    "supported",
]

#: ``MADV_POPULATE_WRITE`` (``<asm-generic/mman-common.h>``, Linux 5.14).
_MADV_POPULATE_WRITE = 23
#: ``MADV_HUGEPAGE`` (Linux 2.6.38).
_MADV_HUGEPAGE = 14
#: Ranges under this many bytes are left to the reads: a thread's start costs more.
MIN_BYTES = 1 << 20
#: One ``madvise`` covers at most this many bytes, so a stop is seen within one step.
STEP = 8 << 20

_PAGE = mmap.PAGESIZE
_lock = threading.Lock()
_madvise: Callable[[int, int, int], int] | None = None  # where MADV_POPULATE_WRITE works
_probed = False


#: Every byte value with bit 0 set (a page in memory, as ``mincore`` reports it).
_ODD_BYTES = bytes(range(1, 256, 2))


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise`` (Linux only), or None; looked up once."""
    return libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


def resident(address: int, nbytes: int) -> bool:
    """Whether every page of ``[address, address + nbytes)`` is in memory (``mincore``).

    ``address`` is a page boundary. False where it cannot be told (no ``mincore``, or the
    kernel refuses the range): the caller then populates, as it would have.
    """
    fn = libc_function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p))
    pages = -(-nbytes // _PAGE)
    if fn is None or pages <= 0:
        return False
    vec = (ctypes.c_ubyte * pages)()
    if fn(address, nbytes, vec) != 0:
        return False
    # Bit 0 of each byte says the page is in memory (the others are reserved): deleting the
    # odd bytes leaves nothing. In C: a generator over the bytes held the GIL for ~10 ms of
    # a 768 MB restore into live targets, while the read threads waited for it.
    return not bytes(vec).translate(None, _ODD_BYTES)


def _probe() -> Callable[[int, int, int], int] | None:
    """The C library's madvise where ``MADV_POPULATE_WRITE`` works (one probe page), else None."""
    fn = _libc_madvise()
    if fn is None:
        return None
    page = mmap.mmap(-1, _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        anchor = ctypes.c_char.from_buffer(page)
        try:
            ok = fn(ctypes.addressof(anchor), _PAGE, _MADV_POPULATE_WRITE) == 0
        finally:
            del anchor
    finally:
        page.close()
    if not ok:
        log.debug("madvise(MADV_POPULATE_WRITE) unsupported here (errno %d)", ctypes.get_errno())
        return None
    return fn


def advise_huge(buf: mmap.mmap) -> bool:
    """Ask for transparent huge pages under ``buf`` (``MADV_HUGEPAGE``); whether it was taken.

    Call it before the first touch. True says the kernel took the advice, not that it will
    find free huge pages. For buffers the disk reads or writes with ``O_DIRECT``: a request
    holds at most ``max_segments`` physically contiguous runs, so from 4 KiB pages it is
    capped at ~1 MiB on a disk that takes 4 MiB (see ``storage.directio``). ``buf`` must be a
    private anonymous mapping (``MAP_PRIVATE | MAP_ANONYMOUS``): shared ones follow the
    shmem setting.
    """
    fn = _libc_madvise()
    if fn is None:
        return False
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return fn(ctypes.addressof(anchor), len(buf), _MADV_HUGEPAGE) == 0
    finally:
        del anchor


def supported() -> bool:
    """Whether this kernel populates ranges (``MADV_POPULATE_WRITE``); probed once."""
    global _madvise, _probed  # the probe's answer, for the life of the process
    with _lock:
        if not _probed:
            _madvise = _probe()
            _probed = True
        return _madvise is not None


def populate(address: int, nbytes: int, stop: threading.Event | None = None) -> int:
    """Fault in the whole pages of ``[address, address + nbytes)``, writable; contents kept.

    Pages the range shares only in part with other memory are left alone. Stops early once
    ``stop`` is set (checked every :data:`STEP` bytes) or at the first range the kernel
    refuses (``ENOMEM``: not mapped; ``EFAULT``, ``EPERM``, ``EHWPOISON``: see madvise(2)).

    Returns:
        The bytes populated, or found in memory already (0 where unsupported).
    """
    if not supported() or _madvise is None:
        return 0
    lo = -(-address // _PAGE) * _PAGE
    hi = (address + nbytes) // _PAGE * _PAGE
    done = 0
    while lo + done < hi:
        if stop is not None and stop.is_set():
            break
        n = min(STEP, hi - lo - done)
        if resident(lo + done, n):
            done += n  # in place already: nothing to fault in
            continue
        if _madvise(lo + done, n, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            log.debug("madvise(MADV_POPULATE_WRITE) refused: %s", os.strerror(err))
            if err == errno.EINTR:
                continue
            break
        done += n
    return done


class Prefaulter:
    """A thread that populates ``ranges`` (``(address, nbytes)``) in order while it is open.

    Leaving the block stops the thread between two steps and waits for it, so it never
    outlives the memory it was given (the caller keeps that memory alive until then).
    Ranges under :data:`MIN_BYTES` are skipped; with nothing to do, or where the kernel
    cannot populate, no thread is started. ``populated`` holds the bytes done.
    """

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        self.ranges = [(a, n) for a, n in ranges if n >= MIN_BYTES]
        self.populated = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        for address, nbytes in self.ranges:
            if self._stop.is_set():
                return
            self.populated += populate(address, nbytes, self._stop)

    def __enter__(self) -> Prefaulter:
        if self.ranges and supported():
            self._thread = threading.Thread(
                target=self._run, name="ckptstore-prefault", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

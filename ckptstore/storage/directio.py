"""Large aligned file I/O that bypasses the page cache where the filesystem allows it.

Checkpoints are written once and not read back soon, so the page cache only costs: a
buffered write copies every byte into it and ``fsync`` then flushes it at about half the
disk's speed. ``O_DIRECT`` DMA-s from our buffers straight to the device. It needs aligned
buffers, offsets and lengths, so bytes are copied into two page-aligned bounce buffers (a
copy into existing memory runs at 7-20 GB/s) while the other buffer is being written by a
helper thread; the CRC32C is computed on each buffer as it fills (the ``crc32c`` package
releases the GIL). Memory that already lines up with its place in the file (async staging
and the shard layout arrange that) is written straight from where it is
(``DirectWriter.write_segment``), in the same requests as the bounce buffer's bytes around
it: one ``pwritev`` per buffer's worth, not two requests a tensor. The last partial block
goes through the page cache, so no padding or truncation is needed.

The buffers sit on transparent huge pages (:func:`new_buffer`), a pool of them kept per
process: a request holds at most ``max_segments`` physically contiguous runs of memory, so
from scattered 4 KiB pages it is cut short on a disk that takes larger ones. Where the
device's own limits say so (:func:`segment_capped`), memory that lines up is copied into
the buffers too, unless it is known to sit on huge pages itself (:func:`mark_huge`).
Where ``O_DIRECT`` is refused (tmpfs, some network filesystems: ``EINVAL``) the same code
runs with ordinary buffered writes and ``fsync``.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import errno
import fcntl
import functools
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._prefault import advise_huge
from ..integrity import BlockCRC, BlockSums, SubBlocks, crc32c_of

__all__ = [
    "ALIGN",
    "BOUNCE",
    "DirectWriter",
    "mark_huge",
    "new_buffer",
    "on_huge_pages",
    "open_direct_read",
    "open_nonblocking",
    "read_into",
    "segment_capped",
    "stream_pipelined",
    "unmark_huge",
]

ALIGN = 4096
#: Size of each of the two bounce buffers; large writes keep the device queue full.
BUFFER = 32 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


#: Niceness of checkpoint I/O threads. A training step that runs on every core (intra-op
#: threads) waits for its slowest thread, so any CPU the writer takes costs it more than its
#: share: measured on 2 cores with a 3 GB async save, nice 10 slowed steps by ~45%, nice 19
#: by ~13% (the save then takes longer while training saturates the CPU: 23 s instead of
#: 4 s, still off the training path; on an idle CPU, as in GPU training, nothing changes).
IO_NICE = 19


def lower_priority(nice: int = IO_NICE) -> None:
    """Lower the scheduling priority of the calling thread (Linux: priority is per thread).

    Checkpoint I/O threads yield the CPU to training: an async save then slows the training
    step less. The threads this one starts inherit it.
    """
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


#: An idle I/O thread waits this long for its next task before it exits.
_IDLE_S = 30.0


class _Worker:
    """A daemon I/O thread that runs one task at a time and then waits, idle, for the next.

    Starting a thread per task cost ~0.35 ms (0.12 ms of CPU) on the shared 2-core VM, and a
    DTensor save hands one task per tensor to its writers: ~600 a rank for 588 DTensors.
    """

    def __init__(self, nice: int) -> None:
        self.nice = nice
        self._go = threading.Semaphore(0)
        self._task: Callable[[], None] | None = None
        # Started by the thread that submits its first task, so it inherits that thread's
        # scheduling priority (see Call._run); it only ever serves tasks of that priority.
        self._thread = threading.Thread(target=self._loop, name="ckptstore-io", daemon=True)
        self._thread.start()

    def give(self, task: Callable[[], None]) -> None:
        self._task = task
        self._go.release()

    def _loop(self) -> None:
        while True:
            if not self._go.acquire(timeout=_IDLE_S):
                with _idle_lock:
                    idle = _idle.get(self.nice, [])
                    if self in idle:  # nobody took it meanwhile: exit
                        idle.remove(self)
                        return
                continue  # taken just now: its task is on the way
            task, self._task = self._task, None
            if task is not None:
                task()
            task = None  # nothing of the task (a view of a buffer) outlives it here
            with _idle_lock:
                _idle.setdefault(self.nice, []).append(self)


_idle_lock = threading.Lock()
#: Idle workers, by the niceness of the threads that started them.
_idle: dict[int, list[_Worker]] = {}


def _forget_workers() -> None:
    """In a forked child the workers' threads do not exist: never hand them a task.

    Nor take the parent's kept buffers: the child maps its own. (They were shared mappings
    until session 20, so a child and its parent saving at once wrote through the same
    memory; private ones are copied on write, but the child need not hold them either.)
    """
    global _idle_lock, _pool_lock  # a lock held at fork time stays held in the child
    _idle_lock = threading.Lock()
    _idle.clear()
    _pool_lock = threading.Lock()
    _pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return 0


class Call:
    """Run ``fn(*args)`` on an I/O thread now; :meth:`result` waits for it.

    Plain daemon threads, not a ``concurrent.futures`` pool: an async save still in flight
    when the interpreter exits is finished by its writer thread, and pools refuse new work
    once interpreter shutdown has begun. Threads are reused (an idle one of the caller's
    priority takes the task; see :class:`_Worker`), and exit after :data:`_IDLE_S` idle.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._value: Any = None
        nice = _niceness()
        with _idle_lock:
            idle = _idle.get(nice)
            worker = idle.pop() if idle else None
        task = functools.partial(self._run, fn, args)
        if worker is None:
            worker = _Worker(nice)
        worker.give(task)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        # The priority is inherited from the thread that started this one: lowered on an
        # async save's background writer, the caller's own in a synchronous save (the
        # caller waits for these threads; at nice 19 a busy CPU starved them: a 2-rank
        # FSDP2 save spent 1.6 s writing 200 MB a rank that took 0.2 s at normal priority).
        try:
            self._value = fn(*args)
        except BaseException as e:
            self._exc = e
        finally:
            self._done.set()

    def result(self) -> Any:
        """The return value of ``fn``, or its exception raised here."""
        self._done.wait()
        if self._exc is not None:
            raise self._exc
        return self._value


def run_all(calls: Sequence[Callable[[], Any]], max_workers: int = 3) -> list[BaseException | None]:
    """Run the callables on up to ``max_workers`` threads; their exceptions, in order."""
    errors: list[BaseException | None] = [None] * len(calls)
    lock = threading.Lock()
    todo = iter(range(len(calls)))

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                calls[i]()
            except BaseException as e:
                errors[i] = e

    # Each thread runs in a copy of the caller's context: what the caller's block set there
    # (the write group of iomode.side_by_side) holds for the callables too.
    n = max(1, min(max_workers, len(calls)))
    for w in [Call(contextvars.copy_context().run, worker) for _ in range(n)]:
        w.result()
    return errors


#: Segments shorter than this are copied through the bounce buffer (not worth a request).
_SEGMENT_MIN = 256 << 10
#: Whether a :class:`DirectWriter` copies memory that lines up into its buffers too:
#: ``"auto"`` where the device cuts requests from 4 KiB pages short (:func:`segment_capped`),
#: ``"always"`` or ``"never"``.
BOUNCE = "auto"
#: :meth:`DirectWriter.write` copies and checksums in pieces of this many bytes (half of
#: the 2 MiB L2 cache a core of the VM has: a piece is checksummed where it was just copied).
_PIECE = 1 << 20
#: Pieces of one request at most (Linux's IOV_MAX is 1024).
_IOV_MAX = 256
#: A file's first request is sent once it holds this many bytes, each next one at twice as
#: many as the one before, up to a buffer's worth (see :meth:`DirectWriter._queue`).
_FIRST_REQUEST = 4 << 20


class DirectWriter(BlockSums):
    """A write-only, checksumming file object for one new file (``O_EXCL``).

    Call :meth:`finish` to write the tail, fsync and close; :meth:`abort` closes without
    fsync. ``crc``, ``blocks`` and ``nbytes`` describe what was written.
    """

    #: :meth:`write_segment` takes ``sub=`` (``safetensors.write_laid_out`` asks).
    sub_blocks = True

    def __init__(
        self,
        path: str,
        *,
        direct: bool = True,
        buffer_size: int = BUFFER,
        choose: Callable[[], bool] | None = None,
        report: Callable[[bool, int, float], None] | None = None,
    ) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        # O_DIRECT is switched on (fcntl) only once a whole buffer is ready: small files
        # are cheaper through the page cache (an O_DIRECT write that extends a file costs
        # milliseconds on ext4), and the tail of a large one is written buffered too, so no
        # padding and truncation are needed.
        self.fd = os.open(path, flags, 0o644)
        self.direct = False  # whether O_DIRECT was used for any write
        self._can_direct = bool(direct and _O_DIRECT)
        # Asked once, when the first whole buffer is ready, whether O_DIRECT is worth it on
        # this device (iomode.write_mode): a file that never fills a buffer never asks.
        self._choose = choose
        # Told (O_DIRECT?, bytes, seconds from open to fsync) when a file whose mode was
        # chosen is durable: the measurement the next choice is made from.
        self._report = report
        self._chosen = False
        self._t_open = time.perf_counter()
        self.path = path
        self._sum = BlockCRC()
        self.nbytes = 0
        self.bounced = 0  # bytes that went through the bounce buffers (copied once more)
        self._size = max(ALIGN, buffer_size - buffer_size % ALIGN)
        # The second bounce buffer is mapped only when the first one fills (small files,
        # e.g. state.json, never need it).
        self._bufs = [_take_buffer(self._size)]
        # Memory that lines up is still copied into the buffers (on huge pages) where the
        # device cuts requests from 4 KiB pages short (segment_capped).
        self._bounce_all = BOUNCE == "always" or (
            BOUNCE == "auto"
            and self._can_direct
            and self._size >= HUGE_MIN
            and segment_capped(os.fstat(self.fd).st_dev)
        )
        self._views = [memoryview(self._bufs[0])]
        self._cur = 0
        self._pos = 0  # bytes filled in the current buffer
        self._mark = 0  # bytes of the current buffer queued (in ``_vec``) or sent
        # What is queued for the next request, in file order from ``_offset``: the bounce
        # buffer's stretches and the caller's memory between them (see :meth:`_queue`).
        self._vec: list[memoryview] = []
        self._vec_bytes = 0
        self._offset = 0  # file offset of ``_vec[0]`` (of ``_mark`` while it is empty)
        self._pending: Call | None = None
        self._closed = False
        self._limit = min(self._size, _FIRST_REQUEST)  # what the next request is sent at

    # -- file-object protocol (what torch.save and our encoders use) --

    def write(self, data: Any, sub: SubBlocks | None = None) -> int:
        """Copy ``data`` into the bounce buffer, writing out each request's worth.

        A request goes once the buffer holds what the next one is sent at (the ramp of
        :meth:`_queue`: 4 MiB, then twice the one before, up to the whole buffer), so the
        disk starts on a file whose every byte is copied (``segment_capped``) as soon as
        its first 4 MiB are in, not its first 32: with four such files a rank on two busy
        cores, the first requests left 22-38 ms after their files were opened.

        ``sub`` receives the CRC32C of every ``sub.block`` bytes of ``data``, from the same
        pass (see :meth:`write_segment`).

        The bytes are checksummed in the buffer, each :data:`_PIECE` right after it is
        copied there, while it is still in the CPU's cache: the bytes checksummed are the
        bytes written, and the caller's memory is read once. Checksumming all of ``data``
        first and copying it after read it twice: one 384 MB tensor took 87 ms of CPU
        against 56 ms, two processes side by side on the 2-core VM (session 21). With the
        sharded bench's shards (three quarters of the bytes in tensors of 0.5-2.1 MB, which
        the L3 cache held between the two passes), two saves took 6% less CPU and the same
        time.
        """
        mv = memoryview(data).cast("B")
        n = len(mv)
        self.bounced += n
        done = 0
        while done < n:
            fill = min(self._size, self._limit)  # a multiple of ALIGN: the ramp's sizes
            if self._pos >= fill:  # (a request goes at ``fill``) whole buffers, as before
                fill = self._size
            end = done + min(fill - self._pos, n - done)
            buf = self._views[self._cur]
            while done < end:
                k = min(_PIECE, end - done)
                piece = buf[self._pos : self._pos + k]
                piece[:] = mv[done : done + k]
                self._sum.update(piece, sub)
                self._pos += k
                done += k
            if self._pos == fill:
                self._send()
        self.nbytes += n
        return n

    def write_segment(self, data: Any, address: int, sub: SubBlocks | None = None) -> int:
        """Write ``data``, whose first byte is at memory ``address``, without a bounce copy.

        Where the memory and the file offset are congruent modulo the block size (async
        staging places its buffers so), the block-aligned middle of ``data`` goes to the
        disk straight from the caller's memory, one buffer-sized request in flight while
        the next is checksummed; the partial blocks at both ends (shared with neighbouring
        data) take the ordinary :meth:`write` path. Otherwise all of it does. ``data`` must
        stay unchanged until :meth:`finish` returns.

        ``sub`` receives the CRC32C of every ``sub.block`` bytes of ``data`` (a shard's
        chunk CRCs), from the same single pass that checksums the file.
        """
        mv = memoryview(data).cast("B")
        n = len(mv)
        if n >= _SEGMENT_MIN and self._buffered(n):
            return self._write_through(mv, sub)
        start = self._offset + self._vec_bytes + self._pos - self._mark  # mv[0]'s offset
        if (
            n < _SEGMENT_MIN
            or not self._can_direct
            or (address - start) % ALIGN
            or (self._bounce_all and not on_huge_pages(address, n))
        ):
            return self.write(mv, sub)
        head = -start % ALIGN
        body = (n - head) - (n - head) % ALIGN
        if head:
            self.write(mv[:head], sub)
        done = head  # the bounce buffer now ends on a block boundary: the middle follows it
        while done < head + body:
            k = min(self._size, head + body - done)
            view = mv[done : done + k]
            self._sum.update(view, sub)
            self._queue(view)
            self.nbytes += k
            done += k
        if done < n:
            self.write(mv[done:], sub)
        return n

    def _buffered(self, n: int) -> bool:
        """Whether this file is written through the page cache (decided for ``n`` bytes)."""
        if self._choose is not None and n >= self._size:
            self._set_direct_choice()
        return not self._can_direct

    def _set_direct_choice(self) -> None:
        choose, self._choose = self._choose, None
        if choose is not None:
            self._chosen = True
            if not choose():
                self._can_direct = False

    def _write_through(self, mv: memoryview, sub: SubBlocks | None = None) -> int:
        """Buffered writes straight from the caller's memory (no bounce copy), in slices.

        Any offset and length will do through the page cache; one request is written by
        the I/O thread while the next slice is checksummed.
        """
        n = len(mv)
        for i in range(0, n, self._size):
            view = mv[i : i + self._size]
            self._sum.update(view, sub)
            self._queue(view)
        self.nbytes += n
        return n

    def flush(self) -> None:
        """No-op: data goes out in whole buffers and at :meth:`finish`."""

    def writable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Never: the checksum needs the bytes in order."""
        return False

    def tell(self) -> int:
        """Bytes written so far."""
        return self.nbytes

    # -- mechanics --

    def _wait(self) -> None:
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()

    def _pwrite_all(self, views: list[memoryview], offset: int) -> None:
        """Write ``views`` one after the other from ``offset``: one ``pwritev`` where it can."""
        i = 0
        while i < len(views):
            if i == len(views) - 1:
                n = os.pwrite(self.fd, views[i], offset)
            else:
                n = os.pwritev(self.fd, views[i : i + _IOV_MAX], offset)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            offset += n
            while i < len(views) and n >= len(views[i]):
                n -= len(views[i])
                i += 1
            if n:
                views[i] = views[i][n:]

    def _set_direct(self, on: bool) -> bool:
        if on and self._choose is not None:
            self._set_direct_choice()
        if on and not self._can_direct:  # buffered was chosen: never switch it on later
            return False
        return set_direct(self.fd, on)

    def _queue(self, view: memoryview) -> None:
        """Queue ``view`` (the caller's memory, checksummed) after the bounce bytes before it.

        What is queued goes as one request (``pwritev``) once it holds a buffer's worth:
        a shard of hundreds of tensors is written in requests of :data:`BUFFER` bytes, each
        tensor's block-aligned middle straight from its memory and the blocks it shares
        with its neighbours from the bounce buffer, not in two requests a tensor.

        Except at the start: the first request goes at :data:`_FIRST_REQUEST` bytes, and
        each next one at twice the one before, so the disk starts on a file within a few
        milliseconds of its opening. Checksumming a whole buffer first took 5-8 ms of CPU
        and, with 4 writers a rank on 2 busy cores, 10-45 ms before the first request of a
        sharded save's files went out (the disk idle meanwhile); the ramp made a 2-rank
        save of 384 MB a rank 10-14 ms faster (2-3%, paired in 10 rounds).
        """
        self._seal()
        self._vec.append(view)
        self._vec_bytes += len(view)
        if self._vec_bytes >= self._limit or len(self._vec) >= _IOV_MAX:
            self._send()

    def _seal(self) -> None:
        """Queue the bounce buffer's bytes not queued yet (checksummed as they were copied)."""
        if self._pos > self._mark:
            self._vec.append(self._views[self._cur][self._mark : self._pos])
            self._vec_bytes += self._pos - self._mark
            self._mark = self._pos

    def _send(self) -> None:
        """Hand what is queued to the I/O thread, after the request in flight is done.

        The bounce buffer sent is not touched until that request is done: the next bytes go
        into the other one, free since the request before was waited for.
        """
        self._seal()
        if not self._vec:
            return
        self._dispatch()
        if self._pos:
            if len(self._bufs) == 1:
                self._bufs.append(_take_buffer(self._size))
                self._views.append(memoryview(self._bufs[1]))
            self._cur ^= 1
            self._pos = self._mark = 0

    def _dispatch(self) -> None:
        """Send the queue as one request (O_DIRECT switched on where it may be)."""
        self._wait()
        if self._can_direct and not self.direct:
            self.direct = self._set_direct(True)
            self._can_direct = self.direct  # refused (tmpfs): the rest through the page cache
        vec, self._vec = self._vec, []
        self._pending = Call(self._pwrite_all, vec, self._offset)
        self._limit = min(self._size, self._limit * 2)
        self._offset += self._vec_bytes
        self._vec_bytes = 0

    def finish(self) -> None:
        """Write the tail (buffered where it is not whole blocks), fsync and close.

        Nothing is truncated: the file is written exactly as long as the data, never padded.
        """
        try:
            if self._vec:  # the caller's memory queued: as any request (O_DIRECT where it may)
                self._dispatch()  # not the tail after it, nor the buffer it lies in
            self._wait()
            if self._pos > self._mark:
                view = self._views[self._cur][self._mark : self._pos]  # checksummed already
                if self.direct and len(view) % ALIGN:
                    # The whole blocks of the last buffer still with O_DIRECT, and only the
                    # partial block after them through the cache: a last buffer of a file
                    # written all buffered took up to 32 MiB a file through the page cache
                    # (and its flush at fsync), once every byte went through the buffers.
                    whole = len(view) - len(view) % ALIGN
                    if whole:
                        self._pwrite_all([view[:whole]], self._offset)
                        self._offset += whole
                        view = view[whole:]
                    self._set_direct(False)
                self._pwrite_all([view], self._offset)
                self._offset += len(view)
                self._mark = self._pos
            os.fsync(self.fd)
            if self._chosen and self._report is not None:
                self._report(self._can_direct, self.nbytes, time.perf_counter() - self._t_open)
        finally:
            self._close()

    def abort(self) -> None:
        """Close without making anything durable (the caller removes the file)."""
        with contextlib.suppress(Exception):
            self._wait()
        self._close()

    def close(self) -> None:
        """Alias of :meth:`finish` for file-object users."""
        if not self._closed:
            self.finish()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self.fd)
        for v in self._views:
            v.release()
        for b in self._bufs:
            _give_back(b, self._size)


#: Idle bounce buffers (of :data:`BUFFER` bytes) kept for the next writer, at most this many
#: (256 MB; a pool holds only as many as saves used at once). A fresh mapping takes a page
#: fault per 4 KiB on first touch: filling 64 MB of new buffers cost 93 ms of CPU on the
#: shared 2-core VM, 8 ms in buffers mapped before. A DTensor save opens up to 4 writers a
#: rank, every save, two buffers each: with 4 kept, each save of a 2-rank job that copied
#: every byte (segment_capped) mapped 4 new ones and took 0.396 s of CPU a rank for two
#: saves, against 0.356 s with 8 kept (session 20, in one job).
_POOL_MAX = 8
_pool: list[mmap.mmap] = []
_pool_lock = threading.Lock()


def _take_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer of ``size`` bytes: a kept one where it fits, else a new one."""
    if size == BUFFER:
        with _pool_lock:
            while _pool:
                buf = _pool.pop()
                if len(buf) == size:  # kept when BUFFER was another size (tests set it)
                    return buf
    return new_buffer(size)


def new_buffer(size: int) -> mmap.mmap:
    """A new page-aligned buffer for ``O_DIRECT`` requests, on huge pages where given.

    A private anonymous mapping advised ``MADV_HUGEPAGE`` (see :func:`segment_capped`): each
    2 MiB page is one physically contiguous segment of a request, where 4 KiB pages are 512.
    """
    if not hasattr(mmap, "MAP_PRIVATE"):  # not POSIX
        return mmap.mmap(-1, size)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_MIN:
        advise_huge(buf)
    return buf


#: Buffers this large or larger are advised onto huge pages (:func:`new_buffer`).
HUGE_MIN = 2 << 20

_huge_lock = threading.Lock()
_huge_starts: list[int] = []  # sorted
_huge_ends: dict[int, int] = {}


def mark_huge(address: int, nbytes: int) -> None:
    """Record ``[address, address + nbytes)`` as memory of ours advised onto huge pages.

    A :class:`DirectWriter` that copies everything into its buffers (:func:`segment_capped`)
    still writes memory inside such a range straight from where it is (async staging
    buffers, ``save.staging``). A stale record costs speed, never bytes: the writer then
    sends 4 KiB pages where it could have copied them.
    """
    with _huge_lock:
        if address not in _huge_ends:
            bisect.insort(_huge_starts, address)
        _huge_ends[address] = address + nbytes


def unmark_huge(address: int) -> None:
    """Forget the range :func:`mark_huge` recorded at ``address`` (its memory is freed)."""
    with _huge_lock:
        if _huge_ends.pop(address, None) is not None:
            del _huge_starts[bisect.bisect_left(_huge_starts, address)]


def on_huge_pages(address: int, nbytes: int) -> bool:
    """Whether ``[address, address + nbytes)`` lies inside one range of :func:`mark_huge`."""
    with _huge_lock:
        i = bisect.bisect_right(_huge_starts, address) - 1
        return i >= 0 and address + nbytes <= _huge_ends[_huge_starts[i]]


#: Where the kernel lists block devices by number (tests point it elsewhere).
_SYSFS_BLOCK = "/sys/dev/block"
#: :func:`segment_capped` when requests from 4 KiB pages are at most this share of the
#: largest the device takes: a copy of every byte (~0.1 s of CPU a GB) for requests a few
#: percent larger would not pay.
_CAPPED_BY = 2


@functools.lru_cache(maxsize=64)
def segment_capped(dev: int) -> bool:
    """Whether the block device of ``dev`` takes requests far larger than 4 KiB pages fill.

    A request holds at most ``max_segments`` physically contiguous runs of memory, and the
    pages of a tensor or of a plain buffer are scattered: 4 KiB each. Where
    ``max_segments x 4 KiB`` is at most half of ``max_sectors_kb`` (254 x 4 KiB against 4 MiB
    on the test VM's virtio disk; an NVMe drive's 127 x 4 KiB against 512 KiB is not), requests
    from such memory are cut short and the disk is slower:
    768 MB written from 4 KiB pages in 0.44-0.47 s (requests of 570 KiB on average), from
    huge pages in 0.24 s (3.8 MiB), 4 threads, measured with ``/sys/block/vda/stat``. There,
    a :class:`DirectWriter` copies every byte into its buffers (on huge pages,
    :func:`new_buffer`) instead of writing memory that lines up straight from where it is.
    False where the limits are unknown (not a block device, no ``/sys``).
    """
    base = f"{_SYSFS_BLOCK}/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a partition's is its disk's
        try:
            with open(f"{queue}/max_segments") as f:
                segments = int(f.read())
            with open(f"{queue}/max_sectors_kb") as f:
                most = int(f.read()) << 10
        except (OSError, ValueError):
            continue
        return segments * mmap.PAGESIZE * _CAPPED_BY <= most
    return False


def _give_back(buf: mmap.mmap, size: int) -> None:
    """Keep ``buf`` for the next writer, or unmap it. No I/O uses it any more."""
    if size == BUFFER and not buf.closed and len(buf) == size:
        with _pool_lock:
            if len(_pool) < _POOL_MAX:
                _pool.append(buf)
                return
    # A failed write's traceback may still hold a slice of the buffer; the mapping is then
    # freed when that is collected.
    with contextlib.suppress(BufferError):
        buf.close()


def open_direct_read(
    path: str, *, dir_fd: int | None = None, direct: bool = True
) -> tuple[int, bool]:
    """Open ``path`` for reading, with ``O_DIRECT`` where allowed; never follows symlinks."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    if direct and _O_DIRECT:
        try:
            return open_nonblocking(path, flags | _O_DIRECT, dir_fd=dir_fd), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return open_nonblocking(path, flags, dir_fd=dir_fd), False


def open_nonblocking(path: str, flags: int, *, dir_fd: int | None = None) -> int:
    """``os.open`` that never waits: a FIFO planted in a store blocked its reader for good.

    Opened with ``O_NONBLOCK`` (a FIFO without a writer opens at once), which is cleared
    again on a regular file; on anything else it stays, and the caller's check that the fd
    is a regular file refuses it.
    """
    fd = os.open(path, flags | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_into(fd: int, dest: memoryview, offset: int) -> int:
    """``pread`` until ``dest`` is full or the file ends; returns the bytes read.

    A short read that leaves the position off a block boundary is the end of the file (a
    regular file returns less than asked only there): the loop stops instead of asking
    again at that unaligned offset, which with ``O_DIRECT`` fails with ``EINVAL`` on Linux
    before 5.5 rather than returning 0, and would make every file whose size is not a whole
    number of blocks unreadable. A short read that ends on a block boundary (Linux returns at
    most 2 GiB - 4 KiB a call) is followed by another, aligned, read.
    """
    got = 0
    while got < len(dest):
        n = os.preadv(fd, [dest[got:]], offset + got)
        if n <= 0:
            break
        got += n
        if got < len(dest) and (offset + got) % ALIGN:
            break
    return got


def set_direct(fd: int, on: bool) -> bool:
    """Switch ``O_DIRECT`` on or off for an open file; False where the filesystem refuses."""
    if not _O_DIRECT:
        return False
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = (fl | _O_DIRECT) if on else (fl & ~_O_DIRECT)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, want)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return False  # tmpfs and some network filesystems refuse O_DIRECT
    return True


#: Reads in flight while the slice before them is checked and consumed: one more than the
#: two a plain double buffer keeps, so a disk that serves several requests at once (through
#: readahead or a deeper O_DIRECT queue) is kept busy while the CPU works.
READ_DEPTH = 3


def stream_pipelined(
    fd: int,
    consume: Callable[[int, memoryview], None] | None,
    *,
    crc: bool = True,
    pace: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """Read a file front to back, :data:`READ_DEPTH` slices in flight; ``(bytes, crc32c)``.

    Each slice is read by an I/O thread into one of ``READ_DEPTH + 1`` page-aligned buffers
    of :data:`BUFFER` bytes (the writers' pool: kept ones first, given back after a read
    that finished), then checksummed (with ``crc``; else 0 is returned) and passed
    to ``consume(offset, view)`` in order on the calling thread (the view is valid only
    during the call). ``fd`` may be opened with ``O_DIRECT`` or not.

    ``pace()``, where given, is called on the calling thread before each read is issued
    (never on an I/O thread): a background upload waits there while a save runs, so that
    no new read of it competes with the save for the disk.
    """
    nbuf = READ_DEPTH + 1
    bufs = [_take_buffer(BUFFER) for _ in range(nbuf)]  # kept ones first (_pool)
    views = [memoryview(b) for b in bufs]
    futs: dict[int, Call] = {}
    done = False  # a short read was seen: no more submissions
    ok = False  # the buffers go back to the pool only after a read that finished
    try:
        for i in range(READ_DEPTH):
            if pace is not None:
                pace()
            futs[i] = Call(read_into, fd, views[i % nbuf], i * BUFFER)
        total_crc = 0
        offset = 0
        i = 0
        while i in futs:
            n = futs.pop(i).result()
            if n < BUFFER:
                done = True
            elif not done and i + READ_DEPTH not in futs:
                # into the buffer of slice i - 1, consumed already
                j = i + READ_DEPTH
                if pace is not None:
                    pace()
                futs[j] = Call(read_into, fd, views[j % nbuf], j * BUFFER)
            if n == 0:
                break
            chunk = views[i % nbuf][:n]
            try:
                if crc:
                    total_crc = crc32c_of(chunk, total_crc)
                if consume is not None:
                    consume(offset, chunk)
            finally:
                chunk.release()
            offset += n
            i += 1
            if done:
                break
        ok = True
        return offset, total_crc
    finally:
        for f in futs.values():  # never free a buffer an I/O thread is still reading into
            with contextlib.suppress(Exception):
                f.result()
        for v in views:
            v.release()
        for b in bufs:
            if ok:
                _give_back(b, BUFFER)
                continue
            # A view a failed consumer still holds (in its traceback) would turn the real
            # error into a BufferError; the mapping is then freed with the view.
            with contextlib.suppress(BufferError):
                b.close()

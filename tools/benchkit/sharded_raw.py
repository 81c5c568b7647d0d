"""The raw O_DIRECT contender of the sharded bench (``benchkit.sharded``): the disk's floor.

Every rank writes its own local bytes of the state with O_DIRECT from one aligned buffer,
into as many files as ckptstore writes; a restore reads the same bytes with O_DIRECT, split
over the restoring ranks, into reused buffers (``raw``) or into new, untouched memory
(``raw-fresh``).

Two more restores do the least work a *checked* restore into existing tensors does (the
floor of ``ckpt-live``): every byte read is checked by one CRC32C pass and lands in touched
memory that PyTorch allocated (its large CPU allocations start 64 bytes past a page, so
``O_DIRECT`` cannot read into them). ``raw-checked``: O_DIRECT into the reused aligned
buffers, CRC32C there, one copy into the target. ``raw-checked-buffered``: buffered reads
(the page cache's readahead, one kernel copy) straight into the target, CRC32C there.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch

from benchkit.disk import ALIGN, CHUNK, dma_buffer, fill_buffer, odirect_write
from ckptstore.sharded.chunks import BLOCK

#: O_DIRECT reads a raw restore keeps in flight per process (ckptstore's READ_THREADS).
RAW_READERS = 4
#: The checked reads check (and copy) this many bytes at a time, while they are in the CPU's
#: cache: the CRC block of the shards ckptstore writes.
CHECK_BLOCK = BLOCK


class Raw:
    """O_DIRECT writes and reads of the same byte counts, from one aligned buffer."""

    def __init__(self, tensors: list[torch.Tensor] | None) -> None:
        self.buf = dma_buffer(CHUNK)  # page-aligned, on huge pages where given (see there)
        self.bufs: list[mmap.mmap] = []  # the readers' (see read)
        self.kept: list[mmap.mmap] = []  # what a fresh read filled (see read)
        self.target: torch.Tensor | None = None  # the checked reads' (see prepare_target)
        fill_buffer(self.buf, tensors or [])

    def write_parts(self, d: Path, rank: int, nbytes: int) -> None:
        """``nbytes`` into as many files as ckptstore's shard parts, written concurrently."""
        from concurrent.futures import ThreadPoolExecutor

        from ckptstore.sharded import plan as sharding

        n = max(1, min(sharding.MAX_PARTS, nbytes // sharding.PART_BYTES))
        sizes = [nbytes // n + (i < nbytes % n) for i in range(n)]
        paths = [d / f"raw.rank{rank}.{i}.bin" for i in range(n)]
        if n == 1:
            self.write(paths[0], sizes[0])
            return
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(self.write, paths, sizes))

    def write(self, path: Path, nbytes: int) -> None:
        nbytes = -(-nbytes // ALIGN) * ALIGN
        odirect_write(path, self.buf, nbytes)

    def prepare_target(self, nbytes: int) -> None:
        """Allocate and touch ``nbytes`` of PyTorch memory for the checked reads (untimed):
        the live tensors of a job that built its model before it restores."""
        if self.target is None or self.target.numel() < nbytes:
            self.target = None
            self.target = torch.empty(nbytes, dtype=torch.uint8)
            self.target.fill_(1)

    def read(
        self,
        spans: list[tuple[Path, int, int]],
        *,
        fresh: bool = False,
        checked: str | None = None,
    ) -> int:
        """Read ``(file, offset, length)`` spans (aligned) with O_DIRECT; bytes read.

        :data:`RAW_READERS` slices of :data:`CHUNK` bytes in flight at once, each thread
        into its own aligned buffer: the disk's speed with as many requests queued as
        ckptstore's restore keeps (``targets.READ_THREADS``), not one at a time.

        ``fresh``: each slice into new, untouched memory (an anonymous mapping of its size,
        kept until :meth:`release`), as a restore into new tensors must: the kernel faults
        in every page it fills (about 1 ns a byte on this machine, where reading into the
        reused buffers never faults).

        ``checked``: ``"copy"`` (each slice CRC32C-checked in its buffer and copied into the
        target at its place) or ``"buffered"`` (each slice read without O_DIRECT straight into
        the target, and checked there); :meth:`prepare_target` first.
        """
        from concurrent.futures import ThreadPoolExecutor

        import crc32c

        pieces = [
            (path, pos, min(CHUNK, off + length - pos))
            for path, off, length in spans
            for pos in range(off, off + length, CHUNK)
        ]
        places, at = [], 0  # where each slice lands in the target
        for _, _, want in pieces:
            places.append(at)
            at += want
        into: memoryview | None = None
        if checked is not None:
            if self.target is None or self.target.numel() < at:
                raise RuntimeError("Raw.read(checked=...) needs prepare_target first")
            array: Any = self.target.numpy()  # numpy's stubs do not say it is a buffer
            into = memoryview(array).cast("B")
        while len(self.bufs) < RAW_READERS:
            self.bufs.append(dma_buffer(CHUNK))
        free = list(self.bufs)

        def one(piece: tuple[Path, int, int], place: int) -> int:
            path, pos, want = piece
            if into is not None and checked == "buffered":
                dest = into[place : place + want]
                fd = os.open(path, os.O_RDONLY)
                try:
                    got = 0
                    while got < want:  # a CRC block at a time, checked while in the cache
                        n = os.preadv(fd, [dest[got : got + CHECK_BLOCK]], pos + got)
                        if n <= 0:
                            break
                        crc32c.crc32c(dest[got : got + n])
                        got += n
                    return got
                finally:
                    os.close(fd)
            if fresh:
                buf = mmap.mmap(-1, -(-want // ALIGN) * ALIGN)  # page-aligned, untouched
                self.kept.append(buf)
            else:
                buf = free.pop()  # list.pop is atomic: one buffer per running thread
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                got, end = 0, pos + want
                while pos < end:
                    n = os.preadv(fd, [memoryview(buf)[: end - pos]], pos)
                    if n <= 0:
                        break
                    pos += n
                    got += n
                if into is not None:  # "copy": checked where it landed, then copied
                    view = memoryview(buf)
                    for at in range(0, got, CHECK_BLOCK):  # the copy reads it from the cache
                        end = min(at + CHECK_BLOCK, got)
                        crc32c.crc32c(view[at:end])
                        into[place + at : place + end] = view[at:end]
                return got
            finally:
                os.close(fd)
                if not fresh:
                    free.append(buf)

        with ThreadPoolExecutor(RAW_READERS) as pool:
            return sum(pool.map(one, pieces, places))

    def release(self) -> None:
        """Unmap what fresh reads filled (untimed)."""
        for b in self.kept:
            b.close()
        self.kept.clear()

    def close(self) -> None:
        self.release()
        self.target = None
        self.buf.close()
        for b in self.bufs:
            b.close()


def raw_spans(d: Path, rank: int, world: int) -> list[tuple[Path, int, int]]:
    """This rank's share of the concatenated raw files, cut on 4 KiB boundaries."""
    files = sorted(d.glob("raw.rank*.bin"))  # each rank's parts, in one order everywhere
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    blocks = total // ALIGN
    lo = blocks * rank // world * ALIGN
    hi = blocks * (rank + 1) // world * ALIGN
    spans, base = [], 0
    for f, size in zip(files, sizes, strict=True):
        a, b = max(lo, base), min(hi, base + size)
        if a < b:
            spans.append((f, a - base, b - a))
        base += size
    return spans

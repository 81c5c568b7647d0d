"""The raw O_DIRECT contender of the sharded bench (``benchkit.sharded``): the disk's floor.

Every rank writes its own local bytes of the state with O_DIRECT from one aligned buffer,
into as many files as ckptstore writes; a restore reads the same bytes with O_DIRECT, split
over the restoring ranks, into reused buffers (``raw``) or into new, untouched memory
(``raw-fresh``).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from benchkit.disk import ALIGN, CHUNK, dma_buffer, fill_buffer, odirect_write

#: O_DIRECT reads a raw restore keeps in flight per process (ckptstore's READ_THREADS).
RAW_READERS = 4


class Raw:
    """O_DIRECT writes and reads of the same byte counts, from one aligned buffer."""

    def __init__(self, tensors: list[torch.Tensor] | None) -> None:
        self.buf = dma_buffer(CHUNK)  # page-aligned, on huge pages where given (see there)
        self.bufs: list[mmap.mmap] = []  # the readers' (see read)
        self.kept: list[mmap.mmap] = []  # what a fresh read filled (see read)
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

    def read(self, spans: list[tuple[Path, int, int]], *, fresh: bool = False) -> int:
        """Read ``(file, offset, length)`` spans (aligned) with O_DIRECT; bytes read.

        :data:`RAW_READERS` slices of :data:`CHUNK` bytes in flight at once, each thread
        into its own aligned buffer: the disk's speed with as many requests queued as
        ckptstore's restore keeps (``targets.READ_THREADS``), not one at a time.

        ``fresh``: each slice into new, untouched memory (an anonymous mapping of its size,
        kept until :meth:`release`), as a restore into new tensors must: the kernel faults
        in every page it fills (about 1 ns a byte on this machine, where reading into the
        reused buffers never faults).
        """
        from concurrent.futures import ThreadPoolExecutor

        pieces = [
            (path, pos, min(CHUNK, off + length - pos))
            for path, off, length in spans
            for pos in range(off, off + length, CHUNK)
        ]
        while len(self.bufs) < RAW_READERS:
            self.bufs.append(dma_buffer(CHUNK))
        free = list(self.bufs)

        def one(piece: tuple[Path, int, int]) -> int:
            path, pos, want = piece
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
                return got
            finally:
                os.close(fd)
                if not fresh:
                    free.append(buf)

        with ThreadPoolExecutor(RAW_READERS) as pool:
            return sum(pool.map(one, pieces))

    def release(self) -> None:
        """Unmap what fresh reads filled (untimed)."""
        for b in self.kept:
            b.close()
        self.kept.clear()

    def close(self) -> None:
        self.release()
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

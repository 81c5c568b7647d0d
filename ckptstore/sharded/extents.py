"""Restore reads by file extent: a file's boxes in runs, one ``O_DIRECT`` request a run.

In: the reads a restoring rank plans (``targets.read_items``: a box of a stored chunk and
the target memory it goes to), and each file's ``O_DIRECT`` descriptor. Out: every box in
its target, each CRC32C block checked in a staging buffer before a byte of it is copied
out, so no target, fresh or the caller's own, ever holds a byte that failed its check.

Why: read box by box through the page cache, a restore ran at ~1.3-1.7 GB/s on the test
VM, where ``O_DIRECT`` requests of 8 MiB or more from buffers on huge pages read the same
files at ~2.3 GB/s and with a tenth of the CPU (no page cache to fill, no readahead, no
kernel copy). A box is often small (a bias, a shard of a few hundred KB), so the unit of a
request is not the box but a run of a file: its boxes sorted by offset, merged while the
run stays under :data:`EXTENT` and the gap between two boxes under :data:`GAP` (read and
dropped). A box larger than :data:`EXTENT` is cut at its CRC blocks. Each run is read into
a stage from a small pool of huge-page buffers (``directio.new_buffer``; a stage of 4 KiB
pages splits a request into ~0.6 MiB segments on a ``segment_capped`` disk), its blocks
are checked there while still in cache, and ``memmove`` copies each box's bytes into its
target (the GIL released). The runs go on twice ``targets.READ_THREADS`` threads, with
``READ_THREADS`` requests at the disk at once (``targets.run_tasks``): the checks and copies
of the runs that just landed never leave the disk idle.

Used by a sharded restore (``targets.read_into``) and by DCP's ``dcp.load`` through
``CkptStoreReader`` (``dcp.py``), where the store reads with ``O_DIRECT`` (``io``, or
``"auto"`` as the device measured).

Only a box that is one contiguous byte range of its chunk and of its contiguous target of
the stored dtype goes this way (FSDP2's row shards restored on any world size: every box),
a target on the CPU or on a GPU (:data:`DEVICES`): a GPU target's pieces are copied from
the stage with ``Tensor.copy_``, each once all of its blocks passed. A file with any
other box is read as before, box by box through the page cache, so no file is read
partly with ``O_DIRECT`` and partly buffered: on the test VM such a mix made the kernel's
readahead read the ``O_DIRECT`` ranges a second time (970-981 MB read for 806, session
21). Where the store reads through the page cache, the files whose every box goes to a
GPU are read by runs too, each with one buffered ``pread`` (``targets.read_into``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from ..errors import IntegrityError
from ..integrity import crc32c_of
from ..storage.directio import ALIGN, new_buffer, read_into
from .chunks import Chunk

__all__ = ["EXTENT", "GAP", "Piece", "Run", "plan", "read_run", "spans"]

#: The size of a stage, and the most bytes one run reads (one request) from its first
#: block rounded down to 4 KiB to its last rounded up. 8 MiB requests from huge pages read
#: the bench's 768 MB at 2.3-2.5 GB/s, as fast as 16 or 32 MiB (4 in flight). A multiple
#: of 2 MiB: the kernel places such a mapping on a huge-page boundary, so every page of the
#: stage is a huge one; at 8 MiB + 8 KiB a quarter of it was on 4 KiB pages.
EXTENT = 8 << 20
#: Two boxes of a file at most this far apart share a run: the bytes between are read
#: and dropped (safetensors headers, padding, another rank's rows of a resharded chunk).
GAP = 128 << 10
#: Idle stages kept for the next restore (a fresh huge-page buffer costs ~2 ns a byte to
#: touch on the test VM): one per thread of a restore's reads (``targets.read_into`` runs
#: twice ``READ_THREADS`` of them: as many reading as checking and copying).
_STAGES_MAX = 8


@dataclasses.dataclass(slots=True, eq=False)
class Piece:
    """Blocks ``k0 .. k1 - 1`` of a chunk of tensor ``name``, read to fill one box.

    The box's bytes ``first .. end`` of the chunk go to the memory at ``address``; for a
    target on a GPU, to byte ``address`` of ``device`` (its local data as bytes).
    """

    name: str
    chunk: Chunk
    k0: int
    k1: int
    first: int
    end: int
    address: int
    device: torch.Tensor | None = dataclasses.field(default=None, compare=False)

    def lo(self, block: int) -> int:
        """The file offset of the piece's first block."""
        return self.chunk.start + self.k0 * block

    def hi(self, block: int) -> int:
        """The file offset just past the piece's last block."""
        return self.chunk.start + min(self.k1 * block, self.chunk.nbytes)


@dataclasses.dataclass(slots=True, eq=False)
class Run:
    """Pieces of one file read with one request: bytes ``start`` (aligned) to ``end``."""

    file: str
    start: int
    end: int
    pieces: tuple[Piece, ...]


#: The devices whose targets runs copy into from the stage (``Tensor.copy_``); CPU targets
#: take a ``memmove``. Others (and ``meta``) are read box by box. Tests add ``"cpu"`` to
#: run the device way on CPU tensors.
DEVICES = frozenset({"cuda"})

_Memory = tuple[int, tuple[int, ...], int, torch.Tensor | None]


def _memory(t: torch.Tensor, dtype: torch.dtype) -> _Memory | None:
    """``(address, shape, itemsize, device)`` of a target's local data for runs to fill.

    Runs copy into a contiguous tensor of the stored ``dtype`` only, on the CPU (by its
    address) or on a device of :data:`DEVICES` (``device``: its data as bytes, ``address``
    0); None for others.
    """
    if t.dtype != dtype or not t.is_contiguous():
        return None
    if t.device.type in DEVICES:  # first: tests put "cpu" in DEVICES to take this way
        if not t.numel():
            return None
        return 0, tuple(t.shape), dtype.itemsize, t.reshape(-1).view(torch.uint8)
    if t.device.type == "cpu":
        return t.data_ptr(), tuple(t.shape), dtype.itemsize, None
    return None


def _one_range(
    sizes: Sequence[int], at: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int] | None:
    """The ``(first, end)`` bytes of a box of a row-major array of ``sizes``, or None.

    None unless the box is one contiguous, non-empty range of the array: the dims after
    the last one it does not take whole are whole, those before it of length 1.
    (``chunks.box_byte_range`` and a count, in one pass: ~1 us a box, not ~5.)
    """
    step, first, total = itemsize, 0, itemsize
    whole = True  # every dim after ``d`` is taken whole
    for d in range(len(sizes) - 1, -1, -1):
        n = lengths[d]
        if n == 0 or (not whole and n != 1):
            return None
        first += at[d] * step
        total *= n
        whole = whole and n == sizes[d]
        step *= sizes[d]
    return first, first + total


def plan(
    items: Iterable[tuple[str, Chunk, tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
    flat: Mapping[str, torch.Tensor],
    local_of: Callable[[torch.Tensor], torch.Tensor],
    *,
    block: int,
    dtype_of: Callable[[str], torch.dtype],
    files: Callable[[str], bool],
    host: bool = True,
) -> tuple[list[Run], list[tuple[str, Chunk, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]:
    """The runs that read every box of the files that can be read by extent, and the rest.

    ``items`` are ``targets.read_items``'s for the targets ``flat`` (``local_of`` gives a
    target's local data), of chunks checked in blocks of ``block`` bytes, ``dtype_of(name)``
    the stored dtype of a target; ``files(name)`` says whether a file can be read with
    ``O_DIRECT``. A file goes by runs when it can and every box of it is one contiguous
    range of its chunk and of its target's memory (see the module's doc), on the CPU only
    with ``host``; all of its items go to the rest otherwise, in their order. Integers
    only, per box: a target's memory is looked at once.

    Returns:
        ``(runs, rest)``: runs in file order, each file's by offset; the other items.
    """
    span = EXTENT - ALIGN  # a run's bytes from its rounded-down start: whole blocks fit
    per = span // block if 0 < block <= span else 0
    by_file: dict[str, list[Piece]] = {}
    items = list(items)
    refused: set[str] = set()
    memory: dict[str, _Memory | None] = {}
    for name, chunk, src_at, dest_at, lengths in items:
        file = chunk.file
        if file in refused:
            continue
        if name not in memory:
            found = _memory(local_of(flat[name]), dtype_of(name))
            memory[name] = found if host or found is None or found[3] is not None else None
        mem = memory[name]
        src = dst = None
        if per and mem is not None:
            src = _one_range(chunk.sizes, src_at, lengths, mem[2])
            dst = _one_range(mem[1], dest_at, lengths, mem[2])
        pieces = by_file.get(file)
        if pieces is None and src is not None and dst is not None and files(file):
            pieces = by_file[file] = []  # files() asked once a file
        if src is None or dst is None or mem is None or pieces is None:
            refused.add(file)
            by_file.pop(file, None)
            continue
        first, end = src
        b0, b1 = first // block, -(-end // block)
        for k in range(b0, b1, per):
            pieces.append(
                Piece(name, chunk, k, min(b1, k + per), first, end, mem[0] + dst[0], mem[3])
            )
    runs: list[Run] = []
    for file, pieces in by_file.items():
        # Each piece's first block's offset, by offset (ties in the order made), and one past
        # its last block's end: Piece.lo and Piece.hi without two calls a piece.
        bounds = sorted(
            (p.chunk.start + p.k0 * block, i, p.chunk.start + min(p.k1 * block, p.chunk.nbytes))
            for i, p in enumerate(pieces)
        )
        group: list[Piece] = []
        start = last = 0
        for lo, i, hi in bounds:
            p = pieces[i]
            if group and (hi - start > span or lo - last > GAP):
                runs.append(Run(file, start, last, tuple(group)))
                group = []
            if not group:
                start = lo - lo % ALIGN
            group.append(p)
            last = max(last, hi)
        if group:
            runs.append(Run(file, start, last, tuple(group)))
    rest = [item for item in items if item[1].file not in by_file]
    return runs, rest


def spans(runs: Iterable[Run]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of each box's target memory, in the order the runs fill them.

    What ``_prefault.Prefaulter`` faults in ahead of the reads: CPU memory only.
    """
    out: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    for run in runs:
        for p in run.pieces:
            if p.device is not None:
                continue
            key = (p.address, p.end - p.first)
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


_stage_lock = threading.Lock()
_stages: list[mmap.mmap] = []


def _take_stage() -> mmap.mmap:
    size = EXTENT
    with _stage_lock:
        while _stages:
            buf = _stages.pop()
            if len(buf) == size:  # kept when EXTENT was another size (tests set it)
                return buf
            buf.close()
    return new_buffer(size)


def _give_stage(buf: mmap.mmap) -> None:
    with _stage_lock:
        if len(_stages) < _STAGES_MAX and len(buf) == EXTENT:
            _stages.append(buf)
            return
    with contextlib.suppress(BufferError):  # a failed run's traceback may hold a view
        buf.close()


def _forget_stages() -> None:
    """In a forked child: a fresh lock, and none of the parent's stages (copies on write)."""
    global _stage_lock  # a lock held at fork time stays held in the child
    _stage_lock = threading.Lock()
    _stages.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_stages)


def read_run(
    run: Run,
    block: int,
    direct_fd: Callable[[str], int | None],
    read_to: Callable[[str, int, list[memoryview]], None],
    where: str,
    *,
    gate: threading.Semaphore | None = None,
) -> int:
    """Read ``run`` into a stage with one request, check every block, copy the boxes out.

    The request goes through ``direct_fd(run.file)`` (an ``O_DIRECT`` descriptor); where
    that is None or the kernel refuses the request (``EINVAL``: an alignment the
    filesystem does not take), through ``read_to`` (the reader's buffered ``pread``).
    ``gate``, where given, is held for the request only, not for the checks and copies
    after it: the caller's cap on the requests in flight.

    Returns:
        The bytes read.

    Raises:
        IntegrityError: the file is shorter than the run, unreadable, or a block does not
            match its CRC32C (nothing of that block, nor of any later one of the run, was
            copied into its target).
    """
    size = run.end - run.start
    stage = _take_stage()
    try:
        view = memoryview(stage)
        anchor = ctypes.c_char.from_buffer(stage)
        base = ctypes.addressof(anchor)
        host: torch.Tensor | None = None  # the stage as a tensor, for copies to a device
        try:
            with gate or contextlib.nullcontext():
                _fill(run, view, direct_fd, read_to, where)
            for p in run.pieces:
                chunk = p.chunk
                for k in range(p.k0, p.k1):
                    k_lo, k_hi = k * block, min((k + 1) * block, chunk.nbytes)
                    at = chunk.start + k_lo - run.start
                    if crc32c_of(view[at : at + k_hi - k_lo]) != chunk.crcs[k]:
                        raise IntegrityError(
                            f"{where}: tensor {p.name!r}: block {k} of its chunk at "
                            f"{list(chunk.offsets)} in {run.file} (bytes {chunk.start + k_lo}..) "
                            "does not match its crc32c; the file is corrupt"
                        )
                    if p.device is None:
                        a, b = max(k_lo, p.first), min(k_hi, p.end)
                        # Checked: now, and only now, into the target (memmove drops the GIL).
                        ctypes.memmove(p.address + (a - p.first), base + at + (a - k_lo), b - a)
                if p.device is not None:
                    # Every block of the piece checked: its bytes to the device in one copy
                    # (not one a block: each copy is a launch of its own), synchronous, so
                    # the stage is free to reuse once it returns.
                    if host is None:
                        host = torch.frombuffer(stage, dtype=torch.uint8)
                    a, b = max(p.k0 * block, p.first), min(p.k1 * block, p.end)
                    at = chunk.start + a - run.start
                    dest = p.address + (a - p.first)
                    p.device[dest : dest + b - a].copy_(host[at : at + b - a])
        finally:
            del anchor, view, host
    finally:
        _give_stage(stage)
    return size


def _fill(
    run: Run,
    view: memoryview,
    direct_fd: Callable[[str], int | None],
    read_to: Callable[[str, int, list[memoryview]], None],
    where: str,
) -> None:
    """Read the run's bytes into the start of ``view``."""
    size = run.end - run.start
    fd = direct_fd(run.file)
    if fd is not None:
        whole = -(-size // ALIGN) * ALIGN  # O_DIRECT lengths are whole blocks
        try:
            got = read_into(fd, view[:whole], run.start)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise IntegrityError(f"{where}: {run.file} unreadable ({e})") from None
        else:
            if got < size:
                raise IntegrityError(
                    f"{where}: {run.file}: {size} bytes at {run.start} not there; it is truncated"
                )
            return
    read_to(run.file, run.start, [view[:size]])

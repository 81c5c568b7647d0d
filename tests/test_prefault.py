"""The restore's prefault thread (``ckptstore._prefault``): pages faulted in, bytes kept."""

from __future__ import annotations

import ctypes
import mmap
import resource
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch
from _helpers import row_chunks

from ckptstore import _prefault
from ckptstore._prefault import Prefaulter, populate, supported
from ckptstore.errors import IntegrityError
from ckptstore.sharded import targets
from ckptstore.sharded.chunks import ChunkIndex

PAGE = mmap.PAGESIZE

needs_populate = pytest.mark.skipif(
    not supported(), reason="this kernel has no madvise(MADV_POPULATE_WRITE) (Linux < 5.14)"
)


@pytest.fixture
def region() -> Iterator[tuple[mmap.mmap, int]]:
    """Fresh anonymous memory of 256 pages (none faulted in yet) and its address."""
    m = mmap.mmap(-1, 256 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(m)
    try:
        yield m, ctypes.addressof(anchor)
    finally:
        del anchor
        m.close()


def _faults_writing(address: int, nbytes: int) -> int:
    """This thread's minor page faults while it writes one byte of every page."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for off in range(0, nbytes, PAGE):
        ctypes.memset(address + off, 7, 1)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@needs_populate
def test_populate_faults_the_pages_in_and_keeps_their_bytes(region: tuple[mmap.mmap, int]) -> None:
    m, address = region
    half = 128 * PAGE
    # The measure works: writing fresh pages faults each one in.
    assert _faults_writing(address, 16 * PAGE) >= 16
    m[:PAGE] = bytes(range(256)) * (PAGE // 256)  # a page with contents
    assert populate(address, 256 * PAGE) == 256 * PAGE
    assert m[:PAGE] == bytes(range(256)) * (PAGE // 256)  # kept: nothing was written
    assert m[16 * PAGE : half] == bytes(half - 16 * PAGE)  # fresh pages still read as zero
    # Every page was mapped writable: writing them all now faults (almost) none in.
    assert _faults_writing(address + 16 * PAGE, 240 * PAGE) <= 8


@needs_populate
def test_populate_leaves_the_pages_it_shares_in_part_alone(region: tuple[mmap.mmap, int]) -> None:
    _, address = region
    # From 100 bytes into page 0 to 100 bytes into page 4: only pages 1..3 are whole.
    assert populate(address + 100, 4 * PAGE) == 3 * PAGE
    assert _faults_writing(address + PAGE, 3 * PAGE) <= 1
    assert _faults_writing(address + 4 * PAGE, PAGE) == 1  # page 4 was left to the writer
    assert populate(address + 100, PAGE - 200) == 0  # inside one page: nothing whole


@needs_populate
def test_populate_asks_the_kernel_only_for_steps_with_a_page_missing(
    region: tuple[mmap.mmap, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory in place already (a trained model's) is not walked again, page by page."""
    _, address = region
    assert not _prefault.resident(address, 256 * PAGE)  # fresh: no page there yet
    _faults_writing(address, 64 * PAGE)  # the first 64 pages in place, the rest not
    assert _prefault.resident(address, 64 * PAGE)
    assert not _prefault.resident(address, 65 * PAGE)
    assert _prefault._madvise is not None
    real = _prefault._madvise
    asked: list[tuple[int, int]] = []

    def counting(at: int, n: int, advice: int) -> int:
        asked.append((at - address, n))
        return real(at, n, advice)

    monkeypatch.setattr(_prefault, "_madvise", counting)
    monkeypatch.setattr(_prefault, "STEP", 32 * PAGE)
    assert populate(address, 256 * PAGE) == 256 * PAGE
    # Steps 0 and 1 (pages 0..63) were in place; steps 2..7 were populated, each once.
    assert asked == [(k * 32 * PAGE, 32 * PAGE) for k in range(2, 8)]
    assert _prefault.resident(address, 256 * PAGE)
    assert _faults_writing(address, 256 * PAGE) <= 8


@needs_populate
def test_an_unmapped_range_is_skipped() -> None:
    m = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(m)
    address = ctypes.addressof(anchor)
    del anchor
    m.close()  # unmapped: madvise says ENOMEM, nothing is done, nothing raised
    assert populate(address, 4 * PAGE) == 0


@needs_populate
def test_a_prefaulter_stops_when_its_block_is_left(
    region: tuple[mmap.mmap, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, address = region
    monkeypatch.setattr(_prefault, "MIN_BYTES", PAGE)
    monkeypatch.setattr(_prefault, "STEP", PAGE)
    # The same memory listed 100,000 times: far more work than the block lasts.
    with Prefaulter([(address, 256 * PAGE)] * 100_000) as pf:
        assert any(t.name == "ckptstore-prefault" for t in threading.enumerate())
    assert not any(t.name == "ckptstore-prefault" for t in threading.enumerate())
    assert 0 < pf.populated < 100_000 * 256 * PAGE
    # Ranges under MIN_BYTES are left out; with none left, no thread is started at all.
    monkeypatch.setattr(_prefault, "MIN_BYTES", 512 * PAGE)
    with Prefaulter([(address, 256 * PAGE)]) as pf:
        assert not any(t.name == "ckptstore-prefault" for t in threading.enumerate())
    assert pf.ranges == []
    assert pf.populated == 0


class _Recorded(Prefaulter):
    made: ClassVar[list[_Recorded]] = []

    def __init__(self, ranges: object) -> None:
        super().__init__(ranges)  # type: ignore[arg-type]
        _Recorded.made.append(self)


def test_read_into_faults_the_targets_in_read_order_and_joins_its_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every CPU target, in the order the read tasks fill them; the thread gone on return."""
    monkeypatch.setattr(_prefault, "MIN_BYTES", PAGE)
    monkeypatch.setattr(targets, "Prefaulter", _Recorded)
    _Recorded.made = []
    block = 64 << 10
    saved = {f"model/w{i}": torch.randn(64, 1024) for i in range(3)}  # 256 KiB each
    raw = bytearray()
    tensors = {}
    for name, t in saved.items():
        data, tensors[name] = row_chunks(t, 4, block, len(raw))
        raw += data
    index = ChunkIndex(tensors, block=block)

    def read_to(name: str, off: int, bufs: list[memoryview]) -> None:
        for b in bufs:
            b[:] = raw[off : off + len(b)]
            off += len(b)

    def read(name: str, off: int, n: int) -> bytearray:
        return raw[off : off + n]

    flat = {name: torch.empty(64, 1024) for name in reversed(saved)}  # read in flat's order
    assert targets.read_into(index, flat, read, "s", read_to) == len(raw)
    for name, t in saved.items():
        assert torch.equal(flat[name], t)
    (pf,) = _Recorded.made
    assert pf.ranges == [(t.data_ptr(), t.numel() * 4) for t in flat.values()]
    assert pf._thread is None
    assert not any(t.name == "ckptstore-prefault" for t in threading.enumerate())

    # A block that fails: the error is raised, the thread stopped and joined as well.
    raw[tensors["model/w1"].chunks[2].start + 3] ^= 1
    with pytest.raises(IntegrityError, match=r"block 0 of its chunk at \[32, 0\]"):
        targets.read_into(index, {n: torch.empty(64, 1024) for n in saved}, read, "s", read_to)
    assert _Recorded.made[-1]._thread is None
    assert not any(t.name == "ckptstore-prefault" for t in threading.enumerate())

    # Switched off (targets.PREFAULT), no prefaulter is made.
    monkeypatch.setattr(targets, "PREFAULT", False)
    raw[tensors["model/w1"].chunks[2].start + 3] ^= 1
    count = len(_Recorded.made)
    out = {n: torch.empty(64, 1024) for n in saved}
    targets.read_into(index, out, read, "s", read_to)
    assert len(_Recorded.made) == count
    assert all(torch.equal(out[n], saved[n]) for n in saved)

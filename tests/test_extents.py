"""Restore reads by file extent (``sharded/extents.py``): real files, real ``O_DIRECT``.

A file's boxes go in runs of at most ``EXTENT`` bytes, one aligned ``O_DIRECT`` request a
run, into a stage where every block is checked before a byte of it reaches its target. A
file with any box that is not one contiguous range goes box by box through the page cache
instead, whole. The manager's restores choose between the two as the store's ``io`` says
(``"auto"``: by the speeds measured, ``storage/iomode.py``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointManager
from ckptstore.errors import IntegrityError
from ckptstore.sharded import extents, targets
from ckptstore.sharded.chunks import Chunk, ChunkIndex, TensorEntry
from ckptstore.storage import iomode
from ckptstore.storage.directio import ALIGN, open_direct_read
from tests._helpers import huge_share, row_chunks, step_path, thp_at_first_touch

pytestmark = pytest.mark.timeout(120)

BLOCK = 4096


class Files:
    """Real files in ``root`` read as a restore reads them: an ``O_DIRECT`` descriptor per
    file, and the buffered ``pread`` of the reader (``read_to``), each call recorded."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fds: dict[str, int] = {}
        self.buffered: list[tuple[str, int, int]] = []

    def write(self, name: str, data: bytes) -> None:
        (self.root / name).write_bytes(data)

    def direct_fd(self, name: str) -> int | None:
        if name not in self.fds:
            fd, direct = open_direct_read(str(self.root / name))
            assert direct, "the test's filesystem takes O_DIRECT"
            self.fds[name] = fd
        return self.fds[name]

    def read_to(self, name: str, offset: int, bufs: list[memoryview]) -> None:
        self.buffered.append((name, offset, sum(len(b) for b in bufs)))
        with open(self.root / name, "rb") as f:
            f.seek(offset)
            for b in bufs:
                assert f.readinto(b) == len(b)  # type: ignore[attr-defined]

    def read(self, name: str, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        self.read_to(name, offset, [memoryview(buf)])
        return buf

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Files]:
    f = Files(tmp_path)
    yield f
    f.close()


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every ``O_DIRECT`` request of the runs: ``(offset, length)``."""
    seen: list[tuple[int, int]] = []
    real = extents.read_into

    def read_into(fd: int, dest: memoryview, offset: int) -> int:
        seen.append((offset, len(dest)))
        return real(fd, dest, offset)

    monkeypatch.setattr(extents, "read_into", read_into)
    return seen


def _stored(files: Files, t: torch.Tensor, parts: int, at: int = 0, name: str = "f") -> ChunkIndex:
    """``t`` saved as ``parts`` row chunks from offset ``at`` of file ``name``."""
    raw, entry = row_chunks(t, parts, BLOCK, at)
    chunks = tuple(Chunk(c.offsets, c.sizes, name, c.start, c.nbytes, c.crcs) for c in entry.chunks)
    files.write(name, bytes(at) + bytes(raw) + bytes(123))  # a tail: the file is no run's end
    return ChunkIndex({"model/w": TensorEntry("float32", tuple(t.shape), chunks)}, block=BLOCK)


def _read(files: Files, index: ChunkIndex, flat: dict[str, torch.Tensor], **kw: Any) -> int:
    return targets.read_into(
        index, flat, files.read, "s", files.read_to, direct_fd=files.direct_fd, **kw
    )


def _plan(
    index: ChunkIndex,
    flat: dict[str, torch.Tensor],
    boxes: dict[str, Any] | None = None,
    files: Any = lambda f: True,
    host: bool = True,
) -> tuple[list[extents.Run], list[Any]]:
    """``extents.plan`` of the reads of ``flat`` from ``index``, as ``targets.read_into``
    calls it (every file readable with ``O_DIRECT`` unless ``files`` says otherwise)."""
    return extents.plan(
        targets.read_items(index, flat, boxes or {}),
        flat,
        targets.local_of,
        block=index.block,
        dtype_of=lambda n: index.tensors[n].torch_dtype,
        files=files,
        host=host,
    )


def test_a_file_is_read_in_aligned_runs_of_at_most_extent_bytes(
    files: Files, requests: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extents, "EXTENT", 64 << 10)
    t = torch.randn(1024, 64)  # 256 KiB in 16 chunks of 16 KiB, from byte 1000 of the file
    index = _stored(files, t, 16, at=1000)
    out = torch.full((1024, 64), -7.0)
    assert _read(files, index, {"model/w": out}) > t.numel() * 4
    assert torch.equal(out, t)
    assert files.buffered == []  # nothing through the page cache
    # Runs of whole boxes (16 KiB chunks from byte 1000 + 16 KiB x i): three to a run, the
    # fourth would end past 64 KiB of the run's aligned start; each run one request, from
    # its first box's block rounded down to 4 KiB, its length rounded up.
    starts = [1000 + (16 << 10) * i for i in range(0, 16, 3)]
    ends = [min(a + 3 * (16 << 10), 1000 + (256 << 10)) for a in starts]
    want = [
        (a - a % ALIGN, -(-(b - a + a % ALIGN) // ALIGN) * ALIGN)
        for a, b in zip(starts, ends, strict=True)
    ]
    assert sorted(requests) == want
    assert all(n <= 64 << 10 for _, n in requests)


def test_a_box_larger_than_an_extent_is_cut_at_its_blocks(
    files: Files, requests: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extents, "EXTENT", 3 * BLOCK)
    # A run holds whole blocks within EXTENT - 4 KiB of its rounded-down start: 2 here.
    t = torch.randn(40, 1000)  # one chunk of 160,000 bytes: 40 blocks, the last partial
    index = _stored(files, t, 1)
    runs, rest = _plan(index, {"model/w": t})
    assert rest == []
    assert [(p.k0, p.k1) for r in runs for p in r.pieces] == [
        (k, min(k + 2, 40)) for k in range(0, 40, 2)
    ]
    assert all(r.end - r.start <= 2 * BLOCK for r in runs)
    out = torch.empty(40, 1000)
    _read(files, index, {"model/w": out})
    assert torch.equal(out, t)
    assert len(requests) == 20


def test_boxes_further_apart_than_the_gap_are_separate_runs(files: Files) -> None:
    t = torch.randn(64, 64)
    index = _stored(files, t, 2)
    a, b = index.tensors["model/w"].chunks
    gap = extents.GAP + 1  # the second chunk moved past the gap
    far = Chunk(b.offsets, b.sizes, "f", b.start + gap, b.nbytes, b.crcs)
    moved = ChunkIndex({"model/w": TensorEntry("float32", (64, 64), (a, far))}, block=BLOCK)
    data = (files.root / "f").read_bytes()
    files.write("f", data[: b.start] + bytes(gap) + data[b.start :])
    flat = {"model/w": torch.empty(64, 64)}
    runs, _ = _plan(moved, flat)
    assert [len(r.pieces) for r in runs] == [1, 1]
    _read(files, moved, flat)
    assert torch.equal(flat["model/w"], t)
    # Within the gap, one run reads both boxes and the bytes between them.
    runs, _ = _plan(index, flat)
    assert [len(r.pieces) for r in runs] == [2]


def test_a_file_with_a_box_that_is_not_one_range_is_read_box_by_box_whole(
    files: Files, requests: list[tuple[int, int]]
) -> None:
    t = torch.randn(64, 64)
    u = torch.randn(64, 64)
    index = _stored(files, t, 4, name="f")
    other = _stored(files, u, 4, name="g")
    both = ChunkIndex(
        {"model/w": index.tensors["model/w"], "model/u": other.tensors["model/w"]}, block=BLOCK
    )
    # A column range of w: its boxes are not one range of their chunks, so all of file f
    # goes box by box; u's file g still goes by runs.
    flat = {"model/w": torch.full((64, 64), -7.0), "model/u": torch.empty(64, 64)}
    boxes = {"model/w": ((0, 0), (64, 32))}
    runs, rest = _plan(both, flat, boxes=boxes)
    assert {r.file for r in runs} == {"g"}
    assert {item[1].file for item in rest} == {"f"}
    targets.read_into(
        both, flat, files.read, "s", files.read_to, boxes=boxes, direct_fd=files.direct_fd
    )
    assert torch.equal(flat["model/w"][:, :32], t[:, :32])
    assert bool((flat["model/w"][:, 32:] == -7.0).all())
    assert torch.equal(flat["model/u"], u)
    assert {name for name, _, _ in files.buffered} == {"f"}
    assert requests  # g's runs
    # A file that has no O_DIRECT descriptor goes box by box too.
    runs, rest = _plan(both, flat, files=lambda f: f != "g")
    assert {r.file for r in runs} == {"f"}
    assert {item[1].file for item in rest} == {"g"}


def test_requests_in_flight_are_capped_while_other_runs_are_checked(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READ_THREADS requests at most, and the checks and copies of other runs meanwhile."""
    import threading
    import time

    lock = threading.Lock()
    now = {"reads": 0, "checks": 0}
    most = {"reads": 0, "both": 0}
    real_read, real_crc = extents.read_into, extents.crc32c_of

    def count(kind: str, fn: Any, *a: Any) -> Any:
        with lock:
            now[kind] += 1
            most["reads"] = max(most["reads"], now["reads"])
            most["both"] = max(most["both"], now["reads"] + now["checks"])
        try:
            time.sleep(0.01 if kind == "reads" else 0.003)
            return fn(*a)
        finally:
            with lock:
                now[kind] -= 1

    monkeypatch.setattr(extents, "read_into", lambda *a: count("reads", real_read, *a))
    monkeypatch.setattr(extents, "crc32c_of", lambda *a: count("checks", real_crc, *a))
    monkeypatch.setattr(extents, "EXTENT", 4 * BLOCK)
    t = torch.randn(1024, 64)  # 64 blocks: 22 runs of 3
    index = _stored(files, t, 16)
    out = torch.empty(1024, 64)
    _read(files, index, {"model/w": out})
    assert torch.equal(out, t)
    assert most["reads"] == targets.READ_THREADS
    assert most["both"] > targets.READ_THREADS  # reads went on while runs were checked


def test_a_corrupt_block_stops_its_run_before_a_byte_of_it_reaches_the_target(
    files: Files,
) -> None:
    t = torch.randn(64, 64)  # 4 chunks of 4 KiB rows: one block each
    index = _stored(files, t, 4)
    bad = index.tensors["model/w"].chunks[2]
    data = bytearray((files.root / "f").read_bytes())
    data[bad.start + 100] ^= 0x10
    files.write("f", bytes(data))
    out = torch.full((64, 64), -7.0)
    with pytest.raises(
        IntegrityError, match=r"tensor 'model/w': block 0 of its chunk at \[32, 0\] in f"
    ) as ei:
        _read(files, index, {"model/w": out})
    assert "does not match its crc32c" in str(ei.value)
    assert bool((out[32:48] == -7.0).all())  # the failed block: nothing of it copied
    assert torch.equal(out[:32], t[:32])  # the run's blocks before it were


@pytest.fixture
def device_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU targets taken the way GPU targets go (``extents.DEVICES``): each piece copied
    with ``Tensor.copy_`` once all of its blocks passed, not block by block by address."""
    monkeypatch.setattr(extents, "DEVICES", frozenset({"cpu"}))


@pytest.mark.usefixtures("device_way")
def test_a_device_target_gets_a_piece_only_once_every_block_of_it_passed(files: Files) -> None:
    t = torch.randn(256, 64)  # 4 chunks of 64 rows, 16 KiB: 4 blocks each
    index = _stored(files, t, 4)
    runs, rest = _plan(index, {"model/w": t})
    assert rest == []
    assert all(p.device is not None for r in runs for p in r.pieces)
    assert extents.spans(runs) == []  # device memory is never prefaulted
    out = torch.empty(256, 64)
    _read(files, index, {"model/w": out})
    assert torch.equal(out, t)
    # A corrupt third block of chunk 1: none of chunk 1 reaches the target (the CPU way
    # copies its first two blocks), chunk 0 does.
    bad = index.tensors["model/w"].chunks[1]
    data = bytearray((files.root / "f").read_bytes())
    data[bad.start + 2 * BLOCK + 5] ^= 0x01
    files.write("f", bytes(data))
    out = torch.full((256, 64), -7.0)
    with pytest.raises(IntegrityError, match=r"block 2 of its chunk at \[64, 0\] in f"):
        _read(files, index, {"model/w": out})
    assert torch.equal(out[:64], t[:64])
    assert bool((out[64:128] == -7.0).all())


@pytest.mark.usefixtures("device_way")
def test_device_targets_go_by_runs_through_the_page_cache_too(
    files: Files, requests: list[tuple[int, int]]
) -> None:
    """Without ``O_DIRECT`` (``io="buffered"``), files whose every box goes to a device are
    read by runs all the same, one buffered read a run; a file with a box for a CPU target
    goes box by box, as CPU targets do through the page cache."""
    t = torch.randn(256, 64)
    index = _stored(files, t, 4)
    out = torch.empty(256, 64)
    targets.read_into(index, {"model/w": out}, files.read, "s", files.read_to)
    assert torch.equal(out, t)
    assert requests == []  # no O_DIRECT request
    # One read of the run (4 chunks of 16 KiB in one 64 KiB run), not one per box.
    assert files.buffered == [("f", 0, 256 * 64 * 4)]
    runs, _ = _plan(index, {"model/w": t}, host=False)
    assert runs  # a device target goes by runs where CPU targets may not


def test_cpu_targets_go_by_runs_only_with_o_direct(
    files: Files, requests: list[tuple[int, int]]
) -> None:
    """Through the page cache a CPU target is read box by box, straight into it (one copy,
    the kernel's): runs would add the stage's copy."""
    t = torch.randn(256, 64)
    index = _stored(files, t, 4)
    out = torch.empty(256, 64)
    targets.read_into(index, {"model/w": out}, files.read, "s", files.read_to)
    assert torch.equal(out, t)
    assert requests == []
    assert len(files.buffered) == 4 * 4  # box by box, a read a block
    runs, rest = _plan(index, {"model/w": t}, host=False)
    assert runs == []
    assert len(rest) == 4
    runs, rest = _plan(index, {"model/w": t})
    assert len(runs) == 1
    assert rest == []


def test_a_file_shorter_than_its_runs_is_an_integrity_error(files: Files) -> None:
    t = torch.randn(64, 64)
    index = _stored(files, t, 4)
    data = (files.root / "f").read_bytes()
    files.write("f", data[: 3 * 4096 + 10])
    out = torch.full((64, 64), -7.0)
    with pytest.raises(IntegrityError, match="not there; it is truncated"):
        _read(files, index, {"model/w": out})


def test_a_request_the_kernel_refuses_goes_through_the_page_cache(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int, dest: memoryview, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")  # an alignment the fs does not take

    monkeypatch.setattr(extents, "read_into", refuse)
    t = torch.randn(64, 64)
    index = _stored(files, t, 4)
    out = torch.empty(64, 64)
    _read(files, index, {"model/w": out})
    assert torch.equal(out, t)
    assert files.buffered  # every run through read_to

    def fail(fd: int, dest: memoryview, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(extents, "read_into", fail)
    with pytest.raises(IntegrityError, match=r"f unreadable \(\[Errno 5\]"):
        _read(files, index, {"model/w": torch.empty(64, 64)})


def test_stages_are_kept_for_the_next_restore(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    real = extents.new_buffer

    def new_buffer(size: int) -> Any:
        made.append(size)
        return real(size)

    monkeypatch.setattr(extents, "new_buffer", new_buffer)
    monkeypatch.setattr(extents, "EXTENT", 2 * BLOCK)  # kept stages of another size: dropped
    t = torch.randn(512, 64)  # 32 runs
    index = _stored(files, t, 8)
    for _ in range(3):
        out = torch.empty(512, 64)
        _read(files, index, {"model/w": out})
        assert torch.equal(out, t)
    # The first read's (one a thread: twice READ_THREADS at most), reused since.
    assert 1 <= len(made) <= 2 * targets.READ_THREADS
    assert len(extents._stages) <= 2 * targets.READ_THREADS


# ---- the manager's restores: which way, and both restore the same bytes --------------------


def _build(mesh: object, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.to_local().clone() for p in model.parameters()]  # type: ignore[operator]
    for st in opt.state.values():
        out += [st[k].to_local().clone() for k in ("exp_avg", "exp_avg_sq")]
    return out


@pytest.fixture(params=[False, True], ids=["cpu-way", "device-way"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether CPU targets are taken as a GPU's are (by runs either way, a copy_ a piece)."""
    if request.param:
        monkeypatch.setattr(extents, "DEVICES", frozenset({"cpu"}))
    return bool(request.param)


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_both_ways_restore_the_same_bytes_and_io_chooses_the_way(
    mesh: object, tmp_path: Path, runs_read: list[str], io: str, way: bool
) -> None:
    model, opt = _build(mesh, 1)
    want = _values(model, opt)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    for live in (True, False):  # into the targets' own tensors, and into fresh ones
        model, opt = _build(mesh, 2)
        if not live:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # no moments yet
        with CheckpointManager(tmp_path / "s", storage_options={"io": io}) as mgr:
            assert mgr.restore({"model": model, "optimizer": opt}) == 1
        got = _values(model, opt)
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if io == "direct" or way:
        assert runs_read
        assert all(f.startswith("_shards.") for f in runs_read)
    else:
        assert runs_read == []


def test_auto_tries_each_way_then_keeps_the_faster(
    mesh: object, tmp_path: Path, runs_read: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(iomode, "MEASURED_BYTES", 1)  # this small restore is a measurement
    model, opt = _build(mesh, 1)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    iomode.forget()
    modes: list[str] = []
    for _ in range(3):
        before = len(runs_read)
        with CheckpointManager(tmp_path / "s") as mgr:
            mgr.restore({"model": model, "optimizer": opt})
        modes.append("direct" if len(runs_read) > before else "buffered")
    reads = [d for d in iomode.decisions() if d["op"] == "read"]
    # Each way tried once, each measured, then the faster one (as measured) is used.
    assert modes[:2] == ["direct", "buffered"]
    assert [d["mode"] for d in reads] == modes
    stats = {d["mode"]: d["bytes_per_s"] for d in reads[:2]}
    faster = "direct" if stats["direct"] > stats["buffered"] * 1.05 else "buffered"
    assert modes[2] == faster


def test_one_range_is_box_byte_range_where_the_box_is_one_range() -> None:
    from ckptstore.sharded.chunks import box_byte_range

    gen = torch.Generator().manual_seed(3)
    for _ in range(3000):
        dims = int(torch.randint(0, 5, (1,), generator=gen))
        sizes = [int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(dims)]
        at = [int(torch.randint(0, n, (1,), generator=gen)) for n in sizes]
        lengths = [
            int(torch.randint(0, n - a + 1, (1,), generator=gen))
            for n, a in zip(sizes, at, strict=True)
        ]
        first, end = box_byte_range(sizes, at, lengths, 2)
        count = 2 * int(torch.tensor(lengths, dtype=torch.int64).prod())
        want = (first, end) if first != end and end - first == count else None
        assert extents._one_range(sizes, at, lengths, 2) == want, (sizes, at, lengths)


@pytest.mark.skipif(not thp_at_first_touch(), reason="no huge pages at first touch here")
def test_a_stage_is_on_huge_pages() -> None:
    """A stage is a multiple of 2 MiB, so the kernel places it on a huge-page boundary and
    every page of it is huge (at 8 MiB + 8 KiB, a quarter was on 4 KiB pages: a request
    from those is cut into ~0.6 MiB segments on a ``segment_capped`` disk)."""
    import ctypes

    extents._forget_stages()
    stage = extents._take_stage()
    try:
        assert len(stage) % (2 << 20) == 0
        for off in range(0, len(stage), 4096):
            stage[off] = 1
        anchor = ctypes.c_char.from_buffer(stage)
        aligned = ctypes.addressof(anchor) % (2 << 20) == 0
        del anchor
        if not aligned:  # pragma: no cover - kernels before 6.7 need not align the mapping
            pytest.skip("this kernel does not place large anonymous mappings on 2 MiB")
        # At least the stage's length in huge pages in its mapping (smaps counts a mapping
        # the kernel merged with its neighbours as one: the share may exceed 1).
        assert huge_share(stage) >= 1.0
    finally:
        extents._give_stage(stage)


def test_a_store_that_refuses_o_direct_is_read_box_by_box(
    mesh: object, tmp_path: Path, runs_read: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some network
    filesystems): with ``io="direct"`` the restore reads every file box by box through the
    page cache and restores the same bytes. The refusal is simulated: this kernel's tmpfs
    takes ``O_DIRECT``."""
    from ckptstore.storage import local

    real = local.open_direct_read

    def refused(path: str, *, dir_fd: int | None = None, direct: bool = True) -> tuple[int, bool]:
        return real(path, dir_fd=dir_fd, direct=False)  # what EINVAL at open falls back to

    model, opt = _build(mesh, 1)
    want = _values(model, opt)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    monkeypatch.setattr(local, "open_direct_read", refused)
    model, opt = _build(mesh, 2)
    with CheckpointManager(tmp_path / "s", storage_options={"io": "direct"}) as mgr:
        assert mgr.restore({"model": model, "optimizer": opt}) == 1
    assert all(torch.equal(a, b) for a, b in zip(_values(model, opt), want, strict=True))
    assert runs_read == []


def test_a_step_deleted_before_its_read_is_an_integrity_error_not_a_crash(
    mesh: object, tmp_path: Path
) -> None:
    """Retention may delete a step between its manifest and its payloads: the reader's
    choice of mode must not fail on the missing directory (``restore`` skips a step that
    fails with ``IntegrityError`` and goes on to the next); the reads then say so."""
    import shutil

    from ckptstore.storage.local import LocalStorage

    model, opt = _build(mesh, 1)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    storage = LocalStorage(str(tmp_path / "s"))
    manifest = storage.read_manifest(1)
    shutil.rmtree(step_path(tmp_path / "s", 1))
    with storage.range_reader(1, manifest.files) as reader:
        assert reader.read_mode() == "buffered"
        name = next(n for n in manifest.files if n.startswith("_shards."))
        with pytest.raises(IntegrityError, match="truncated, missing or replaced"):
            reader.direct_fd(name)
        reader.record_read("buffered", 1 << 30, 1.0)  # nothing to record it against


def test_a_range_past_the_file_is_refused_before_its_buffer_is_made(
    mesh: object, tmp_path: Path
) -> None:
    """A forged chunk asking for 16 TiB of a small file: ``RangeReader.read`` made the
    zero-filled buffer first (3.4 GB of RSS for a 3 GiB claim, a MemoryError for this one),
    and only then found the file too short (found by review)."""
    from ckptstore.storage.local import LocalStorage

    model, opt = _build(mesh, 1)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    storage = LocalStorage(str(tmp_path / "s"))
    files = storage.read_manifest(1).files
    name = next(n for n in files if n.startswith("_shards."))
    with storage.range_reader(1, files) as reader:
        with pytest.raises(IntegrityError, match=r"run past the file \(\d+ bytes\)"):
            reader.read(name, 8, 1 << 44)
        with pytest.raises(IntegrityError, match="run past the file"):
            reader.read(name, files[name].bytes - 4, 8)
        assert len(reader.read(name, files[name].bytes - 4, 4)) == 4


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_a_sharded_step_restores_into_gpu_tensors_in_place_by_runs(
    mesh: object, tmp_path: Path, runs_read: list[str], io: str
) -> None:
    """FSDP2 shards saved on the CPU, restored into a model on the GPU: by runs through
    either way of reading, straight into the model's own GPU memory, every byte."""
    model, opt = _build(mesh, 1)
    want = [p.full_tensor() for p in model.parameters()]  # type: ignore[operator]
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    gpu = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda()
    ptrs = [p.data_ptr() for p in gpu.parameters()]
    with CheckpointManager(tmp_path / "s", storage_options={"io": io}) as mgr:
        assert mgr.restore({"model": gpu}) == 1
    assert [p.data_ptr() for p in gpu.parameters()] == ptrs
    got = [p.detach() for p in gpu.parameters()]
    assert all(g.device.type == "cuda" for g in got)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    assert runs_read
    assert all(f.startswith("_shards.") for f in runs_read)


@needs_cuda
@pytest.mark.parametrize("direct", [True, False])
def test_a_corrupt_block_never_reaches_a_gpu_target(files: Files, direct: bool) -> None:
    t = torch.randn(256, 64)  # 4 chunks of 64 rows, 4 blocks each
    index = _stored(files, t, 4)
    out = torch.empty(256, 64, device="cuda")
    fd = files.direct_fd if direct else None
    targets.read_into(index, {"model/w": out}, files.read, "s", files.read_to, direct_fd=fd)
    assert torch.equal(out.cpu(), t)
    bad = index.tensors["model/w"].chunks[1]
    data = bytearray((files.root / "f").read_bytes())
    data[bad.start + 3 * BLOCK + 5] ^= 0x01
    files.write("f", bytes(data))
    out = torch.full((256, 64), -7.0, device="cuda")
    with pytest.raises(IntegrityError, match=r"block 3 of its chunk at \[64, 0\] in f"):
        targets.read_into(index, {"model/w": out}, files.read, "s", files.read_to, direct_fd=fd)
    host = out.cpu()
    assert torch.equal(host[:64], t[:64])
    assert bool((host[64:128] == -7.0).all())

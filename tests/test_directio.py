"""The fast I/O paths: O_DIRECT writes and reads, their fallback, and the streaming decoder."""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from ckptstore import CheckpointManager, IntegrityError, StateMismatchError
from ckptstore.codec.safetensors import StreamDecoder, write_safetensors
from ckptstore.integrity import SubBlocks, crc32c_of
from ckptstore.storage import directio
from ckptstore.storage.directio import ALIGN, DirectWriter
from ckptstore.storage.local import LocalStorage
from tests._helpers import huge_share, run_forked, thp_at_first_touch


def _write(path: Path, chunks: list[bytes], **kw: object) -> DirectWriter:
    w = DirectWriter(str(path), **kw)  # type: ignore[arg-type]
    for c in chunks:
        w.write(c)
    w.finish()
    return w


@pytest.mark.parametrize(
    "sizes",
    [
        [0],  # empty file
        [1],  # shorter than one block
        [ALIGN - 1, 1],  # exactly one block, split
        [ALIGN + 1],  # unaligned tail
        [3 * ALIGN + 17, 5, 0, 999],
        [(1 << 20) + 3] * 5,  # several bounce buffers (buffer_size below is 1 MiB)
    ],
)
@pytest.mark.parametrize("direct", [True, False])
def test_direct_writer_bytes_size_and_crc(tmp_path: Path, sizes: list[int], direct: bool) -> None:
    chunks = [os.urandom(n) for n in sizes]
    data = b"".join(chunks)
    w = _write(tmp_path / "f", chunks, direct=direct, buffer_size=1 << 20)
    assert (tmp_path / "f").read_bytes() == data  # exactly the data: no padding to remove
    assert w.nbytes == len(data)
    assert w.crc == crc32c_of(data)
    if direct and len(data) > 1 << 20:
        assert w.direct  # ext4 here: O_DIRECT was really used for the whole buffers
    else:
        assert not w.direct  # small files go through the page cache


@pytest.mark.parametrize("piece", [4_099, 3 * ALIGN, 1 << 20])
def test_copied_bytes_are_checksummed_piece_by_piece_in_the_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """write() copies and checksums in pieces: the file's, its blocks' and a stretch's CRCs
    stay exact wherever the pieces, the requests, the blocks and the stretch's blocks cut."""
    monkeypatch.setattr(directio, "_PIECE", piece)
    head, data = os.urandom(ALIGN + 3), os.urandom(5 * (1 << 20) + 12_345)
    sub = SubBlocks(70_001)
    w = DirectWriter(str(tmp_path / "f"), buffer_size=1 << 20)  # a request every MiB
    w.write(head)
    assert w.write(data, sub) == len(data)
    w.finish()
    whole = head + data
    assert (tmp_path / "f").read_bytes() == whole
    assert w.nbytes == len(whole) == w.bounced
    assert w.crc == crc32c_of(whole)
    step = 4 << 20  # integrity.BLOCK: the file has two blocks
    assert w.blocks == tuple(crc32c_of(whole[i : i + step]) for i in range(0, len(whole), step))
    assert sub.close() == [crc32c_of(data[i : i + 70_001]) for i in range(0, len(data), 70_001)]


def test_direct_writer_falls_back_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    real_open, real_fcntl = os.open, fcntl.fcntl

    def no_direct(path: str, flags: int, *a: object, **k: object) -> int:
        if flags & directio._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (tmpfs refuses O_DIRECT)")
        return real_open(path, flags, *a, **k)  # type: ignore[arg-type]

    def fcntl_no_direct(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & directio._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (tmpfs refuses O_DIRECT)")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(fcntl, "fcntl", fcntl_no_direct)
    data = os.urandom(3 * ALIGN + 5)
    w = _write(tmp_path / "f", [data], buffer_size=ALIGN)
    assert not w.direct
    assert (tmp_path / "f").read_bytes() == data
    fd, direct = directio.open_direct_read(str(tmp_path / "f"))
    try:
        assert not direct
        buf = bytearray(len(data))
        assert directio.read_into(fd, memoryview(buf), 0) == len(data)
        assert bytes(buf) == data
    finally:
        os.close(fd)


def test_direct_writer_refuses_to_overwrite(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        DirectWriter(str(tmp_path / "f"))
    assert (tmp_path / "f").read_bytes() == b"old"


def test_direct_writer_error_propagates_from_the_io_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def enospc(*a: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    w = DirectWriter(str(tmp_path / "f"), buffer_size=ALIGN)
    monkeypatch.setattr(os, "pwrite", enospc)
    with pytest.raises(OSError) as ei:  # noqa: PT012 - the error surfaces on a later call
        w.write(os.urandom(3 * ALIGN))
        w.finish()
    assert ei.value.errno == errno.ENOSPC
    w.abort()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("chunk", [1 << 12, 1 << 20])
def test_local_stream_reads_every_byte_in_order(
    tmp_path: Path, direct_io: bool, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ckptstore.storage.directio.BUFFER", chunk)
    data = os.urandom(5 * chunk + 123)
    (tmp_path / "f").write_bytes(data)
    st = LocalStorage(str(tmp_path), direct_io=direct_io)
    seen = bytearray()

    def consume(offset: int, view: memoryview) -> None:
        assert offset == len(seen)
        seen.extend(view)

    total, crc = st._stream("f", consume)
    assert total == len(data)
    assert crc == crc32c_of(data)
    assert bytes(seen) == data


@pytest.mark.parametrize(
    ("size", "most"),
    [
        ((2 << 20) + 123, None),  # the whole file in one short read, ending unaligned
        (2 << 20, None),  # a short read ending on a block boundary: one more read, aligned
        ((2 << 20) + 123, 1 << 20),  # reads capped at whole blocks (as Linux caps at 2 GiB)
        (3 * ALIGN + 5, None),  # a small file: one buffered read
    ],
)
@pytest.mark.parametrize("direct_io", [True, False])
def test_reads_never_go_on_at_an_unaligned_offset(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    size: int,
    most: int | None,
    direct_io: bool,
) -> None:
    # Linux before 5.5 answers an O_DIRECT read at an unaligned offset with EINVAL, even at
    # the end of the file, where newer kernels return 0. The fake below does the same (and
    # may also return fewer bytes than asked, in whole blocks): a read that went on after
    # the short final read would make every payload of 1 MiB or more unreadable there.
    real = os.preadv
    offsets: list[int] = []

    def old_kernel_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        offsets.append(offset)
        if offset % ALIGN:
            raise OSError(errno.EINVAL, "Invalid argument (O_DIRECT read at an unaligned offset)")
        if most is not None and len(buffers[0]) > most:
            buffers = [buffers[0][:most]]
        return real(fd, buffers, offset)

    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(os, "preadv", old_kernel_preadv)
    st = LocalStorage(str(tmp_path), direct_io=direct_io)
    seen = bytearray()
    total, crc = st._stream("f", lambda offset, view: seen.extend(view))
    assert (total, crc) == (len(data), crc32c_of(data))
    assert bytes(seen) == data
    assert offsets, "the fake was not called"
    assert all(o % ALIGN == 0 for o in offsets), offsets
    buf = bytearray(size + ALIGN)  # read_into itself, asked for more than the file holds
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert directio.read_into(fd, memoryview(buf), 0) == size
    finally:
        os.close(fd)
    assert bytes(buf[:size]) == data


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(1000, 257, generator=g),  # 1 MB, not a multiple of 4096 bytes
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "half": torch.randn(33, generator=g).half(),
        "mask": torch.rand(17, generator=g) > 0.5,
        "bf16": torch.randn(5, 5, generator=g).bfloat16(),
    }


@pytest.mark.parametrize("chunk", [1, 13, 4096, 1 << 30])
def test_stream_decoder_any_chunking_and_into_existing_tensors(chunk: int) -> None:
    ts = _tensors()
    buf = io.BytesIO()
    write_safetensors(buf, ts)
    data = buf.getvalue()
    assert safetensors.torch.load(data).keys() == ts.keys()  # a standard file
    target = torch.zeros(1000, 257)
    wrong_shape = torch.zeros(33)  # float32, not float16: must not be written into
    dec = StreamDecoder(len(data), "f", {"big": target, "half": wrong_shape})
    mv = memoryview(data)
    for off in range(0, len(data), chunk):
        dec(off, mv[off : off + chunk])
    out = dec.result()
    for k, v in ts.items():
        assert out[k].dtype == v.dtype
        assert torch.equal(out[k], v), k
    assert out["big"] is target  # filled in place, no intermediate copy
    assert out["half"] is not wrong_shape
    assert dec.reused == 1
    assert torch.equal(wrong_shape, torch.zeros(33))


def test_huge_tensor_roundtrip(tmp_path: Path) -> None:
    # Larger than both bounce buffers together: crosses many buffer boundaries.
    big = torch.arange(40 << 20, dtype=torch.int32).reshape(-1, 1024)  # 160 MiB
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"x": big})
        got = mgr.load()["x"]
        assert torch.equal(got, big)
        assert mgr.verify(1).ok
    p = tmp_path / "s" / "step-000000000001" / "x.safetensors"
    assert torch.equal(safetensors.torch.load_file(str(p))["_"], big)


def test_in_place_restore_reads_into_the_models_own_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = torch.optim.Adam(src.parameters())
    src(torch.randn(2, 64)).sum().backward()
    opt.step()
    dst = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    dopt = torch.optim.Adam(dst.parameters())
    dst(torch.randn(2, 64)).sum().backward()
    dopt.step()
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    exp_avg_ptr = dopt.state_dict()["state"][0]["exp_avg"].data_ptr()
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": src, "optimizer": opt})
        assert mgr.restore({"model": dst, "optimizer": dopt}, in_place=True) == 1
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k])
        assert v.data_ptr() == ptrs[k]
    assert dopt.state_dict()["state"][0]["exp_avg"].data_ptr() == exp_avg_ptr
    assert torch.equal(
        dopt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def test_in_place_restore_checks_shapes_before_reading_anything(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": nn.Linear(4, 4)})
        other = nn.Linear(4, 5)
        before = {k: v.clone() for k, v in other.state_dict().items()}
        # A payload that is never read: delete it to prove the refusal came first.
        os.unlink(tmp_path / "s" / "step-000000000001" / "model.safetensors")
        with pytest.raises(StateMismatchError, match=r"weight: checkpoint \(4, 4\)"):
            mgr.restore({"model": other}, step=1, in_place=True)
        for k, v in other.state_dict().items():
            assert torch.equal(v, before[k])


def test_default_restore_leaves_targets_untouched_on_corruption(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": nn.Linear(256, 256)})
        p = tmp_path / "s" / "step-000000000001" / "model.safetensors"
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))
        target = nn.Linear(256, 256)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(IntegrityError, match="crc32c"):
            mgr.restore({"model": target}, step=1)
        for k, v in target.state_dict().items():
            assert torch.equal(v, before[k])


@pytest.mark.timeout(120)
def test_large_async_save_in_flight_at_exit_is_finished(tmp_path: Path) -> None:
    # The file is larger than one bounce buffer, so its writes need I/O threads, started
    # while the interpreter is already shutting down (no executor accepts work then).
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from ckptstore import CheckpointManager\n"
        "m = CheckpointManager(sys.argv[1], async_save=True)\n"
        "m.save(1, {'a': torch.arange(12 << 20, dtype=torch.float32), 'b': torch.ones(3)})\n"
    )
    root = tmp_path / "s"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]
        assert mgr.verify(1).ok
        assert torch.equal(mgr.load()["a"], torch.arange(12 << 20, dtype=torch.float32))


# ---- zero-copy writes of staged tensors (async safetensors saves) -------------------------


def _placed(data: bytes, shift: int) -> tuple[memoryview, int, object]:
    """``data`` placed ``shift`` bytes past a page boundary: (view, address, keep-alive)."""
    import ctypes
    import mmap

    m = mmap.mmap(-1, len(data) + shift + 1)
    m[shift : shift + len(data)] = data
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return memoryview(m)[shift : shift + len(data)], base + shift, m


SEG = directio._SEGMENT_MIN


@pytest.mark.parametrize("size", [17, SEG - 1, SEG, 3 * SEG + 123])
@pytest.mark.parametrize("prefix", [0, 5, ALIGN])  # bytes written before, through write()
@pytest.mark.parametrize("shift", [0, 5, 64])  # the segment's distance from a page boundary
def test_write_segment_bytes_and_crc(tmp_path: Path, size: int, prefix: int, shift: int) -> None:
    head, data = os.urandom(prefix), os.urandom(size)
    view, address, keep = _placed(data, shift)
    w = DirectWriter(str(tmp_path / "f"), buffer_size=SEG // 2)  # several direct requests
    w.write(head)
    sub = SubBlocks(7_777)  # the segment's own block CRCs, from the same pass
    assert w.write_segment(view, address, sub) == size
    w.write(b"tail")
    w.finish()
    assert (tmp_path / "f").read_bytes() == head + data + b"tail"
    assert w.nbytes == prefix + size + 4
    assert w.crc == crc32c_of(head + data + b"tail")
    assert sub.close() == [crc32c_of(data[i : i + 7_777]) for i in range(0, size, 7_777)]
    # Memory congruent with the file offset (mod the block size): only the partial blocks
    # at the ends were copied; anything else went through the bounce buffer whole.
    congruent = (shift - prefix) % ALIGN == 0
    if congruent and size >= SEG:
        first = -prefix % ALIGN
        middle = (size - first) - (size - first) % ALIGN
        assert w.bounced == prefix + size - middle + 4
        assert w.direct
    else:
        assert w.bounced == prefix + size + 4
    view.release()
    del keep


def _shard_like(w: DirectWriter, seed: int) -> tuple[bytes, list[object]]:
    """Write what a shard file is into ``w``: tensors lined up with their place in the file
    (``shard_layout``), small ones between them copied through the bounce buffer.

    Returns the bytes written and what keeps the tensors' memory alive until ``finish``.
    """
    import random

    rng = random.Random(seed)
    out, keep = bytearray(b"{header}" * 11), []
    w.write(bytes(out))
    for _ in range(40):
        small = os.urandom(rng.randrange(1, 3 * ALIGN))
        w.write(small)
        out += small
        data = os.urandom(SEG + rng.randrange(0, 3 * ALIGN))
        view, address, m = _placed(data, len(out) % ALIGN)
        assert w.write_segment(view, address) == len(data)
        out += data
        keep += [view, m]
    return bytes(out), keep


class _Requests:
    """Counts the writes ``directio`` makes (a spy: each is the real call), or cuts them short."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, short: int | None = None) -> None:
        self.pieces: list[int] = []
        self.sizes: list[int] = []  # the bytes each call asked to write
        self.direct: list[bool] = []  # whether each went with O_DIRECT
        real_v, real_1 = os.pwritev, os.pwrite

        def is_direct(fd: int) -> bool:
            import fcntl

            return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))

        def pwritev(fd: int, views: list[memoryview], offset: int) -> int:
            self.pieces.append(len(views))
            self.sizes.append(sum(len(v) for v in views))
            self.direct.append(is_direct(fd))
            if short is not None:  # as a kernel may: less than asked, whole blocks
                cut, left = [], short
                for v in views:
                    cut.append(v[:left])
                    left -= len(cut[-1])
                    if not left:
                        break
                views = cut
            return real_v(fd, views, offset)

        def pwrite(fd: int, view: memoryview, offset: int) -> int:
            self.pieces.append(1)
            self.sizes.append(len(view))
            self.direct.append(is_direct(fd))
            return real_1(fd, view if short is None else view[:short], offset)

        monkeypatch.setattr(directio.os, "pwritev", pwritev)
        monkeypatch.setattr(directio.os, "pwrite", pwrite)


def _check_shard_like(
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    short: int | None = None,
    *,
    buffer_size: int = 1 << 20,
    bounce: str = "never",
) -> tuple[DirectWriter, bytes, _Requests]:
    """:func:`_shard_like` into a new file at ``path``, the writes counted (or cut short);
    the file holds exactly the bytes written, and the writer their CRC32C. ``bounce`` is
    ``directio.BOUNCE`` (``"never"``: the tensors' memory goes to the disk straight, on any
    device)."""
    monkeypatch.setattr(directio, "BOUNCE", bounce)
    requests = _Requests(monkeypatch, short)
    w = DirectWriter(str(path), buffer_size=buffer_size)
    data, keep = _shard_like(w, seed)
    w.finish()
    monkeypatch.undo()
    del keep
    assert path.read_bytes() == data
    assert w.crc == crc32c_of(data)
    return w, data, requests


def test_a_file_of_many_tensors_goes_to_the_disk_in_a_few_large_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each request holds a buffer's worth: the tensors' aligned middles from their memory,
    # the blocks between them from the bounce buffer. Before, each tensor took two requests
    # (the bounce buffer's blocks, then its middle), each a hand-off to the I/O thread.
    w, data, requests = _check_shard_like(tmp_path / "f", monkeypatch, 1)
    assert w.bounced < 40 * 5 * ALIGN  # the tensors themselves were not copied
    assert len(requests.pieces) <= len(data) // (1 << 20) + 2, requests.pieces  # not 80
    assert max(requests.pieces) > 4  # several tensors and the blocks between them at once


def test_a_file_starts_with_a_small_request_and_each_next_one_doubles_up_to_a_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk starts on a file once the first few MB are checksummed, not a whole buffer
    # (with the first request at a buffer's worth, this file's first request held 4 MiB).
    monkeypatch.setattr(directio, "_FIRST_REQUEST", SEG)
    _, data, requests = _check_shard_like(tmp_path / "f", monkeypatch, 3, buffer_size=4 << 20)
    piece = SEG + 3 * ALIGN  # what one tensor adds to a request at most
    *sent, rest, tail = requests.sizes  # then what finish sends, and the unaligned tail
    limits = [min(SEG << k, 4 << 20) for k in range(len(sent) + 1)]
    assert all(lim <= n < lim + piece for lim, n in zip(limits, sent, strict=False)), sent
    assert len(sent) >= 5  # 256 KiB, 512 KiB, 1 MiB, 2 MiB, then 4 MiB
    assert sent[0] < 2 * SEG
    assert rest < limits[len(sent)] + piece
    assert tail < ALIGN
    assert sum(requests.sizes) == len(data)


@pytest.mark.parametrize("fault", ["short", "pieces"])
def test_short_writes_and_the_piece_limit_still_write_every_byte_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    # A write(2) may write less than asked (whole blocks under O_DIRECT): the rest follows
    # at its offset. A request of more pieces than the limit goes in several calls.
    if fault == "pieces":
        monkeypatch.setattr(directio, "_IOV_MAX", 3)
    short = 3 * ALIGN if fault == "short" else None
    _, data, requests = _check_shard_like(tmp_path / "f", monkeypatch, 2, short)
    if fault == "pieces":
        assert max(requests.pieces) == 3
    else:
        assert len(requests.pieces) >= len(data) // (3 * ALIGN)


def test_write_segment_falls_back_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    real_fcntl = fcntl.fcntl

    def fcntl_no_direct(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & directio._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (tmpfs refuses O_DIRECT)")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", fcntl_no_direct)
    data = os.urandom(3 * SEG + 1)
    view, address, keep = _placed(data, 0)
    w = DirectWriter(str(tmp_path / "f"), buffer_size=SEG)
    w.write_segment(view, address)
    w.finish()
    assert not w.direct
    assert (tmp_path / "f").read_bytes() == data
    assert w.crc == crc32c_of(data)
    # Through the page cache from the start (buffered chosen): the same CRCs, block by block.
    w = DirectWriter(str(tmp_path / "g"), direct=False, buffer_size=SEG)
    w.write(b"h")
    sub = SubBlocks(SEG // 3)
    w.write_segment(view, address, sub)
    w.finish()
    assert (tmp_path / "g").read_bytes() == b"h" + data
    assert w.crc == crc32c_of(b"h" + data)
    assert sub.close() == [crc32c_of(data[i : i + SEG // 3]) for i in range(0, len(data), SEG // 3)]
    view.release()
    del keep


def test_write_segment_error_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def eio(*a: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    view, address, keep = _placed(os.urandom(4 * SEG), 0)
    w = DirectWriter(str(tmp_path / "f"), buffer_size=SEG)
    monkeypatch.setattr(os, "pwrite", eio)
    with pytest.raises(OSError) as ei:  # noqa: PT012 - the error surfaces on a later call
        w.write_segment(view, address)
        w.finish()
    assert ei.value.errno == errno.EIO
    w.abort()
    view.release()
    del keep


@pytest.mark.parametrize("nth", [1, 3])
def test_a_full_disk_in_a_request_of_many_pieces_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    # A request that gathers several tensors and the blocks between them (pwritev) fails as
    # a whole: its errno reaches the caller, on a later call or at finish, never lost.
    real = os.pwritev
    calls = [0]

    def full(fd: int, views: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] >= nth:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, views, offset)

    monkeypatch.setattr(directio.os, "pwritev", full)
    w = DirectWriter(str(tmp_path / "f"), buffer_size=1 << 20)
    with pytest.raises(OSError) as ei:  # noqa: PT012 - the error surfaces on a later call
        _, _keep = _shard_like(w, 3)
        w.finish()
    assert ei.value.errno == errno.ENOSPC
    assert calls[0] == nth  # nothing more was sent after the failed request
    w.abort()


def test_async_safetensors_files_are_byte_identical_to_sync(tmp_path: Path) -> None:
    """Staged tensors placed for zero-copy writes give exactly the synchronous bytes."""
    torch.manual_seed(0)
    state = {
        "model": {
            "big": torch.randn(1 << 20),  # 4 MiB: written straight from staging
            "odd": torch.randn(3, 333).to(torch.bfloat16),
            "ints": torch.arange(7, dtype=torch.int64),
            "empty": torch.zeros(0, 4),
            "strided": torch.randn(512, 256).t(),  # not contiguous: staged contiguous
        },
        "opt": {"m": torch.randn(100_000), "step": torch.tensor(3.0), "v": torch.randn(70_001)},
        "step": 3,
    }
    with CheckpointManager(tmp_path / "sync") as mgr:
        mgr.save(3, state)
    with CheckpointManager(tmp_path / "async", async_save=True) as mgr:
        before = state["model"]["big"].clone()
        h = mgr.save(3, state)
        with torch.no_grad():  # changed right after save returns: not in the checkpoint
            state["model"]["big"].add_(1)
        h.wait()
    a, b = tmp_path / "sync" / "step-000000000003", tmp_path / "async" / "step-000000000003"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        if n != "manifest.json":  # created time differs
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    loaded = safetensors.torch.load_file(str(b / "model.safetensors"))
    assert torch.equal(loaded["big"], before)
    assert torch.equal(loaded["strided"], state["model"]["strided"])


@pytest.mark.parametrize("bounce", ["never", "always"])
def test_async_staging_places_tensors_for_zero_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bounce: str
) -> None:
    """Each staged tensor's address is congruent with its file offset (mod the block size),
    and the big ones reach the file without going through the bounce buffer. Where every
    byte is copied into the writer's buffers (``"always"``, or ``"auto"`` on a device that
    cuts requests from 4 KiB pages short), a staged tensor on huge pages (2 MiB or more)
    still goes straight from its staging memory, and a smaller one is copied."""
    import ckptstore.storage.local as local_mod

    monkeypatch.setattr(directio, "BOUNCE", bounce)
    from ckptstore.codec.safetensors import build_header

    writers: list[DirectWriter] = []

    class Spy(DirectWriter):
        def __init__(self, *a: object, **k: object) -> None:
            super().__init__(*a, **k)  # type: ignore[arg-type]
            writers.append(self)

    state = {"model": {"w": torch.randn(1 << 19), "b": torch.randn(5), "u": torch.randn(99_999)}}
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        mp = pytest.MonkeyPatch()
        mp.setattr(local_mod, "DirectWriter", Spy)
        try:
            mgr.save(1, state).wait()
        finally:
            mp.undo()
        staged = mgr._staging._bufs
        head, order = build_header(state["model"])
        pos = len(head)
        for name, t in order:
            buf = staged[f"model/{name}"]
            start = (pos - buf.data_ptr()) % ALIGN
            assert buf.numel() == t.numel() * t.element_size() + ALIGN
            assert (buf.data_ptr() + start - pos) % ALIGN == 0
            pos += t.numel() * t.element_size()
    (model,) = [w for w in writers if w.path.endswith("model.safetensors")]
    assert (
        model.nbytes == (tmp_path / "s" / "step-000000000001" / "model.safetensors").stat().st_size
    )
    small = 99_999 * 4  # "u": under 2 MiB, staged in memory of 4 KiB pages
    if bounce == "never":
        assert model.bounced < 3 * ALIGN + len(head)  # headers and partial blocks only
    else:
        assert small <= model.bounced < small + 3 * ALIGN + len(head)  # not "w"'s 2 MiB
    assert model.direct


# ---- restore: block-checked streaming into the targets, either I/O mode -------------------------

BLOCK = 4 << 20


def _big_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(9 << 20, generator=g),  # 36 MiB: more than one 32 MiB read slice
        "b": torch.randn(1 << 20, generator=g),  # 4 MiB, after "a" in the file
        "c": torch.randint(0, 100, (1000,), generator=g),
    }


class Buffers(nn.Module):
    """A module of plain buffers: restored in place, like a model's parameters."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in tensors.items():
            self.register_buffer(k, v)


def _big_state(seed: int, fill: float | None = None) -> dict[str, nn.Module]:
    ts = _big_tensors(seed)
    if fill is not None:
        ts = {k: torch.full_like(v, fill) for k, v in ts.items()}
    return {"m": Buffers(ts)}


def _of(state: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return dict(state["m"].state_dict())


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("io_mode", ["direct", "buffered", "auto"])
def test_restore_is_byte_exact_in_every_io_mode(tmp_path: Path, fmt: str, io_mode: str) -> None:
    src = {"m": nn.Linear(1024, 1200)}  # 4.7 MiB of weight: a payload of two blocks
    opts = {"io": io_mode}
    with CheckpointManager(tmp_path / "s", format=fmt, storage_options=opts) as mgr:
        assert isinstance(mgr.storage, LocalStorage)
        assert mgr.storage.io == io_mode
        mgr.save(1, src)
        dst = {"m": nn.Linear(1024, 1200)}
        ptr = dst["m"].weight.data_ptr()
        assert mgr.restore(dst) == 1
    for k, v in src["m"].state_dict().items():
        assert torch.equal(dst["m"].state_dict()[k], v), k
    assert dst["m"].weight.data_ptr() == ptr  # read into the model's own tensor


def test_io_option_is_checked() -> None:
    with pytest.raises(ValueError, match="io must be one of auto, direct, buffered"):
        LocalStorage("/tmp/x", io="fast")
    with pytest.raises(ValueError, match="takes only"):
        CheckpointManager("/tmp/x", storage_options={"anon": True})


def _corrupt(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("io_mode", ["direct", "buffered"])
def test_a_corrupt_block_never_reaches_its_target(tmp_path: Path, io_mode: str) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root, storage_options={"io": io_mode}) as mgr:
        mgr.save(1, _big_state(1))
    path = root / "step-000000000001" / "m.safetensors"
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    bad_block = (data_start + (9 << 22) + 100) // BLOCK  # a byte of "b"
    _corrupt(path, data_start + (9 << 22) + 100)
    state = _big_state(0, fill=7)
    target = _of(state)
    mgr = CheckpointManager(root, storage_options={"io": io_mode})
    with mgr, pytest.raises(IntegrityError) as ei:
        mgr.restore(state, step=1)
    msg = str(ei.value)
    assert str(path) in msg
    assert f"block {bad_block} " in msg
    # "b" lies in the bad block: none of its bytes were copied. What the caller sees of "a"
    # (README, "What a failed restore leaves"): the blocks read and verified before the bad
    # one hold step 1, the rest its old values.
    assert bool((target["b"] == 7).all())
    assert bool((target["c"] == 7).all())
    a = target["a"]
    want = _big_tensors(1)["a"]
    changed = (a != 7).nonzero()
    if len(changed):
        n = int(changed[-1]) + 1
        assert torch.equal(a[:n], want[:n])
        assert bool((a[n:] == 7).all())
        assert (data_start + 4 * n) % BLOCK == 0 or n == a.numel()


def test_the_fallback_step_overwrites_what_the_failed_one_wrote(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, _big_state(1))
        mgr.save(2, _big_state(2))
    path = root / "step-000000000002" / "m.safetensors"
    _corrupt(path, path.stat().st_size - 10)  # the last block: the others were copied
    state = _big_state(0, fill=0)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 1
    for k, v in _big_tensors(1).items():
        assert torch.equal(_of(state)[k], v), k


def test_a_fallback_that_cannot_overwrite_a_tensor_says_so(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"m": Buffers({"a": torch.ones(3)})})
        mgr.save(2, {"m": Buffers({"a": torch.ones(3), "big": torch.randn(9 << 20)})})
    path = root / "step-000000000002" / "m.safetensors"
    _corrupt(path, path.stat().st_size - 10)
    target = {"m": Buffers({"a": torch.zeros(3), "big": torch.zeros(9 << 20)})}
    with CheckpointManager(root) as mgr, pytest.raises(IntegrityError, match=r"m/big") as ei:
        mgr.restore(target, strict=False)
    assert "partly written by a newer step" in str(ei.value)
    assert "in_place=False" in str(ei.value)


def test_in_place_false_leaves_every_target_unchanged(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, _big_state(1))
    path = root / "step-000000000001" / "m.safetensors"
    _corrupt(path, path.stat().st_size - 10)
    state = _big_state(0, fill=7)
    with CheckpointManager(root) as mgr, pytest.raises(IntegrityError, match="block"):
        mgr.restore(state, step=1, in_place=False)
    assert all(bool((t == 7).all()) for t in _of(state).values())


_RSS_CHILD = """
import resource, sys, torch
from ckptstore import CheckpointManager
n = int(sys.argv[2])
model = torch.nn.Module()
for i in range(8):
    model.register_buffer(f"t{i}", torch.full((n // 4 // 8,), float(i)))
state = {"m": model}
with CheckpointManager(sys.argv[1], storage_options={"io": sys.argv[3]}) as mgr:
    mgr.save(1, state)
    for t in model.buffers():
        t.zero_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mgr.restore(state, step=1)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert all(bool((t == i).all()) for i, t in enumerate(model.buffers()))
print((after - before) * 1024)
"""


@pytest.mark.timeout(120)
def test_restore_holds_read_buffers_not_a_copy_of_the_state(tmp_path: Path) -> None:
    # In a child process, so its peak RSS is this restore's: 384 MB of state restored in
    # place may grow the peak by the read buffers (4 x 32 MiB) and some slack, never by a
    # second copy of the state (in_place=False grows it by ~400 MB: the check can fail).
    import subprocess
    import sys

    n = 384 << 20
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(tmp_path / "s"), str(n), "auto"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    grew = int(proc.stdout.split()[-1])
    assert grew < n // 2, f"peak RSS grew by {grew / 1e6:.0f} MB restoring {n / 1e6:.0f} MB"


def test_read_mode_is_measured_on_the_files_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.storage import iomode

    monkeypatch.setattr(directio, "BUFFER", 1 << 20)
    monkeypatch.setattr(iomode, "MEASURED_BYTES", 1 << 20)
    iomode.forget()
    data = os.urandom((6 << 20) + 5)
    (tmp_path / "f").write_bytes(data)
    st = LocalStorage(str(tmp_path))
    for _ in range(3):
        seen = bytearray()
        total, crc = st._stream("f", lambda o, v, seen=seen: seen.extend(v))
        assert (total, crc, bytes(seen)) == (len(data), crc32c_of(data), data)
    reads = [h for h in iomode.decisions() if h["op"] == "read"]
    # Each mode once, then the faster of the two.
    assert [h["mode"] for h in reads[:2]] == ["direct", "buffered"]
    speeds = {h["mode"]: h["bytes_per_s"] for h in reads[:2]}
    faster = float(speeds["direct"]) > 1.05 * float(speeds["buffered"])  # type: ignore[arg-type]
    assert reads[2]["mode"] == ("direct" if faster else "buffered")
    iomode.forget()


def test_a_paced_read_is_not_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paced read (a background upload, held at its gate and sending over the network) is
    not a measure of the disk: it records no speed, so it never steers restores (nor, through
    the cache, later processes) to the other mode; an unpaced read of the same file does."""
    from ckptstore.storage import iomode

    monkeypatch.setattr(directio, "BUFFER", 1 << 20)
    monkeypatch.setattr(iomode, "MEASURED_BYTES", 1 << 20)
    iomode.forget()
    data = os.urandom((3 << 20) + 5)
    (tmp_path / "f").write_bytes(data)
    st = LocalStorage(str(tmp_path))
    seen = bytearray()
    total, crc = st._stream("f", lambda o, v: seen.extend(v), pace=lambda: time.sleep(0.05))
    assert (total, crc, bytes(seen)) == (len(data), crc32c_of(data), data)
    assert [h for h in iomode.decisions() if h["op"] == "read"] == []
    st._stream("f", None)
    assert len([h for h in iomode.decisions() if h["op"] == "read"]) == 1
    iomode.forget()


def test_a_copied_step_is_not_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step copied between stores (a fetch from the replica) is written as fast as its
    source is read: it tries no write mode and records no write speed, so it never steers
    the saves; the save that wrote the source did record one."""
    from ckptstore.storage import iomode, open_storage
    from ckptstore.tiers.replica import fetch_step

    iomode.forget()
    monkeypatch.setattr(iomode, "MEASURED_BYTES", 1 << 20)
    x = torch.randn(9 << 20)  # 36 MiB: fills a whole buffer, so its mode is chosen
    with CheckpointManager(tmp_path / "a") as mgr:
        mgr.save(1, {"x": x})
    assert [h for h in iomode.decisions() if h["op"] == "write"]
    iomode.forget()
    fetch_step(open_storage(str(tmp_path / "a")), open_storage(str(tmp_path / "b")), 1)
    assert [h for h in iomode.decisions() if h["op"] == "write"] == []
    with CheckpointManager(tmp_path / "b") as mgr:
        assert torch.equal(mgr.load(1)["x"], x)
    iomode.forget()


def test_write_mode_follows_the_speeds_saves_reached(tmp_path: Path) -> None:
    from ckptstore.storage import iomode

    iomode.forget()
    d = str(tmp_path)
    # Each mode until it has a measurement, then the faster, the other every 8th file.
    assert iomode.write_mode(d) == "direct"
    iomode.record_write(d, "direct", 1 << 30, 1.0)
    assert iomode.write_mode(d) == "buffered"
    iomode.record_write(d, "buffered", 1 << 30, 1.5)
    iomode.record_write(d, "buffered", 1 << 10, 1e-9)  # too small to count
    picks = [iomode.write_mode(d) for _ in range(16)]
    assert picks.count("buffered") == 2  # explored
    assert picks.count("direct") == 14
    # Far behind (under half the speed): tried again only every 64th file.
    iomode.record_write(d, "buffered", 1 << 30, 4.0)
    iomode.record_write(d, "buffered", 1 << 30, 4.0)
    picks = [iomode.write_mode(d) for _ in range(128)]
    assert picks.count("buffered") == 2
    # Conditions change: buffered becomes faster, and the next exploration shows it.
    iomode.record_write(d, "buffered", 1 << 30, 0.1)
    iomode.record_write(d, "buffered", 1 << 30, 0.1)
    assert [iomode.write_mode(d) for _ in range(4)] == ["buffered"] * 4
    iomode.forget()


def test_close_write_figures_keep_o_direct_and_close_read_figures_keep_buffered(
    tmp_path: Path,
) -> None:
    """A buffered write copies every byte through the page cache: 2.5x the CPU of O_DIRECT
    on the test VM at a speed within 15%, where two close figures' noise flipped sharded
    saves to buffered writes. Writes go buffered only where that is clearly faster (1.25x);
    reads keep their tie to buffered (a second reader finds the file in the page cache)."""
    from ckptstore.storage import iomode

    iomode.forget()
    d = str(tmp_path)
    dev = os.stat(d).st_dev
    iomode.record_write(d, "direct", 1 << 30, 1.15)
    iomode.record_write(d, "buffered", 1 << 30, 1.0)  # 15% faster
    assert [iomode.write_mode(d) for _ in range(7)] == ["direct"] * 7
    with iomode.side_by_side(measure=False):
        assert iomode.write_mode(d) == "direct"
    iomode.record_write(d, "buffered", 1 << 30, 0.5)  # now (1 + 2) / 2 GiB/s: 1.7x direct
    assert [iomode.write_mode(d) for _ in range(2)] == ["direct", "buffered"]  # 8th: explores
    iomode.record_read(dev, "direct", 1 << 30, 1.0)
    iomode.record_read(dev, "buffered", 1 << 30, 1.03)  # direct 3% faster: not enough
    assert iomode.read_mode(dev) == "buffered"
    iomode.forget()


def test_files_written_side_by_side_are_one_file_to_the_choice(tmp_path: Path) -> None:
    """A group of concurrent part files shares one mode, chosen (and explored) once for the
    group, and its bytes over its span are one figure. Before, a group never tried nor
    measured anything: a slow figure of O_DIRECT (cached from a busy disk) made every
    sharded save of the machine write buffered for good."""
    from ckptstore.storage import iomode

    iomode.forget()
    d = str(tmp_path)
    with iomode.side_by_side():
        assert [iomode.write_mode(d) for _ in range(4)] == ["direct"] * 4  # nothing known
        iomode.record_write(d, "direct", 1 << 29, 1.0)  # two files, each 0.5 GiB in 1 s
        iomode.record_write(d, "direct", 1 << 29, 1.0)
        assert iomode.decisions() == []  # measured when the group ends
    (fig,) = iomode.decisions()
    assert fig["mode"] == "direct"
    assert (1 << 30) / 1.1 < float(str(fig["bytes_per_s"])) <= 1 << 30  # 1 GiB over ~1 s
    with iomode.side_by_side():  # buffered is untried: the whole group tries it
        assert [iomode.write_mode(d) for _ in range(4)] == ["buffered"] * 4
        iomode.record_write(d, "buffered", 1 << 30, 4.0)
    assert [h["mode"] for h in iomode.decisions()] == ["direct", "buffered"]
    # Settled: direct (4x faster), buffered re-tried by the 64th group, all of it at once.
    picks = []
    for _ in range(64):
        with iomode.side_by_side():
            group = {iomode.write_mode(d) for _ in range(3)}
            assert len(group) == 1
            picks += group
    assert picks.count("buffered") == 1
    assert picks.count("direct") == 63
    iomode.forget()


def test_a_group_that_failed_or_overlapped_measures_nothing(tmp_path: Path) -> None:
    """A failed save's files, a copy's (written as fast as their source is read) and two
    groups at once (each confounds the other) record no figure and take the settled mode."""
    from ckptstore.storage import iomode

    iomode.forget()
    d = str(tmp_path)

    def failed_save() -> None:
        with iomode.side_by_side():
            iomode.write_mode(d)
            iomode.record_write(d, "direct", 1 << 30, 100.0)
            raise OSError("a part file failed")

    with pytest.raises(OSError, match="a part file failed"):
        failed_save()
    with iomode.side_by_side(measure=False):
        assert iomode.write_mode(d) == "direct"
        iomode.record_write(d, "direct", 1 << 30, 100.0)
    with iomode.side_by_side(), iomode.side_by_side():
        iomode.record_write(d, "direct", 1 << 30, 100.0)
    assert iomode.decisions() == []
    iomode.record_write(d, "direct", 1 << 30, 1.0)  # alone: measured
    with iomode.side_by_side(measure=False):  # buffered untried, but a copy never tries
        assert iomode.write_mode(d) == "direct"
    with iomode.side_by_side():
        inner = iomode.side_by_side()
        inner.__enter__()
        assert iomode.write_mode(d) == "direct"  # overlapped: settled, no trial
        inner.__exit__(None, None, None)
        iomode.record_write(d, "direct", 1 << 30, 100.0)
    assert len(iomode.decisions()) == 1
    iomode.forget()


def test_a_file_on_another_thread_is_not_one_of_a_groups_files(tmp_path: Path) -> None:
    """The group is the block's (its context, which run_all's threads share), not the
    process's: a file another thread writes meanwhile takes the settled mode, is not added
    to the group's figure, and confounds it (found by review: it was counted in)."""
    import threading

    from ckptstore.storage import directio, iomode

    iomode.forget()
    d = str(tmp_path)
    iomode.record_write(d, "direct", 1 << 30, 1.0)  # buffered untried
    seen: dict[str, str] = {}

    def lone() -> None:
        seen["lone"] = iomode.write_mode(d)
        iomode.record_write(d, "buffered", 1 << 30, 0.1)

    with iomode.side_by_side():

        def part() -> None:
            seen["part"] = iomode.write_mode(d)

        directio.run_all([part])  # run_all's threads run in the block's context
        t = threading.Thread(target=lone)
        t.start()
        t.join()
        iomode.record_write(d, "buffered", 1 << 30, 1.0)
    assert seen == {"part": "buffered", "lone": "direct"}  # the group's trial; settled
    assert [h["mode"] for h in iomode.decisions()] == ["direct"]  # confounded: no figure
    iomode.forget()


def test_a_sharded_save_writes_its_parts_as_one_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_shards opens its part files inside side_by_side: every one is written in the
    mode chosen once for the group (here buffered, the untried one, by all of them), and
    their bytes together are one figure when the save's files are all written."""
    from ckptstore.sharded import plan as sharding
    from ckptstore.storage import iomode, open_storage

    iomode.forget()
    iomode.record_write(str(tmp_path), "direct", 1 << 30, 1.0)  # buffered is untried
    monkeypatch.setattr(sharding, "PART_BYTES", 33 << 20)  # files fill a buffer: they choose
    seen: list[tuple[str, int]] = []
    real = iomode.write_mode
    monkeypatch.setattr(
        iomode, "write_mode", lambda d: seen.append((real(d), len(iomode._groups))) or seen[-1][0]
    )
    storage = open_storage(tmp_path / "store")
    storage.check_root()
    pending = storage.begin(1)
    boxes = {f"w{i}@0": (f"w{i}", (0,), torch.zeros(33 << 18)) for i in range(2)}  # 2 x 33 MB
    sharding.write_shards(pending, 0, boxes, {})
    assert len(pending.files) == 2
    assert len(seen) == 2
    assert all(mode == "buffered" and groups == 1 for mode, groups in seen)
    writes = [h for h in iomode.decisions() if h["op"] == "write"]
    assert [h["mode"] for h in writes] == ["direct", "buffered"]  # the group: one figure
    storage.abort(pending)
    iomode.forget()


def test_a_large_auto_save_reports_its_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.storage import iomode

    iomode.forget()
    monkeypatch.setattr(iomode, "MEASURED_BYTES", 1 << 20)
    x = torch.randn(9 << 20)  # 36 MiB: fills a whole buffer, so its mode is chosen
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"x": x})
        mgr.save(2, {"x": x})
        assert torch.equal(mgr.load(2)["x"], x)
    writes = [h for h in iomode.decisions() if h["op"] == "write"]
    assert [h["mode"] for h in writes] == ["direct", "buffered"]
    assert all(float(h["bytes_per_s"]) > 0 for h in writes)  # type: ignore[arg-type]
    iomode.forget()


def test_io_threads_are_reused_at_the_callers_priority() -> None:
    """A finished Call's thread takes the next task of a caller of the same niceness; a
    caller that lowered its priority (an async save's writer) gets threads at its own."""

    def who() -> tuple[int, int]:
        return threading.get_ident(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    first = directio.Call(who).result()
    assert directio.Call(who).result() == first  # the same, idle thread
    assert first[1] == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    got: list[tuple[int, int]] = []

    def lowered() -> None:
        directio.lower_priority(first[1] + 5)
        got.append(directio.Call(who).result())
        got.append(directio.Call(who).result())

    t = threading.Thread(target=lowered)
    t.start()
    t.join(30)
    assert got[0][1] == first[1] + 5  # never a thread of the caller's higher priority
    assert got[0][0] != first[0]
    assert got[1] == got[0]
    assert directio.Call(who).result() == first  # the first one still serves its own


def test_bounce_buffers_are_kept_for_the_next_writer(tmp_path: Path) -> None:
    """A writer's mapped buffer goes to the next writer (no page faults again), and the bytes
    each one writes are its own."""
    a = os.urandom(3 * ALIGN + 12345)
    b = os.urandom(777)  # shorter: nothing of a's bytes left in the buffer may follow it
    w1 = directio.DirectWriter(str(tmp_path / "a"))
    w1.write(a)
    used = {id(x) for x in w1._bufs}
    w1.finish()
    w2 = directio.DirectWriter(str(tmp_path / "b"))
    w2.write(b)
    assert {id(x) for x in w2._bufs} & used  # reused, not mapped again
    w2.finish()
    assert (tmp_path / "a").read_bytes() == a
    assert (tmp_path / "b").read_bytes() == b
    assert len(directio._pool) <= directio._POOL_MAX


def test_io_threads_work_in_a_forked_child(tmp_path: Path) -> None:
    """Idle threads do not survive fork: a child must start its own, not wait on theirs."""
    directio.Call(lambda: None).result()  # leave an idle thread (and a kept buffer) behind

    def child() -> None:
        w = directio.DirectWriter(str(tmp_path / "child"))
        w.write(b"x" * (directio.BUFFER + 1))
        w.finish()
        assert directio.Call(lambda: 7).result() == 7

    hung = "the forked child hung on an I/O thread of its parent"
    assert run_forked(child, 60, hung) == 0
    assert (tmp_path / "child").stat().st_size == directio.BUFFER + 1


def test_pace_runs_on_the_caller_before_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stream_pipelined(pace=...)``: each read is issued only after ``pace()`` returned, so a
    pace that blocks (a background upload's gate during a save) holds back every later read;
    the bytes come out whole once it lets go."""
    monkeypatch.setattr(directio, "BUFFER", 1 << 16)
    data = os.urandom(5 * (1 << 16) + 10)  # 6 slices, the last one short
    path = tmp_path / "f"
    path.write_bytes(data)
    reads: list[int] = []
    real = directio.read_into

    def counted(fd: int, dest: memoryview, offset: int) -> int:
        reads.append(offset)
        return real(fd, dest, offset)

    monkeypatch.setattr(directio, "read_into", counted)
    paces: list[int] = []
    go = threading.Event()

    def pace() -> None:
        paces.append(len(reads))
        if len(paces) == 2:  # the second read waits until the test lets it go
            assert go.wait(30)

    out = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        t = threading.Thread(
            target=directio.stream_pipelined,
            args=(fd, lambda off, mv: out.extend(mv)),
            kwargs={"pace": pace},
        )
        t.start()
        deadline = time.monotonic() + 30
        while len(paces) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # an unpaced reader would have issued its other reads by now
        assert len(paces) == 2
        assert reads == [0]  # only the read issued before the blocked pace
        go.set()
        t.join(30)
    finally:
        os.close(fd)
    assert bytes(out) == data
    assert len(paces) == len(reads)  # one pace per read issued (some past the end: empty)
    assert sorted(reads)[:6] == [i << 16 for i in range(6)]


# ---- requests as large as the device takes: huge-page buffers, copies where it pays -------------


def test_where_requests_from_small_pages_are_cut_short_every_byte_goes_through_the_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "always" (what "auto" does where segment_capped): the tensors lined up with the file
    # are copied too, into buffers on huge pages; the bytes and requests are the same.
    monkeypatch.setattr(directio, "_FIRST_REQUEST", SEG)
    w, data, requests = _check_shard_like(
        tmp_path / "f", monkeypatch, 4, buffer_size=4 << 20, bounce="always"
    )
    assert w.bounced == len(data)
    assert w.direct
    assert max(requests.pieces) == 1  # one stretch of one buffer, no tensors
    # The ramp as for memory sent from where it is: 256 KiB, 512 KiB, 1, 2, then 4 MiB (the
    # buffer) each; before, a file copied into the buffers waited for a whole one.
    ramp = [SEG, 2 * SEG, 4 * SEG, 8 * SEG]
    assert requests.sizes[: len(ramp)] == ramp
    assert set(requests.sizes[len(ramp) : -2]) == {4 << 20}
    # Only the last partial block goes through the page cache: the whole blocks of the last
    # buffer went with O_DIRECT too (before, the whole last buffer went buffered).
    *whole, last = zip(requests.sizes, requests.direct, strict=True)
    assert all(direct and n % ALIGN == 0 for n, direct in whole), whole
    assert last[0] < ALIGN
    assert not last[1]
    # "never": the same shard, its tensors straight from their memory.
    w, data, _ = _check_shard_like(tmp_path / "g", monkeypatch, 4, buffer_size=4 << 20)
    assert w.bounced < 40 * 5 * ALIGN


def test_memory_marked_as_on_huge_pages_is_written_from_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ctypes

    monkeypatch.setattr(directio, "BOUNCE", "always")
    buf = directio.new_buffer(4 << 20)
    anchor = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(anchor)
    del anchor
    payload = os.urandom(4 << 20)
    buf[:] = payload
    head = os.urandom(ALIGN)

    def write(name: str) -> DirectWriter:
        w = DirectWriter(str(tmp_path / name), buffer_size=4 << 20)
        w.write(head)
        w.write_segment(memoryview(buf), address)
        w.finish()
        assert (tmp_path / name).read_bytes() == head + payload
        return w

    directio.mark_huge(address, len(buf))
    try:
        assert directio.on_huge_pages(address + ALIGN, 1 << 20)
        assert not directio.on_huge_pages(address - ALIGN, 1 << 20)  # starts before it
        assert not directio.on_huge_pages(address, len(buf) + 1)  # ends after it
        assert write("marked").bounced == ALIGN  # the header only
    finally:
        directio.unmark_huge(address)
    assert not directio.on_huge_pages(address, 1)
    assert write("unmarked").bounced == ALIGN + len(payload)
    buf.close()


def _fake_queue(root: Path, name: str, segments: int, sectors_kb: int) -> Path:
    queue = root / name / "queue"
    queue.mkdir(parents=True)
    (queue / "max_segments").write_text(f"{segments}\n")
    (queue / "max_sectors_kb").write_text(f"{sectors_kb}\n")
    return root / name


def test_segment_capped_reads_the_devices_own_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sysfs = tmp_path / "sys"
    monkeypatch.setattr(directio, "_SYSFS_BLOCK", str(sysfs / "dev" / "block"))
    directio.segment_capped.cache_clear()
    (sysfs / "dev" / "block").mkdir(parents=True)
    virtio = _fake_queue(sysfs / "devices", "vda", 254, 4096)  # 254 x 4 KiB < 4 MiB
    nvme = _fake_queue(sysfs / "devices", "nvme0n1", 1024, 1024)  # 4 MiB >= 1 MiB
    near = _fake_queue(sysfs / "devices", "nvme1n1", 127, 512)  # 508 KiB: nearly 512
    (virtio / "vda1").mkdir()  # a partition: no queue of its own, its disk's
    for dev, target in [
        ("253:0", virtio),
        ("253:1", virtio / "vda1"),
        ("259:0", nvme),
        ("259:1", near),
    ]:
        (sysfs / "dev" / "block" / dev).symlink_to(target)
    try:
        assert directio.segment_capped(os.makedev(253, 0))
        assert directio.segment_capped(os.makedev(253, 1))
        assert not directio.segment_capped(os.makedev(259, 0))
        assert not directio.segment_capped(os.makedev(259, 1))  # a copy would not pay
        assert not directio.segment_capped(os.makedev(7, 3))  # not listed: unknown
    finally:
        directio.segment_capped.cache_clear()


@pytest.mark.skipif(not thp_at_first_touch(), reason="no huge pages at first touch here")
def test_new_buffers_are_on_huge_pages() -> None:
    buf = directio.new_buffer(8 << 20)
    for off in range(0, len(buf), 4096):
        buf[off] = 1
    assert huge_share(buf) > 0  # 2 MiB pages under it (4 KiB pages only, without the advice)
    buf.close()


def test_async_staging_of_large_tensors_is_marked_until_freed(tmp_path: Path) -> None:
    import gc

    state = {"w": torch.randn(1 << 20), "b": torch.randn(5)}
    with CheckpointManager(tmp_path / "s", async_save=True) as mgr:
        mgr.save(1, state).wait()
        big, small = mgr._staging._bufs["w/_"], mgr._staging._bufs["b/_"]
        assert directio.on_huge_pages(big.data_ptr(), big.numel())
        assert not directio.on_huge_pages(small.data_ptr(), small.numel())
        address = big.data_ptr()
        del big, small
        mgr.save(2, {"b": state["b"]}).wait()  # "w" unused: its staging buffer is dropped
    gc.collect()
    assert not directio.on_huge_pages(address, 1)
    into = {"w": torch.zeros(1 << 20), "b": torch.zeros(5)}
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.restore(into, step=1)
    assert torch.equal(into["w"], state["w"])


def test_reads_take_their_buffers_from_the_pool_and_give_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(3 * directio.BUFFER // 2)
    (tmp_path / "f").write_bytes(data)
    made: list[int] = []
    real = directio.new_buffer

    def counted(size: int) -> object:
        made.append(size)
        return real(size)

    monkeypatch.setattr(directio, "new_buffer", counted)
    monkeypatch.setattr(directio, "_pool", [])
    got = bytearray()

    def keep(offset: int, view: memoryview) -> None:
        got.extend(view)

    for _ in range(2):
        got.clear()
        fd = os.open(tmp_path / "f", os.O_RDONLY)
        try:
            assert directio.stream_pipelined(fd, keep) == (len(data), crc32c_of(data))
        finally:
            os.close(fd)
        assert bytes(got) == data
    # The first read mapped its READ_DEPTH + 1 buffers, the second took them from the pool.
    assert made == [directio.BUFFER] * (directio.READ_DEPTH + 1)
    assert len(directio._pool) == directio.READ_DEPTH + 1

    # A read whose consumer fails gives nothing back (a view may outlive it).
    def fail(offset: int, view: memoryview) -> None:
        raise ValueError("consumer")

    directio._pool.clear()
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="consumer"):
            directio.stream_pipelined(fd, fail)
    finally:
        os.close(fd)
    assert directio._pool == []


def test_a_forked_child_never_writes_through_its_parents_buffers(tmp_path: Path) -> None:
    """A child forked after a save maps buffers of its own; the parent's keep their bytes."""
    w = DirectWriter(str(tmp_path / "parent"), buffer_size=directio.BUFFER)
    w.write(b"p" * (directio.BUFFER + ALIGN))  # two buffers, kept at finish
    w.finish()
    kept = list(directio._pool)
    assert kept
    before = [bytes(b[:ALIGN]) for b in kept]
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: save something of its own, say what its pool held
        code = 1
        try:
            os.close(r)
            empty = directio._pool == []
            c = DirectWriter(str(tmp_path / "child"), buffer_size=directio.BUFFER)
            c.write(b"c" * (directio.BUFFER + ALIGN))
            c.finish()
            os.write(wfd, b"empty" if empty else b"inherited")
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    said = os.read(r, 64)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert said == b"empty"
    assert [bytes(b[:ALIGN]) for b in kept] == before  # nothing of the child's "c" here
    assert (tmp_path / "child").read_bytes() == b"c" * (directio.BUFFER + ALIGN)

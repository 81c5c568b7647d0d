"""The fast I/O paths: O_DIRECT writes and reads, their fallback, and the streaming decoder."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from ckptstore import CheckpointManager, IntegrityError, StateMismatchError
from ckptstore.codec.safetensors import StreamDecoder, write_safetensors
from ckptstore.integrity import crc32c_of
from ckptstore.storage import directio
from ckptstore.storage.directio import ALIGN, DirectWriter
from ckptstore.storage.local import LocalStorage


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
    monkeypatch.setattr("ckptstore.storage.local.BUFFER", chunk)
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
    assert w.write_segment(view, address) == size
    w.write(b"tail")
    w.finish()
    assert (tmp_path / "f").read_bytes() == head + data + b"tail"
    assert w.nbytes == prefix + size + 4
    assert w.crc == crc32c_of(head + data + b"tail")
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


def test_async_staging_places_tensors_for_zero_copy(tmp_path: Path) -> None:
    """Each staged tensor's address is congruent with its file offset (mod the block size),
    and the big ones reach the file without going through the bounce buffer."""
    import ckptstore.storage.local as local_mod
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
    assert model.bounced < 3 * ALIGN + len(head)  # headers and partial blocks only
    assert model.direct

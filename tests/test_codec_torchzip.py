"""ckptstore.codec.torchzip, zipstream: ``.pt`` payloads are plain torch.save zips, read safely."""

from __future__ import annotations

import io
import logging
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import (
    RunsCode,
    assert_same,
    deflated,
    fresh_like,
    make_state,
    replace_payload,
    step_dir,
)

from ckptstore import CheckpointManager, IntegrityError, UnsafeCheckpointError
from ckptstore.codec import torchzip, zipstream


def saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def member_data_offset(data: bytes, suffix: str) -> tuple[str, int, int]:
    """(name, offset of its first data byte, size) of the zip member ending in ``suffix``."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    assert info.compress_type == zipfile.ZIP_STORED  # torch.save never compresses
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    return info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size


def test_write_and_load_roundtrip() -> None:
    tensors = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([True, False]),
        "h": torch.tensor([1.5], dtype=torch.bfloat16),
        "s": torch.tensor(7, dtype=torch.uint64),
    }
    buf = io.BytesIO()
    torchzip.write_torch(buf, tensors)
    data = buf.getvalue()
    assert torchzip.check_zip(data, "x.pt", deep=True) >= 4
    got = torchzip.load_tensor_dict(data, "x.pt")
    assert list(got) == ["w", "b", "h", "s"]
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype, k
        assert torch.equal(got[k], t), k
    # The same bytes load with torch.load(weights_only=True): a standard file.
    plain = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(plain["w"], tensors["w"])


@pytest.mark.parametrize("cut", [0.5, -22, -1, 30])
def test_check_zip_detects_truncation(cut: float) -> None:
    data = saved({"w": torch.arange(100.0)})
    n = int(len(data) * cut) if isinstance(cut, float) else (cut if cut > 0 else len(data) + cut)
    with pytest.raises(IntegrityError) as ei:
        torchzip.check_zip(data[:n], "run/model.pt", deep=False)
    msg = str(ei.value)
    assert msg.startswith("run/model.pt: not a readable torch zip archive (")
    assert "the file is truncated or corrupt" in msg
    assert "central directory" in msg
    with pytest.raises(IntegrityError):
        torchzip.load_tensor_dict(data[:n], "run/model.pt")


def test_check_zip_catches_a_flipped_byte_only_when_deep() -> None:
    data = bytearray(saved({"w": torch.arange(100.0)}))
    name, start, size = member_data_offset(bytes(data), "/data/0")
    assert size == 400
    data[start + 40] ^= 0x01  # element 10: 10.0 -> 10.000001
    # deep=False reads only the central directory: it cannot see this.
    assert torchzip.check_zip(data, "m.pt", deep=False) == torchzip.check_zip(
        saved({"w": torch.arange(100.0)}), "m.pt", deep=False
    )
    with pytest.raises(IntegrityError) as ei:
        torchzip.check_zip(data, "m.pt", deep=True)
    assert str(ei.value) == f"m.pt: zip member {name!r} fails its CRC-32 check"
    # And the reason ckptstore checks: torch.load itself loads the flipped value silently.
    silently = torch.load(io.BytesIO(bytes(data)), weights_only=True)["w"]
    assert silently[10].item() != 10.0
    assert torch.equal(silently[:10], torch.arange(10.0))


def test_check_zip_accepts_file_objects_and_rejects_other_zips(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    path.write_bytes(saved({"w": torch.zeros(2)}))
    with path.open("rb") as f:
        assert torchzip.check_zip(f, str(path), deep=True) >= 3
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(IntegrityError) as ei:
        torchzip.check_zip(buf.getvalue(), "o.pt", deep=True)
    assert str(ei.value) == "o.pt: zip archive has no data.pkl; not a torch.save file"


def test_load_refuses_a_pickle_that_would_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = saved({"w": torch.zeros(2), "evil": RunsCode(str(marker))})
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError) as ei:
        torchzip.load_tensor_dict(data, "run/model.pt")
    msg = str(ei.value)
    assert msg.startswith(
        "run/model.pt: refused to load: the pickle inside asks for more than tensors and plain data"
    )
    assert msg.endswith("ckptstore never falls back to weights_only=False")
    assert not marker.exists()
    # The trap is real: an unrestricted torch.load runs it.
    torch.load(io.BytesIO(data), weights_only=False)
    assert marker.read_text() == "code ran"


@pytest.mark.parametrize(
    "obj",
    [[torch.zeros(1)], {"w": [torch.zeros(1)]}, {"n": 1}, {0: torch.zeros(1)}, torch.zeros(1)],
)
def test_load_requires_a_flat_dict_of_tensors(obj: Any) -> None:
    with pytest.raises(IntegrityError) as ei:
        torchzip.load_tensor_dict(saved(obj), "p.pt")
    assert str(ei.value) == "p.pt: payload is not a flat dict of tensors"


def test_manager_torch_payloads_load_with_weights_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, format="torch") as mgr:
        mgr.save(5, {"model": model, "optimizer": opt, "step": 5})
    step_dir = tmp_path / "step-000000000005"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "manifest.json",
        "model.pt",
        "optimizer.pt",
        "state.json",
    ]
    weights = torch.load(step_dir / "model.pt", weights_only=True)
    assert list(weights) == list(model.state_dict())  # "0.weight", "0.bias", ...
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k
    optim = torch.load(step_dir / "optimizer.pt", weights_only=True)
    assert sorted(optim) == [f"state.{i}.momentum_buffer" for i in range(4)]
    for i, p in enumerate(model.parameters()):
        assert torch.equal(optim[f"state.{i}.momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_views_are_saved_without_their_whole_storage(tmp_path: Path) -> None:
    big = torch.arange(100_000, dtype=torch.float32)
    with CheckpointManager(tmp_path, format="torch") as mgr:
        mgr.save(1, {"m": {"head": big[:4]}})
        assert mgr.load()["m"]["head"].tolist() == [0.0, 1.0, 2.0, 3.0]
    size = (tmp_path / "step-000000000001" / "m.pt").stat().st_size
    assert size < 4096  # not the 400 kB storage that torch.save would write for the view


def _no_inflating(*args: Any) -> Any:
    raise AssertionError("a zip member was inflated")


def test_check_zip_refuses_a_compressed_member_without_inflating_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = deflated(saved({"w": torch.zeros(100_000)}))  # 400 kB of zeros: about 400 bytes
    monkeypatch.setattr(zipfile, "_get_decompressor", _no_inflating)
    for deep in (False, True):
        with pytest.raises(IntegrityError) as ei:
            torchzip.check_zip(data, "run/model.pt", deep=deep)
        msg = str(ei.value)
        assert msg.startswith("run/model.pt: zip member 'archive/data.pkl' is compressed (deflate")
        assert "torch.save stores every member uncompressed" in msg
        assert "refused without inflating anything" in msg
    # So does the payload decoder, before torch.load sees it.
    with pytest.raises(IntegrityError, match="is compressed"):
        torchzip.load_tensor_dict(data, "run/model.pt")


def test_check_zip_refuses_a_stored_member_whose_sizes_disagree() -> None:
    data = bytearray(saved({"w": torch.zeros(4)}))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        pos = zf.start_dir  # the central directory: one entry per member, in this order
        for info in zf.infolist():
            lengths = struct.unpack("<HHH", data[pos + 28 : pos + 34])
            if info.filename.endswith("/data/0"):
                break
            pos += 46 + sum(lengths)
    data[pos + 24 : pos + 28] = struct.pack("<I", 1 << 30)  # its uncompressed size
    with pytest.raises(IntegrityError) as ei:
        torchzip.check_zip(bytes(data), "m.pt", deep=False)
    assert str(ei.value) == (
        f"m.pt: zip member {info.filename!r} is stored uncompressed in 16 bytes but says it "
        f"holds {1 << 30}; the archive is corrupt"
    )


def test_restore_falls_back_from_a_payload_with_a_compressed_member(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "s"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root, format="torch") as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    path = root / step_dir(2) / "model.pt"
    replace_payload(root / step_dir(2), "model.pt", deflated(path.read_bytes()))
    where = f"{path}: zip member 'archive/data.pkl' is compressed (deflate, "
    with CheckpointManager(root) as mgr:
        fresh = fresh_like(states[1])
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert mgr.restore(fresh) == 1
        assert_same(dict(fresh["model"].state_dict()), dict(states[1]["model"].state_dict()))
        assert any(where in r.getMessage() for r in caplog.records)
        with pytest.raises(IntegrityError) as ei:
            mgr.restore(fresh_like(states[1]), step=2)
        assert str(ei.value).startswith(where)
        for deep in (False, True):
            report = mgr.verify(2, deep=deep)
            assert len(report.problems) == 1
            assert report.problems[0].startswith(where)


# ---- the streaming decoder -------------------------------------------------------------------


def stream(data: bytes, piece: int, into: dict[str, torch.Tensor] | None = None) -> Any:
    dec = zipstream.StreamDecoder.from_buffer(data, "f.pt", into)
    assert dec is not None
    mv = memoryview(data)
    for o in range(0, len(data), piece):
        dec(o, mv[o : o + piece])
    return dec


@pytest.mark.parametrize("piece", [1, 29, 4096, 1 << 30])
def test_stream_decoder_is_byte_exact_in_any_slicing(piece: int) -> None:
    ts = {
        "w": torch.randn(33, 7),
        "i": torch.arange(100, dtype=torch.int64),
        "h": torch.randn(9).to(torch.bfloat16),
        "b": torch.tensor([True, False, True]),
        "s": torch.tensor(2.5),
        "e": torch.empty(0, 3),
    }
    target = torch.zeros(33, 7)
    wrong = torch.zeros(33, 7, dtype=torch.float64)  # another dtype: never written into
    dec = stream(saved(ts), piece, {"w": target, "i": wrong})
    out = dec.result()
    assert_same(out, ts)
    assert out["w"] is target
    assert dec.reused == 1
    assert torch.equal(wrong, torch.zeros(33, 7, dtype=torch.float64))


def test_stream_decoder_rebuilds_views_of_a_shared_storage() -> None:
    base = torch.arange(20.0)
    ts = {"x": base[2:7], "y": base.view(4, 5)[:, 1], "z": base}
    out = stream(saved(ts), 64).result()
    assert_same(out, {k: v.clone() for k, v in ts.items()})
    assert out["x"].untyped_storage().data_ptr() == out["z"].untyped_storage().data_ptr()


def test_stream_decoder_refuses_a_pickle_that_would_run_code(tmp_path: Path) -> None:
    flag = tmp_path / "ran"
    data = saved({"t": torch.ones(2), "evil": RunsCode(str(flag))})
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        stream(data, 1 << 20)
    assert not flag.exists()


def _cd_entries(data: bytes) -> list[int]:
    """Offsets of the central directory entries."""
    out, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        out.append(at)
        at = data.find(b"PK\x01\x02", at + 1)
    return out


def test_stream_decoder_refuses_hostile_directories() -> None:
    data = bytearray(saved({"a": torch.ones(1000), "b": torch.zeros(1000)}))
    eocd = data.rfind(b"PK\x05\x06")
    # A directory said to be huge, or to lie outside the file: refused before it is read.
    big = bytearray(data)
    big[eocd + 12 : eocd + 16] = struct.pack("<I", 0xFFFFFF00)
    with pytest.raises(IntegrityError, match="out of bounds"):
        zipstream.StreamDecoder.from_buffer(big, "f.pt", None)
    many = bytearray(data)
    many[eocd + 10 : eocd + 12] = struct.pack("<H", 0xFFFE)  # more entries than fit
    with pytest.raises(IntegrityError, match="out of bounds"):
        zipstream.StreamDecoder.from_buffer(many, "f.pt", None)
    # Two members pointing at the same bytes.
    entries = _cd_entries(bytes(data))
    twin = bytearray(data)
    lho0 = twin[entries[0] + 42 : entries[0] + 46]
    twin[entries[-1] + 42 : entries[-1] + 46] = lho0
    with pytest.raises(IntegrityError, match="overlaps"):
        zipstream.StreamDecoder.from_buffer(twin, "f.pt", None)
    # No end record at all (truncated).
    with pytest.raises(IntegrityError, match="no end of central directory"):
        zipstream.StreamDecoder.from_buffer(data[: eocd - 1], "f.pt", None)


def test_stream_decoder_refuses_a_storage_missing_from_the_archive() -> None:
    data = bytearray(saved({"a": torch.ones(1000), "b": torch.zeros(1000)}))
    # Rename member data/1 (in its local header and its directory entry) to data/9.
    for at in (data.find(b"archive/data/1"), data.rfind(b"archive/data/1")):
        data[at : at + 14] = b"archive/data/9"
    with pytest.raises(IntegrityError, match=r"storages \['1'\] of data.pkl are not in it"):
        stream(bytes(data), 1 << 20).result()


def sequential(data: bytes, piece: int, into: dict[str, torch.Tensor] | None = None) -> Any:
    """A :class:`SequentialDecoder` fed ``data`` front to back in slices of ``piece``."""
    dec = zipstream.SequentialDecoder("f.pt", into)
    mv = memoryview(data)
    for o in range(0, len(data), piece):
        dec(o, mv[o : o + piece])
    return dec


@pytest.mark.parametrize("piece", [7, 29, 4096, 1 << 30])
def test_sequential_decoder_is_byte_exact_in_any_slicing(piece: int) -> None:
    ts = {
        "w": torch.randn(33, 7),
        "i": torch.arange(100, dtype=torch.int64),
        "h": torch.randn(9).to(torch.bfloat16),
        "b": torch.tensor([True, False, True]),
        "e": torch.empty(0, 3),
        "big": torch.randn(50_000),
    }
    target = torch.zeros(50_000)
    wrong = torch.zeros(33, 7, dtype=torch.float64)  # another dtype: never written into
    dec = sequential(saved(ts), piece, {"big": target, "w": wrong})
    out = dec.result()
    assert_same(out, ts)
    assert out["big"] is target
    assert dec.reused == 1
    assert torch.equal(wrong, torch.zeros(33, 7, dtype=torch.float64))
    # Held: the small records, the directory and the window before it, never the 200 KB
    # storage (the tensor took its bytes).
    assert dec.peak < 3 * (64 << 10) + 4096, dec.peak


def test_sequential_decoder_rebuilds_views_and_refuses_code(tmp_path: Path) -> None:
    base = torch.arange(20.0)
    ts = {"x": base[2:7], "z": base}
    out = sequential(saved(ts), 64).result()
    assert_same(out, {k: v.clone() for k, v in ts.items()})
    flag = tmp_path / "ran"
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        sequential(saved({"t": torch.ones(2), "evil": RunsCode(str(flag))}), 100)
    assert not flag.exists()


def test_sequential_decoder_checks_the_directory_against_what_streamed() -> None:
    data = saved({"a": torch.ones(1000), "b": torch.zeros(1000)})
    # Truncated anywhere: never a result.
    for cut in (10, len(data) // 2, data.rfind(b"PK\x01\x02") + 10, len(data) - 1):
        with pytest.raises(IntegrityError):
            sequential(data[:cut], 1 << 20).result()
    # The directory names a member that did not stream by (renamed there only).
    other = bytearray(data)
    at = other.rfind(b"archive/version")
    other[at : at + 15] = b"archive/versioX"
    with pytest.raises(IntegrityError, match="directory disagrees with the local headers"):
        sequential(bytes(other), 4096).result()
    # A descriptor that gives a storage another size than data.pkl does.
    _, start, size = member_data_offset(data, "data/1")
    bad = bytearray(data)
    bad[start + size + 8 : start + size + 16] = struct.pack("<II", size + 4, size + 4)
    with pytest.raises(IntegrityError, match="its descriptor says"):
        sequential(bytes(bad), 4096)
    # A storage before data.pkl, or a first member that is not data.pkl: not torch.save's
    # layout, for the whole-file path.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data/0", b"\0" * 8)
        zf.writestr("archive/data.pkl", b"")
    with pytest.raises(zipstream.NotStreamable):
        sequential(buf.getvalue(), 4096)


def test_sequential_decoder_bounds_a_record_without_a_descriptor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = bytearray(saved({"a": torch.ones(10)}))
    _, start, size = member_data_offset(bytes(data), "data.pkl")
    data[start + size : start + size + 4] = b"XXXX"  # data.pkl's descriptor defaced
    monkeypatch.setattr(zipstream, "_MAX_SCANNED", 1024)
    with pytest.raises(zipstream.NotStreamable):
        sequential(bytes(data) + bytes(4096), 64)
    # A look-alike descriptor (its own offset twice, a wrong CRC) inside a record.
    fake = bytearray(saved({"a": torch.ones(10)}))
    fake[start + size + 4 : start + size + 8] = b"\0\0\0\0"
    with pytest.raises(zipstream.NotStreamable):
        sequential(bytes(fake), 64)


def test_torch_zstd_payload_not_laid_out_as_torch_save_is_read_whole(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(1000.0)}}
    root = tmp_path / "s"
    with CheckpointManager(root, format="torch", compression="zstd") as mgr:
        mgr.save(1, state)
    # The same tensors in an archive whose storage comes before data.pkl: zipfile keeps
    # the order it is given.
    with zipfile.ZipFile(io.BytesIO(saved(state["model"]))) as src:
        infos = sorted(src.infolist(), key=lambda i: not i.filename.endswith("data/0"))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as dst:
            for info in infos:
                dst.writestr(info, src.read(info))
    replace_payload(root / step_dir(1), "model.pt.zst", _zst(out.getvalue()))
    with CheckpointManager(root) as mgr:
        assert_same(mgr.load(1), state)


def _zst(data: bytes) -> bytes:
    from ckptstore.codec import zstd

    buf = io.BytesIO()
    sink = zstd.ZstdSink(buf)
    sink.write(data)
    sink.close()
    return buf.getvalue()


def test_torch_format_restores_by_streaming_into_the_targets(tmp_path: Path) -> None:
    # Multi-block payloads (4 MiB blocks): the streaming path, targets filled in place.
    torch.manual_seed(0)
    src = torch.nn.Linear(1536, 1536)  # 9 MiB of weight
    with CheckpointManager(tmp_path / "s", format="torch") as mgr:
        mgr.save(1, {"model": src})
        entry = mgr.manifest(1).files["model.pt"]
        assert entry.blocks is not None
        assert len(entry.blocks) == 3
        dst = torch.nn.Linear(1536, 1536)
        ptr = dst.weight.data_ptr()
        assert mgr.restore({"model": dst}) == 1
    assert_same(dict(dst.state_dict()), dict(src.state_dict()))
    assert dst.weight.data_ptr() == ptr


def test_torch_format_corrupt_block_never_reaches_its_target(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = torch.nn.Linear(1536, 1536)  # 9 MiB of weight: blocks 0..2 of model.pt
    root = tmp_path / "s"
    with CheckpointManager(root, format="torch") as mgr:
        mgr.save(1, {"model": src})
    path = root / step_dir(1) / "model.pt"
    data = bytearray(path.read_bytes())
    _, start, size = member_data_offset(bytes(data), "data/0")
    at = start + size - 100  # the weight's last bytes: the file's last block
    assert at // (4 << 20) == 2
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    dst = torch.nn.Linear(1536, 1536)
    with torch.no_grad():
        dst.weight.fill_(7)
        dst.bias.fill_(7)
    with CheckpointManager(root) as mgr, pytest.raises(IntegrityError) as ei:
        mgr.restore({"model": dst}, step=1)
    assert str(path) in str(ei.value)
    assert "block 2 " in str(ei.value)
    # The bytes of the bad block never reached the weight.
    flat = dst.weight.detach().reshape(-1)
    tail = (size - ((at // (4 << 20)) * (4 << 20) - start)) // 4
    assert bool((flat[-tail:] == 7).all())


def checked(data: bytes, piece: int) -> int:
    """Members of ``data`` per :class:`ZipStreamChecker`, fed in slices of ``piece``."""
    c = zipstream.ZipStreamChecker("f.pt")
    mv = memoryview(data)
    for o in range(0, len(data), piece):
        c(o, mv[o : o + piece])
    assert c.peak < 3 * (64 << 10) + 4096, c.peak  # never the 200 KB storage
    return c.finish()


@pytest.mark.parametrize("piece", [3, 15, 16, 17, 4096, 1 << 30])
def test_zip_stream_checker_agrees_with_check_zip_in_any_slicing(piece: int) -> None:
    data = saved({"a": torch.arange(1000.0), "b": torch.zeros(3, dtype=torch.int8),
                  "c": torch.randn(50_000)})  # fmt: skip
    assert checked(data, piece) == torchzip.check_zip(data, "f.pt", deep=True)


def test_zip_stream_checker_finds_what_a_deep_check_finds() -> None:
    data = saved({"a": torch.arange(1000.0), "c": torch.randn(50_000)})
    _, start, size = member_data_offset(data, "data/1")
    flipped = bytearray(data)
    flipped[start + size // 2] ^= 0x04  # a storage byte: its CRC-32 fails
    with pytest.raises(IntegrityError, match=r"zip member '.*data/1' fails its CRC-32 check"):
        checked(bytes(flipped), 4096)
    with pytest.raises(IntegrityError, match="ended before the archive did"):
        checked(data[: len(data) // 2], 4096)  # truncated in a storage
    with pytest.raises(IntegrityError, match="no end of central directory"):
        checked(data[: len(data) - 30], 4096)  # truncated in its directory
    other = bytearray(data)
    at = other.rfind(b"archive/version")
    other[at : at + 15] = b"archive/versioX"  # the directory names another member
    with pytest.raises(IntegrityError, match="disagrees with the local headers"):
        checked(bytes(other), 4096)
    with pytest.raises(IntegrityError, match="is compressed"):
        checked(deflated(data), 4096)

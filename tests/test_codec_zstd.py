"""ckptstore.codec.zstd: standard zstd frames, checksummed on disk, strict on the way back."""

from __future__ import annotations

import io
import json
import logging
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import zstandard
from _helpers import (
    assert_same,
    drop_memory,
    fresh_like,
    local_view,
    make_state,
    memory_view,
    plant_zstd_bomb,
    replace_payload,
    run_forked,
    step_dir,
    zeros_frame,
)

from ckptstore import CheckpointManager, IntegrityError
from ckptstore import cli as cli_mod
from ckptstore.codec import safetensors as st
from ckptstore.codec import zstd

TEXT = b"the quick brown fox jumps over the lazy dog " * 500


def compressed(*chunks: bytes) -> bytes:
    buf = io.BytesIO()
    sink = zstd.ZstdSink(buf)
    for c in chunks:
        assert sink.write(c) == len(c)  # counts input bytes, as a file object should
    sink.close()
    assert not buf.closed  # the underlying sink stays open for the checksum writer
    return buf.getvalue()


def test_sink_writes_one_standard_frame_with_a_checksum() -> None:
    data = compressed(TEXT[:1000], memoryview(TEXT[1000:]), b"")
    assert data[:4] == b"\x28\xb5\x2f\xfd"  # the zstd frame magic
    params = zstandard.get_frame_parameters(data)
    assert params.has_checksum
    assert len(data) < len(TEXT) // 10
    # Any zstd reader gets the bytes back (the frame is streamed, so no content size).
    assert zstandard.ZstdDecompressor().decompressobj().decompress(data) == TEXT
    sink = zstd.ZstdSink(io.BytesIO())
    assert sink.writable()
    assert not sink.seekable()
    sink.flush()
    sink.close()


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_decompress_roundtrip(kind: type) -> None:
    out = zstd.decompress(kind(compressed(TEXT)), "x.zst")
    assert type(out) is bytearray
    assert out == TEXT
    assert zstd.decompress(compressed(), "empty.zst") == bytearray()


def test_decompress_reads_concatenated_frames() -> None:
    assert zstd.decompress(compressed(b"abc") + compressed(b"def"), "x") == bytearray(b"abcdef")


def test_decompress_detects_a_flipped_byte() -> None:
    data = bytearray(compressed(TEXT))
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(IntegrityError) as ei:
        zstd.decompress(data, "run/model.safetensors.zst")
    assert str(ei.value).startswith("run/model.safetensors.zst: zstd stream is corrupt (")


@pytest.mark.parametrize("keep", [-1, -4, -(10**9), 5, 0], ids=["-1", "-4", "half", "5", "0"])
def test_decompress_detects_truncation(keep: int) -> None:
    data = compressed(TEXT)
    n = len(data) // 2 if keep == -(10**9) else (len(data) + keep if keep < 0 else keep)
    with pytest.raises(IntegrityError) as ei:
        zstd.decompress(data[:n], "m.zst")
    assert str(ei.value) == "m.zst: zstd stream is truncated (its last frame never ends)"
    if n:  # a truncated second frame too
        with pytest.raises(IntegrityError, match="truncated"):
            zstd.decompress(compressed(b"abc") + data[:n], "m.zst")


def test_decompress_refuses_trailing_garbage() -> None:
    with pytest.raises(IntegrityError, match=r"^m\.zst: zstd stream is corrupt \("):
        zstd.decompress(compressed(TEXT) + b"garbage!", "m.zst")


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_manager_checksums_the_compressed_bytes(tmp_path: Path, fmt: str) -> None:
    state = {"model": {"w": torch.zeros(256, 256), "b": torch.arange(10)}}
    with CheckpointManager(tmp_path / "z", format=fmt, compression="zstd") as mgr:
        mgr.save(1, state)
        manifest = mgr.manifest(1)
    ext = {"safetensors": ".safetensors", "torch": ".pt"}[fmt]
    name = f"model{ext}.zst"
    entry = manifest.files[name]
    assert entry.codec == fmt
    assert entry.compression == "zstd"
    on_disk = (tmp_path / "z" / "step-000000000001" / name).read_bytes()
    assert entry.bytes == len(on_disk)
    assert entry.crc32c == crc32c.crc32c(on_disk)
    assert len(on_disk) < 256 * 256 * 4 // 50  # zeros compress
    # state.json is never compressed: it is small and must stay readable.
    assert manifest.files["state.json"].compression is None
    raw = json.loads((tmp_path / "z" / "step-000000000001" / "manifest.json").read_bytes())
    assert raw["files"][name]["compression"] == "zstd"


def test_compressed_payload_is_the_uncompressed_one(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(1000, dtype=torch.float32), "m": torch.eye(3)}}
    with CheckpointManager(tmp_path / "raw") as mgr:
        mgr.save(1, state)
    with CheckpointManager(tmp_path / "zst", compression="zstd") as mgr:
        mgr.save(1, state)
    raw = (tmp_path / "raw" / "step-000000000001" / "model.safetensors").read_bytes()
    zst = (tmp_path / "zst" / "step-000000000001" / "model.safetensors.zst").read_bytes()
    assert zstd.decompress(zst, "x") == raw
    raw_state = (tmp_path / "raw" / "step-000000000001" / "state.json").read_bytes()
    zst_state = (tmp_path / "zst" / "step-000000000001" / "state.json").read_bytes()
    assert raw_state == zst_state  # the tree names groups, never file names


# ---- decompression bombs --------------------------------------------------------------------


def peak_bytes(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()``'s result, or the exception it raised, and the peak of Python memory it
    allocated (every buffer a decompression fills is a Python bytes or bytearray)."""
    tracemalloc.start()
    try:
        try:
            result: Any = call()
        except Exception as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_decompress_stops_a_real_bomb_at_its_limit() -> None:
    bomb = compressed(TEXT) + zeros_frame()  # 1 GiB of zeros after the text, ~33 KB in all
    assert len(bomb) < 64 << 10
    err, peak = peak_bytes(
        lambda: zstd.decompress(bomb, "m.zst", limit=len(TEXT) + 10, why="its tensors can take")
    )
    assert isinstance(err, IntegrityError)
    assert str(err) == (
        f"m.zst: zstd stream inflates past the {len(TEXT) + 10} bytes its tensors can take; "
        "refused without inflating the rest (a corrupt file, or a decompression bomb). "
        "Restore an earlier step"
    )
    assert peak < 2 << 20, f"{peak} bytes allocated to refuse it"
    # The limit itself is fine; one byte less is not.
    assert zstd.decompress(compressed(TEXT), "m", limit=len(TEXT)) == TEXT
    with pytest.raises(IntegrityError, match="inflates past the"):
        zstd.decompress(compressed(TEXT), "m", limit=len(TEXT) - 1)


def test_decompress_stops_where_the_safetensors_header_says_the_file_ends() -> None:
    buf = io.BytesIO()
    st.write_safetensors(buf, {"w": torch.arange(16, dtype=torch.float32)})
    raw = buf.getvalue()
    where = "run/step-000000000002/model.safetensors.zst"

    def declared(out: bytearray) -> int | None:
        return st.declared_size(out, where)

    assert zstd.decompress(compressed(raw), where, declared=declared) == raw
    # Declared small, inflating to 1 GiB: no limit is given, the header alone bounds it.
    # (The bomb is built before the count starts: zeros_frame's first call, in a worker
    # where no test before made it, allocates a 64 MiB block of zeros to compress.)
    bomb = compressed(raw) + zeros_frame()
    err, peak = peak_bytes(lambda: zstd.decompress(bomb, where, declared=declared))
    assert isinstance(err, IntegrityError)
    assert str(err).startswith(
        f"{where}: zstd stream inflates past the {len(raw)} bytes its own header declares; "
    )
    assert peak < 2 << 20, f"{peak} bytes allocated to refuse it"
    # A header that is not one is refused as soon as it is in.
    with pytest.raises(IntegrityError, match="not a valid safetensors file"):
        zstd.decompress(compressed(b"\xff" * 8) + zeros_frame(), where, declared=declared)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_restore_falls_back_from_a_decompression_bomb(
    tmp_path: Path, fmt: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "z"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root, format=fmt, compression="zstd") as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    name = {"safetensors": "model.safetensors.zst", "torch": "model.pt.zst"}[fmt]
    # Step 2's model payload: its own bytes, then 1 GiB of zeros; manifest forged to match.
    plant_zstd_bomb(root, 2, name)
    where = f"{root}/{step_dir(2)}/{name}"
    why = {
        "safetensors": "bytes its own header declares",
        "torch": "bytes its tensors in the state file can take",
    }[fmt]
    with CheckpointManager(root, keep=1) as mgr:
        fresh = fresh_like(states[1])
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            got, peak = peak_bytes(lambda: mgr.restore(fresh))
        assert got == 1, got
        assert peak < 32 << 20, f"restore allocated {peak} bytes"
        assert_same(dict(fresh["model"].state_dict()), dict(states[1]["model"].state_dict()))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("step 2" in w and where in w and "inflates past" in w for w in warnings)

        with pytest.raises(IntegrityError) as ei:
            mgr.restore(fresh_like(states[1]), step=2)
        assert str(ei.value).startswith(f"{where}: zstd stream inflates past the ")
        assert why in str(ei.value)
        assert mgr.load()["step"] == 1

        report = mgr.verify(2)  # deep: inflates, as far as it may
        assert report.problems == [str(ei.value)]
        assert mgr.verify(2, deep=False).ok  # quick checks never inflate anything
        assert mgr.verify(1).ok
        # Retention sees step 2 is bad: step 1, the last good one, stays.
        assert mgr.prune() == []
        assert mgr.steps() == [1, 2]
    assert cli_mod.main(["verify", str(root)]) == 1
    assert "inflates past" in capsys.readouterr().out


# ---- frames, streaming, threads --------------------------------------------------------------


def noise(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that compress a little, as weights do (random floats, low bits zeroed)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n // 4, generator=g).view(torch.int32) & ~0xFFF
    return bytes(t.view(torch.uint8).numpy().tobytes())


def frames_of(data: bytes) -> list[tuple[int, int]]:
    """(compressed length, declared content size) of each frame of ``data``."""
    out = []
    pos = 0
    while pos < len(data):
        size = zstandard.frame_content_size(data[pos:])
        n = zstandard.ZstdDecompressor().decompressobj()
        n.decompress(data[pos:])
        length = len(data) - pos - len(n.unused_data)
        out.append((length, size))
        pos += length
    return out


def test_sink_writes_independent_frames_with_sizes_and_checksums() -> None:
    raw = noise(5 * (64 << 10) // 2)  # two and a half frames of 64 KiB
    buf = io.BytesIO()
    sink = zstd.ZstdSink(buf, frame=64 << 10)
    for i in range(0, len(raw), 50_000):  # writes that do not line up with frames
        sink.write(memoryview(raw)[i : i + 50_000])
    sink.close()
    data = buf.getvalue()
    frames = frames_of(data)
    assert [size for _, size in frames] == [64 << 10, 64 << 10, 32 << 10]
    pos = 0
    for length, _ in frames:
        assert zstandard.get_frame_parameters(data[pos:]).has_checksum
        pos += length
    # Any zstd reader reads the concatenation of frames.
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    assert reader.read() == raw
    assert zstd.decompress(data, "x") == raw


def test_inflater_streams_in_order_holding_a_few_frames() -> None:
    frame = 256 << 10
    raw = noise(24 << 20)
    buf = io.BytesIO()
    sink = zstd.ZstdSink(buf, frame=frame)
    sink.write(raw)
    sink.close()
    data = buf.getvalue()
    assert len(frames_of(data)) == 96
    out = bytearray(len(raw))  # allocated before tracing: the target, not a buffer
    at = [0]

    def consume(piece: memoryview) -> None:
        out[at[0] : at[0] + len(piece)] = piece
        at[0] += len(piece)

    inflater = zstd.Inflater(consume, "m.zst", limit=len(raw), window=3)

    def run() -> int:
        for i in range(0, len(data), 1 << 20):
            inflater.feed(memoryview(data)[i : i + (1 << 20)])
        return inflater.finish()

    got, peak = peak_bytes(run)
    assert got == len(raw)
    assert out == raw
    # Held at once: the piece being parsed (a frame's worth of input at most) and the
    # frames in flight (compressed and inflated), never the 24 MiB stream.
    bound = zstd.FRAME + (1 << 20) + 4 * 2 * frame
    assert inflater.peak <= bound, (inflater.peak, bound)
    assert peak < bound + (1 << 20), f"{peak} bytes allocated while inflating"


def test_inflater_streams_a_single_frame_file_of_earlier_versions_block_by_block() -> None:
    raw = noise(12 << 20, seed=1)
    buf = io.BytesIO()
    # The writer of earlier versions: one multi-threaded frame, no content size.
    cctx = zstandard.ZstdCompressor(level=1, threads=-1, write_checksum=True)
    with cctx.stream_writer(buf, closefd=False) as w:
        w.write(raw)
    data = buf.getvalue()
    assert zstandard.frame_content_size(data) == -1
    sizes: list[int] = []
    out = bytearray()

    def consume(piece: memoryview) -> None:
        sizes.append(len(piece))
        out.extend(piece)

    inflater = zstd.Inflater(consume, "old.zst", limit=len(raw))
    for i in range(0, len(data), 1 << 20):
        inflater.feed(memoryview(data)[i : i + (1 << 20)])
    assert inflater.finish() == len(raw)
    assert out == raw
    assert max(sizes) <= 2 << 20  # pieces of what a fed megabyte completes, not the file
    assert inflater.peak <= zstd.FRAME + (3 << 20)


def test_inflater_refuses_a_frame_whose_declared_size_passes_the_limit_before_inflating() -> None:
    data = zstandard.ZstdCompressor(level=1).compress(bytes(8 << 20))  # declares 8 MiB
    inflater = zstd.Inflater(lambda _: None, "m.zst", limit=1 << 20, why="its tensors can take")
    with pytest.raises(IntegrityError, match=r"inflates past the 1048576 bytes its tensors"):
        inflater.feed(data)
    assert inflater.out == 0  # nothing inflated


def test_inflater_refuses_a_frame_of_empty_blocks_that_never_ends() -> None:
    good = zstandard.ZstdCompressor(level=1).compress(b"abc")
    # Same header (3 bytes of content), then endless empty raw blocks: bounded, refused.
    header_len = 6  # magic, descriptor (single segment), 1-byte content size
    hostile = good[:header_len] + b"\x00\x00\x00" * 200_000
    inflater = zstd.Inflater(lambda _: None, "m.zst")
    with pytest.raises(IntegrityError, match="longer than its 3 bytes of content can take"):
        inflater.feed(hostile)
    assert inflater.peak < 2 * zstd.FRAME


def test_inflater_names_a_corrupt_frame() -> None:
    raw = noise(3 << 20, seed=2)
    buf = io.BytesIO()
    sink = zstd.ZstdSink(buf, frame=1 << 20)
    sink.write(raw)
    sink.close()
    data = bytearray(buf.getvalue())
    first, second, _ = frames_of(bytes(data))
    data[first[0] + second[0] // 2] ^= 0x55  # inside the second frame
    with pytest.raises(IntegrityError) as ei:
        zstd.decompress(data, "run/model.safetensors.zst")
    msg = str(ei.value)
    assert msg.startswith("run/model.safetensors.zst: zstd stream is corrupt (")
    assert f"frame at byte {first[0]})" in msg


def _forge(step_path: Path, name: str, data: bytes) -> None:
    """Replace a payload, forging its manifest entry (size, CRC and block CRCs) to match."""
    from _helpers import forge_manifest

    from ckptstore.integrity import BLOCK, crc32c_of, format_crc
    from ckptstore.sharded.chunks import block_crcs

    (step_path / name).write_bytes(data)

    def edit(doc: dict[str, Any]) -> None:
        entry = doc["files"][name]
        entry["bytes"] = len(data)
        entry["crc32c"] = format_crc(crc32c_of(data))
        if entry.get("blocks") is not None:
            entry["blocks"] = block_crcs(data, BLOCK)  # a file's blocks, not a chunk's

    manifest = step_path / "manifest.json"
    manifest.write_bytes(forge_manifest(manifest.read_bytes(), edit))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_restore_streams_compressed_payloads_through_a_bounded_buffer(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zstd, "FRAME", 1 << 20)
    monkeypatch.setattr(zstd, "THREADS", 2)  # a window of 3 frames in flight
    g = torch.Generator().manual_seed(3)
    # 40 MiB, barely compressible: the buffers are measured.
    w = torch.randn(10 << 20, generator=g)
    state = {"model": {"w": w, "b": torch.arange(7)}, "step": 3}
    root = tmp_path / "z"
    with CheckpointManager(root, format=fmt, compression="zstd") as mgr:
        mgr.save(3, state)
    ext = {"safetensors": ".safetensors", "torch": ".pt"}[fmt]
    path = root / step_dir(3) / f"model{ext}.zst"
    assert len(frames_of(path.read_bytes())) >= w.nbytes >> 20  # 1 MiB frames
    peaks: list[int] = []

    class Recorded(zstd.Inflater):
        def finish(self) -> int:
            n = super().finish()
            peaks.append(self.peak)
            return n

    monkeypatch.setattr(zstd, "Inflater", Recorded)
    target = {"model": {"w": torch.zeros_like(w), "b": torch.zeros(7, dtype=torch.int64)}}
    with CheckpointManager(root) as mgr:
        got, peak = peak_bytes(lambda: mgr.load(3))
    assert isinstance(got, dict), got
    assert_same(got["model"], state["model"])
    assert got["step"] == 3
    # The input being parsed (up to two frames) and the window of frames in flight (each
    # compressed and inflated), one more while a frame is handed over: 1 MiB frames.
    assert max(peaks) <= (2 + 2 * (3 + 1)) * (1 << 20) + (64 << 10), peaks
    # Streamed into the tensors, in both formats (a torch.save zip member by member): the
    # buffers read and inflated, not the 40 MiB file.
    assert peak < 30 << 20, f"load allocated {peak} bytes"
    with CheckpointManager(root) as mgr:
        mgr.restore(target, in_place=True)
    assert torch.equal(target["model"]["w"], w)
    target["model"]["w"].zero_()
    with CheckpointManager(root) as mgr:  # the default, checked restore streams too
        got, peak = peak_bytes(lambda: mgr.restore(target))
    assert got == 3, got
    assert peak < 30 << 20, f"restore allocated {peak} bytes"
    assert torch.equal(target["model"]["w"], w)


def test_corrupt_frame_is_found_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zstd, "FRAME", 1 << 20)
    root = tmp_path / "z"
    states = {s: {"model": {"w": torch.randn(1 << 20) + s}} for s in (1, 2)}
    with CheckpointManager(root, compression="zstd") as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    name = "model.safetensors.zst"
    data = bytearray((root / step_dir(2) / name).read_bytes())
    first = frames_of(bytes(data))[0][0]
    data[first + 5000] ^= 0x01  # inside the second frame; checksums forged to match
    _forge(root / step_dir(2), name, bytes(data))
    where = f"{root}/{step_dir(2)}/{name}"
    with CheckpointManager(root) as mgr:
        with pytest.raises(IntegrityError) as ei:
            mgr.load(2)
        assert str(ei.value).startswith(f"{where}: zstd stream is corrupt (")
        assert f"frame at byte {first})" in str(ei.value)
        fresh = {"model": {"w": torch.zeros(1 << 20)}}
        assert mgr.restore(fresh) == 1  # falls back to the step that verifies
        assert torch.equal(fresh["model"]["w"], states[1]["model"]["w"])


GOLDEN_ZSTD = Path(__file__).parent / "golden_zstd"


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_golden_zstd_stores_of_the_single_frame_writer_still_load(tmp_path: Path, fmt: str) -> None:
    import shutil

    old = tmp_path / "old"
    shutil.copytree(GOLDEN_ZSTD / f"v1-{fmt}-zstd", old)
    plain = tmp_path / "plain"
    shutil.copytree(Path(__file__).parent / "golden" / f"v1-{fmt}", plain)
    for p in (old / "step-000000001000").glob("*.zst"):
        data = p.read_bytes()
        assert zstandard.frame_content_size(data) == -1  # one streamed frame, no size
    with CheckpointManager(old) as a, CheckpointManager(plain) as b:
        assert a.verify(1000).ok
        assert_same(a.load(1000), b.load(1000))


def test_a_corrupt_compressed_block_is_refused_before_it_inflates(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(2 << 20, generator=g)  # 8 MiB: about two blocks compressed
    root = tmp_path / "z"
    with CheckpointManager(root, compression="zstd") as mgr:
        mgr.save(1, {"model": {"w": w}})
        entry = mgr.manifest(1).files["model.safetensors.zst"]
    assert entry.blocks is not None
    assert len(entry.blocks) == 2
    path = root / step_dir(1) / "model.safetensors.zst"
    data = bytearray(path.read_bytes())
    data[(4 << 20) + 100] ^= 0x04  # block 1: the manifest is left as it was
    path.write_bytes(bytes(data))
    fed: list[int] = []

    class Recorded(zstd.Inflater):
        def feed(self, data: bytes | bytearray | memoryview) -> None:
            fed.append(len(data))
            super().feed(data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zstd, "Inflater", Recorded)
        with CheckpointManager(root) as mgr, pytest.raises(IntegrityError) as ei:
            mgr.load(1)
    assert str(ei.value).startswith(
        f"{root}/{step_dir(1)}/model.safetensors.zst: block 1 (bytes {4 << 20}.."
    )
    assert sum(fed) <= 4 << 20  # only block 0 reached the decompressor


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_verify_and_broadcast_copies_stream_compressed_payloads(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.codec import payload
    from ckptstore.manifest import FileEntry

    monkeypatch.setattr(zstd, "FRAME", 1 << 20)
    monkeypatch.setattr(zstd, "THREADS", 2)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(5 << 20, generator=g)  # 20 MiB, barely compressible: several blocks
    root = tmp_path / "z"
    with CheckpointManager(root, format=fmt, compression="zstd") as mgr:
        mgr.save(1, {"model": {"w": w}})
    name = "model" + {"safetensors": ".safetensors", "torch": ".pt"}[fmt] + ".zst"
    path = root / step_dir(1) / name
    data = bytearray(path.read_bytes())
    assert len(data) > 16 << 20
    # verify: each block checked, inflated and its content checked as it streams by; the
    # whole-file path held the compressed file and the inflated one (~40 MiB).
    with CheckpointManager(root) as mgr:
        report, peak = peak_bytes(lambda: mgr.verify(1))
    assert report.ok, report.problems
    assert report.bytes_checked >= len(data)
    assert peak < 12 << 20, f"verify allocated {peak} bytes"
    # A broadcast copy (the whole compressed file, checked, in memory) inflates into the
    # target as it streams, not into a second, inflated copy.
    entry = FileEntry(bytes=len(data), crc32c=0, codec=fmt, compression="zstd")
    target = torch.zeros_like(w)
    got, peak = peak_bytes(lambda: payload.decode_bytes(data, entry, name, {"w": target}))
    assert isinstance(got, dict), got
    assert got["w"] is target
    assert torch.equal(target, w)
    assert peak < 12 << 20, f"decode_bytes allocated {peak} bytes"
    # Content that is wrong under a right checksum (forged): found by the streamed check.
    content = zstd.decompress(data, name)
    if fmt == "torch":
        content[len(content) // 2] ^= 0x10  # inside the storage: its zip CRC-32 fails
        expect = "fails its CRC-32 check"
    else:
        content = content[:-100]  # shorter than its header declares
        expect = "safetensors header declares"
    _forge(root / step_dir(1), name, compressed(bytes(content)))
    with CheckpointManager(root) as mgr:
        report = mgr.verify(1)
    assert not report.ok
    assert any(expect in p for p in report.problems), report.problems


def test_verify_refuses_a_multi_block_bomb_while_it_streams(tmp_path: Path) -> None:
    root = tmp_path / "z"
    with CheckpointManager(root, format="torch", compression="zstd") as mgr:
        mgr.save(1, {"model": {"w": torch.arange(1000.0)}})
    name = "model.pt.zst"
    content = zstd.decompress((root / step_dir(1) / name).read_bytes(), name)
    # The archive, a skippable frame of 5 MiB (several blocks: the streamed check), then a
    # frame of 1 GiB of zeros in ~32 KB: far past what 4 KB of tensors can take.
    skip = (0x184D2A50).to_bytes(4, "little") + (5 << 20).to_bytes(4, "little") + bytes(5 << 20)
    _forge(root / step_dir(1), name, compressed(bytes(content)) + skip + zeros_frame())
    with CheckpointManager(root) as mgr:
        report, peak = peak_bytes(lambda: mgr.verify(1))
    assert not report.ok
    assert any("inflates past" in p for p in report.problems), report.problems
    assert peak < 24 << 20, f"verify allocated {peak} bytes"


# ---- restores straight into the targets (issue 13) -------------------------------------------


def _mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and sizes: some span 64 KiB frames, some are empty."""
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(70_000, generator=g),  # 280 KB: five frames
        "bf16": torch.randn(300, 129, generator=g).to(torch.bfloat16),
        "f16": torch.randn(40_001, generator=g).to(torch.float16),
        "f64": torch.randn(9_999, generator=g).double(),
        "i64": torch.randint(-(2**62), 2**62, (20_000,), generator=g),
        "i8": torch.randint(-128, 127, (100_003,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 5, 7), generator=g, dtype=torch.uint8),
        "bool": torch.rand(65_537, generator=g) > 0.5,
        "empty": torch.empty(0),
        "empty2d": torch.empty(3, 0, dtype=torch.int32),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(
        a.numel() == 0
        or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_zstd_restore_is_byte_exact_into_the_targets(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zstd, "FRAME", 64 << 10)  # tensors span frame boundaries
    state = _mixed_state(5)
    root = tmp_path / "z"
    with CheckpointManager(root, format=fmt, compression="zstd") as mgr:
        mgr.save(1, {"model": state})
    ext = {"safetensors": ".safetensors", "torch": ".pt"}[fmt]
    assert len(frames_of((root / step_dir(1) / f"model{ext}.zst").read_bytes())) > 10
    # A module's buffers: restored into its own tensors (a plain dict's values are replaced).
    target = torch.nn.Module()
    for k, v in state.items():
        target.register_buffer(k, torch.full_like(v, 7) if v.dtype != torch.bool else ~v)
    same_objects = dict(target.named_buffers())
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": target}) == 1
    for k, v in state.items():
        got = getattr(target, k)
        assert got is same_objects[k], k
        assert _same_bytes(got, v), k


def _content_and_frames(fmt: str, state: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    from ckptstore.codec import payload

    buf = io.BytesIO()
    if fmt == "safetensors":
        st.write_safetensors(buf, state)
    else:
        from ckptstore.codec import torchzip

        torchzip.write_torch(buf, {k: payload._covering(v) for k, v in state.items()})
    content = buf.getvalue()
    return content, compressed(content)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_frame_failing_its_checksum_never_reaches_the_target(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.codec import payload
    from ckptstore.manifest import FileEntry

    monkeypatch.setattr(zstd, "FRAME", 64 << 10)
    w = torch.arange(200_000, dtype=torch.float32)  # 800 KB: 13 frames
    content, data = _content_and_frames(fmt, {"w": w})
    frames = frames_of(data)
    bad = 4
    at = sum(n for n, _ in frames[:bad])
    # The fifth frame's content checksum (its last 4 bytes) no longer matches: the bytes on
    # disk may carry a right CRC32C (forged, or bad before they were checksummed).
    forged = bytearray(data)
    forged[at + frames[bad][0] - 1] ^= 0xFF
    entry = FileEntry(bytes=len(forged), crc32c=0, codec=fmt, compression="zstd")
    target = torch.full_like(w, -1.0)
    with pytest.raises(IntegrityError, match=f"zstd stream is corrupt .*frame at byte {at}"):
        payload.decode_bytes(forged, entry, "m.zst", {"w": target}, limit=len(content) + 4096)
    # Where the bad frame's content lies in the tensor: none of it was written.
    start = content.find(w[:64].numpy().tobytes())  # the tensor's first bytes
    assert start > 0
    first_bad = (bad * (64 << 10) - start) // 4
    assert 0 < first_bad < w.numel()
    assert torch.equal(target[first_bad:], torch.full_like(w[first_bad:], -1.0))
    assert torch.equal(
        target[: first_bad - 16384], w[: first_bad - 16384]
    )  # earlier frames went in


@pytest.mark.parametrize("cut", [1, 4, 5000, 70_000])
def test_a_truncated_stream_is_refused(cut: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.codec import payload
    from ckptstore.manifest import FileEntry

    monkeypatch.setattr(zstd, "FRAME", 64 << 10)
    content, data = _content_and_frames("safetensors", {"w": torch.randn(50_000)})
    short = bytearray(data[:-cut])
    entry = FileEntry(bytes=len(short), crc32c=0, codec="safetensors", compression="zstd")
    with pytest.raises(IntegrityError, match=r"truncated|safetensors header declares"):
        payload.decode_bytes(short, entry, "m.zst", {}, limit=len(content) + 4096)


def test_inflater_takes_pieces_of_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # Frames split anywhere across the pieces fed: parsed in place where a piece holds
    # them whole, kept (copied) only where one runs into the next piece.
    monkeypatch.setattr(zstd, "FRAME", 64 << 10)
    raw = noise(384 << 10, seed=9)  # six frames
    data = compressed(raw)
    g = torch.Generator().manual_seed(1)
    for trial in range(4):
        out = bytearray()
        inflater = zstd.Inflater(out.extend, "m.zst", limit=len(raw))
        pos = 0
        while pos < len(data):
            n = int(torch.randint(1, [13, 300, 70_000, 400_000][trial], (1,), generator=g))
            inflater.feed(memoryview(data)[pos : pos + n])
            pos += n
        assert inflater.finish() == len(raw)
        assert out == raw, trial
        assert inflater.peak <= 2 * (64 << 10) + 4 * 2 * (70 << 10), inflater.peak


def _drop_block_crcs(step_path: Path, name: str) -> None:
    """Rewrite the manifest as writers before block CRCs did (the whole-file CRC only)."""
    from _helpers import forge_manifest

    manifest = step_path / "manifest.json"

    def edit(doc: dict[str, Any]) -> None:
        doc["files"][name].pop("blocks", None)

    manifest.write_bytes(forge_manifest(manifest.read_bytes(), edit))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_verify_streams_a_compressed_payload_without_block_crcs(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zstd, "FRAME", 1 << 20)
    monkeypatch.setattr(zstd, "THREADS", 2)
    w = torch.randn(5 << 20, generator=torch.Generator().manual_seed(4))  # 20 MiB
    root = tmp_path / "z"
    with CheckpointManager(root, format=fmt, compression="zstd") as mgr:
        mgr.save(1, {"model": {"w": w}})
    name = "model" + {"safetensors": ".safetensors", "torch": ".pt"}[fmt] + ".zst"
    step_path = root / step_dir(1)
    _drop_block_crcs(step_path, name)
    assert "blocks" not in json.loads((step_path / "manifest.json").read_bytes())["files"][name]
    # Read whole before, then inflated whole: ~40 MiB held. Now a few frames.
    with CheckpointManager(root) as mgr:
        report, peak = peak_bytes(lambda: mgr.verify(1))
    assert report.ok, report.problems
    assert report.bytes_checked >= (step_path / name).stat().st_size
    assert peak < 12 << 20, f"verify allocated {peak} bytes"
    # A flipped byte: reported as the checksum mismatch it is, whatever it did to the stream.
    data = bytearray((step_path / name).read_bytes())
    data[len(data) // 2] ^= 0x20
    (step_path / name).write_bytes(bytes(data))
    with CheckpointManager(root) as mgr:
        report = mgr.verify(1)
    assert not report.ok
    assert any("does not match the manifest's" in p and name in p for p in report.problems), (
        report.problems
    )
    assert not any("zstd stream" in p for p in report.problems), report.problems


@pytest.mark.parametrize(
    "command", [["export", "--hf"], ["export", "--dcp"], ["diff"]], ids=["hf", "dcp", "diff"]
)
def test_export_and_diff_inflate_a_payload_only_as_far_as_its_state_file_allows(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # A torch-format payload is not laid out as torch.save writes it (its first member is
    # not data.pkl), so it is inflated whole, and 1 GiB of zeros follows its content.
    # Export and diff read it through StepTensors, which inflated it without a bound.
    root = tmp_path / "z"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root, format="torch", compression="zstd") as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    name = "model.pt.zst"
    path = root / step_dir(2) / name
    pt = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(pt)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in sorted(src.infolist(), key=lambda i: not i.filename.endswith("data.pkl")):
            dst.writestr(info, src.read(info))  # data.pkl last
    bomb = zstandard.ZstdCompressor(level=1).compress(out.getvalue()) + zeros_frame()
    replace_payload(root / step_dir(2), name, bomb)
    argv = (
        [command[0], str(root), "1", "2"]
        if command == ["diff"]
        else [*command[:1], str(root), "--step", "2", *command[1:], str(tmp_path / "out")]
    )
    code, peak = peak_bytes(lambda: cli_mod.main(argv))
    assert code == 1
    assert peak < 64 << 20, f"{command}: {peak} bytes"
    err = capsys.readouterr().err
    assert f"{path}: zstd stream inflates past the " in err
    assert "its tensors in the state file can take" in err
    assert not (tmp_path / "out").exists()


def _claims_32_tib(fmt: str, compressed: bool) -> bytes:
    """A payload file that declares a 32 TiB tensor in its first bytes: a safetensors
    header (the content then 1 GiB of zeros), or a torch.save zip whose data.pkl says its
    storage holds 2**43 floats (the storage itself 280 KB)."""
    if fmt == "safetensors":
        n = 1 << 43
        hdr = json.dumps({"weight": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
        head = hdr.encode() + b" " * (-(8 + len(hdr)) % 8)
        return zstandard.ZstdCompressor().compress(len(head).to_bytes(8, "little") + head)
    buf = io.BytesIO()
    torch.save({"weight": torch.zeros(70_000)}, buf)
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        for info in z.infolist():
            data, rel = z.read(info), info.filename.split("/", 1)[1]
            if rel == "data.pkl":  # the storage's size (its first BININT 70000): LONG1 2**43
                old = b"J" + (70_000).to_bytes(4, "little")
                assert data.count(old) == 2  # the storage's size, then the tensor's shape
                data = data.replace(old, b"\x8a\x06" + (1 << 43).to_bytes(6, "little"), 1)
            if rel != ".data/serialization_id":
                writer.write_record(rel, data, len(data))
    writer.write_end_of_file()
    del writer
    return zstandard.ZstdCompressor().compress(out.getvalue()) if compressed else out.getvalue()


@pytest.mark.parametrize(
    ("fmt", "compression", "said"),
    [
        ("safetensors", "zstd", "zstd stream inflates past the "),
        ("torch", "zstd", "data.pkl declares storages of 35184372088832 bytes, past the "),
        ("torch", None, "storage 'data/0' holds 280000 bytes, data.pkl says 35184372088832"),
    ],
    ids=["safetensors-zstd", "torch-zstd", "torch"],
)
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_size_a_payload_declares_is_checked_before_it_is_allocated(  # noqa: PLR0917
    tmp_path: Path,
    fmt: str,
    compression: str | None,
    said: str,
    where: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by review: the size declared by a compressed safetensors header or by data.pkl
    # was allocated before it was compared with anything, so the allocator raised a bare
    # RuntimeError. A local restore caught it as a malformed state.json node; on an
    # object store (payloads decoded on read threads) restore raised it and never fell
    # back to step 1.
    root = tmp_path / "z"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root, format=fmt, compression=compression) as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    name = "model" + {"safetensors": ".safetensors", "torch": ".pt"}[fmt]
    name += ".zst" if compression else ""
    replace_payload(root / step_dir(2), name, _claims_32_tib(fmt, compression is not None))
    view = local_view(root) if where == "local" else memory_view()
    if where == "memory":
        for rel, data in local_view(root).files().items():
            view.write(rel, data)
    try:
        with CheckpointManager(view.url, keep=None) as mgr:
            with pytest.raises(IntegrityError) as ei:
                mgr.load(2)
            assert f"{name}: " in str(ei.value)
            assert said in str(ei.value)
            fresh = fresh_like(states[1])
            with caplog.at_level(logging.WARNING, logger="ckptstore"):
                assert mgr.restore(fresh) == 1
            assert_same(dict(fresh["model"].state_dict()), dict(states[1]["model"].state_dict()))
            assert any(
                "step 2" in r.getMessage() and said in r.getMessage() for r in caplog.records
            )
    finally:
        drop_memory(view)


def test_a_stream_of_many_tiny_frames_is_refused_early() -> None:
    # Found by review: a million empty frames (9 bytes each) after the real ones are a valid
    # stream of the same content, and inflating it took 52 s for a 10 MB file: each frame
    # went through a worker thread. ckptstore writes at most one frame of under 64 KiB (its
    # last); up to 16 are taken, the 17th is refused.
    empty = zstandard.ZstdCompressor(write_content_size=True).compress(b"")
    skip = (0x184D2A50).to_bytes(4, "little") + (0).to_bytes(4, "little")
    parts = [TEXT[i : i + 1000] for i in range(0, len(TEXT), 1000)]  # 23 frames of 1000
    small = [zstandard.ZstdCompressor(write_content_size=True).compress(p) for p in parts]
    nofcs = [zstandard.ZstdCompressor(write_content_size=False).compress(p) for p in parts]
    assert zstd.decompress(b"".join(small[:15]) + empty, "m.zst") == b"".join(parts[:15])
    for tail, what in (
        (empty * 100_000, "empty frames"),
        (skip * 100_000, "skippable frames"),
        (b"".join(small), "frames of 1000 bytes"),
        (b"".join(nofcs), "frames that declare no size"),
    ):
        stream = compressed(TEXT) + tail
        with pytest.raises(IntegrityError) as ei:
            zstd.decompress(stream, "m.zst")
        assert "17 frames of under 64 KiB by byte " in str(ei.value), what
        assert str(ei.value).startswith("m.zst: zstd stream is corrupt ("), what


def test_restore_falls_back_from_a_stream_of_many_empty_frames(tmp_path: Path) -> None:
    root = tmp_path / "z"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root, compression="zstd") as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    name = "model.safetensors.zst"
    path = root / step_dir(2) / name
    empty = zstandard.ZstdCompressor(write_content_size=True).compress(b"")
    _forge(root / step_dir(2), name, path.read_bytes() + empty * 1_000_000)
    with CheckpointManager(root, keep=None) as mgr:
        with pytest.raises(IntegrityError, match="frames of under 64 KiB"):
            mgr.load(2)
        fresh = fresh_like(states[1])
        assert mgr.restore(fresh) == 1
        assert_same(dict(fresh["model"].state_dict()), dict(states[1]["model"].state_dict()))
        assert not mgr.verify(2).ok


def test_a_forked_child_loads_and_saves_zstd_steps(tmp_path: Path) -> None:
    """A DataLoader worker (a forked child) of a process that had decoded a zstd step: the
    frame pool's idle count came along without its threads, frames were queued for no
    thread, and every zstd load or save of the child hung (found by review)."""
    w = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: 3 frames, through the pool
    root = tmp_path / "s"
    with CheckpointManager(root, compression="zstd") as mgr:
        mgr.save(1, {"w": w})
        mgr.load(1)  # the pool's threads exist now
    want = w.numpy().tobytes()

    def child() -> None:
        torch.set_num_threads(1)  # as a DataLoader worker: no OpenMP region after the fork
        got = CheckpointManager(root).load(1)["w"]
        assert got.numpy().tobytes() == want
        with CheckpointManager(tmp_path / "child", compression="zstd") as m:
            m.save(1, {"w": got})

    assert run_forked(child, 60, "the forked child hung on the zstd frame pool") == 0
    with CheckpointManager(tmp_path / "child") as m:
        assert torch.equal(m.load(1)["w"], w)

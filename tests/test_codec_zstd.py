"""ckptstore.codec.zstd: standard zstd frames, checksummed on disk, strict on the way back."""

from __future__ import annotations

import io
import json
from pathlib import Path

import crc32c
import pytest
import torch
import zstandard

from ckptstore import CheckpointManager, IntegrityError
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

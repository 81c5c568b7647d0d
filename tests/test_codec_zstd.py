"""ckptstore.codec.zstd: standard zstd frames, checksummed on disk, strict on the way back."""

from __future__ import annotations

import io
import json
import logging
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import zstandard
from _helpers import assert_same, fresh_like, make_state, plant_zstd_bomb, step_dir, zeros_frame

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
    err, peak = peak_bytes(
        lambda: zstd.decompress(compressed(raw) + zeros_frame(), where, declared=declared)
    )
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

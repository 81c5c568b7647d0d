"""Single-file helpers: ``atomic_save`` and ``verify_file``."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from _helpers import deflated

from ckptstore import atomic_save, verify_file

VALUE = 1.2345


def payload(n: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), VALUE), "step": torch.tensor(7)}


def others(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p != path)


def test_atomic_save_writes_a_loadable_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.pt"
    atomic_save(payload(), target)
    loaded = torch.load(target, weights_only=True)
    assert torch.equal(loaded["w"], payload()["w"])
    atomic_save({"w": torch.zeros(2)}, str(target))  # replaces, str paths too
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.zeros(2))
    assert others(target) == []
    assert verify_file(target).ok


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_failed_save_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type[BaseException]
) -> None:
    target = tmp_path / "ckpt.pt"
    atomic_save(payload(), target)
    old = target.read_bytes()
    real_save = torch.save

    def half_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])  # half of it reaches the file
        f.flush()
        raise exc("interrupted")

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(exc):
        atomic_save({"w": torch.zeros(10_000)}, target)
    assert target.read_bytes() == old, "the target holds the old file, whole"
    assert others(target) == [], "no temporary file is left behind"


def test_failed_first_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(OSError, match="No space"):
        atomic_save(payload(), tmp_path / "new.pt")
    assert list(tmp_path.iterdir()) == []


def test_readers_never_see_a_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ckpt.pt"
    atomic_save(payload(), target)
    seen: list[bool] = []
    real_save = torch.save

    def observing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        f.flush()
        # Mid-save, the target is still the old, complete file.
        seen.append(verify_file(target).ok)
        seen.append(torch.equal(torch.load(target, weights_only=True)["w"], payload()["w"]))

    monkeypatch.setattr(torch, "save", observing_save)
    atomic_save({"w": torch.ones(3)}, target)
    assert seen == [True, True]
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))


# ---- verify_file ------------------------------------------------------------------------


def data_offset(raw: bytes) -> int:
    """Where the tensor bytes of ``payload()`` start in a file."""
    i = raw.find(struct.pack("<f", VALUE) * 16)
    assert i > 0
    return i


@pytest.fixture(params=["pt", "safetensors"])
def good_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "pt":
        path = tmp_path / "model.pt"
        torch.save(payload(), path)
    else:
        path = tmp_path / "model.safetensors"
        safetensors.torch.save_file(payload(), path)
    return path


def test_verify_file_accepts_good_files(good_file: Path) -> None:
    for deep in (True, False):
        report = verify_file(good_file, deep=deep)
        assert report.ok, report.problems
        assert report.files == 1
    assert verify_file(good_file).bytes_checked == good_file.stat().st_size


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_verify_file_detects_truncation(good_file: Path, keep: float) -> None:
    raw = good_file.read_bytes()
    good_file.write_bytes(raw[: int(len(raw) * keep)])
    for deep in (True, False):
        report = verify_file(good_file, deep=deep)
        assert not report.ok
        assert str(good_file) in report.problems[0]


def test_verify_file_flipped_byte_in_tensor_data_pt(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(payload(), path)
    raw = bytearray(path.read_bytes())
    raw[data_offset(bytes(raw)) + 100] ^= 0x01
    path.write_bytes(bytes(raw))
    # torch.load itself does not notice ...
    assert not torch.equal(torch.load(path, weights_only=True)["w"], payload()["w"])
    # ... the quick check (central directory) neither; the deep one checks member CRCs.
    assert verify_file(path, deep=False).ok
    report = verify_file(path)
    assert not report.ok
    assert "CRC" in report.problems[0]


def test_verify_file_flipped_byte_in_safetensors_header(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(payload(), path)
    raw = bytearray(path.read_bytes())
    raw[raw.find(b'"shape"') + 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    report = verify_file(path)
    assert not report.ok
    assert str(path) in report.problems[0]


def test_verify_file_rejects_non_regular_files(tmp_path: Path) -> None:
    report = verify_file(tmp_path)
    assert not report.ok
    assert "not a regular file" in report.problems[0]
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    report = verify_file(fifo)  # must not block opening it
    assert not report.ok
    assert "not a regular file" in report.problems[0]
    missing = verify_file(tmp_path / "absent.pt")
    assert not missing.ok
    assert "absent.pt" in missing.problems[0]


def test_verify_file_rejects_garbage(tmp_path: Path) -> None:
    for name, data in [("a.pt", b"not a zip at all"), ("b.safetensors", b"\xff" * 64), ("c", b"")]:
        path = tmp_path / name
        path.write_bytes(data)
        assert not verify_file(path).ok, name


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (MARKER,))


MARKER = ""


def test_verify_file_never_unpickles(tmp_path: Path) -> None:
    global MARKER
    MARKER = str(tmp_path / "pwned")
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("evil/data.pkl", pickle.dumps(_Evil()))
        zf.writestr("evil/version", "3\n")
    report = verify_file(path)
    assert report.ok  # structurally fine: a torch zip with valid member CRCs
    assert not os.path.exists(MARKER), "verify_file must never unpickle"


def test_verify_file_refuses_a_compressed_member_without_inflating_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.pt"
    buf = io.BytesIO()
    torch.save(payload(1 << 20), buf)  # 4 MiB of one value: a few kB deflated
    path.write_bytes(deflated(buf.getvalue()))
    assert path.stat().st_size < 64 << 10

    def no_inflating(*args: Any) -> Any:
        raise AssertionError("a zip member was inflated")

    monkeypatch.setattr(zipfile, "_get_decompressor", no_inflating)
    for deep in (True, False):
        report = verify_file(path, deep=deep)
        assert not report.ok
        assert len(report.problems) == 1
        assert report.problems[0].startswith(
            f"{path}: zip member 'archive/data.pkl' is compressed (deflate, "
        )

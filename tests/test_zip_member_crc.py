"""Restores and loads of ``format="torch"`` payloads check every zip member's CRC-32.

``torch.load`` never checks the CRC-32 a zip stores per member, and the manifest's CRC32C
covers the file as written: a writer that checksums what it wrote, or an attacker who
re-signs the manifest, leaves a member whose bytes contradict the archive's own CRC-32.
``verify`` fails such a step; restores and loads must refuse it too (review s39 #3), on
every path: uncompressed files read whole (one block) or streamed block by block, an old
manifest's large file without block CRCs (read whole, ``torch.load``), and zstd payloads
(inflated and followed front to back), in place or not, whole or ``keys=``.
"""

from __future__ import annotations

import io
import logging
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import assert_same, edit_entry, fresh_like, make_state, step_dir

from ckptstore import CheckpointManager, IntegrityError
from ckptstore.codec import torchzip, zipstream
from ckptstore.codec import zstd as zstd_codec
from ckptstore.integrity import BLOCK, crc32c_of, format_crc


def saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def flip_member(data: bytes, which: str) -> tuple[bytes, str]:
    """``data`` with one byte flipped in the middle of a member: the largest storage
    (``which="storage"``) or ``data.pkl``; and that member's name."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = zf.infolist()
    if which == "storage":
        info = max((i for i in infos if "/data/" in i.filename), key=lambda i: i.file_size)
    else:
        info = next(i for i in infos if i.filename.endswith("/data.pkl"))
    lho = info.header_offset
    nlen, xlen = struct.unpack("<HH", data[lho + 26 : lho + 30])
    out = bytearray(data)
    out[lho + 30 + nlen + xlen + info.file_size // 2] ^= 0x10
    return bytes(out), info.filename


def resign(step: Path, name: str, data: bytes, *, blocks: bool = True) -> None:
    """Replace a file of a step and re-sign its manifest row: size, CRC32C, block CRCs
    (dropped with ``blocks=False``: an older manifest's row)."""
    (step / name).write_bytes(data)

    def fix(row: dict[str, Any]) -> None:
        row.update(bytes=len(data), crc32c=format_crc(crc32c_of(data)))
        if blocks and len(data) > BLOCK:
            row["blocks"] = [crc32c_of(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]
        else:
            row.pop("blocks", None)

    edit_entry(step, name, fix)


def compressed(content: bytes | bytearray) -> bytes:
    buf = io.BytesIO()
    sink = zstd_codec.ZstdSink(buf)
    sink.write(content)
    sink.close()
    return buf.getvalue()


def state(seed: int, big: bool) -> dict[str, Any]:
    s = make_state(seed)
    if big:  # 6 MB of random floats: its file is over a block, compressed or not
        s["big"] = {"w": torch.randn(1_500_000, generator=torch.Generator().manual_seed(seed))}
    return s


def forged_store(tmp_path: Path, *, zstd: bool, big: bool, which: str, blocks: bool = True) -> Any:
    """Steps 1 and 2; in step 2 one member of a payload flipped and the manifest re-signed.

    Returns (root, states, the file's path, the member's name).
    """
    root = tmp_path / "s"
    states = {s: state(s, big) for s in (1, 2)}
    kw: dict[str, Any] = {"format": "torch"}
    if zstd:
        kw["compression"] = "zstd"
    with CheckpointManager(root, **kw) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    step = root / step_dir(2)
    name = ("big" if big else "model") + ".pt" + (".zst" if zstd else "")
    raw = (step / name).read_bytes()
    if zstd:
        content = zstd_codec.decompress(raw, name)
        flipped, member = flip_member(bytes(content), which)
        forged = compressed(flipped)
    else:
        forged, member = flip_member(raw, which)
    assert (len(forged) > BLOCK) == big  # the path under test: streamed, or read whole
    resign(step, name, forged, blocks=blocks)
    return root, states, step / name, member


#: (zstd, big, block CRCs): each path a restore reads a ``.pt`` payload by.
CASES = [
    pytest.param((False, False, True), id="pt-one-block"),  # read whole, then decoded
    pytest.param((False, True, True), id="pt-streamed"),  # decoded block by block
    pytest.param((False, True, False), id="pt-no-block-crcs"),  # read whole, torch.load
    pytest.param((True, False, True), id="zst-one-block"),
    pytest.param((True, True, True), id="zst-streamed"),
]


@pytest.mark.parametrize("which", ["storage", "data.pkl"])
@pytest.mark.parametrize("case", CASES)
def test_a_member_failing_its_crc_is_refused_and_restore_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: tuple[bool, bool, bool], which: str
) -> None:
    zstd, big, blocks = case
    root, states, path, member = forged_store(
        tmp_path, zstd=zstd, big=big, which=which, blocks=blocks
    )
    msg = f"{path}: zip member {member!r} fails its CRC-32 check"
    entry = "big" if big else "model"
    with CheckpointManager(root) as mgr:
        # verify and restore agree: the step is bad, for the same reason.
        assert mgr.verify(2).problems == [msg]
        for in_place in (None, False, True):
            kw = {} if in_place is None else {"in_place": in_place}
            with pytest.raises(IntegrityError) as ei:
                mgr.restore(state(7, big), step=2, **kw)
            assert str(ei.value) == msg, in_place
            fresh = state(7, big)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="ckptstore"):
                assert mgr.restore(fresh, **kw) == 1, in_place
            assert any(msg in r.getMessage() for r in caplog.records), in_place
            assert_same(dict(fresh["model"].state_dict()), dict(states[1]["model"].state_dict()))
            if big:
                assert_same(fresh["big"], states[1]["big"])
        for keys in (None, [entry]):
            with pytest.raises(IntegrityError) as ei:
                mgr.load(step=2, keys=keys)
            assert str(ei.value) == msg, keys
            got = mgr.load(keys=keys)  # the newest that loads
            assert_same(got[entry], states[1][entry] if big else states[1]["model"].state_dict())


# ---- the decoders, on their own --------------------------------------------------------------


def test_stream_decoder_checks_each_member_in_any_slicing() -> None:
    data = saved({"a": torch.arange(1000.0), "c": torch.randn(50_000)})
    flipped, member = flip_member(data, "storage")

    def decode(piece: int) -> None:
        dec = zipstream.StreamDecoder.from_buffer(flipped, "f.pt", None)
        assert dec is not None
        for o in range(0, len(flipped), piece):
            dec(o, memoryview(flipped)[o : o + piece])
        dec.result()

    for piece in (1, 7, 4096, 1 << 30):
        with pytest.raises(IntegrityError) as ei:
            decode(piece)
        assert str(ei.value) == f"f.pt: zip member {member!r} fails its CRC-32 check"
    # And the whole-archive path (torch.load) checks them the same way first.
    with pytest.raises(IntegrityError) as ei:
        torchzip.load_tensor_dict(flipped, "f.pt")
    assert str(ei.value) == f"f.pt: zip member {member!r} fails its CRC-32 check"


def central_entry(data: bytes, member: str) -> int:
    """The offset of ``member``'s central directory entry in a zip."""
    at = data.rfind(b"PK\x05\x06")
    _, _, _, _, count, _, cd_off, _ = struct.unpack("<IHHHHIIH", data[at : at + 22])
    pos = cd_off
    for _ in range(count):
        nlen, xlen, clen = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        if data[pos + 46 : pos + 46 + nlen].decode() == member:
            return pos
        pos += 46 + nlen + xlen + clen
    raise AssertionError(member)


def test_sequential_decoder_checks_the_data_and_the_directory() -> None:
    data = saved({"a": torch.arange(1000.0), "c": torch.randn(50_000)})

    def decode(content: bytes) -> None:
        dec = zipstream.SequentialDecoder("f.pt", None)
        for o in range(0, len(content), 4096):
            dec(o, memoryview(content)[o : o + 4096])
        dec.result()

    decode(data)
    flipped, member = flip_member(data, "storage")
    with pytest.raises(IntegrityError) as ei:
        decode(flipped)  # the bytes disagree with their data descriptor
    assert str(ei.value) == f"f.pt: zip member {member!r} fails its CRC-32 check"
    # Descriptor and bytes agree; the central directory gives another CRC-32.
    forged = bytearray(data)
    pos = central_entry(data, member)
    (crc,) = struct.unpack("<I", forged[pos + 16 : pos + 20])
    forged[pos + 16 : pos + 20] = struct.pack("<I", crc ^ 1)
    with pytest.raises(IntegrityError) as ei:
        decode(bytes(forged))
    assert str(ei.value) == f"f.pt: zip member {member!r} fails its CRC-32 check"
    with pytest.raises(IntegrityError, match="fails its CRC-32 check"):
        torchzip.check_zip(bytes(forged), "f.pt", deep=True)  # as verify says


def forge_end(data: bytearray, how: str) -> None:
    """Edit the end records of a ``torch.save`` zip (a zip64 end record, its locator, the
    end record: torch.save writes all three, back to back)."""
    eocd = data.rfind(b"PK\x05\x06")
    loc = eocd - 20
    rec = loc - 56
    assert data[loc : loc + 4] == b"PK\x06\x07"
    assert data[rec : rec + 4] == b"PK\x06\x06"
    if how == "locator-disks":  # "disk 0 of 256": zipfile refuses multi-disk archives
        data[loc + 16 : loc + 20] = struct.pack("<I", 256)
    elif how == "zip64-directory-offset":  # zipfile takes the zip64 record's values
        data[rec + 48 : rec + 56] = struct.pack("<Q", 1 << 40)
    else:  # no locator: zipfile looks for the directory right before the end record
        data[loc : loc + 4] = b"\x00" * 4


@pytest.mark.parametrize("how", ["locator-disks", "zip64-directory-offset", "locator-signature"])
def test_end_records_zipfile_refuses_are_refused_by_restore_as_by_verify(
    tmp_path: Path, how: str
) -> None:
    """``verify`` reads a payload's directory with ``zipfile``; a restore streamed it by
    its own reading of the end records, which ignored these edits, and loaded the step."""
    root = tmp_path / "s"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root, format="torch") as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    step = root / step_dir(2)
    data = bytearray((step / "model.pt").read_bytes())
    forge_end(data, how)
    resign(step, "model.pt", bytes(data))
    assert zipstream.StreamDecoder.from_buffer(data, "m.pt", None) is None  # read it whole
    with CheckpointManager(root) as mgr:
        (problem,) = mgr.verify(2).problems
        assert problem.startswith(f"{step / 'model.pt'}: ")
        with pytest.raises(IntegrityError) as ei:
            mgr.restore(fresh_like(states[1]), step=2)
        assert str(ei.value) == problem
        with pytest.raises(IntegrityError) as ei:
            mgr.load(step=2)
        assert str(ei.value) == problem
        fresh = fresh_like(states[1])
        assert mgr.restore(fresh) == 1
        assert_same(dict(fresh["model"].state_dict()), dict(states[1]["model"].state_dict()))

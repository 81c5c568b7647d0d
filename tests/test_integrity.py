"""ckptstore.integrity: CRC32C per block and whole, combined; block checks before use."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import MANIFEST, step_dir

from ckptstore import CheckpointManager, FileEntry, IntegrityError
from ckptstore.integrity import (
    BLOCK,
    BlockCRC,
    CRCWriter,
    SubBlocks,
    check_blocks,
    crc32c_combine,
    crc32c_of,
)
from ckptstore.storage import LocalStorage


@pytest.mark.parametrize(("la", "lb"), [(0, 0), (0, 7), (7, 0), (1, 1), (13, 4099), (BLOCK, 3)])
def test_combine_equals_the_crc_of_the_concatenation(la: int, lb: int) -> None:
    a, b = os.urandom(la), os.urandom(lb)
    assert crc32c_combine(crc32c_of(a), crc32c_of(b), lb) == crc32c_of(a + b)


def test_combine_is_exact_for_any_length_and_associative() -> None:
    # Shifts by each power of two of the length, composed: lengths with many bits set, a
    # block and a byte either side, and lengths far past any file (checked by associativity).
    for lb in (255, 256, 257, (1 << 18) - 1, 1 << 18, (1 << 18) + 1, 3_333_333, 9_999_991):
        a, b = os.urandom(100), os.urandom(lb)
        assert crc32c_combine(crc32c_of(a), crc32c_of(b), lb) == crc32c_of(a + b), lb
    c = crc32c_of(b"x")
    huge = (1 << 40) + 12_345
    split = crc32c_combine(crc32c_combine(c, 0, 1 << 40), 0, 12_345)
    assert crc32c_combine(c, 0, huge) == split
    assert crc32c_combine(c, 7, 0) == c


@pytest.mark.parametrize("sub_block", [1000, 1 << 18, 3 * BLOCK])
def test_sub_blocks_come_from_the_same_pass_as_the_file_blocks(sub_block: int) -> None:
    # A tensor in the middle of a file, fed in pieces that straddle both grids: the file's
    # block CRCs and whole CRC are those of a plain pass, the tensor's those of its bytes.
    head, tensor, tail = os.urandom(12_345), os.urandom(2 * BLOCK + 777), os.urandom(99)
    plain, mixed = BlockCRC(), BlockCRC()
    plain.update(head + tensor + tail)
    mixed.update(head)
    sub = SubBlocks(sub_block)
    for i in range(0, len(tensor), 1_000_003):
        mixed.update(tensor[i : i + 1_000_003], sub)
    mixed.update(tail)
    assert (mixed.crc, mixed.block_crcs(), mixed.nbytes) == (
        plain.crc,
        plain.block_crcs(),
        plain.nbytes,
    )
    want = [crc32c_of(tensor[i : i + sub_block]) for i in range(0, len(tensor), sub_block)]
    assert sub.nbytes == len(tensor)
    assert sub.close() == want
    assert SubBlocks(sub_block).close() == []  # an empty tensor has no blocks


def test_two_stretches_get_their_blocks_from_the_same_pass() -> None:
    # An object store's part (a grid of its own over the whole stream) and a tensor's blocks
    # at once: pieces cut at three grids, each byte hashed once.
    head, tensor = os.urandom(3_333), os.urandom(3 * BLOCK + 5)
    data = head + tensor
    plain, mixed = BlockCRC(), BlockCRC()
    plain.update(data)
    part, sub = SubBlocks(5_000_011), SubBlocks(1 << 18)
    mixed.update(head, part)
    for i in range(0, len(tensor), 999_999):
        mixed.update(tensor[i : i + 999_999], (sub, part))
    assert (mixed.crc, mixed.block_crcs()) == (plain.crc, plain.block_crcs())
    assert part.close() == [
        crc32c_of(data[i : i + 5_000_011]) for i in range(0, len(data), 5_000_011)
    ]
    assert sub.close() == [
        crc32c_of(tensor[i : i + (1 << 18)]) for i in range(0, len(tensor), 1 << 18)
    ]


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
@pytest.mark.parametrize("piece", [1 << 20, 3 * BLOCK + 5, 999_983])
def test_block_crc_splits_at_block_boundaries(size: int, piece: int) -> None:
    data = os.urandom(size)
    s = BlockCRC()
    for i in range(0, size, piece):
        s.update(data[i : i + piece])
    assert s.nbytes == size
    assert s.crc == crc32c_of(data)
    want = [crc32c_of(data[i : i + BLOCK]) for i in range(0, size, BLOCK)]
    assert s.block_crcs() == (tuple(want) if size > BLOCK else None)


def test_crc_writer_records_blocks(tmp_path: Path) -> None:
    data = os.urandom(2 * BLOCK + 100)
    with open(tmp_path / "f", "wb") as f:
        w = CRCWriter(f)
        w.write(data[:5])
        w.write(data[5:])
    assert (tmp_path / "f").read_bytes() == data
    assert w.crc == crc32c_of(data)
    assert w.blocks == tuple(crc32c_of(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK))


def entry_of(data: bytes) -> FileEntry:
    blocks = tuple(crc32c_of(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK))
    return FileEntry(len(data), crc32c_of(data), "safetensors", blocks=blocks)


def test_check_blocks_checks_whole_blocks_only() -> None:
    data = os.urandom(3 * BLOCK + 10)
    e = entry_of(data)
    assert check_blocks(e, 0, data, "f") == len(data)
    assert check_blocks(e, BLOCK, data[BLOCK : 2 * BLOCK + 7], "f") == BLOCK  # a partial one
    assert check_blocks(e, 3 * BLOCK, data[3 * BLOCK :], "f") == 10  # the short last block
    assert check_blocks(e, 0, data[: BLOCK - 1], "f") == 0
    bad = bytearray(data)
    bad[2 * BLOCK + 5] ^= 1
    assert check_blocks(e, 0, bad[: 2 * BLOCK], "f") == 2 * BLOCK  # before the bad block
    with pytest.raises(IntegrityError) as ei:
        check_blocks(e, 0, bad, "run/step-1/model.safetensors")
    msg = str(ei.value)
    assert "run/step-1/model.safetensors" in msg
    assert f"block 2 (bytes {2 * BLOCK}..{3 * BLOCK})" in msg
    assert "crc32c" in msg
    with pytest.raises(IntegrityError, match="run past the end"):
        check_blocks(e, 3 * BLOCK, data[3 * BLOCK :] + b"x", "f")
    with pytest.raises(ValueError, match="block-aligned"):
        check_blocks(e, 5, data[5:], "f")
    with pytest.raises(ValueError, match="no block CRCs"):
        check_blocks(FileEntry(10, 0, "json"), 0, b"0123456789", "f")


# ---- what a save writes, and what a read checks ----------------------------------------------


def saved_big(root: Path, nbytes: int = 3 * BLOCK + 1000) -> torch.Tensor:
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": x, "small": torch.ones(3)})
    return x


@pytest.mark.parametrize("direct_io", [True, False])
def test_save_records_the_blocks_of_every_large_file(tmp_path: Path, direct_io: bool) -> None:
    x = torch.randint(0, 255, (3 * BLOCK + 1000,), dtype=torch.uint8)
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        assert isinstance(mgr.storage, LocalStorage)
        mgr.storage.direct_io = direct_io
        mgr.save(1, {"x": x, "small": torch.ones(3)})
    doc = json.loads((root / step_dir(1) / MANIFEST).read_text())
    large = [n for n, e in doc["files"].items() if e["bytes"] > BLOCK]
    assert large == ["x.safetensors"]
    for name, e in doc["files"].items():
        data = (root / step_dir(1) / name).read_bytes()
        if e["bytes"] > BLOCK:
            assert e["blocks"] == [
                crc32c_of(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)
            ]
        else:
            assert "blocks" not in e  # one block: its crc32c is its block's


def test_stream_passes_on_no_byte_of_a_corrupt_block(tmp_path: Path) -> None:
    root = tmp_path / "s"
    saved_big(root)
    path = root / step_dir(1) / "x.safetensors"
    data = bytearray(path.read_bytes())
    data[2 * BLOCK + 3] ^= 0x10
    path.write_bytes(bytes(data))
    storage = LocalStorage(str(root))
    entry = storage.read_manifest(1).files["x.safetensors"]
    seen: list[tuple[int, int]] = []

    def consume(offset: int, chunk: memoryview) -> None:
        seen.append((offset, len(chunk)))

    with pytest.raises(IntegrityError) as ei:
        storage.stream_file(1, "x.safetensors", entry, consume)
    assert str(path) in str(ei.value)
    assert "block 2 " in str(ei.value)
    # Nothing of the bad block or after it went through (the local reader checks a whole
    # 32 MB slice before passing any of it on, so here nothing did).
    assert all(o + n <= 2 * BLOCK for o, n in seen)


def test_blocks_arriving_in_odd_pieces_are_gathered_then_checked(tmp_path: Path) -> None:
    # The generic base-class reader (object stores) reads unaligned pieces.
    root = tmp_path / "s"
    x = saved_big(root)
    storage = LocalStorage(str(root))
    entry = storage.read_manifest(1).files["x.safetensors"]
    pieces: list[tuple[int, int]] = []
    got = bytearray()

    def odd_stream(
        rel: str, consume: Any, *, crc: bool = True, pace: Any = None
    ) -> tuple[int, int]:
        data = (root / rel).read_bytes()
        pos = 0
        for k, n in enumerate([1, 4097, BLOCK, 3 * BLOCK]):
            piece = memoryview(data)[pos : pos + n + k]
            if len(piece):
                consume(pos, piece)
            pos += len(piece)
        return pos, 0

    def consume(offset: int, chunk: memoryview) -> None:
        assert offset == len(got)
        pieces.append((offset, len(chunk)))
        got.extend(chunk)

    storage._stream = odd_stream  # type: ignore[method-assign]
    storage.stream_file(1, "x.safetensors", entry, consume)
    assert bytes(got) == (root / step_dir(1) / "x.safetensors").read_bytes()
    assert all(o % BLOCK == 0 for o, _ in pieces)
    assert len(got) > x.numel()


def test_verify_deep_names_the_corrupt_block(tmp_path: Path) -> None:
    root = tmp_path / "s"
    saved_big(root)
    path = root / step_dir(1) / "x.safetensors"
    data = bytearray(path.read_bytes())
    data[BLOCK + 1] ^= 1
    path.write_bytes(bytes(data))
    with CheckpointManager(root) as mgr:
        report = mgr.verify(1)
        quick = mgr.verify(1, deep=False)
    assert not report.ok
    assert len(report.problems) == 1
    assert "x.safetensors" in report.problems[0]
    assert "block 1 (bytes" in report.problems[0]
    assert "crc32c" in report.problems[0]
    assert quick.ok  # sizes and headers only

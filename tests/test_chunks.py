"""The chunk index of DTensor checkpoints: round trip, hostile input, verified ranged reads."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
from _helpers import row_chunks

from ckptstore.errors import IntegrityError
from ckptstore.manifest import FileEntry
from ckptstore.sharded.chunks import (
    Chunk,
    ChunkIndex,
    TensorEntry,
    block_crcs,
    box_byte_range,
    fast_chunk,
    parse_chunk,
    read_box,
    read_box_into,
)

FILES = {
    "_shards.rank00000.safetensors": FileEntry(1000, 0, "safetensors"),
    "_shards.rank00001.safetensors": FileEntry(1000, 0, "safetensors"),
    "state.json": FileEntry(10, 0, "json"),
}


def two_chunks() -> ChunkIndex:
    a = Chunk((0, 0), (4, 6), "_shards.rank00000.safetensors", 100, 96, (1,))
    b = Chunk((4, 0), (3, 6), "_shards.rank00001.safetensors", 200, 72, (2,))
    return ChunkIndex(
        {"model/w": TensorEntry("float32", (7, 6), (a, b), (2,), ("dp",), ("S(0)",))},
        block=4096,
    )


def doc() -> dict[str, Any]:
    return json.loads(two_chunks().to_bytes())


def parse(d: dict[str, Any]) -> ChunkIndex:
    return ChunkIndex.from_bytes(json.dumps(d).encode(), FILES, "step-1/dtensors.json")


def test_round_trip() -> None:
    idx = parse(doc())
    assert idx == two_chunks()
    assert [c.file for c in idx.tensors["model/w"].chunks] == [
        "_shards.rank00000.safetensors",
        "_shards.rank00001.safetensors",
    ]


def _dcp_metadata(idx: ChunkIndex) -> Any:
    """The index as DCP's ``Metadata``, to compare ckptstore's read plan with DCP's planner's."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    return Metadata(
        state_dict_metadata={
            name: TensorStorageMetadata(
                properties=TensorProperties(dtype=t.torch_dtype),
                size=torch.Size(t.shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                    for c in t.chunks
                ],
            )
            for name, t in idx.tensors.items()
        }
    )


def _edit(path: list[Any], value: Any) -> dict[str, Any]:
    d = doc()
    node: Any = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return d


CHUNK0 = ["tensors", "model/w", "chunks", 0]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_edit(["ckptstore_chunks"], 9), "not a ckptstore chunk index"),
        (_edit(["block"], 0), "'block' must be"),
        (_edit(["tensors", "model/w", "dtype"], "object"), "unsupported dtype"),
        (_edit(["tensors", "model/w", "shape"], [7, -6]), "shape must hold integers"),
        (_edit([*CHUNK0, "offsets"], [4, 0]), "box [4, 0]+[4, 6] outside"),
        (_edit([*CHUNK0, "sizes"], [3, 6]), "do not fit its box"),
        (_edit([*CHUNK0, "file"], "../etc/passwd"), "unsafe file name"),
        (_edit([*CHUNK0, "file"], "state.json"), "not an uncompressed payload"),
        (_edit([*CHUNK0, "file"], "other.safetensors"), "not an uncompressed payload"),
        (_edit([*CHUNK0, "start"], 950), "do not fit its box"),
        (_edit([*CHUNK0, "bytes"], 95), "do not fit its box"),
        (_edit([*CHUNK0, "crc32c"], []), "one crc32c per 4096 bytes"),
        (_edit([*CHUNK0, "crc32c"], ["xyz"]), "8 hex digits"),
        (_edit(["tensors", "model/w", "chunks"], []), "non-empty list"),
    ],
)
def test_hostile_index_is_refused(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(IntegrityError, match=r"step-1/dtensors\.json") as ei:
        parse(edit)
    assert message in str(ei.value)


def _row_mutations() -> list[Any]:
    """Chunk rows one edit away from a good one: each field's wrong types, bounds, spellings."""
    good = doc()["tensors"]["model/w"]["chunks"][0]
    good = dict(good, crc32c=["0000abcd"])
    values: dict[str, list[Any]] = {
        "offsets": [
            [0, 0],
            [1, 0],
            [3, 0],
            [4, 0],
            [0, -1],
            [0.0, 0],
            [True, 0],
            [0],
            [0, 0, 0],
            (0, 0),
            "00",
            None,
            [0, 1 << 60],
        ],
        "sizes": [[4, 6], [3, 6], [4, 5], [8, 6], [-4, 6], [4, 6.0], [4, True], [4], None],
        "file": [
            "_shards.rank00000.safetensors",
            "_shards.rank00001.safetensors",
            "state.json",
            "big.json",
            "packed.safetensors",
            "other.safetensors",
            "../x",
            ".hidden",
            "",
            None,
            7,
            "_shards.rank00000.safetensors\x00",
        ],
        "start": [0, 100, 904, 905, -1, True, 100.0, "100", None],
        "bytes": [96, 95, 97, 0, -96, True, 96.0, None],
        "crc32c": [
            ["0000abcd"],
            ["0000ABCD"],
            ["0x00abcd"],
            [" 000abcd"],
            ["+000abcd"],
            ["0000_bcd"],
            ["0000abc"],
            ["0000abcde"],
            ["0000abc", "d"],
            ["abcd"],
            ["0000abcd", "0000abcd"],
            [],
            ["zzzzzzzz"],
            [0xABCD],
            [None],
            "0000abcd",
            ["0000ab d"],
            ["0000 ab "],
            ["0000abc\u00e9"],
            None,
        ],
    }
    rows: list[Any] = [(4096, r) for r in (good, [], None, "row")]
    for key, vs in values.items():
        rows += [(4096, dict(good, **{key: v})) for v in vs]
        rows.append((4096, {k: v for k, v in good.items() if k != key}))
    # Blocks of 64 bytes: two CRCs a row, of 8 characters each and not only in all.
    for crcs in (
        ["0000abcd", "0000abce"],
        ["0000abc", "d0000abc"],
        ["0000abc", "d0000abcd"],
        ["0000abcd0", "000abcd"],
        ["0000abcd"],
        ["0000abcd"] * 3,
    ):
        rows.append((64, dict(good, crc32c=crcs)))
    return rows


#: FILES, and payloads of the right size that a chunk may still not point into.
WIDE = {
    **FILES,
    "big.json": FileEntry(1000, 0, "json"),
    "packed.safetensors": FileEntry(1000, 0, "safetensors", "zstd"),
}


@pytest.mark.parametrize(("block", "row"), _row_mutations())
def test_the_fast_row_parse_accepts_and_makes_exactly_what_the_full_check_does(
    block: int, row: Any
) -> None:
    entry = TensorEntry("float32", (7, 6), ())
    try:
        want: Chunk | None = parse_chunk(row, entry, WIDE, block, "step-1/_index.rank00000.json")
    except IntegrityError:
        want = None
    payloads: dict[str, FileEntry] = {}
    got = fast_chunk(row, (7, 6), 4, WIDE, block, payloads)
    if want is None:
        assert got is None  # refused: the caller asks parse_chunk, which says why
    elif got is not None:  # or None for a spelling only parse_chunk takes ("0x...")
        assert got == want
        assert type(got.crcs[0]) is int
        assert got.crcs == want.crcs
        assert payloads == {got.file: WIDE[got.file]}
    # Every row a save writes, or of plain hex digits, takes the fast path.
    if want and all(c in "0123456789abcdefABCDEF" for c in "".join(row["crc32c"])):
        assert got == want


def test_a_part_of_rows_the_fast_path_doubts_parses_as_before() -> None:
    # The index parsed with a row only parse_chunk takes ("0x" CRC) and one it refuses.
    d = doc()
    d["tensors"]["model/w"]["chunks"][0]["crc32c"] = ["0x000001"]
    assert parse(d).tensors["model/w"].chunks[0].crcs == (1,)
    d["tensors"]["model/w"]["chunks"][1]["crc32c"] = [True]
    with pytest.raises(IntegrityError, match=r"chunk 1: crc32c values must be 8 hex digits"):
        parse(d)


def test_gaps_and_overlaps_are_refused() -> None:
    # A gap: the second chunk moved down leaves row 4 uncovered (volume still matches
    # only if something overlaps): both are "do not cover exactly".
    d = doc()
    second = d["tensors"]["model/w"]["chunks"][1]
    d["tensors"]["model/w"]["chunks"].append(dict(second, offsets=[4, 0]))
    with pytest.raises(IntegrityError, match="cover"):
        parse(d)
    d = doc()
    d["tensors"]["model/w"]["chunks"][1]["offsets"] = [3, 0]  # overlaps row 3, misses row 6
    with pytest.raises(IntegrityError, match="cover"):
        parse(d)


def test_index_size_and_chunk_count_are_bounded() -> None:
    with pytest.raises(IntegrityError, match="larger than any real index"):
        ChunkIndex.from_bytes(b" " * (512 << 20 | 1), FILES, "x")
    with pytest.raises(IntegrityError, match="not valid JSON"):
        ChunkIndex.from_bytes(b"[" * 100_000, FILES, "x")


def test_box_byte_range_row_major() -> None:
    # rows 1..2 of a (4, 6) float32 chunk: bytes 24..72
    assert box_byte_range((4, 6), (1, 0), (2, 6), 4) == (24, 72)
    # a column block: from (0, 2) to (3, 3) -> elements 2..21
    assert box_byte_range((4, 6), (0, 2), (4, 2), 4) == (8, 88)
    assert box_byte_range((4, 6), (0, 0), (0, 6), 4) == (0, 0)
    assert box_byte_range((), (), (), 2) == (0, 2)


def _stored(t: torch.Tensor, block: int) -> tuple[bytearray, Chunk]:
    raw = bytearray(b"\xee" * 37) + bytearray(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    chunk = Chunk(
        (0,) * t.dim(),
        tuple(t.shape),
        "f",
        37,
        t.numel() * t.element_size(),
        tuple(block_crcs(raw[37:], block)),
    )
    return raw, chunk


def test_read_box_returns_the_sub_box_and_reads_only_covering_blocks() -> None:
    t = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    raw, chunk = _stored(t, 4096)
    reads: list[tuple[int, int]] = []

    def read(name: str, off: int, n: int) -> bytearray:
        reads.append((off, n))
        return raw[off : off + n]

    got = read_box(read, chunk, torch.float32, (30, 5), (4, 7), block=4096, where="s")
    assert torch.equal(got, t[30:34, 5:12])
    # rows 30..33 lie in bytes 5760..6528: one 4 KiB block (4096..8192), not the chunk.
    assert reads == [(37 + 4096, 4096)]


def test_read_box_detects_a_flipped_byte_before_using_it() -> None:
    t = torch.randn(64, 48)
    raw, chunk = _stored(t, 4096)
    raw[37 + 5000] ^= 1

    def read(name: str, off: int, n: int) -> bytearray:
        return raw[off : off + n]

    with pytest.raises(IntegrityError, match="block 1 of its chunk at"):
        read_box(read, chunk, torch.float32, (0, 0), (64, 48), block=4096, where="s")
    # A box that avoids the damaged block still reads (and is checked).
    ok = read_box(read, chunk, torch.float32, (0, 0), (10, 48), block=4096, where="s")
    assert torch.equal(ok, t[:10])


def test_read_box_zero_d_and_bfloat16() -> None:
    t = torch.tensor(3.5, dtype=torch.bfloat16)
    raw, chunk = _stored(t, 4096)
    got = read_box(
        lambda n, o, k: raw[o : o + k], chunk, torch.bfloat16, (), (), block=4096, where="s"
    )
    assert got.dtype == torch.bfloat16
    assert float(got) == 3.5


def _scatter(raw: bytearray, reads: list[tuple[int, int]]) -> Any:
    def read_to(name: str, off: int, bufs: list[memoryview]) -> None:
        reads.append((off, sum(len(b) for b in bufs)))
        for b in bufs:
            b[:] = raw[off : off + len(b)]
            off += len(b)

    return read_to


@pytest.mark.parametrize(
    ("offsets", "lengths"),
    [
        ((0, 0), (64, 48)),
        ((30, 0), (4, 48)),
        ((1, 0), (62, 48)),
        ((63, 0), (1, 48)),
        ((5, 3), (1, 9)),
    ],
    ids=["whole", "rows-in-one-block", "rows-across-blocks", "last-row", "part-of-a-row"],
)
def test_read_box_into_reads_in_place_what_read_box_returns(
    offsets: tuple[int, int], lengths: tuple[int, int]
) -> None:
    # Block 1000 bytes: boxes start and end inside blocks, whose other bytes go to side
    # buffers; each block's CRC spans the side buffer and the target's memory.
    t = torch.randn(64, 48)
    raw, chunk = _stored(t, 1000)
    want = read_box(
        lambda n, o, k: raw[o : o + k],
        chunk,
        torch.float32,
        offsets,
        lengths,
        block=1000,
        where="s",
    )
    dest = torch.full(lengths, -1.0)
    reads: list[tuple[int, int]] = []
    got = read_box_into(
        _scatter(raw, reads),
        chunk,
        torch.float32,
        offsets,
        lengths,
        dest=dest,
        block=1000,
        where="s",
    )
    assert torch.equal(dest, want)
    first, end = box_byte_range((64, 48), offsets, lengths, 4)
    lo, hi = first // 1000 * 1000, min(-(-end // 1000) * 1000, 64 * 48 * 4)
    # One read a covering block, in file order: each block checked right after its read.
    assert reads == [(37 + k, min(k + 1000, hi) - k) for k in range(lo, hi, 1000)]
    assert got == hi - lo


def test_read_box_into_writes_a_rows_range_of_a_bigger_target_in_place() -> None:
    t = torch.randn(16, 8, dtype=torch.bfloat16)
    raw, chunk = _stored(t, 64)
    full = torch.zeros(40, 8, dtype=torch.bfloat16)
    dest = full.narrow(0, 10, 16)  # contiguous rows of the target
    assert read_box_into(
        _scatter(raw, []), chunk, torch.bfloat16, (0, 0), (16, 8), dest=dest, block=64, where="s"
    )
    assert torch.equal(full[10:26], t)
    assert not full[:10].any()
    assert not full[26:].any()


def test_read_box_into_declines_what_is_not_one_contiguous_range() -> None:
    t = torch.randn(8, 6)
    raw, chunk = _stored(t, 4096)
    reads: list[tuple[int, int]] = []
    read_to = _scatter(raw, reads)
    cols = torch.zeros(8, 2)
    # Columns of the chunk are not one byte range; a column slice of a target is not one either;
    # nor is a target of another dtype.
    assert (
        read_box_into(
            read_to, chunk, torch.float32, (0, 2), (8, 2), dest=cols, block=4096, where="s"
        )
        is None
    )
    wide = torch.zeros(8, 12)
    half = wide.narrow(1, 0, 6)
    assert (
        read_box_into(
            read_to, chunk, torch.float32, (0, 0), (8, 6), dest=half, block=4096, where="s"
        )
        is None
    )
    dbl = torch.zeros(8, 6, dtype=torch.float64)
    assert (
        read_box_into(
            read_to, chunk, torch.float32, (0, 0), (8, 6), dest=dbl, block=4096, where="s"
        )
        is None
    )
    assert reads == []


@pytest.mark.parametrize(
    "at", [10, 1500, 64 * 48 * 4 - 3], ids=["head-block", "middle", "tail-block"]
)
def test_read_box_into_finds_a_flipped_byte_in_any_block(at: int) -> None:
    t = torch.randn(64, 48)
    raw, chunk = _stored(t, 1000)
    raw[37 + at] ^= 4
    dest = torch.empty(62, 48)
    with pytest.raises(IntegrityError, match=f"block {at // 1000} of its chunk at"):
        read_box_into(
            _scatter(raw, []),
            chunk,
            torch.float32,
            (1, 0),
            (62, 48),
            dest=dest,
            block=1000,
            where="s",
        )


def _columns(n: int, gap_at: int | None = None, overlap_at: int | None = None) -> ChunkIndex:
    """A tensor of ``n`` one-column chunks (``Shard(1)`` over ``n`` ranks), each 4 bytes."""
    chunks = []
    for i in range(n):
        col = i + 1 if gap_at is not None and i >= gap_at else i
        col = 12_344 if overlap_at is not None and i == overlap_at else col
        # Each its own 4 bytes: chunks that share bytes are refused (issue 24 #7).
        chunks.append(Chunk((0, col), (1, 1), "_shards.rank00000.safetensors", 4 * i, 4, (0,)))
    width = n + (1 if gap_at is not None else 0)
    entry = TensorEntry("float32", (1, width), tuple(chunks), (n,), ("dp",), ("S(1)",))
    return ChunkIndex({"model/w": entry}, block=4096)


@pytest.mark.timeout(60)
def test_column_chunks_are_checked_in_n_log_n() -> None:
    """issue 24 #9: 20,000 Shard(1) chunks; a sweep along dim 0 compared every pair (~7 min)."""
    files = {"_shards.rank00000.safetensors": FileEntry(1 << 20, 0, "safetensors")}
    index = ChunkIndex.from_bytes(_columns(20_000).to_bytes(), files, "t")
    assert len(index.tensors["model/w"].chunks) == 20_000
    with pytest.raises(IntegrityError, match="cover the"):  # a gap is still found
        ChunkIndex.from_bytes(_columns(20_000, gap_at=7_000).to_bytes(), files, "t")
    # And an overlap: the last chunk moved onto column 12,344 (the volume is right, so only
    # the overlap check can tell).
    with pytest.raises(IntegrityError, match="cover the"):
        ChunkIndex.from_bytes(_columns(20_000, overlap_at=19_999).to_bytes(), files, "t")


def test_a_layout_that_would_not_end_is_refused_as_hostile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work on a hostile index is bounded: past the budget, a clear refusal."""
    from ckptstore.sharded import chunks as chunks_mod

    monkeypatch.setattr(chunks_mod, "_OVERLAP_BUDGET", 1000)
    # A staircase swept along dim 0 (the first of equally varied dims): every box stays active.
    n = 200
    stairs = [
        Chunk((i, n - 1 - i), (n - i, 1), "_shards.rank00000.safetensors", 0, 4 * (n - i), (0,))
        for i in range(n)
    ]
    files = {"_shards.rank00000.safetensors": FileEntry(1 << 20, 0, "safetensors")}
    with pytest.raises(IntegrityError, match="the index is hostile"):
        chunks_mod._overlap(stairs)
    assert files  # the layout, not the files, is what is refused


# ---- chunks that share bytes of a file (issue 24 #7) ---------------------------------------

BIG = {
    "_shards.rank00000.safetensors": FileEntry(1 << 20, 0, "safetensors"),
    "_shards.rank00001.safetensors": FileEntry(1 << 20, 0, "safetensors"),
}


def _row(offsets: list[int], sizes: list[int], file: int, start: int) -> dict[str, Any]:
    nbytes = 4 * sizes[0] * (sizes[1] if len(sizes) > 1 else 1)
    return {
        "offsets": offsets,
        "sizes": sizes,
        "file": f"_shards.rank{file:05d}.safetensors",
        "start": start,
        "bytes": nbytes,
        "crc32c": ["00000000"] * max(1, -(-nbytes // 4096)) if nbytes else [],
    }


def _index(tensors: dict[str, tuple[list[int], list[dict[str, Any]]]]) -> bytes:
    doc = {
        "ckptstore_chunks": 1,
        "block": 4096,
        "tensors": {
            n: {"dtype": "float32", "shape": shape, "chunks": rows}
            for n, (shape, rows) in tensors.items()
        },
    }
    return json.dumps(doc).encode()


def test_chunks_of_one_tensor_that_share_bytes_are_refused() -> None:
    """64 rows of a (64, 300) float32 tensor all pointing at row 0's 1,200 bytes: bounds,
    sizes and exact cover hold, and the load read 64 x the payload (before: loaded)."""
    rows = [_row([i, 0], [1, 300], 0, 100) for i in range(64)]
    with pytest.raises(IntegrityError) as ei:
        ChunkIndex.from_bytes(_index({"w": ([64, 300], rows)}), BIG, "step-2/dtensors.json")
    msg = str(ei.value)
    assert msg.startswith("step-2/dtensors.json: ")
    assert "overlap in _shards.rank00000.safetensors: bytes [100, 1300) and [100, 1300)" in msg
    assert "the chunk index is corrupt or hostile" in msg
    # A partial overlap (one byte) is refused too, and a chunk that ends where the next
    # starts is not.
    rows = [_row([0, 0], [1, 300], 0, 100), _row([1, 0], [1, 300], 0, 1299)]
    with pytest.raises(IntegrityError, match=r"bytes \[100, 1300\) and \[1299, 2499\)"):
        ChunkIndex.from_bytes(_index({"w": ([2, 300], rows)}), BIG, "t")
    rows[1]["start"] = 1300
    ChunkIndex.from_bytes(_index({"w": ([2, 300], rows)}), BIG, "t")


def test_chunks_of_two_tensors_that_share_bytes_are_refused() -> None:
    a = [_row([0, 0], [4, 6], 0, 200), _row([4, 0], [3, 6], 1, 0)]
    b = [_row([0], [10], 1, 80)]  # [80, 120) of rank 1's file: after a's [0, 72)
    ChunkIndex.from_bytes(_index({"a": ([7, 6], a), "b": ([10], b)}), BIG, "t")
    b[0]["start"] = 40  # [40, 80) meets a's [0, 72) in the file of rank 1
    with pytest.raises(IntegrityError) as ei:
        ChunkIndex.from_bytes(_index({"a": ([7, 6], a), "b": ([10], b)}), BIG, "step-2/x")
    msg = str(ei.value)
    assert "chunk [4, 0] of 'a' and chunk [0] of 'b' overlap" in msg
    assert "in _shards.rank00001.safetensors: bytes [0, 72) and [40, 80)" in msg
    assert "corrupt or hostile" in msg
    # The same offsets in another file share nothing.
    b[0]["file"] = "_shards.rank00000.safetensors"
    ChunkIndex.from_bytes(_index({"a": ([7, 6], a), "b": ([10], b)}), BIG, "t")


def test_real_layouts_share_no_bytes() -> None:
    """Row chunks, Shard(1) column chunks, a zero-size tensor (its empty chunks may sit
    anywhere, even at another chunk's start) and a 0-d tensor are all accepted."""
    rows = [_row([4 * i, 0], [4, 6], i % 2, 96 * (i // 2)) for i in range(4)]
    cols = [_row([0, 3 * i], [5, 3], 0, 4096 + 60 * i) for i in range(4)]
    empty = [_row([0, 0], [0, 6], 0, 4096), _row([0, 0], [0, 6], 1, 0)]
    scalar = [dict(_row([], [1], 1, 500), offsets=[], sizes=[])]
    index = ChunkIndex.from_bytes(
        _index(
            {
                "rows": ([16, 6], rows),
                "cols": ([5, 12], cols),
                "empty": ([0, 6], empty),
                "scalar": ([], scalar),
            }
        ),
        BIG,
        "t",
    )
    assert len(index.tensors["cols"].chunks) == 4


def test_the_byte_check_is_n_log_n() -> None:
    """4M chunks is the budget: sorting them is the cost, never comparing every pair."""
    from ckptstore.sharded.chunks import check_disjoint

    n = 200_000
    chunks = [
        ("w", Chunk((i,), (1,), "_shards.rank00000.safetensors", 4 * ((i * 7919) % n), 4, (0,)))
        for i in range(n)
    ]
    check_disjoint(chunks, "t")  # a shuffled order, no overlap
    chunks.append(("v", Chunk((0,), (1,), "_shards.rank00000.safetensors", 4 * n - 2, 4, (0,))))
    with pytest.raises(IntegrityError, match=r"\[799996, 800000\) and \[799998, 800002\)"):
        check_disjoint(chunks, "t")


def _rows_index(t: torch.Tensor, parts: int) -> tuple[bytearray, ChunkIndex]:
    """``t`` saved as ``parts`` row chunks, one after another in file ``f``."""
    raw, entry = row_chunks(t, parts, 64)
    return raw, ChunkIndex({"model/w": entry}, block=64)


def test_read_into_reads_boxes_at_once_and_stops_every_read_on_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptstore.sharded import targets
    from ckptstore.sharded.targets import READ_THREADS, read_into

    # Boxes of 512 bytes: each a task of its own only with tasks this small.
    monkeypatch.setattr(targets, "BATCH_BYTES", 512)

    t = torch.randn(32, 8)
    raw, index = _rows_index(t, 16)
    lock = threading.Lock()
    state = {"running": 0, "most": 0}

    def read_to(name: str, off: int, bufs: list[memoryview]) -> None:
        with lock:
            state["running"] += 1
            state["most"] = max(state["most"], state["running"])
        try:
            time.sleep(0.02)
            _scatter(raw, [])(name, off, bufs)
        finally:
            with lock:
                state["running"] -= 1

    out = torch.empty(32, 8)
    assert read_into(index, {"model/w": out}, lambda n, o, k: raw[o : o + k], "s", read_to) == len(
        raw
    )
    assert torch.equal(out, t)
    assert 1 < state["most"] <= READ_THREADS
    # A flipped byte in the 4th chunk: its error is raised, and by then no read is running
    # (nothing writes into the targets after read_into gave up).
    raw[index.tensors["model/w"].chunks[3].start + 5] ^= 1
    with pytest.raises(IntegrityError, match="block 0 of its chunk at \\[6, 0\\]"):
        read_into(
            index, {"model/w": torch.empty(32, 8)}, lambda n, o, k: raw[o : o + k], "s", read_to
        )
    assert state["running"] == 0
    # At the default task size the four small boxes go to one thread, in turn.
    monkeypatch.undo()
    raw[index.tensors["model/w"].chunks[3].start + 5] ^= 1
    state["most"] = 0
    out = torch.empty(32, 8)
    read_into(index, {"model/w": out}, lambda n, o, k: raw[o : o + k], "s", read_to)
    assert torch.equal(out, t)
    assert state["most"] == 1


def test_read_items_are_the_overlaps_of_the_target_boxes_with_the_stored_chunks() -> None:
    """The reads of a resharded restore, computed from the boxes (DCP's planner's answer)."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from ckptstore.sharded.targets import read_items

    index = two_chunks()  # rows 0..3 and 4..6 of a 7 x 6 tensor
    a, b = index.tensors["model/w"].chunks
    flat = {"model/w": torch.empty(7, 6)}
    # Rows 2..5 of columns 1..4: part of each chunk, at offsets in the target's own data.
    got = read_items(index, flat, {"model/w": ((2, 1), (6, 5))})
    assert got == [
        ("model/w", a, (2, 1), (0, 0), (2, 4)),
        ("model/w", b, (0, 1), (2, 0), (2, 4)),
    ]
    # A box inside one chunk reads that chunk only; an empty box (a rank that holds no
    # row of an uneven shard) reads nothing.
    assert read_items(index, flat, {"model/w": ((5, 0), (7, 6))}) == [
        ("model/w", b, (1, 0), (0, 0), (2, 6))
    ]
    assert read_items(index, flat, {"model/w": ((7, 0), (7, 6))}) == []
    # No box given: the whole tensor, as DCP's planner reads it for a plain target.
    whole = read_items(index, flat, {})
    plan = create_default_local_load_plan(flat, _dcp_metadata(index), True)
    assert [(n, c.offsets, s, d, k) for n, c, s, d, k in whole] == [
        (
            i.storage_index.fqn,
            tuple(i.storage_index.offset),
            tuple(i.storage_offsets),
            tuple(i.dest_offsets),
            tuple(i.lengths),
        )
        for i in plan.items
    ]
    # A 0-d tensor is one item of no dims.
    scalar = Chunk((), (), "_shards.rank00000.safetensors", 0, 4, (3,))
    sidx = ChunkIndex({"step": TensorEntry("float32", (), (scalar,))}, block=4096)
    assert read_items(sidx, {"step": torch.empty(())}, {}) == [("step", scalar, (), (), ())]
    # A target the index lacks, or of another shape, is refused before anything is read.
    with pytest.raises(IntegrityError, match="holds no tensor 'model/v'"):
        read_items(index, {"model/v": torch.empty(7, 6)}, {})
    with pytest.raises(IntegrityError, match=r"holds \[7, 6\], the target is \[6, 7\]"):
        read_items(index, {"model/w": torch.empty(6, 7)}, {})


def test_template_box_is_computed_once_per_shape_mesh_and_placements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restore's boxes come from a cache: the layers of a model repeat a few layouts."""
    import torch.distributed as dist
    import torch.distributed.tensor._utils as dt_utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ckptstore.sharded.targets import _fresh_like, template_box

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    try:
        mesh = init_device_mesh("cpu", (3,))
        ts = [
            DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0)], shape=(7, 4), stride=(4, 1))
            for _ in range(4)
        ]
        calls = []
        real = dt_utils.compute_local_shape_and_global_offset

        def counted(*a: Any, **k: Any) -> Any:
            calls.append(a)
            return real(*a, **k)

        monkeypatch.setattr(dt_utils, "compute_local_shape_and_global_offset", counted)
        cache: dict[Any, Any] = {}
        # Rank 1 of 3 holds rows 3..5 of 7 (torch's uneven split: 3, 3, 1).
        assert [template_box(t, (7, 4), cache) for t in ts] == [((3, 0), (6, 4))] * 4
        assert len(calls) == 1
        assert template_box(ts[0], (7, 4)) == ((3, 0), (6, 4))  # no cache: computed
        assert len(calls) == 2
        # Another stored shape: the target is made whole.
        assert template_box(ts[0], (8, 4), cache) == ((0, 0), (8, 4))
        # The fresh tensor made of such a template has its layout and a local part of its own.
        fresh = _fresh_like(ts[0], (7, 4), torch.float32)
        assert isinstance(fresh, DTensor)
        assert fresh.placements == ts[0].placements
        assert tuple(fresh.shape) == (7, 4)
        assert tuple(fresh.to_local().shape) == (3, 4)
        assert not fresh.requires_grad
        assert fresh.to_local().data_ptr() != ts[0].to_local().data_ptr()
    finally:
        dist.destroy_process_group()


def test_small_boxes_go_to_the_read_threads_together() -> None:
    """Biases and norms share a task; a large box is a task of its own; order is kept."""
    from ckptstore.sharded.targets import BATCH_BYTES, batches, read_items

    small, big = 1024, BATCH_BYTES // 4  # float32 elements: 4 KiB and BATCH_BYTES
    tensors = {}
    start = 0
    for name, n in [("a", small), ("b", small), ("w", big), ("c", small)] + [
        (f"s{i}", BATCH_BYTES // 16) for i in range(5)
    ]:
        c = Chunk((0,), (n,), "f", start, 4 * n, (0,) * -(-4 * n // 4096))
        start += 4 * n
        tensors[name] = TensorEntry("float32", (n,), (c,))
    index = ChunkIndex(tensors, block=4096)
    items = read_items(index, {n: torch.empty(e.shape) for n, e in tensors.items()}, {})
    got = [[item[0] for item in task] for task in batches(items, index.tensors)]
    # s0..s3 fill one task (4 x BATCH_BYTES / 4); s4 starts the next.
    assert got == [["w"], ["a", "b", "c", "s0", "s1", "s2", "s3"], ["s4"]]

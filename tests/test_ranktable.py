"""The rank table of format 4 (``_ranks.jsonl``): each rank's files, one checked line a rank.

The format-4 golden store (``tests/golden/v4-dtensor``, 2 ranks) is the real thing; the
hostile tables are crafted from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import forge_manifest, run_cli

from ckptstore import CheckpointManager
from ckptstore.errors import CommitError, IntegrityError, ManifestError
from ckptstore.manifest import MAX_RANK_LINE, RANK_TABLE_NAME, FileEntry, Manifest
from ckptstore.ranktable import RankFiles, encode, expand, lean, parse_line, rank_of
from ckptstore.storage import open_storage

GOLDENS = Path(__file__).parent / "golden"
STEP = "step-000000000007"
OLD = "step-000000000006"


def entry(rank: int, size: int = 10) -> FileEntry:
    return FileEntry(size, 0x1234, "safetensors", None, rank, None)


def test_lines_round_trip_and_each_line_stands_alone() -> None:
    rows = {r: {f"_shards.rank{r:05d}.safetensors": entry(r, 10 + r)} for r in (0, 2)}
    data, table = encode(rows, 3)  # rank 1 wrote nothing: an empty line
    assert (table.count, len(data)) == (3, 3 * table.width)
    assert all(data[(r + 1) * table.width - 1] == ord("\n") for r in range(3))
    line = data[2 * table.width : 3 * table.width]
    assert parse_line(line, 2, "t") == {"_shards.rank00002.safetensors": entry(2, 12)}
    assert parse_line(data[table.width : 2 * table.width], 1, "t") == {}
    with pytest.raises(IntegrityError, match=r"t line 1: holds rank 2's files"):
        parse_line(line, 1, "t")  # a line moved to another rank's place
    bad = bytearray(line)
    bad[bad.index(b'"bytes":12') + 9] = ord("9")  # the size edited, the CRC kept
    with pytest.raises(IntegrityError, match=r"t line 2: fails its CRC32C; the table is corrupt"):
        parse_line(bytes(bad), 2, "t")
    with pytest.raises(ValueError, match="listed under rank 0"):
        encode({0: {"_shards.rank00001.safetensors": entry(1)}}, 2)
    assert rank_of("_index.rank00012.json") == 12
    assert rank_of("state.json") is None


def test_a_table_no_reader_would_open_is_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptstore.ranktable as rt

    monkeypatch.setattr(rt, "MAX_RANK_LINE", 100)
    blocks = FileEntry(40 << 20, 1, "safetensors", None, 0, tuple(range(10)))
    with pytest.raises(CommitError, match="more than the 100 a reader accepts"):
        encode({0: {"_shards.rank00000.safetensors": blocks}}, 1)


def _signed_line(rank: int, files: dict[str, Any]) -> bytes:
    from ckptstore.integrity import crc32c_of, format_crc

    body = {"files": files, "rank": rank}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps(dict(body, crc32c=format_crc(crc32c_of(canon))), sort_keys=True).encode()


def test_a_line_naming_another_ranks_file_or_a_marker_is_refused() -> None:
    row = entry(1).to_json()
    # A valid CRC (a hostile writer computes it): rank 1's line lists rank 0's file name.
    with pytest.raises(IntegrityError, match="is not rank 1's"):
        parse_line(_signed_line(1, {"_shards.rank00000.safetensors": row}), 1, "t")
    with pytest.raises(IntegrityError, match="marker the store writes itself"):
        parse_line(_signed_line(1, {"pinned": row}), 1, "t")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """The v4 golden step 7 over a format-3 step 6 (the v3 golden, renumbered)."""
    root = tmp_path / "store"
    shutil.copytree(GOLDENS / "v4-dtensor", root)
    shutil.copytree(GOLDENS / "v3-dtensor" / STEP, root / OLD)
    m = root / OLD / "manifest.json"
    m.write_bytes(forge_manifest(m.read_bytes(), lambda d: d.update(step=6)))
    return root


def test_a_restore_reads_only_the_lines_it_needs(store: Path) -> None:
    storage = open_storage(store)
    head = storage.read_manifest(7, table=False)
    assert not head.complete
    assert sorted(head.files) == [
        "_ranks.jsonl",
        "dtensors.json",
        "model.safetensors",
        "state.json",
    ]
    m = lean(storage, head)
    files = m.files
    assert isinstance(files, RankFiles)
    full = storage.read_manifest(7)
    assert full.complete
    assert files["_shards.rank00001.safetensors"] == full.files["_shards.rank00001.safetensors"]
    assert files.get("_index.rank00001.json") == full.files["_index.rank00001.json"]
    assert files.lines_read == 1  # rank 1's line alone
    assert "_shards.rank00007.safetensors" not in files  # no such rank: no read
    assert files.lines_read == 1
    assert sorted(files) == sorted(full.files)  # walking every file reads the whole table
    # The manifest writes itself back as it was read (the head, the table beside it).
    assert full.to_bytes() == (store / STEP / "manifest.json").read_bytes()
    assert Manifest.from_bytes(full.to_bytes()).files.keys() == head.files.keys()


def _corrupt_line(store: Path, rank: int) -> None:
    path = store / STEP / RANK_TABLE_NAME
    data = bytearray(path.read_bytes())
    width = len(data) // 2
    at = data.index(b'"bytes":', rank * width) + 8
    data[at] = ord("9") if data[at] != ord("9") else ord("8")  # a digit rots
    path.write_bytes(bytes(data))


def test_a_rotten_line_fails_its_rank_only_and_restore_falls_back(store: Path) -> None:
    _corrupt_line(store, 1)
    storage = open_storage(store)
    files = lean(storage, storage.read_manifest(7, table=False)).files
    assert files["_shards.rank00000.safetensors"].rank == 0  # rank 0's line is intact
    with pytest.raises(IntegrityError, match=r"_ranks.jsonl line 1: fails its CRC32C"):
        files["_shards.rank00001.safetensors"]
    with pytest.raises(ManifestError, match=r"_ranks.jsonl line 1: fails its CRC32C"):
        storage.read_manifest(7)
    mgr = CheckpointManager(store)
    report = mgr.verify(7)
    assert not report.ok
    assert any("_ranks.jsonl" in p for p in report.problems), report.problems
    target: dict[str, Any] = {"model": {"w": torch.zeros(7, 3)}, "step": 0}
    assert mgr.restore(target, strict=False) == 6  # the whole of w needs rank 1's line
    w = target["model"]["w"]
    assert w.tolist() == [[(3 * r + c) / 4 for c in range(3)] for r in range(7)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [RANK_TABLE_NAME, "local-ranks", "../.ckptstore.index"])
def test_a_fifo_in_the_store_blocks_no_reader(
    store: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: opened without O_NONBLOCK, a FIFO where the rank table, a node's
    marker or the listing cache lie hung restore, load, `ls` and `verify` for good."""
    fifo = store / STEP / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    rc, out, err = run_cli(capsys, "ls", store)
    assert "6" in out, out + err
    rc, out, err = run_cli(capsys, "verify", store, "--all")
    if name == "../.ckptstore.index":  # only a cache: ignored, and replaced
        assert rc == 0, out + err
    else:
        assert rc == 1, out + err  # step 7 fails, naming the file
        assert name in out + err, out + err
    target: dict[str, Any] = {"model": {"w": torch.zeros(7, 3)}, "step": 0}
    with CheckpointManager(store) as mgr:  # a node's marker is not read by a restore
        assert mgr.restore(target, strict=False) == (6 if name == RANK_TABLE_NAME else 7)
    assert target["model"]["w"].tolist() == [[(3 * r + c) / 4 for c in range(3)] for r in range(7)]
    if name != "../.ckptstore.index":
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # read around, never written or removed


def test_a_part_pointing_into_another_ranks_file_is_refused_and_restore_falls_back(
    store: Path,
) -> None:
    """Rank 1's index part points its chunk of model/cols into rank 0's shard file (inside
    it, its CRC left); the part and the rank table re-signed as an attacker would. A rank
    reading that part alone restored rank 0's bytes as its own (found by review)."""
    from ckptstore.integrity import crc32c_of, format_crc

    step = store / STEP
    part = step / "_index.rank00001.json"
    doc = json.loads(part.read_bytes())
    doc["chunks"]["model/cols"][0]["file"] = "_shards.rank00000.safetensors"
    body = json.dumps(doc, separators=(",", ":")).encode()
    part.write_bytes(body)
    table = step / RANK_TABLE_NAME
    data = table.read_bytes()
    width = len(data) // 2
    files = json.loads(data[width:])["files"]
    files["_index.rank00001.json"].update(bytes=len(body), crc32c=format_crc(crc32c_of(body)))
    canon = json.dumps({"files": files, "rank": 1}, sort_keys=True, separators=(",", ":"))
    line = json.dumps(
        {"crc32c": format_crc(crc32c_of(canon.encode())), "files": files, "rank": 1},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    assert len(line) < width
    table.write_bytes(data[:width] + line.ljust(width - 1) + b"\n")
    m = step / "manifest.json"
    m.write_bytes(
        forge_manifest(
            m.read_bytes(),
            lambda d: d["files"][RANK_TABLE_NAME].update(
                crc32c=format_crc(crc32c_of(table.read_bytes()))
            ),
        )
    )
    said = "'model/cols' chunk 0 lies in _shards.rank00000.safetensors, which rank 1 did not write"
    mgr = CheckpointManager(store)
    report = mgr.verify(7)
    assert not report.ok
    assert any(said in p for p in report.problems), report.problems
    with pytest.raises(IntegrityError, match=said):
        mgr.load(7)
    target: dict[str, Any] = {"model": {"w": torch.zeros(7, 3)}, "step": 0}
    assert mgr.restore(target, strict=False) == 6  # the step before still loads
    assert target["model"]["w"].tolist() == [[(3 * r + c) / 4 for c in range(3)] for r in range(7)]


# Under an address space of 1 GiB: a table read whole (2 GiB) cannot be.
_UNDER_1GIB = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
    "from ckptstore.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.timeout(120)
def test_a_table_forged_to_gigabytes_is_read_a_line_at_a_time(store: Path) -> None:
    """Found by review: a manifest forged to 128 ranks of 16 MiB lines over a sparse
    _ranks.jsonl (no disk used) cost ls and verify 2 GiB of memory before a line was
    checked; the first line's failure now ends the read."""
    count, width = 128, MAX_RANK_LINE

    def edit(d: dict[str, Any]) -> None:
        d.update(world_size=count)
        d["rank_table"].update(count=count, width=width)
        d["files"][RANK_TABLE_NAME].update(bytes=count * width)

    m = store / STEP / "manifest.json"
    m.write_bytes(forge_manifest(m.read_bytes(), edit))
    os.truncate(store / STEP / RANK_TABLE_NAME, count * width)
    for argv in (["verify", str(store), "--all"], ["ls", str(store)]):
        cmd = [sys.executable, "-c", _UNDER_1GIB, *argv]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=100)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 1, said
        assert f"{STEP}/_ranks.jsonl line 0: not valid JSON" in said, said
        assert "Traceback" not in said, said
    assert CheckpointManager(store).restore({"model": {}, "step": 0}, strict=False) == 6


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(rank_table={"count": 2}), "'rank_table' must be {'count': N"),
        (lambda d: d["rank_table"].update(count=3), "rank table of 3 ranks in a step saved by 2"),
        (lambda d: d["rank_table"].update(width=2**25), "rank_table width must be an integer"),
        (lambda d: d["rank_table"].update(width=100), "must be listed, of no rank, with 2 x 100"),
        (lambda d: d.pop("rank_table"), "format version 4 without its 'rank_table'"),
        (lambda d: d.update(format_version=3), "a 'rank_table' in a format-3 manifest"),
        (
            lambda d: d["files"].update(
                {"_x.rank00001.json": dict(d["files"]["state.json"], rank=1)}
            ),
            "files of a rank (['_x.rank00001.json']) listed beside a rank table",
        ),
    ],
)
def test_a_hostile_rank_table_header_is_refused(store: Path, edit: Any, message: str) -> None:
    m = store / STEP / "manifest.json"
    m.write_bytes(forge_manifest(m.read_bytes(), edit))
    with pytest.raises(ManifestError) as ei:
        open_storage(store).read_manifest(7)
    assert message in str(ei.value)
    assert CheckpointManager(store).restore({"model": {}, "step": 0}, strict=False) == 6


def test_a_table_listing_a_name_twice_is_refused(store: Path) -> None:
    head = open_storage(store).read_manifest(7, table=False)
    table = head.rank_table
    assert table is not None
    with pytest.raises(IntegrityError, match="bytes, the manifest says more"):
        expand(head, b"", "t")
    # A file of no rank in the manifest, and the same name on rank 0's line.
    name = "x.rank00000.json"
    files = {**head.files, name: FileEntry(2, 0, "json", None, None, None)}
    rows = [_signed_line(0, {name: entry(0).to_json()}), _signed_line(1, {})]
    assert max(len(x) for x in rows) < table.width
    data = b"".join(x.ljust(table.width - 1) + b"\n" for x in rows)
    with pytest.raises(IntegrityError, match=r"x\.rank00000\.json is listed twice"):
        expand(dataclasses.replace(head, files=files), data, "t")

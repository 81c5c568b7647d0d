"""verify: quick (manifest, presence, sizes, headers) and deep (every checksum) checks."""

from __future__ import annotations

import dataclasses
import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from _helpers import (
    MANIFEST,
    deflated,
    edit_entry,
    flip_byte,
    forge_manifest,
    index_chunks,
    local_view,
    make_state,
    plant_zstd_bomb,
    replace_payload,
    run_cli,
    step_dir,
)

from ckptstore import CheckpointManager, IntegrityError, VerifyReport
from ckptstore.integrity import crc32c_of, format_crc
from ckptstore.ops.verify import verify_checkpoint
from ckptstore.sharded.chunks import BLOCK
from ckptstore.storage import open_storage

FORMATS = [("safetensors", None), ("torch", None), ("safetensors", "zstd"), ("torch", "zstd")]


def ext(fmt: str, compression: str | None) -> str:
    return {"safetensors": ".safetensors", "torch": ".pt"}[fmt] + (".zst" if compression else "")


@pytest.fixture(params=FORMATS, ids=[f"{f}-{c or 'raw'}" for f, c in FORMATS])
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    fmt, compression = request.param
    root = tmp_path / "s"
    with CheckpointManager(root, format=fmt, compression=compression) as mgr:
        mgr.save(1, make_state(1, width=256))
    return root, f"model{ext(fmt, compression)}"


def verify(root: Path, deep: bool = True) -> VerifyReport:
    with CheckpointManager(root) as mgr:
        return mgr.verify(1, deep=deep)


def test_good_checkpoint(saved: tuple[Path, str]) -> None:
    root, _ = saved
    doc = json.loads((root / step_dir(1) / MANIFEST).read_text())
    deep = verify(root)
    assert deep.ok, deep.problems
    assert deep.files == len(doc["files"])
    assert deep.bytes_checked == sum(e["bytes"] for e in doc["files"].values())
    assert deep.step == 1
    assert deep.target.endswith(step_dir(1))
    assert deep.to_dict()["ok"] is True
    quick = verify(root, deep=False)
    assert quick.ok
    assert not quick.deep


def test_flipped_data_byte_needs_deep(saved: tuple[Path, str]) -> None:
    root, name = saved
    path = root / step_dir(1) / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    path.write_bytes(bytes(raw))
    deep = verify(root)
    assert not deep.ok
    assert len(deep.problems) == 1
    assert name in deep.problems[0]
    assert "crc32c" in deep.problems[0]
    assert "does not match" in deep.problems[0]


@pytest.mark.parametrize("damage", ["truncate", "delete", "directory", "symlink"])
def test_structural_damage_is_found_quickly(saved: tuple[Path, str], damage: str) -> None:
    root, name = saved
    path = root / step_dir(1) / name
    data = path.read_bytes()
    path.unlink()
    if damage == "truncate":
        path.write_bytes(data[:-7])
    elif damage == "directory":
        path.mkdir()
    elif damage == "symlink":
        (root.parent / "elsewhere").write_bytes(data)
        path.symlink_to(root.parent / "elsewhere")
    for deep in (True, False):
        report = verify(root, deep=deep)
        assert not report.ok
        assert any(name in p for p in report.problems), report.problems


def test_broken_headers_are_found_quickly(tmp_path: Path) -> None:
    for fmt in ("safetensors", "torch"):
        root = tmp_path / fmt
        with CheckpointManager(root, format=fmt) as mgr:
            mgr.save(1, {"model": torch.nn.Linear(64, 64)})
        name = "model.safetensors" if fmt == "safetensors" else "model.pt"
        path = root / step_dir(1) / name
        raw = bytearray(path.read_bytes())
        if fmt == "safetensors":
            raw[0:8] = (len(raw) * 2).to_bytes(8, "little")  # header longer than the file
        else:
            i = raw.rfind(b"PK\x05\x06")  # the zip's end-of-central-directory record
            raw[i : i + 4] = b"XX\x05\x06"
        path.write_bytes(bytes(raw))
        report = verify(root, deep=False)
        assert not report.ok, fmt
        assert name in report.problems[0]


def rewrite(root: Path, name: str, data: bytes, edit: Any = None, *, step: int = 1) -> None:
    """Replace a file and forge the manifest so sizes and checksums match again."""
    (root / step_dir(step) / name).write_bytes(data)
    mpath = root / step_dir(step) / MANIFEST

    def fix(doc: dict[str, Any]) -> None:
        doc["files"][name].update(bytes=len(data), crc32c=format_crc(crc32c_of(data)))
        if edit:
            edit(doc)

    mpath.write_bytes(forge_manifest(mpath.read_bytes(), fix))


def test_state_json_that_is_not_json(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": 1})
    rewrite(root, "state.json", b"{not json")
    assert verify(root, deep=False).ok  # quick does not read it
    report = verify(root)
    assert not report.ok
    assert "state.json" in report.problems[0]
    assert "not valid JSON" in report.problems[0]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_non_finite_number_in_state_json_is_damage_and_the_step_before_restores(
    tmp_path: Path,
    compression: str | None,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # ckptstore writes its JSON with allow_nan=False (a non-finite float of the state is a
    # typed node), but json.loads reads Infinity: a shape of [Infinity, 3] escaped restore,
    # resume and load as a raw OverflowError (int(inf)) instead of a fall-back to step 1,
    # `verify` passed the step, and with zstd payloads crashed on it.
    root = tmp_path / "s"
    states = {s: make_state(s) for s in (1, 2)}
    with CheckpointManager(root, compression=compression) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    path = root / step_dir(2) / "state.json"
    text = path.read_text()
    shape = '"shape":[8,4]'  # fc1.weight's
    assert shape in text
    rewrite(root, "state.json", text.replace(shape, '"shape":[Infinity,8]', 1).encode(), step=2)
    with CheckpointManager(root) as mgr:
        with caplog.at_level("WARNING", logger="ckptstore"):
            fresh = make_state(0)
            assert mgr.restore(fresh) == 1
        assert "state.json: not valid JSON (non-finite number Infinity" in caplog.text
        assert torch.equal(fresh["model"].fc1.weight, states[1]["model"].fc1.weight)
        assert mgr.load()["step"] == states[1]["step"]
        report = mgr.verify(2)
        assert not report.ok
        assert "state.json: not valid JSON (non-finite number Infinity" in report.problems[0]
    code, out, err = run_cli(capsys, "verify", str(root), "--all")
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    assert "1 failed" in out


def test_an_empty_safetensors_entry_with_an_impossible_shape_is_refused(tmp_path: Path) -> None:
    # A zero dim makes an entry empty, and its other dims escaped every check: [0, 2**64]
    # passed verify, and load failed in torch.empty with an error blaming state.json.
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    path = root / step_dir(2) / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    end = max(v["data_offsets"][1] for k, v in head.items() if k != "__metadata__")
    head["evil"] = {"dtype": "F32", "shape": [0, 1 << 64], "data_offsets": [end, end]}
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    forged = len(blob).to_bytes(8, "little") + blob + raw[8 + n :]
    rewrite(root, "model.safetensors", forged, step=2)
    with CheckpointManager(root) as mgr:
        report = mgr.verify(2, deep=False)
        assert not report.ok
        assert "model.safetensors" in report.problems[0]
        assert (
            "'evil' has a shape [0, 18446744073709551616] no tensor can have"
            in (report.problems[0])
        )
        with pytest.raises(IntegrityError, match=r"model\.safetensors: .*'evil'"):
            mgr.load(2)
        assert mgr.load()["step"] == 1


def test_zip_member_crc_is_checked(tmp_path: Path) -> None:
    # A .pt whose zip member CRC is wrong but whose crc32c in the manifest was recomputed:
    # only the zip's own CRC-32 can tell.
    root = tmp_path / "s"
    with CheckpointManager(root, format="torch") as mgr:
        mgr.save(1, {"w": torch.full((1024,), 3.0)})
    path = root / step_dir(1) / "w.pt"
    raw = bytearray(path.read_bytes())
    i = raw.find(torch.full((16,), 3.0).numpy().tobytes())
    raw[i + 8] ^= 0x01
    rewrite(root, "w.pt", bytes(raw))
    assert verify(root, deep=False).ok
    report = verify(root)
    assert not report.ok
    assert "CRC-32" in report.problems[0]


def test_manifest_without_state_json(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": 1})
    mpath = root / step_dir(1) / MANIFEST
    mpath.write_bytes(forge_manifest(mpath.read_bytes(), lambda d: d["files"].pop("state.json")))
    report = verify(root)
    assert not report.ok
    assert "state.json" in report.problems[0]


def test_missing_manifest_is_one_problem(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": 1})
        view = local_view(root)
        view.write(f"{step_dir(1)}/{MANIFEST}", b"")
        report = verify_checkpoint(mgr.storage, 1)
    assert not report.ok
    assert len(report.problems) == 1
    assert MANIFEST in report.problems[0]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_deep_verify_reports_a_decompression_bomb_without_inflating_it(
    tmp_path: Path, fmt: str
) -> None:
    root = tmp_path / "s"
    with CheckpointManager(root, format=fmt, compression="zstd") as mgr:
        mgr.save(1, make_state(1))
    name = f"model{ext(fmt, 'zstd')}"
    plant_zstd_bomb(root, 1, name)  # its checksum matches: 1 GiB of zeros after its data
    assert verify(root, deep=False).ok  # quick checks never inflate
    tracemalloc.start()
    try:
        report = verify(root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(
        f"{root}/{step_dir(1)}/{name}: zstd stream inflates past the "
    )
    assert peak < 32 << 20, f"verify allocated {peak} bytes"


def _bad_safetensors(raw: bytes) -> bytes:
    return (len(raw) * 2).to_bytes(8, "little") + raw[8:]  # header longer than the file


def _bad_torch(raw: bytes) -> bytes:
    return deflated(raw)  # torch.save never compresses a member


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_deep_verify_checks_what_is_inside_a_compressed_payload(tmp_path: Path, fmt: str) -> None:
    # The compressed stream is sound and its checksum matches; the payload inside is not.
    root = tmp_path / "s"
    with CheckpointManager(root, format=fmt, compression="zstd") as mgr:
        mgr.save(1, make_state(1))
    name = f"model{ext(fmt, 'zstd')}"
    path = root / step_dir(1) / name
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(path.read_bytes())).read()
    bad = _bad_safetensors(raw) if fmt == "safetensors" else _bad_torch(raw)
    replace_payload(root / step_dir(1), name, zstandard.ZstdCompressor().compress(bad))
    assert verify(root, deep=False).ok
    report = verify(root)
    assert len(report.problems) == 1, report.problems
    why = "not a valid safetensors file" if fmt == "safetensors" else "is compressed (deflate"
    assert report.problems[0].startswith(f"{root}/{step_dir(1)}/{name}: ")
    assert why in report.problems[0]


# ---- DTensor checkpoints: the chunk index and per-block CRCs -------------------------------


def dtensor_verify(root: Path, step: int, deep: bool = True) -> VerifyReport:
    with CheckpointManager(root) as mgr:
        return mgr.verify(step, deep=deep)


def index_of(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / "dtensors.json").read_text())


def test_dtensor_checkpoint_verifies(mixed_store: tuple[Path, dict[str, Any]]) -> None:
    root, _ = mixed_store
    for step in (3, 4):
        on_disk = json.loads((root / step_dir(step) / MANIFEST).read_text())["files"]
        assert "state.json" in on_disk
        assert "dtensors.json" in on_disk
        assert "_ranks.jsonl" in on_disk  # format 4: the ranks' files are listed there
        assert not [n for n in on_disk if ".rank" in n]
        files = open_storage(root).read_manifest(step).files  # every file, the table's too
        in_dir = {p.name for p in (root / step_dir(step)).iterdir()} - {MANIFEST}
        assert set(files) == in_dir
        assert "_index.rank00000.json" in files
        deep = dtensor_verify(root, step)
        assert deep.ok, deep.problems
        assert deep.files == len(files)
        assert deep.bytes_checked == sum(e.bytes for e in files.values())
        assert dtensor_verify(root, step, deep=False).ok


@pytest.mark.parametrize(("step", "rank", "block"), [(3, 1, 1), (3, 0, 0), (4, 0, 2)])
def test_flipped_chunk_byte_names_file_block_and_tensor(
    mixed_store: tuple[Path, dict[str, Any]], step: int, rank: int, block: int
) -> None:
    root, _ = mixed_store
    shard_file = f"_shards.rank{rank:05d}.safetensors"
    chunk = next(
        c for c in index_chunks(root / step_dir(step), "table/emb") if c["file"] == shard_file
    )
    assert len(chunk["crc32c"]) > block  # the table's chunks span several blocks
    path = root / step_dir(step) / shard_file
    at = chunk["start"] + block * BLOCK + 123
    path.write_bytes(flip_byte(path.read_bytes(), at))

    assert dtensor_verify(root, step, deep=False).ok  # sizes and headers still fine
    report = dtensor_verify(root, step)
    assert not report.ok
    first = report.problems[0]
    assert first.startswith(str(root / step_dir(step) / shard_file) + ": ")
    assert f"block {block} of the chunk of tensor 'table/emb'" in first
    assert f"at offsets {chunk['offsets']}" in first
    assert "does not match" in first
    # and the whole-file checksum, from the same single read of the file
    assert len(report.problems) == 2
    assert shard_file in report.problems[1]
    assert "crc32c" in report.problems[1]


def forge_index(root: Path, step: int, edit: Any, name: str = "dtensors.json") -> None:
    """Rewrite the index file ``name`` with ``edit(doc)`` and forge the manifest to match it."""
    path = root / step_dir(step) / name
    doc = json.loads(path.read_text())
    edit(doc)
    data = json.dumps(doc).encode()
    path.write_bytes(data)
    edit_entry(
        root / step_dir(step),
        name,
        lambda row: row.update(bytes=len(data), crc32c=format_crc(crc32c_of(data))),
    )


#: Rank 0's part of the split chunk index (format 3): where its chunks are listed.
PART0 = "_index.rank00000.json"


def first_chunk(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["chunks"]["model/inp.weight"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("name", "edit", "expected"),
    [
        (PART0, lambda d: first_chunk(d).update(start=1 << 40), "do not fit its box"),
        (PART0, lambda d: first_chunk(d).update(file="../../etc/passwd"), "unsafe file name"),
        (PART0, lambda d: first_chunk(d).update(offsets=[1, 0]), "cover"),
        (PART0, lambda d: d.update(rank=1), "not the index part of rank 0"),
        (PART0, lambda d: d["chunks"].update(ghost=[]), "'ghost' is not in the index"),
        (
            "dtensors.json",
            lambda d: d["tensors"].pop("model/inp.weight"),
            "'model/inp.weight' is not in",
        ),
        ("dtensors.json", lambda d: d["tensors"]["model/inp.bias"].update(shape=[8]), "cover"),
        ("dtensors.json", lambda d: d.update(block=7), "'block'"),
        (
            "dtensors.json",
            lambda d: d["tensors"]["model/inp.bias"].update(mesh_id=5),
            "names no mesh",
        ),
        ("dtensors.json", lambda d: d["meshes"][0].update(shape=[1 << 30]), "ranks"),
    ],
    ids=[
        "out-of-file",
        "path",
        "overlap",
        "other-rank",
        "ghost-tensor",
        "missing-tensor",
        "shape",
        "block",
        "mesh-id",
        "huge-mesh",
    ],
)
def test_quick_verify_reports_a_hostile_index(
    mixed_store: tuple[Path, dict[str, Any]], name: str, edit: Any, expected: str
) -> None:
    root, _ = mixed_store
    forge_index(root, 3, edit, name)
    for deep in (False, True):
        report = dtensor_verify(root, 3, deep=deep)
        assert not report.ok
        named = ("dtensors.json", "_index.rank", "state.json")
        assert any(any(n in p for n in named) for p in report.problems), report.problems
        assert any(expected in p for p in report.problems), report.problems
    # The other steps are untouched: the replicated step 5 still loads.
    with CheckpointManager(root) as mgr:
        assert mgr.load(5) is not None


def test_dtensor_manifest_must_list_the_index(mixed_store: tuple[Path, dict[str, Any]]) -> None:
    root, _ = mixed_store
    mpath = root / step_dir(3) / MANIFEST
    mpath.write_bytes(forge_manifest(mpath.read_bytes(), lambda d: d["files"].pop("dtensors.json")))
    report = dtensor_verify(root, 3, deep=False)
    assert not report.ok
    assert "manifest lists no dtensors.json" in report.problems[0]


def test_block_checker_across_slices_and_overlaps() -> None:
    from ckptstore.ops.verify import _Block, _BlockChecker

    data = bytes(range(256)) * 40  # 10240 bytes
    spans = [(0, 4096), (4096, 8192), (8192, 10000), (100, 5000), (10000, 10000)]
    blocks = sorted(
        (_Block(lo, hi, crc32c_of(data[lo:hi]), k, "t", (k,)) for k, (lo, hi) in enumerate(spans)),
        key=lambda b: (b.start, b.end),
    )
    blocks[1].crc ^= 1  # the (100, 5000) block: overlaps two others
    for size in (1, 7, 1000, 4096, 20000):
        checker = _BlockChecker([dataclasses.replace(b) for b in blocks], "f")
        for off in range(0, len(data), size):
            checker(off, memoryview(data[off : off + size]))
        problems = checker.finish()
        assert problems == [
            "f: block 3 of the chunk of tensor 't' at offsets [3] (file bytes 100..5000) does "
            "not match its crc32c; the file is corrupt"
        ], size

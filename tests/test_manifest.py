"""ckptstore.manifest: the commit marker round-trips and refuses anything hostile."""

from __future__ import annotations

import json
import math
from typing import Any

import crc32c
import pytest

from ckptstore import FileEntry, Manifest, ManifestError
from ckptstore.integrity import BLOCK
from ckptstore.manifest import (
    FORMAT_VERSION,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    utc_now,
    validate_file_name,
)


def sample() -> Manifest:
    return Manifest(
        step=1200,
        files={
            "model.safetensors": FileEntry(bytes=4096, crc32c=0xDEADBEEF, codec="safetensors"),
            "optimizer.pt.zst": FileEntry(1, 0, "torch", compression="zstd"),
            "state.json": FileEntry(bytes=0, crc32c=0x0000_0001, codec="json"),
            "model.rank00003.safetensors": FileEntry(7, 8, "safetensors", rank=3),
        },
        created="2024-05-01T12:00:00.000000Z",
        format="safetensors",
        world_size=8,
        sharded=True,
        metrics={"val_loss": 0.25, "acc": 1.0},
        metadata={"epoch": 3, "tags": ["a", "ü"], "nested": {"k": None}},
        versions={"ckptstore": "0.1.0", "torch": "2.4.0"},
    )


def resign(doc: dict[str, Any]) -> bytes:
    """Re-serialize an edited manifest with a valid self-checksum (the spec, re-implemented)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    doc = dict(body, checksum=f"{crc32c.crc32c(canonical.encode()):08x}")
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def edited(**changes: Any) -> bytes:
    doc = json.loads(sample().to_bytes())
    doc.update(changes)
    return resign(doc)


def edited_entry(**changes: Any) -> bytes:
    doc = json.loads(sample().to_bytes())
    doc["files"]["state.json"].update(changes)
    return resign(doc)


def refuse(data: bytes, *fragments: str) -> str:
    with pytest.raises(ManifestError) as ei:
        Manifest.from_bytes(data, where="run/step-000000001200/manifest.json")
    msg = str(ei.value)
    assert msg.startswith("run/step-000000001200/manifest.json: "), msg
    for f in fragments:
        assert f in msg, msg
    return msg


# ---- round trip and format ----------------------------------------------------------------


def test_roundtrip() -> None:
    m = sample()
    data = m.to_bytes()
    assert Manifest.from_bytes(data) == m
    assert Manifest.from_bytes(data).to_bytes() == data
    assert m.total_bytes == 4096 + 1 + 0 + 7
    assert m.created_datetime is not None
    assert m.created_datetime.isoformat() == "2024-05-01T12:00:00+00:00"
    assert Manifest(step=0, files={}).created_datetime is None


def test_json_format_is_stable() -> None:
    m = Manifest(step=5, files={"state.json": FileEntry(3, 0xABC, "json")}, created="T")
    doc = json.loads(m.to_bytes())
    body = {
        "created": "T",
        "files": {
            "state.json": {"bytes": 3, "codec": "json", "compression": None, "crc32c": "00000abc"}
        },
        "format": "safetensors",
        "format_version": 1,
        "metadata": {},
        "metrics": {},
        "sharding": {"kind": "replicated"},
        "step": 5,
        "versions": {},
        "world_size": 1,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert doc == dict(body, checksum=f"{crc32c.crc32c(canonical):08x}")
    assert m.to_bytes().endswith(b"}\n")
    assert FORMAT_VERSION == 1


def test_nonfinite_metrics_roundtrip() -> None:
    m = Manifest(step=1, files={}, metrics={"a": math.nan, "b": math.inf, "c": -math.inf})
    data = m.to_bytes()
    assert b"NaN" not in data
    assert b"Infinity" not in data
    assert json.loads(data)["metrics"] == {"a": "nan", "b": "inf", "c": "-inf"}
    back = Manifest.from_bytes(data).metrics
    assert math.isnan(back["a"])
    assert back["b"] == math.inf
    assert back["c"] == -math.inf


def test_utc_now_parses() -> None:
    m = Manifest(step=1, files={}, created=utc_now())
    assert m.created.endswith("Z")
    assert m.created_datetime is not None
    assert m.created_datetime.utcoffset() is not None


# ---- refusals -----------------------------------------------------------------------------


def test_bad_self_checksum() -> None:
    data = sample().to_bytes()
    assert b'"step": 1200' in data
    msg = refuse(data.replace(b'"step": 1200', b'"step": 1201'), "self-checksum mismatch")
    assert "the manifest was edited or corrupted" in msg
    refuse(data.replace(b'"bytes": 4096', b'"bytes": 4097'), "self-checksum mismatch")
    doc = json.loads(data)
    del doc["checksum"]
    refuse(json.dumps(doc).encode(), "self-checksum missing or malformed")
    doc["checksum"] = "xyz"
    refuse(json.dumps(doc).encode(), "self-checksum missing or malformed")


def test_newer_format_version() -> None:
    msg = refuse(edited(format_version=99), "format version 99", "newer ckptstore")
    assert msg.endswith("Upgrade ckptstore to read it.")
    # Format 2 is the DTensor layout: a replicated manifest cannot claim it, nor the reverse.
    refuse(edited(format_version=2), "sharding kind 'sharded' in format version 2")
    refuse(edited(format_version=3), "sharding kind 'sharded' in format version 3")
    refuse(edited(format_version=4), "sharding kind 'sharded' in format version 4")
    refuse(edited(sharding={"kind": "dtensor"}), "sharding kind 'dtensor' in format version 1")
    refuse(edited(format_version=0), "format_version missing or not a positive integer")
    refuse(edited(format_version=True), "format_version missing or not a positive integer")


@pytest.mark.parametrize(
    "name", ["../x", "/etc/passwd", "a/b", ".hidden", "", ".", "..", "a\\b", "x" * 201, "é"]
)
def test_unsafe_file_names(name: str) -> None:
    doc = json.loads(sample().to_bytes())
    doc["files"][name] = doc["files"]["state.json"]
    refuse(resign(doc), f"unsafe file name {name!r} in manifest")
    with pytest.raises(ManifestError, match="one path component"):
        validate_file_name(name)


def test_safe_file_names() -> None:
    for name in ["model.safetensors", "m-1_2.pt.zst", "x" * 200, "0"]:
        assert validate_file_name(name) == name
    with pytest.raises(ManifestError):
        validate_file_name("manifest.json")
    with pytest.raises(ManifestError):
        validate_file_name(3)


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        (
            edited_entry(bytes="12"),
            ["file 'state.json'", "'bytes' must be an integer in [0, 2**50]"],
        ),
        (edited_entry(bytes=-1), ["'bytes' must be an integer", "got -1"]),
        (edited_entry(bytes=True), ["'bytes' must be an integer", "got True"]),
        (edited_entry(bytes=1.0), ["'bytes' must be an integer"]),
        (edited_entry(bytes=MAX_FILE_BYTES + 1), [f"got {2**50 + 1}"]),
        (edited_entry(crc32c=12), ["'crc32c' must be 8 hex digits"]),
        (edited_entry(crc32c="123"), ["'crc32c' must be 8 hex digits"]),
        (edited_entry(codec="pickle"), ["unknown codec 'pickle'"]),
        (edited_entry(compression="gzip"), ["unknown compression 'gzip'"]),
        (edited_entry(rank=-1), ["'rank' must be a non-negative integer"]),
        (edited_entry(rank=False), ["'rank' must be a non-negative integer"]),
        (edited(step=True), ["'step' must be an integer >= 0, got True"]),
        (edited(step=-1), ["'step' must be an integer >= 0, got -1"]),
        (edited(step="1200"), ["'step' must be an integer >= 0, got '1200'"]),
        (edited(world_size=0), ["'world_size' must be an integer >= 1, got 0"]),
        (edited(files=[]), ["'files' must be an object"]),
        (edited(format="pickle"), ["unknown payload format 'pickle'"]),
        (edited(sharding={"kind": "fsdp"}), ["'sharding' must be"]),
        (edited(metrics={"x": "1.0"}), ["metric 'x': metric must be a number, got str"]),
        (edited(metrics={"x": True}), ["metric must be a number, got bool"]),
        (edited(metrics=[]), ["'metrics' must be an object"]),
        (edited(metadata=[]), ["'metadata' must be an object"]),
        (edited(versions={"torch": 2}), ["'versions' must map names to strings"]),
        (edited(created=0), ["'created' must be a string"]),
        (b"[]", ["a manifest is a JSON object"]),
    ],
)
def test_wrong_types(data: bytes, fragments: list[str]) -> None:
    refuse(data, *fragments)


def test_entry_row_must_be_an_object() -> None:
    doc = json.loads(sample().to_bytes())
    doc["files"]["state.json"] = [1, 2]
    refuse(resign(doc), "file 'state.json': entry must be an object")


def test_largest_file_size_is_accepted() -> None:
    m = Manifest.from_bytes(edited_entry(bytes=MAX_FILE_BYTES))
    assert m.files["state.json"].bytes == 2**50


def test_duplicate_keys() -> None:
    data = sample().to_bytes()
    dup = data.replace(b'"step": 1200', b'"step": 1200, "step": 1200')
    refuse(dup, "duplicate key 'step'; the manifest is corrupt or hostile")
    dup = data.replace(b'"codec": "json"', b'"codec": "json", "codec": "torch"')
    refuse(dup, "duplicate key 'codec'")


def test_deeply_nested_json() -> None:
    refuse(b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply; the file is hostile")
    refuse(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply")


@pytest.mark.parametrize("depth", [63, 900, 980])
def test_metadata_nested_under_the_parsers_limit_is_refused_not_a_recursion_error(
    depth: int,
) -> None:
    """Review (s39) #4: a manifest nested ~980 levels parsed, then its checksum's json.dumps
    overflowed the stack: a raw RecursionError out of verify, ls and restore (no fall-back)."""
    import sys

    node: Any = 1
    for _ in range(depth):
        node = [node]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        data = edited(metadata={"x": node})  # signed by a writer with a deeper stack
    finally:
        sys.setrecursionlimit(limit)
    # Where the parser itself gives up depends on the caller's stack: either way, one error.
    msg = refuse(data, "hostile")
    assert "JSON nested more than 64 levels deep (ckptstore writes none)" in msg or (
        depth > 64 and "JSON nested too deeply" in msg
    )
    ok: Any = 1
    for _ in range(61):  # 64 levels with the manifest's own two and the metadata's dict
        ok = [ok]
    assert Manifest.from_bytes(edited(metadata={"x": ok})).metadata == {"x": ok}


def test_save_refuses_metadata_readers_would_refuse(tmp_path: Any) -> None:
    import torch

    from ckptstore import CheckpointManager, ConfigError

    deep: Any = {}
    for _ in range(2000):  # deeper than copy.deepcopy and json.dumps can recurse
        deep = {"a": deep}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError, match="must not nest lists and objects more than 62"):
            mgr.save(1, {"w": torch.ones(2)}, metadata={"d": deep})
        assert mgr.steps() == []


@pytest.mark.parametrize("data", [b"\xff\xfe{}", b"", b"{", b"{'step': 1}", b"\x00" * 10], ids=repr)
def test_not_json(data: bytes) -> None:
    refuse(data, "not valid JSON", "the checkpoint is torn or corrupt")


def test_non_finite_numbers_in_json() -> None:
    data = sample().to_bytes()
    for bad in (b'"step": NaN', b'"step": Infinity', b'"step": 1e400'):
        refuse(data.replace(b'"step": 1200', bad), "non-finite number")
    refuse(data.replace(b'"val_loss": 0.25', b'"val_loss": -Infinity'), "non-finite number")


def test_oversized_manifest() -> None:
    data = b" " * (MAX_MANIFEST_BYTES + 1)
    refuse(data, f"{MAX_MANIFEST_BYTES + 1} bytes is larger than any real manifest")


# ---- per-block CRCs -----------------------------------------------------------------------


BIG = 10 * BLOCK + 5  # 11 blocks, the last one 5 bytes


def with_blocks(blocks: object, size: int = BIG) -> bytes:
    doc = json.loads(sample().to_bytes())
    doc["files"]["model.safetensors"].update(bytes=size, blocks=blocks)
    return resign(doc)


def test_blocks_roundtrip_and_are_json_integers() -> None:
    blocks = tuple(range(0xFFFFFFF5, 0x100000000))  # 11 u32 values, the largest included
    m = Manifest.from_bytes(with_blocks(list(blocks)))
    entry = m.files["model.safetensors"]
    assert entry.blocks == blocks
    assert entry.bytes == BIG
    doc = json.loads(m.to_bytes())
    assert doc["files"]["model.safetensors"]["blocks"] == list(blocks)
    assert Manifest.from_bytes(m.to_bytes()) == m
    # Absent (small files, old manifests): None, and not written.
    assert m.files["state.json"].blocks is None
    assert "blocks" not in doc["files"]["state.json"]


@pytest.mark.parametrize(
    ("blocks", "fragment"),
    [
        ([1] * 10, "list of 11 CRC32Cs"),  # one short
        ([1] * 12, "list of 11 CRC32Cs"),  # one too many
        ([1] * 1_000_000, "got 1000000"),  # refused by its length, not iterated
        ("00000001", "got str"),
        ({"0": 1}, "got dict"),
        ([1] * 10 + [-1], "integers in [0, 2**32)"),
        ([1] * 10 + [1 << 32], "integers in [0, 2**32)"),
        ([1] * 10 + [True], "integers in [0, 2**32)"),
        ([1] * 10 + [1.0], "integers in [0, 2**32)"),
        ([1] * 10 + ["00000001"], "integers in [0, 2**32)"),
    ],
)
def test_hostile_blocks_are_refused(blocks: object, fragment: str) -> None:
    refuse(with_blocks(blocks), "file 'model.safetensors'", "'blocks'", fragment)


def test_blocks_of_an_empty_or_one_block_file() -> None:
    assert Manifest.from_bytes(with_blocks([], size=0)).files["model.safetensors"].blocks == ()
    refuse(with_blocks([7], size=0), "list of 0 CRC32Cs")
    one = Manifest.from_bytes(with_blocks([7], size=BLOCK)).files["model.safetensors"]
    assert one.blocks == (7,)
    refuse(with_blocks([7, 8], size=BLOCK), "list of 1 CRC32Cs")


def test_listing_cache_leaves_blocks_out() -> None:
    m = Manifest.from_bytes(with_blocks(list(range(11))))
    back = Manifest.from_cache(json.loads(json.dumps(m.to_cache())))
    assert back.files["model.safetensors"].blocks is None
    assert back.files["model.safetensors"].crc32c == m.files["model.safetensors"].crc32c


@pytest.mark.parametrize("marker", ["pinned", "replicated", "local-ranks"])
def test_a_payload_named_like_a_marker_is_refused(marker: str) -> None:
    """issue 24 #10: a manifest cannot make a fetch or a copy plant a marker."""
    from ckptstore.layout import LOCAL_RANKS_NAME, PIN_NAME, REPLICATED_NAME
    from ckptstore.manifest import MARKER_NAMES

    assert {PIN_NAME, REPLICATED_NAME, LOCAL_RANKS_NAME} == MARKER_NAMES
    doc = json.loads(sample().to_bytes())
    doc["files"][marker] = doc["files"]["state.json"]
    refuse(resign(doc), f"file name {marker!r}", "marker the store writes itself")


def test_a_step_whose_manifest_nests_too_deeply_is_skipped_and_the_one_before_restores(
    tmp_path: Any,
) -> None:
    """Review (s39) #4 end to end: ``restore()`` raised the RecursionError instead of going
    on to step 1; ``verify`` printed a traceback."""
    import sys

    import torch
    from _helpers import forge_manifest, step_path

    from ckptstore import CheckpointManager
    from ckptstore.ops.verify import verify_checkpoint
    from ckptstore.storage import open_storage

    with CheckpointManager(tmp_path, keep=None) as mgr:
        mgr.save(1, {"w": torch.full((3,), 1.0)})
        mgr.save(2, {"w": torch.full((3,), 2.0)})
    node: Any = 1
    for _ in range(900):
        node = [node]
    path = step_path(tmp_path, 2) / "manifest.json"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        path.write_bytes(
            forge_manifest(path.read_bytes(), lambda d: d.update(metadata={"x": node}))
        )
    finally:
        sys.setrecursionlimit(limit)
    report = verify_checkpoint(open_storage(tmp_path), 2)
    assert not report.ok
    assert any("nested" in p and "hostile" in p for p in report.problems), report.problems
    with CheckpointManager(tmp_path) as mgr:
        got = {"w": torch.zeros(3)}
        assert mgr.restore(got) == 1
        assert torch.equal(got["w"], torch.full((3,), 1.0))
        with pytest.raises(ManifestError, match="hostile"):
            mgr.restore({"w": torch.zeros(3)}, step=2)

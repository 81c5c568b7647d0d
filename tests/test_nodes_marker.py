"""The ``local-ranks`` marker of a node's copy (issue 24 #3): checksummed, read strictly.

A marker that cannot be read, does not parse, fails its checksum or says something
impossible raises (verify then fails the step, naming the marker); it is never taken as "no
rank's files are here", which switched off the checks of every rank's files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptstore.errors import IntegrityError
from ckptstore.layout import LOCAL_RANKS_NAME, step_dirname
from ckptstore.ops.verify import verify_stored_file
from ckptstore.storage import LocalStorage
from ckptstore.tiers import nodes


def _store(tmp_path: Path, marker: bytes | None) -> LocalStorage:
    d = tmp_path / step_dirname(7)
    d.mkdir()
    if marker is not None:
        (d / LOCAL_RANKS_NAME).write_bytes(marker)
    return LocalStorage(str(tmp_path))


def test_the_writer_checksums_its_marker_and_the_reader_checks_it(tmp_path: Path) -> None:
    body = nodes.marker_bytes([3, 2], 4)
    doc = json.loads(body)
    assert doc["ranks"] == [2, 3]
    assert doc["world_size"] == 4
    assert len(doc["checksum"]) == 8
    assert nodes.local_ranks(_store(tmp_path, body), 7) == [2, 3]


def test_an_old_marker_without_checksum_is_still_read(tmp_path: Path) -> None:
    old = json.dumps({"ranks": [2, 3], "world_size": 4}).encode() + b"\n"
    assert nodes.local_ranks(_store(tmp_path, old), 7) == [2, 3]


def test_no_marker_means_every_rank(tmp_path: Path) -> None:
    assert nodes.local_ranks(_store(tmp_path, None), 7) is None


def _edited(**change: object) -> bytes:
    doc = json.loads(nodes.marker_bytes([2, 3], 4))
    doc.update(change)
    return json.dumps(doc).encode()


BAD = {
    "torn": (nodes.marker_bytes([2, 3], 4)[:9], "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "binary": (b"\xff\xfe\x00", "not valid JSON"),
    "a list": (b"[2, 3]", "not a JSON object"),
    "ranks edited": (_edited(ranks=[2]), "does not match its checksum"),
    "world edited": (_edited(world_size=8), "does not match its checksum"),
    "checksum garbled": (_edited(checksum="xyz"), "8 hex digits"),
    "an extra field": (_edited(extra=1), "its fields are"),
    "old, ranks empty": (b'{"ranks": [], "world_size": 4}', "not ascending ranks"),
    "old, rank out of range": (b'{"ranks": [2, 4], "world_size": 4}', "not ascending ranks"),
    "old, not ascending": (b'{"ranks": [3, 2], "world_size": 4}', "not ascending ranks"),
    "old, a bool rank": (b'{"ranks": [true], "world_size": 4}', "not ascending ranks"),
    "old, a string": (b'{"ranks": "2", "world_size": 4}', "not ascending ranks"),
    "old, no world": (b'{"ranks": [2]}', "its fields are"),
    "old, world 0": (b'{"ranks": [0], "world_size": 0}', "world_size 0"),
    "duplicate key": (b'{"ranks": [2], "ranks": [], "world_size": 4}', "duplicate key"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_damaged_marker_raises_naming_it(tmp_path: Path, case: str) -> None:
    data, why = BAD[case]
    with pytest.raises(IntegrityError, match=why) as e:
        nodes.local_ranks(_store(tmp_path, data), 7)
    assert f"{step_dirname(7)}/{LOCAL_RANKS_NAME}: the node-local marker" in str(e.value)


def test_an_unreadable_marker_raises(tmp_path: Path) -> None:
    store = _store(tmp_path, None)
    os.mkdir(tmp_path / step_dirname(7) / LOCAL_RANKS_NAME)  # not a file
    with pytest.raises(IntegrityError, match="marker is unreadable"):
        nodes.local_ranks(store, 7)


def test_a_marker_of_another_world_than_the_manifest_raises(tmp_path: Path) -> None:
    from ckptstore.manifest import Manifest

    store = _store(tmp_path, nodes.marker_bytes([1], 2))
    manifest = Manifest(step=7, created="2024-01-01T00:00:00Z", files={}, world_size=3)
    with pytest.raises(IntegrityError, match="a world of 2 ranks, the manifest's is of 3"):
        nodes.local_ranks(store, 7, manifest)
    assert nodes.local_ranks(store, 7) == [1]


def test_verify_of_the_marker_file_checks_it(tmp_path: Path) -> None:
    import torch

    from ckptstore import CheckpointManager

    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(7, {"w": torch.ones(2)})
    store = LocalStorage(str(tmp_path / "s"))
    marker = tmp_path / "s" / step_dirname(7) / LOCAL_RANKS_NAME
    marker.write_bytes(nodes.marker_bytes([0], 1))
    assert verify_stored_file(store, 7, LOCAL_RANKS_NAME).ok
    marker.write_bytes(b'{"ranks": [0')
    report = verify_stored_file(store, 7, LOCAL_RANKS_NAME)
    assert not report.ok
    assert "node-local marker is corrupt" in report.problems[0]

"""The listing cache of a local store (``.ckptstore.index``): fast, and never wrong.

A cached manifest is used only while its file keeps the identity it had when it was
validated; anything else about the cache (torn, corrupt, hostile, unwritable) falls back to
reading the manifests themselves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _helpers import flip_byte, forge_manifest, step_dir

from ckptstore import CheckpointManager, KeepBest, KeepLast, list_store
from ckptstore.cli import main
from ckptstore.errors import ManifestError
from ckptstore.layout import INDEX_NAME, index_tmp_name
from ckptstore.storage.local import LocalStorage


def make_store(root: Path, n: int = 4) -> None:
    with CheckpointManager(root, keep=None) as mgr:
        for s in range(1, n + 1):
            mgr.save(s, {"w": torch.full((4,), float(s)), "step": s}, metrics={"loss": 10.0 - s})


def summary(root: Path) -> list[tuple[int, object, object]]:
    res = list_store(str(root), {})
    return [
        (s.step, s.manifest.metrics if s.manifest else None, s.error is not None) for s in res.steps
    ]


def assert_newest_loads(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 4
        assert torch.equal(mgr.load()["w"], torch.full((4,), 4.0))


def rewrite_manifest(root: Path, step: int, loss: float) -> None:
    """Replace a manifest by a forged one with a valid self-checksum and other metrics."""
    path = root / step_dir(step) / "manifest.json"
    forged = forge_manifest(path.read_bytes(), lambda d: d["metrics"].update(loss=loss))
    tmp = path.with_suffix(".new")
    tmp.write_bytes(forged)
    os.replace(tmp, path)


def test_ls_writes_the_cache_and_answers_the_same_from_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    first = summary(root)
    assert (root / INDEX_NAME).is_file()
    data = (root / INDEX_NAME).read_bytes()
    assert data.startswith(b"ckptstore-index 1 ")
    assert sorted(json.loads(data.partition(b"\n")[2])) == ["1", "2", "3", "4"]
    assert summary(root) == first == [(s, {"loss": 10.0 - s}, False) for s in range(1, 5)]
    # The cache is neither a step nor garbage: ls does not report it and gc keeps it.
    assert list_store(str(root), {}).garbage == []
    assert main(["gc", str(root)]) == 0
    assert (root / INDEX_NAME).is_file()


def test_writing_the_cache_leaves_the_stores_modification_time(tmp_path: Path) -> None:
    # Lightning resumes ckpt_path="last" from the newest last*.ckpt by modification time;
    # for CkptStoreIO a checkpoint is a store directory. `ckptstore ls` wrote this cache
    # into each store and so made the one listed last (an older run's last.ckpt) the
    # newest: the next fit resumed it, silently.
    old, new = tmp_path / "last.ckpt", tmp_path / "last-v1.ckpt"
    make_store(old)
    make_store(new)
    os.utime(old, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    os.utime(new, ns=(2_000_000_000_000_000_000, 2_000_000_000_000_000_000))
    assert main(["ls", str(old)]) == 0
    assert main(["ls", str(new)]) == 0
    assert (old / INDEX_NAME).is_file()
    assert (new / INDEX_NAME).is_file()
    assert os.stat(old).st_mtime_ns == 1_000_000_000_000_000_000
    assert os.stat(new).st_mtime_ns == 2_000_000_000_000_000_000


def test_a_replaced_manifest_is_read_again(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    summary(root)
    rewrite_manifest(root, 2, 123.0)
    assert summary(root)[1] == (2, {"loss": 123.0}, False)
    # Retention in a fresh manager ranks by the new value, not the cached one.
    with CheckpointManager(root, keep=[KeepLast(1), KeepBest(1, "loss", mode="max")]) as mgr:
        assert mgr.plan_prune() == [1, 3]


def test_a_deleted_step_leaves_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    summary(root)
    with CheckpointManager(root, keep=KeepLast(2)) as mgr:
        assert mgr.prune() == [1, 2]
    assert [s for s, _, _ in summary(root)] == [3, 4]
    doc = json.loads((root / INDEX_NAME).read_bytes().partition(b"\n")[2])
    assert sorted(doc) == ["3", "4"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # torn
        lambda b: flip_byte(b, len(b) - 3),  # a flipped byte in the body
        lambda b: b"",  # empty
        lambda b: b"\x00" * 100,  # zeros after a power loss
        lambda b: b"ckptstore-index 1 00000000\n[[[[",  # wrong checksum, bad JSON
    ],
    ids=["torn", "flipped", "empty", "zeros", "garbage"],
)
def test_a_damaged_cache_is_ignored_and_rebuilt(tmp_path: Path, damage: object) -> None:
    root = tmp_path / "store"
    make_store(root)
    good = summary(root)
    path = root / INDEX_NAME
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    assert summary(root) == good
    assert LocalStorage(str(root))._load_index().keys() == {1, 2, 3, 4}
    assert_newest_loads(root)


def test_a_hostile_cache_with_valid_checksum_but_bad_rows_is_not_trusted(tmp_path: Path) -> None:
    """Rows of the wrong shape (or for the wrong step) fall back to the manifest itself."""
    root = tmp_path / "store"
    make_store(root)
    good = summary(root)
    st = LocalStorage(str(root))
    entries = st._load_index()
    entries[1][1] = ["not", "a", "manifest"]  # malformed row, identity still matches
    entries[2][1][0] = 3  # a row that claims another step
    entries[3] = ["nonsense"]  # wrong arity
    st._save_index(entries)
    assert summary(root) == good
    assert_newest_loads(root)


def test_a_broken_manifest_is_never_cached(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    path = root / step_dir(3) / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"world_size": 1', b'"world_size": 2'))
    for _ in range(2):
        rows = summary(root)
        assert rows[2] == (3, None, True)
    assert "3" not in json.loads((root / INDEX_NAME).read_bytes().partition(b"\n")[2])
    got = LocalStorage(str(root)).read_manifests([3])[3]
    assert isinstance(got, ManifestError)
    assert "self-checksum mismatch" in str(got)


def test_an_unwritable_cache_does_not_fail_the_listing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    (root / INDEX_NAME).mkdir()  # os.replace onto a directory fails (even as root)
    assert summary(root) == [(s, {"loss": 10.0 - s}, False) for s in range(1, 5)]
    assert (root / INDEX_NAME).is_dir()
    assert not [p for p in os.listdir(root) if p.endswith(".tmp")]  # no stray tmp left


def test_a_stale_cache_tmp_is_garbage(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    stray = root / index_tmp_name()
    stray.write_bytes(b"half")
    assert list_store(str(root), {}).garbage == [stray.name]
    assert main(["gc", str(root)]) == 0
    assert not stray.exists()
    assert summary(root)[-1] == (4, {"loss": 6.0}, False)

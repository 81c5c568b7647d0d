"""Two tiers without an object store: what opening a replica refuses (``tiers.twotier``).

The replicas here are local directories (a path, a symlink, a ``file://`` URL): a replica
that is the local store itself under another name must be refused before anything is
uploaded or deleted. The S3 side of the tiers is ``test_replica.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import make_state, step_dir

from ckptstore import CheckpointManager
from ckptstore.errors import CkptStoreError
from ckptstore.tiers.replica import ReplicaError
from ckptstore.tiers.replicate import replicate

pytestmark = pytest.mark.timeout(60)


def _spellings(root: Path, tmp_path: Path) -> dict[str, str]:
    link = tmp_path / "link"
    link.symlink_to(root, target_is_directory=True)
    return {
        "symlink": str(link),
        "file-url": f"file://{root}",
        "file-url-symlink": f"file://{link}",
        "dotted": f"{root}/../{root.name}/.",
    }


@pytest.mark.parametrize("spelling", ["symlink", "file-url", "file-url-symlink", "dotted"])
def test_a_replica_that_is_the_local_root_under_another_name_is_refused(
    tmp_path: Path, spelling: str
) -> None:
    # issue 24 #5: the "same store" check compared spellings; with keep=None and
    # replica_keep=1, replica retention then deleted the local steps.
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, make_state(s))
    url = _spellings(root, tmp_path)[spelling]
    with pytest.raises(CkptStoreError, match="is the local store itself") as info:
        CheckpointManager(root, keep=None, replica=url, replica_keep=1)
    assert isinstance(info.value, ValueError)  # as the spelling check raised before
    assert str(root) in str(info.value)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        step_dir(s) for s in (1, 2, 3)
    ]
    # The sidecar refuses it too (it never deletes local steps, but would call them safe).
    with pytest.raises(CkptStoreError, match="is the local store itself"):
        replicate(root, url, keep=None)
    assert CheckpointManager(root).steps() == [1, 2, 3]


def test_another_directory_is_a_replica(tmp_path: Path) -> None:
    root, other = tmp_path / "run", tmp_path / "replica"
    with CheckpointManager(root, keep=1, replica=f"file://{other}", replica_keep=None) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
        mgr.wait()
        assert mgr.steps() == [2]
    assert CheckpointManager(other).steps() == [1, 2]
    assert not issubclass(ReplicaError, ValueError)
    assert os.path.isdir(other / step_dir(1))


def test_a_replica_manifest_listing_a_marker_is_refused_and_plants_nothing(
    tmp_path: Path,
) -> None:
    """issue 24 #10: the replica's step 2 lists a 'pinned' file; the fetch refuses it."""
    import json

    from _helpers import forge_manifest

    from ckptstore.integrity import crc32c_of, format_crc

    local, remote = tmp_path / "local", tmp_path / "replica"
    state = make_state()
    with CheckpointManager(local, replica=str(remote)) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    # The local copy of step 2 is gone; the replica's lists a planted marker.
    import shutil

    shutil.rmtree(local / step_dir(2))
    (remote / step_dir(2) / "pinned").write_text("planted")
    mpath = remote / step_dir(2) / "manifest.json"

    def plant(d: dict[str, object]) -> None:
        files = d["files"]
        assert isinstance(files, dict)
        crc = format_crc(crc32c_of(b"planted"))
        files["pinned"] = {"bytes": 7, "crc32c": crc, "codec": "json"}

    mpath.write_bytes(forge_manifest(mpath.read_bytes(), plant))
    json.loads(mpath.read_text())  # still JSON, self-checksum forged to match
    with CheckpointManager(local, replica=str(remote)) as mgr:
        target = make_state()
        assert mgr.restore(target) == 1  # the previous good step
    assert not (local / step_dir(2)).exists()
    assert not (local / step_dir(1) / "pinned").exists()


def test_a_gc_during_a_fetch_from_the_replica_does_not_remove_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A resume on an empty node fetches the newest step from the replica into a .tmp-
    # directory of the local root. It held no writer lock, so a `ckptstore gc` run then
    # took the fetch for a crashed save's leftover and removed it: the resume failed with a
    # raw FileNotFoundError. The fetch now holds the lock: gc refuses, the fetch lands.
    import shutil
    import threading

    from _helpers import fresh_like, run_cli

    from ckptstore.storage.pending import Pending

    root, other = tmp_path / "run", tmp_path / "replica"
    states = {s: make_state(s) for s in (10, 20)}
    with CheckpointManager(root, keep=None, replica=str(other), replica_keep=None) as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    shutil.rmtree(root)  # the node's disk is gone: the replica alone holds the steps
    real = Pending.open
    first = threading.Lock()
    seen: list[tuple[int, str]] = []

    def open_file(self: Pending, *args: object, **kwargs: object) -> object:
        if first.acquire(blocking=False):  # the operator's gc, as the fetch writes a file
            rc, out, err = run_cli(capsys, "gc", root)
            seen.append((rc, out + err))
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Pending, "open", open_file)
    with CheckpointManager(root, keep=None, replica=str(other), replica_keep=None) as mgr:
        got = fresh_like(states[20])
        assert mgr.restore(got) == 20
        monkeypatch.undo()
        assert mgr.steps() == [20]  # fetched, committed locally
        assert mgr.verify(20).ok
        mgr.save(21, make_state(21))  # the lock was given back, and is taken again here
    ((rc, text),) = seen
    assert rc != 0
    assert "locked by another writer" in text
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [20, 21]


def test_a_step_fetched_from_the_replica_goes_with_local_retention(tmp_path: Path) -> None:
    # Node B resumes from the replica (step 2 fetched into its empty root) and trains on with
    # keep=1. The fetched step was never uploaded by B's uploader, so it never counted as
    # safe there: local retention kept it for the whole job, beside the newest step.
    from _helpers import fresh_like

    states = {s: make_state(s) for s in range(3)}
    other = tmp_path / "replica"
    with CheckpointManager(tmp_path / "a", keep=1, replica=str(other)) as mgr:
        for s, state in states.items():
            mgr.save(s, state)
    with CheckpointManager(tmp_path / "b", keep=1, replica=str(other)) as mgr:
        assert mgr.restore(fresh_like(states[2])) == 2
        assert mgr.steps() == [2]
        for s in (3, 4, 5):
            mgr.save(s, make_state(s))
            mgr.wait()
        assert mgr.steps() == [5]
        assert mgr.replica is not None
        assert not mgr.replica.holding
    assert CheckpointManager(other).steps() == [5]  # keep=1 there too: 2 went once 3 was safe


def test_a_late_upload_of_a_replaced_save_does_not_make_the_new_one_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Step 5 is deleted (force) and saved again while the upload of its first save is
    # finishing. That upload then marked step 5 safe, whichever save it was: local retention
    # deleted the new save of 5, never uploaded, and the replica kept the one the user
    # deleted. A save is safe only as itself.
    import threading

    from torch import nn

    from ckptstore.tiers import replica as replica_mod

    real = replica_mod.copy_files
    uploaded, release = threading.Event(), threading.Event()

    def late(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]  # the step is on the replica
        if args[2] == 5 and not release.is_set():  # its bookkeeping comes late
            uploaded.set()
            release.wait(30)

    monkeypatch.setattr(replica_mod, "copy_files", late)
    other = tmp_path / "replica"
    with CheckpointManager(tmp_path / "run", keep=1, replica=str(other), replica_keep=5) as mgr:
        mgr.save(5, {"model": nn.Linear(4, 4), "tag": "old"})
        assert uploaded.wait(30)
        mgr.delete(5, force=True)
        mgr.save(5, {"model": nn.Linear(4, 4), "tag": "new"})
        mgr.save(6, {"model": nn.Linear(4, 4), "tag": "six"})
        release.set()
        mgr.wait()
        assert mgr.steps() == [6]
    with CheckpointManager(other) as there:
        assert there.steps() == [5, 6]
        assert there.load(5, keys=["tag"]) == {"tag": "new"}

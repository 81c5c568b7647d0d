"""Tests of managing steps from outside a job (``ckptstore.ops.steps``): ``rm``, ``pin``/``unpin``,
``prune`` and ``gc``, through the library and the command line.

Every refusal is checked to delete nothing, and every command on a directory that is not a
store to create nothing in it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _helpers import run_cli, step_path
from torch import nn

from ckptstore import (
    CheckpointManager,
    CkptStoreError,
    KeepLast,
    NoCheckpointError,
    StoreLockedError,
    delete_steps,
    gc_store,
    pin_steps,
    prune_store,
)
from ckptstore.storage import wait_for_deletions

#: The listing cache of a local store (see storage/local.py).
INDEX = ".ckptstore.index"


def entries(root: Path) -> list[str]:
    """Every entry of ``root``, recursively, relative to it (what a command may not change).

    The listing cache of a store is left out: reading manifests may refresh it.
    """
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != INDEX)


def steps_on_disk(root: Path) -> list[int]:
    wait_for_deletions()
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-"))


def corrupt(root: Path, step: int) -> None:
    f = step_path(root, step) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Steps 1..4 of a small model, with metrics ``loss`` and ``acc``."""
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with CheckpointManager(root, keep=None) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, {"model": model, "step": s}, metrics={"loss": 1 / s, "acc": s / 10})
    return root


# ---- rm -------------------------------------------------------------------------------------


def test_rm_deletes_steps_whole(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "rm", store, "--step", "2", "--step", "1")
    assert (rc, err) == (0, "")
    assert out == "deleted 2 steps: 1, 2\n2 steps left: 3, 4\n"
    assert steps_on_disk(store) == [3, 4]
    assert not any(p.name.startswith(".trash-") for p in store.iterdir())  # freed before exit
    rc, out, _ = run_cli(capsys, "rm", store, "--step", "3", "--json")
    assert rc == 0
    assert json.loads(out) == {"root": str(store), "deleted": [3], "kept": [4]}
    with CheckpointManager(store) as mgr:
        assert mgr.steps() == [4]
        assert mgr.verify().ok


def test_rm_refuses_unknown_steps_and_deletes_nothing(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = entries(store)
    rc, out, err = run_cli(capsys, "rm", store, "--step", "2", "--step", "7")
    assert rc == 1
    assert out == ""
    assert err.startswith("ckptstore: error: ")
    assert "step-000000000007: no committed checkpoint (have 1..4 (4 steps))" in err
    assert err.count("\n") == 1
    assert entries(store) == before
    rc, out, _ = run_cli(capsys, "rm", store, "--step", "7", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["error"] == "NoCheckpointError"
    assert "no committed checkpoint" in doc["message"]


def test_rm_refuses_the_only_good_step_unless_forced(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt(store, 4)
    corrupt(store, 2)
    before = entries(store)
    # 3 is the newest step that verifies; 1 would still be there, so deleting 3 is fine...
    # ...but deleting 3 and 1 leaves only corrupt steps: refused, nothing deleted.
    rc, out, err = run_cli(capsys, "rm", store, "--step", "3", "--step", "1")
    assert rc == 1
    assert out == ""
    # (It said "step 3 is the only checkpoint that verifies", with step 1 verifying too.)
    assert "no step this leaves (2, 4) verifies, and step 3, the newest of those" in err
    assert "nothing was deleted" in err
    assert "--force" in err
    assert entries(store) == before
    with pytest.raises(CkptStoreError, match="no step this leaves"):
        delete_steps(store, [1, 3])
    # Corrupt steps go without a word.
    assert delete_steps(store, [2, 4]).deleted == [2, 4]
    assert steps_on_disk(store) == [1, 3]
    assert run_cli(capsys, "rm", store, "--step", "1", "--step", "3", "--force")[0] == 0
    assert steps_on_disk(store) == []


def test_rm_the_last_step_needs_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "one"
    with CheckpointManager(root) as mgr:
        mgr.save(5, {"x": torch.zeros(2)})
    rc, _, err = run_cli(capsys, "rm", root, "--step", "5")
    assert rc == 1
    assert "step 5 is the only step, and it verifies" in err
    assert steps_on_disk(root) == [5]
    with CheckpointManager(root) as mgr:
        mgr.save(6, {"x": torch.zeros(2)})
    rc, _, err = run_cli(capsys, "rm", root, "--step", "5", "--step", "6")
    assert rc == 1
    assert "this deletes every step, and step 6, the newest of them, verifies" in err
    assert steps_on_disk(root) == [5, 6]
    assert run_cli(capsys, "rm", root, "--step", "6")[0] == 0
    rc, out, _ = run_cli(capsys, "rm", root, "--step", "5", "--force")
    assert (rc, out) == (0, "deleted 1 step: 5\n0 steps left\n")
    assert steps_on_disk(root) == []


def test_rm_refuses_pinned_steps(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "pin", store, "--step", "2")[0] == 0
    rc, _, err = run_cli(capsys, "rm", store, "--step", "1", "--step", "2")
    assert rc == 1
    assert "step 2 is pinned; nothing was deleted: unpin it first" in err
    assert steps_on_disk(store) == [1, 2, 3, 4]
    assert run_cli(capsys, "rm", store, "--step", "2", "--force")[0] == 0
    assert steps_on_disk(store) == [1, 3, 4]


def test_rm_while_a_job_writes_is_refused(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with CheckpointManager(store, keep=None) as writer:
        writer.save(5, {"x": torch.zeros(1)})  # holds the writer lock
        rc, out, err = run_cli(capsys, "rm", store, "--step", "1")
        with pytest.raises(StoreLockedError):
            delete_steps(store, [1])
    assert (rc, out) == (1, "")
    assert "locked by another writer" in err
    assert "nothing was deleted" in err
    assert steps_on_disk(store) == [1, 2, 3, 4, 5]


def test_rm_usage_errors(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["rm", store], ["rm", store, "--step", "x"], ["rm", store, "--step", "-1"]):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2
        assert out == ""
        assert "usage: ckptstore rm" in err
    rc, out, _ = run_cli(capsys, "rm", store, "--json")
    assert rc == 2
    assert json.loads(out)["error"] == "UsageError"
    with pytest.raises(ValueError, match="no step"):
        delete_steps(store, [])
    assert steps_on_disk(store) == [1, 2, 3, 4]


# ---- pin / unpin ----------------------------------------------------------------------------


def test_pin_and_unpin(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "pin", store, "--step", "1")
    assert (rc, out, err) == (0, "pinned step 1\n", "")
    assert (step_path(store, 1) / "pinned").is_file()
    rc, out, _ = run_cli(capsys, "pin", store, "--step", "1", "--step", "2", "--json")
    assert rc == 0
    assert json.loads(out) == {"root": str(store), "pinned": True, "steps": [1, 2], "changed": [2]}
    rc, out, _ = run_cli(capsys, "ls", store, "--json")
    assert [d["pinned"] for d in json.loads(out)] == [True, True, False, False]
    # retention keeps pins
    rc, out, _ = run_cli(capsys, "prune", store, "--keep-last", "1", "--json")
    assert json.loads(out)["deleted"] == [3]
    rc, out, _ = run_cli(capsys, "unpin", store, "--step", "1")
    assert (rc, out) == (0, "unpinned step 1\n")
    rc, out, _ = run_cli(capsys, "unpin", store, "--step", "1")
    assert (rc, out) == (0, "step 1: already unpinned\n")
    assert not (step_path(store, 1) / "pinned").exists()
    assert pin_steps(store, [2], pinned=False).changed == [2]
    rc, out, _ = run_cli(capsys, "prune", store, "--keep-last", "1")
    assert out.splitlines()[0] == "deleted 2 steps: 1, 2"


def test_pin_refuses_unknown_steps(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = entries(store)
    rc, out, err = run_cli(capsys, "pin", store, "--step", "1", "--step", "9")
    assert (rc, out) == (1, "")
    assert "step-000000000009: no committed checkpoint" in err
    assert entries(store) == before  # step 1 was not pinned either
    rc, _, err = run_cli(capsys, "pin", store)
    assert rc == 2
    assert "--step" in err


# ---- prune ------------------------------------------------------------------------------------


def test_prune_with_a_metric_no_step_has_is_a_usage_error(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = entries(store)
    for extra in ([], ["--dry-run"]):
        rc, out, err = run_cli(
            capsys, "prune", store, "--keep-best", "2", "--metric", "val_loss", *extra
        )
        assert rc == 2
        assert out == ""
        assert "usage: ckptstore prune" in err
        assert "no checkpoint of the store records the metric 'val_loss'" in err
        assert "the metrics the store has: acc, loss" in err
    rc, out, _ = run_cli(capsys, "prune", store, "--keep-best", "1", "--metric", "nosuch", "--json")
    assert rc == 2
    doc = json.loads(out)
    assert doc["error"] == "UsageError"
    assert "acc, loss" in doc["message"]
    assert entries(store) == before
    with pytest.raises(ValueError, match="the metrics the store has: acc, loss"):
        prune_store(store, [KeepLast(1), *_keep_best("nosuch")])
    # the right metric works, in a union with other policies too
    rc, out, _ = run_cli(
        capsys, "prune", store, "--keep-best", "1", "--metric", "acc", "--mode", "max"
    )
    assert rc == 0
    assert out.splitlines()[0] == "deleted 3 steps: 1, 2, 3"


def _keep_best(metric: str) -> list[object]:
    from ckptstore import KeepBest

    return [KeepBest(1, metric)]


def test_prune_metric_check_needs_steps_with_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "nometrics"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": torch.zeros(1)})
        mgr.save(2, {"x": torch.zeros(1)})
    rc, _, err = run_cli(capsys, "prune", root, "--keep-best", "1", "--metric", "loss")
    assert rc == 2
    assert "none (no checkpoint records a metric)" in err
    assert steps_on_disk(root) == [1, 2]


def test_prune_library_matches_the_manager(store: Path) -> None:
    corrupt(store, 4)
    plan = prune_store(store, 1, dry_run=True)
    assert (plan.deleted, plan.kept) == ([1, 2], [3, 4])  # 4 is newest, 3 the newest good
    with CheckpointManager(store, keep=1) as mgr:
        assert mgr.plan_prune() == plan.deleted
    res = prune_store(store, 1)
    assert res.deleted == [1, 2]
    assert steps_on_disk(store) == [3, 4]


# ---- a directory that is not a store ------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "{root}"],
        ["prune", "{root}", "--keep-last", "1"],
        ["prune", "{root}", "--keep-last", "1", "--dry-run"],
        ["rm", "{root}", "--step", "1"],
        ["pin", "{root}", "--step", "1"],
        ["ls", "{root}"],
        ["verify", "{root}"],
        ["inspect", "{root}"],
    ],
)
def test_commands_on_a_directory_that_is_not_a_store_create_nothing(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "project"
    root.mkdir()
    (root / "notes.txt").write_text("mine\n")
    (root / "data").mkdir()
    rc, out, err = run_cli(capsys, *[a.format(root=root) for a in argv])
    assert rc == 1
    assert out == ""
    assert err == (
        f"ckptstore: error: {root}: no store there (it holds no step-* checkpoints and no "
        "ckptstore files); check the path\n"
    )
    assert entries(root) == ["data", "notes.txt"]
    rc, out, _ = run_cli(capsys, *[a.format(root=root) for a in argv], "--json")
    assert json.loads(out) == {
        "error": "NoCheckpointError",
        "message": err.removeprefix("ckptstore: error: ").rstrip("\n"),
    }
    assert entries(root) == ["data", "notes.txt"]


def test_gc_and_prune_on_an_empty_directory_create_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(capsys, "gc", empty) == (0, "nothing to remove\n", "")
    assert run_cli(capsys, "prune", empty, "--keep-last", "1") == (
        0,
        f"{empty}: no checkpoints\n",
        "",
    )
    assert os.listdir(empty) == []
    assert gc_store(empty) == []
    assert prune_store(empty, 1).deleted == []
    assert os.listdir(empty) == []
    with pytest.raises(NoCheckpointError, match="no such directory"):
        gc_store(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


# ---- a pin takes no lock: deleters look for it after they renamed the step away -------------


def _pin_just_before_rename(monkeypatch: pytest.MonkeyPatch, root: Path, step: int) -> None:
    """Write step ``step``'s pin marker right before a deleter renames the step away: the
    moment between its look at the pins and its rename, where `ckptstore pin` (no lock)
    said "pinned" and the step was deleted anyway (found by review)."""
    from ckptstore.storage.local import LocalStorage

    real = LocalStorage._rename
    name = step_path(root, step).name

    def rename(self: LocalStorage, src: str, dst: str) -> None:
        if src == name and dst.startswith(".trash-"):
            (step_path(root, step) / "pinned").write_bytes(b"pinned\n")
        real(self, src, dst)

    monkeypatch.setattr(LocalStorage, "_rename", rename)


@pytest.mark.parametrize("how", ["prune", "rm", "retention", "mgr.delete"])
def test_a_step_pinned_while_it_is_deleted_is_kept(
    store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    _pin_just_before_rename(monkeypatch, store, 2)
    if how == "prune":
        res = prune_store(store, 1)
        assert res.deleted == [1, 3]
    elif how == "rm":
        rc, out, err = run_cli(capsys, "rm", store, "--step", "2", "--step", "3")
        assert rc == 1
        assert out == "deleted 1 step: 3\n3 steps left: 1, 2, 4\n"
        assert "step-000000000002 was pinned since it was planned: kept" in err
    elif how == "retention":
        with CheckpointManager(store, keep=1) as mgr:
            mgr.save(5, {"step": 5})
    else:
        with (
            CheckpointManager(store) as mgr,
            pytest.raises(CkptStoreError, match="was pinned while it was being deleted"),
        ):
            mgr.delete(2)
    assert 2 in steps_on_disk(store)
    assert (step_path(store, 2) / "pinned").exists()
    with CheckpointManager(store) as mgr:
        assert mgr.verify(2).ok


def test_a_pin_of_a_step_deleted_as_it_is_written_fails(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The marker was written (and made durable) just before a deleter that looked at the
    # pins before (or, forced, not at all) renamed the step away: pin said "pinned" of a
    # step that was gone.
    from ckptstore.storage.local import LocalStorage

    real = LocalStorage._fsync_dir

    def fsync_dir(self: LocalStorage, rel: str) -> None:
        real(self, rel)
        if rel == step_path(store, 3).name:
            delete_steps(store, [3], force=True)

    monkeypatch.setattr(LocalStorage, "_fsync_dir", fsync_dir)
    with pytest.raises(CkptStoreError, match="was deleted as it was being pinned; nothing is pin"):
        pin_steps(store, [3])
    assert steps_on_disk(store) == [1, 2, 4]


def test_a_running_job_sees_an_unpin(store: Path) -> None:
    # Retention kept a step it once found pinned for the rest of the job (found by review).
    with CheckpointManager(store, keep=1) as mgr:
        pin_steps(store, [4])
        mgr.save(5, {"step": 5})
        assert mgr.steps() == [4, 5]
        pin_steps(store, [4], pinned=False)
        mgr.save(6, {"step": 6})
        assert mgr.steps() == [6]
    assert steps_on_disk(store) == [6]


# ---- what only the job knows: node-local roots, uploads behind -------------------------------


def test_prune_and_rm_refuse_one_nodes_root(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by review: on one node's root of node-local roots, a step published there
    # alone (a power cut) passed as the newest good step, and prune deleted the last step
    # good on every node: the job's resume then found none. Only the ranks together know.
    from ckptstore.tiers import nodes

    for s in (1, 2, 3, 4):
        (step_path(store, s) / "local-ranks").write_bytes(nodes.marker_bytes([0], 2))
    for argv in (("prune", store, "--keep-last", "1"), ("rm", store, "--step", "1")):
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 1
        assert "is one node's root of a job with node-local roots" in err
        assert "nothing was deleted. Call CheckpointManager.prune() on every rank" in err
    assert steps_on_disk(store) == [1, 2, 3, 4]
    assert prune_store(store, 1, force=True).deleted == [1, 2, 3]


def test_prune_and_rm_keep_the_steps_not_yet_on_the_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by review: a job preempted while its uploads lagged behind left steps 0..5
    # locally (its keep=2 held them until they were safe on the replica); `ckptstore prune
    # --keep-last 2` deleted 0..3, which no replica held.
    root, replica = tmp_path / "store", tmp_path / "replica"
    replica.mkdir()
    mgr = CheckpointManager(root, keep=2, replica=str(replica), replica_keep=None)
    assert mgr.replica is not None
    mgr.replica.pause()
    for s in range(6):
        mgr.save(s, {"w": torch.full((4,), float(s))})
    mgr.replica.close(wait=False)  # preempted with its uploads behind
    mgr.close()
    assert steps_on_disk(root) == [0, 1, 2, 3, 4, 5]
    res = prune_store(root, 2)
    assert (res.deleted, res.kept) == ([], [0, 1, 2, 3, 4, 5])
    rc, _, err = run_cli(capsys, "rm", root, "--step", "0", "--step", "1")
    assert rc == 1
    assert f"steps 0, 1 are not yet on the replica {replica}" in err
    assert steps_on_disk(root) == [0, 1, 2, 3, 4, 5]
    assert prune_store(root, 2, force=True).deleted == [0, 1, 2, 3]

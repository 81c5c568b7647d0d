"""The save and restore stages run alone, without a CheckpointManager (save/, restore/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointManager, IntegrityError, StepExistsError
from ckptstore.codec.tree import STATE_FORMAT
from ckptstore.dist import Coordinator
from ckptstore.restore import read, select
from ckptstore.retention import as_policy
from ckptstore.save import admit, commit, encode
from ckptstore.save.jobs import SaveJob, SaveOptions
from ckptstore.session import Session
from ckptstore.storage import open_storage

OPTS = SaveOptions(
    fmt="safetensors", compression=None, async_save=False, allow_pickle=False, barrier_timeout=60
)


def session_at(root: Path) -> Session:
    storage = open_storage(root)
    return Session(
        storage=storage,
        coord=Coordinator(60, enabled=False),
        policy=as_policy(None),
        peers=[0],
        split=False,
        lock=storage.writer_lock(),
    )


def test_encode_alone_gives_the_tree_and_the_tensors_by_group() -> None:
    model = torch.nn.Linear(3, 2)
    got = encode.encode(
        {"model": model, "a b": {"x": 1}},
        None,
        None,
        allow_pickle=False,
        fmt="safetensors",
        compression=None,
        staging=None,
    )
    tree = json.loads(got.tree)
    assert tree["ckptstore_state"] == STATE_FORMAT
    assert tree["root"]["keys"] == ["model", "a b"]
    assert set(got.groups) == {"model"}  # the plain entry holds no tensor
    assert torch.equal(got.groups["model"]["weight"], model.weight.detach())
    assert encode.group_name("a b", 1) == "_1"  # not a safe file stem


def test_commit_stage_alone_commits_a_step_the_manager_restores(tmp_path: Path) -> None:
    session = session_at(tmp_path)
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    encoded = encode.encode(
        {"w": weight},
        None,
        None,
        allow_pickle=False,
        fmt="safetensors",
        compression=None,
        staging=None,
    )
    job = SaveJob(step=7, encoded=encoded, metrics={"loss": 1.5}, metadata={}, rank=None)
    manifest = commit.commit_job(session, job, OPTS)
    assert manifest.step == 7
    assert manifest.metrics == {"loss": 1.5}
    assert (tmp_path / "step-000000000007" / "manifest.json").is_file()
    assert 7 in session.known_good  # what the session knows follows the commit
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [7]
        assert torch.equal(mgr.load(7)["w"], weight)


def test_admit_alone_refuses_an_older_step_and_a_committed_one(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(5, {"x": torch.ones(2)})
    session = session_at(tmp_path)
    assert admit.admit(session, 6, {}, allow_older=False) == (None, False)
    refusal, replace = admit.admit(session, 3, {}, allow_older=False)
    assert isinstance(refusal, ValueError)
    assert not replace
    assert "refusing to save step 3" in str(refusal)
    assert "newest 5" in str(refusal)
    refusal, _ = admit.admit(session, 5, {}, allow_older=True)
    assert isinstance(refusal, StepExistsError)
    assert session.lock is not None
    assert session.lock.is_locked
    session.lock.release()


def test_restore_stages_alone_select_newest_first_and_read_checked_bytes(
    tmp_path: Path,
) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": torch.zeros(3)})
        mgr.save(2, {"x": torch.full((3,), 2.0)})
    session = session_at(tmp_path)
    assert select.candidates(session, None) == [2, 1]
    assert select.candidates(session, 1) == [1]
    out, kinds = read.decode(session, 2, None, allow_pickle=False)
    assert torch.equal(out["x"], torch.full((3,), 2.0))
    assert kinds == {"x": None}
    # A flipped byte in the payload: the read refuses it before the value is used.
    payload = next((tmp_path / "step-000000000002").glob("x*.safetensors"))
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="step-000000000002/x"):
        read.decode(session, 2, None, allow_pickle=False)

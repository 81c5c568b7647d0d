"""Multi-rank behaviour with real processes and gloo on CPU; every test has a hard timeout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointManager
from ckptstore.errors import StateMismatchError
from tests.multirank.launch import launch, timeouts_naming, values
from tests.timing import healthy

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 3.0  # barrier_timeout of the failure scenarios
SLACK = healthy(2.5)  # "within barrier_timeout plus a few seconds" (of a busy host)


def assert_previous_is_newest(root: Path, step: int) -> None:
    mgr = CheckpointManager(root)
    assert mgr.steps() == [step]
    assert mgr.verify(step).ok
    mgr.load()
    assert not [n for n in root.iterdir() if n.name.startswith(".tmp")]


def test_replicated_save_restore(tmp_path):
    vals = values(launch("replicated", 2, tmp_path))
    for v in vals:
        assert v["step"] == 2
        assert v["restored"] == v["saved"] == vals[0]["saved"]
        assert v["exp_avg"] == v["exp_avg_saved"]
        assert v["world_size"] == 2
        assert v["manifest_steps"] == [1, 2]
    # One writer: one file per top-level key, no per-rank files.
    assert vals[0]["files"] == [
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]


def test_save_on_rank0_only_times_out_naming_absent_ranks(tmp_path):
    vals = values(launch("save_on_rank0_only", 3, tmp_path, args={"timeout": TIMEOUT}))
    r0 = vals[0]
    assert not r0["ok"]
    assert r0["error_type"] == "BarrierTimeout"
    assert r0["missing_ranks"] == [1, 2]
    assert r0["phase"] == "save:enter"
    assert r0["step"] == 2
    assert "rank(s) 1, 2 did not arrive" in r0["message"]
    assert r0["seconds"] < TIMEOUT + SLACK
    assert_previous_is_newest(tmp_path / "store", 1)


def test_refused_saves_raise_the_same_error_on_every_rank(tmp_path):
    vals = values(launch("guardrails", 2, tmp_path))
    for key, start in (
        ("older", "refusing to save step 5"),
        ("older_sharded", "refusing to save step 6"),
        ("rank0_lacks_metric", "refusing to save step 11"),
        ("older_async", "refusing to save step 7"),
    ):
        got = [v[key] for v in vals]
        assert [g["ok"] for g in got] == [False, False], (key, got)
        assert {g["error_type"] for g in got} == {"UsageError"}, (key, got)
        assert got[0]["message"] == got[1]["message"], key
        assert got[0]["message"].startswith(f"{start} in {tmp_path / 'store'}"), key
    assert "resume()" in vals[0]["older"]["message"]
    assert "metrics lack 'val_loss'" in vals[1]["rank0_lacks_metric"]["message"]
    assert all(v["only_rank0_has_it"]["ok"] for v in vals)
    assert [v["steps"] for v in vals] == [[12], [12]]


def _one_error_everywhere(vals: list[Any], key: str, error_type: str) -> str:
    """The message of the one error of type ``error_type`` that ``key`` raised on every rank."""
    got = [v[key] for v in vals]
    assert [g["ok"] for g in got] == [False] * len(got), (key, got)
    assert {g["error_type"] for g in got} == {error_type}, (key, got)
    assert len({g["message"] for g in got}) == 1, (key, got)
    return str(got[0]["message"])


def test_a_replicated_state_that_differs_between_ranks_is_named_not_dropped_silently(tmp_path):
    vals = values(launch("replicated_state_differs", 2, tmp_path))
    head = "a replicated save writes rank 0's state alone, and rank(s) 1 hold state it lacks"
    r0 = vals[0]
    assert len(r0["after_list"]) == 1
    assert r0["after_list"][0].startswith(
        f"[rank 0] step 2: {head} (rank 1: other entries, dtypes or "
    )
    assert "shapes in 'seen'): theirs is not saved" in r0["after_list"][0]
    assert len(r0["after_repeat"]) == 2  # step 4 repeated step 2's: not said again
    assert r0["after_repeat"][1].startswith(f"[rank 0] step 3: {head} (rank 1: also 'loader')")
    assert r0["warnings"] == r0["after_repeat"]  # steps 5 and 6: nothing of rank 1's lost
    assert vals[1]["warnings"] == []  # rank 0 tells
    assert [v["steps"] for v in vals] == [[1, 2, 3, 4, 5, 6]] * 2
    assert [v["saved_seen"] for v in vals] == [[0, 1, 2]] * 2  # rank 0's, as documented


def test_calls_that_differ_between_ranks_are_refused_on_every_rank(tmp_path):
    """Collectives pair by order: a save of step 61 on rank 1 committed rank 0's step 62
    holding rank 1's state, a restore(step=4) on rank 1 returned step 2 there, and a save
    met a restore (found by review). Now every rank raises the same UsageError at once."""
    vals = values(launch("calls_differ", 2, tmp_path))
    for key, (mine, theirs) in {
        "steps_differ": ("save(step=62, sharded=True", "save(step=61, sharded=True"),
        "sharded_differs": ("save(step=6, sharded=False", "save(step=6, sharded=True"),
        "restore_differs": ("restore(step=2,", "restore(step=4,"),
        "solo": ("save(step=102,", "save(step=8,"),
        "mixed": ("restore(step=2,", "save(step=10,"),
        "resume_mixed": ("resume(strict=True,", "save(step=10,"),
    }.items():
        msg = _one_error_everywhere(vals, key, "UsageError")
        assert msg.startswith(f"the ranks made different calls: rank 0: {mine}"), (key, msg)
        assert f"rank 1: {theirs}" in msg, (key, msg)
    got = [v["bad_args"] for v in vals]
    assert [g["error_type"] for g in got] == ["ConfigError", "ConfigError"], got
    assert got[0]["message"] == got[1]["message"]
    assert got[0]["message"].startswith("rank 1: metadata must be JSON-serializable (no NaN)")
    # Nothing was written by any refused save; every rank still restores the newest step.
    assert [v["after"] for v in vals] == [[2, 4], [2, 4]]
    assert [v["end"] for v in vals] == [[2, 4], [2, 4]]
    assert vals[0]["restored"] == vals[1]["restored"]
    assert vals[0]["restored"][0] == 4
    got = [v["async_differs"] for v in vals]
    assert [g["error_type"] for g in got] == ["UsageError", "UsageError"], got
    assert got[0]["message"] == got[1]["message"]
    assert (
        "rank 0: save(step=12, sharded=False, allow_older=False, async_save=False)"
        in (got[0]["message"])
    )
    assert [v["after_async"] for v in vals] == [[2, 4], [2, 4]]


def test_only_the_stores_writer_prunes_or_collects_garbage(tmp_path):
    vals = values(launch("other_ranks_maintain", 2, tmp_path))
    assert [v["pruned"] for v in vals] == [[], []]
    assert [v["gc"] for v in vals] == [[], []]
    assert [v["in_flight_left"] for v in vals] == [True, True]
    assert [v["steps"] for v in vals] == [[1, 2, 3], [1, 2, 3]]


def test_a_restore_refused_on_one_rank_changes_no_rank_s_targets(tmp_path):
    vals = values(launch("restore_refused_on_one_rank", 2, tmp_path))
    for step in ("1", "2"):  # replicated, per-rank
        got = [v[step]["res"] for v in vals]
        assert [g["error_type"] for g in got] == ["StateMismatchError"] * 2, got
        assert got[0]["message"].startswith("rank 1: "), got[0]
        assert [v[step]["kept"] for v in vals] == [True, True], step
    got = [v["applied"] for v in vals]  # rank 0 used to return 3 and train on alone
    assert [g["ok"] for g in got] == [False, False], got
    assert got[0]["error_type"] == got[1]["error_type"], got
    assert got[0]["message"].startswith("rank 1: "), got[0]
    assert "cannot take it (injected)" in got[0]["message"]
    assert [v["then"] for v in vals] == [[2, True], [2, True]]


def test_rank_exits_before_save(tmp_path):
    res = launch("rank_exits_before_save", 3, tmp_path, args={"timeout": TIMEOUT})
    assert res[1].returncode == 3
    for v in timeouts_naming(res, 1):
        assert v["phase"] == "save:enter"
        assert v["seconds"] < TIMEOUT + SLACK
    assert_previous_is_newest(tmp_path / "store", 1)


def test_rank_exits_in_the_middle_of_the_commit(tmp_path):
    res = launch("rank_exits_mid_commit", 2, tmp_path, args={"timeout": TIMEOUT})
    assert res[1].returncode == 3
    (v,) = timeouts_naming(res, 1)
    assert v["phase"] == "save:write"
    assert v["seconds"] < TIMEOUT + SLACK
    assert_previous_is_newest(tmp_path / "store", 1)


def test_rank0_raising_during_serialization_raises_on_every_rank(tmp_path):
    vals = values(launch("rank0_raises_in_serialization", 2, tmp_path))
    for v in vals:
        assert v["first"]["error_type"] == "UnsafeCheckpointError"
        assert "state['extra']['obj']" in v["first"]["message"]
        assert v["second"] == {"ok": True, "value": 3, "seconds": v["second"]["seconds"]}
        assert v["steps"] == [1, 3]


def test_sharded_roundtrip_and_refusal_on_other_world_size(tmp_path):
    vals = values(launch("sharded_roundtrip", 2, tmp_path))
    for rank, v in enumerate(vals):
        assert v["step"] == 1
        assert v["sharded"] is True
        assert v["world_size"] == 2
        assert v["shard"] == [100.0 * rank + i for i in range(6)]
        assert v["meta"] == {"rank": rank}
        assert v["model_ok"] is True
    assert "model.rank00001.safetensors" in vals[0]["files"]
    assert "state.rank00000.json" in vals[0]["files"]
    other = values(launch("sharded_restore_other_world", 3, tmp_path))
    for v in other:
        assert v["error_type"] == "StateMismatchError"
        assert "saved with sharded=True by 2 ranks, and this job has 3" in v["message"]
        assert "load(step, rank=r)" in v["message"]
    # One process without a process group: never rank 0's part silently.
    mgr = CheckpointManager(tmp_path / "store")
    with pytest.raises(StateMismatchError, match="per-rank state saved with sharded=True by 2"):
        mgr.load(1)
    with pytest.raises(StateMismatchError, match="restores only on the same world size"):
        mgr.restore({"shard": torch.zeros(6)})
    # Asking for one rank's part explicitly is allowed.
    assert mgr.load(1, rank=1)["shard"].tolist() == [100.0 + i for i in range(6)]


def test_sharded_save_with_full_disk_on_one_rank(tmp_path):
    vals = values(launch("sharded_disk_full", 2, tmp_path))
    for rank, v in enumerate(vals):
        f = v["failed"]
        assert f["error_type"] == "CommitError", f
        assert "rank(s) 1 failed" in f["message"]
        assert "disk is full" in f["message"] or "No space left" in f["message"]
        assert "step 1 is still the newest" in f["message"]
        assert v["steps"] == [1]
        assert v["restored_step"] == 1
        assert v["shard"] == [100.0 * rank + i for i in range(6)]
    assert not [n for n in (tmp_path / "store").iterdir() if n.name.startswith(".tmp")]


def test_restore_falls_back_to_the_same_step_on_every_rank(tmp_path):
    vals = values(launch("corrupt_newest", 2, tmp_path))
    assert [v["step"] for v in vals] == [1, 1]
    assert vals[0]["digest"] == vals[1]["digest"]
    assert vals[0]["verify2"] is False


def test_broadcast_restore_from_node_local_disk(tmp_path):
    vals = values(launch("broadcast_restore", 2, tmp_path))
    for v in vals:
        assert v["step"] == 1
        assert v["digest"] == v["saved"]
        assert v["value"] == 1
        assert v["zstd"] == [2, v["saved"], 2]  # torch format, zstd: byte-exact too
    assert vals[1]["local_files"] == []  # rank 1 never had the files


def test_ddp_ema_rebuild_and_restore(tmp_path):
    vals = values(launch("ddp_ema", 2, tmp_path))
    for v in vals:
        assert v["s1"] == 1
        assert v["rebuilt_equals_model"] is True
        assert v["s2"] == 2
        assert v["ema_restored"] is True
        assert v["ema_differs_from_model"] is True
        assert v["n_averaged"] == v["n_saved"] == 3
    assert vals[0]["after"] == vals[1]["after"]


def test_exact_resume_is_bit_identical(tmp_path):
    straight = values(launch("train_run", 2, tmp_path / "a", args={"total": 9}))
    crashed = launch("train_run", 2, tmp_path / "b", args={"total": 9, "stop_at": 4})
    assert all(r.returncode == 0 and not r.ok and r.error_type is None for r in crashed)
    resumed = values(launch("train_run", 2, tmp_path / "b", args={"total": 9}))
    for a, b in zip(straight, resumed, strict=True):
        assert b["start"] == 4  # newest checkpoint was step 3
        assert a["model"] == b["model"]
        assert a["ema"] == b["ema"]
        assert a["opt"] == b["opt"]
        assert a["lr"] == b["lr"]
    assert straight[0]["model"] == straight[1]["model"]  # DDP kept ranks in sync
    assert torch.__version__  # keep the import honest for type checkers

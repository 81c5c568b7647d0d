"""Power loss at every point of a sharded save of 2 real ranks: shared store and node-local roots.

Each rank of an FSDP2 job (gloo on CPU) records the system calls of its local backend while
it saves step 3, commits it and applies retention (``power_scenarios.power_record``); the
logs, merged by time, rebuild the machine's disk after every call (``tests/power.py``: file
bytes count once fsynced, directory entries once their directory is fsynced). A cut hits
every node at the same moment. For each distinct disk a cut may leave (three views of what
survives, see ``tests/power.py``), on each store root:

- every step committed before is there, except those retention was deleting; step 3 is
  there once every rank saw its commit; nothing else looks committed;
- every visible step verifies deeply (on node-local roots: the files of the node's ranks,
  every file of no rank, the marker);
- on a shared store, the newest step restores in one process with exactly its own values.

Then, once per distinct set of visible steps, the job restarts on the cut disk: 2 ranks
``resume`` (the newest step visible and whole on every node, never an older one while a
newer one is whole), get bit-exact values, and save and verify the next step.

The last tests replay the same logs with one fsync dropped (a rank's shard, a node's tmp
directory before its publish) and show that the checks then fail.
"""

from __future__ import annotations

import pickle
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointManager
from ckptstore.storage import wait_for_deletions
from tests._helpers import visible_problems
from tests.multirank.dtensor_scenarios import digests, make_net
from tests.multirank.launch import launch, values
from tests.multirank.power_scenarios import BEFORE, NEW, disks
from tests.power import VIEWS, PowerModel, materialize

pytestmark = pytest.mark.timeout(300)

SHARED = {"roots": ["shared", "shared"], "keep": 2}
NODES = {"roots": ["node0", "node1"], "keep": 2}


_RECORDED: dict[str, tuple[Path, dict[int, Any]]] = {}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Callable[[dict[str, Any]], Any]:
    """Run a job once per module (its workdir, with ``start.pkl`` and ``events.rankN.pkl``,
    and the digests of each step); the tests replay its logs as they need."""

    def get(job: dict[str, Any]) -> tuple[Path, dict[int, Any]]:
        key = repr(sorted(job.items()))
        if key not in _RECORDED:
            work = tmp_path_factory.mktemp("job")
            got = values(launch("power_scenarios:power_record", 2, work, timeout=200, args=job))
            assert got[0] == got[1]
            _RECORDED[key] = (work, {int(k): v for k, v in got[0].items()})
        return _RECORDED[key]

    return get


def replay(
    work: Path, job: dict[str, Any], skip: Callable[[str, bool], bool] | None = None
) -> PowerModel:
    start = pickle.loads((work / "start.pkl").read_bytes())
    logs = [pickle.loads((work / f"events.rank{r}.pkl").read_bytes()) for r in range(2)]
    return PowerModel.replay(start, logs, stores=tuple(sorted(set(job["roots"]))), skip_fsync=skip)


def one_process_digests(root: Path, step: int) -> dict[str, str]:
    """The step restored in one process (no process group) into a plain model."""
    model = make_net(seed=42)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": model, "optimizer": opt}, step=step, strict=False)
    return digests(model, opt)


def check_root(
    root: Path, must: set[int], may: set[int], shared: bool, saved: dict[int, Any]
) -> tuple[list[int], list[str]]:
    """The steps visible in one store root after a cut, and what is wrong there."""
    with CheckpointManager(root) as mgr:
        steps, problems = visible_problems(mgr, must, may)
    if shared and steps and not problems:
        try:
            if one_process_digests(root, steps[-1]) != saved[steps[-1]]:
                problems.append(f"newest step {steps[-1]} does not restore its own values")
        except Exception as e:  # any failure is the finding
            problems.append(f"newest step {steps[-1]} does not restore: {e}")
    wait_for_deletions()
    return steps, problems


def _in_a_step(rel: str) -> bool:
    """Whether ``rel`` (``ROOT/NAME/...``) lies in a committed step's directory."""
    parts = rel.split("/")
    return len(parts) > 1 and parts[1].startswith("step-")


def check_every_cut(
    model: PowerModel, base: Path, job: dict[str, Any], saved: dict[int, Any]
) -> tuple[int, dict[tuple[Any, ...], Path], list[str]]:
    """Every distinct disk a cut leaves, checked root by root.

    Returns the number of distinct disks, one kept disk per outcome (the steps visible on
    each root, and whether step 3 was acknowledged) for the restart check, and the
    violations.
    """
    acks = [i for i, m in model.markers if m == "acked"]
    assert len(acks) == 2, model.markers
    stores = sorted(set(job["roots"]))
    doomed = set(BEFORE[: max(0, len(BEFORE) + 1 - job["keep"])]) if job["keep"] else set()
    seen: set[Any] = set()
    # What the checks of a root read is its committed steps: disks that differ only in tmp
    # and trash directories (a save's files growing, a deletion going on) are checked once.
    checked: set[Any] = set()
    kept: dict[tuple[Any, ...], Path] = {}
    violations: list[str] = []
    for i, (label, snaps) in enumerate(model.snapshots):
        acked = i >= min(acks)  # a rank saw the commit: it may act on it
        must = (set(BEFORE) - doomed) | ({NEW} if acked else set())
        may = doomed | {NEW}
        for view in VIEWS:
            snap = snaps[view]
            key = (frozenset(snap.items()), acked)
            if key in seen:
                continue
            seen.add(key)
            steps_key = (frozenset((k, v) for k, v in snap.items() if _in_a_step(k)), acked)
            if steps_key in checked:
                continue
            checked.add(steps_key)
            d = base / f"cut-{uuid.uuid4().hex[:8]}"
            materialize(snap, str(disks(d)))
            visible = []
            for store in stores:
                steps, problems = check_root(disks(d) / store, must, may, len(stores) == 1, saved)
                visible.append(tuple(steps))
                violations += [f"cut ({view}) after #{i} {label}: {store}: {p}" for p in problems]
            outcome = (tuple(visible), acked)
            if outcome not in kept:
                kept[outcome] = d
            else:
                shutil.rmtree(d)
    return len(seen), kept, violations


def restart(
    base: Path, kept: dict[tuple[Any, ...], Path], job: dict[str, Any], saved: dict[int, Any]
) -> list[str]:
    """The job restarted on each kept disk (one launch of 2 ranks goes through them all)."""
    cases = sorted(kept.items(), key=lambda kv: repr(kv[0]))
    args = {**job, "cuts": [str(d.relative_to(base)) for _, d in cases]}
    got = values(launch("power_scenarios:power_resume", 2, base, timeout=240, args=args))
    problems = []
    for n, ((visible, acked), _) in enumerate(cases):
        want = max(set.intersection(*(set(v) for v in visible)))
        for rank, outs in enumerate(got):
            v = outs[n]
            where = f"restart on {visible} (acked: {acked}), rank {rank}"
            if v["step"] != want or (acked and v["step"] != NEW):
                problems.append(f"{where}: resumed step {v['step']}, want {want}")
            elif v["digests"] != saved[want]:
                problems.append(f"{where}: step {want} restored other values")
            if not v["saved"]["ok"]:
                problems.append(f"{where}: the next save does not verify: {v['saved']['problems']}")
    return problems


@pytest.mark.parametrize(
    ("job", "async_save"),
    [(SHARED, False), (SHARED, True), (NODES, False)],
    ids=["shared-sync", "shared-async", "nodes-sync"],
)
def test_power_cut_during_a_sharded_save(
    tmp_path: Path, recorded: Callable[[dict[str, Any]], Any], job: dict[str, Any], async_save: bool
) -> None:
    job = {**job, "async": async_save}
    work, saved = recorded(job)
    model = replay(work, job)
    labels = [label for label, _ in model.snapshots]
    # Both ranks' shards and the commit are in the merged trace, in the protocol's order.
    shard1 = max(i for i, s in enumerate(labels) if s.startswith("fsync") and "rank00001" in s)
    publish = [
        i
        for i, s in enumerate(labels)
        if s.startswith("rename ") and ".tmp-step-000000000003" in s.split(" -> ")[0]
    ]
    assert publish, labels
    assert shard1 < min(publish), labels
    ndisks, kept, violations = check_every_cut(model, tmp_path, job, saved)
    assert ndisks >= 6, labels
    assert not violations, "\n".join(violations)
    # The outcomes a cut can leave include step 3 whole (and acknowledged) and not there.
    outcomes = {(vis, acked) for vis, acked in kept}
    assert any(acked for _, acked in outcomes), outcomes
    assert any(all(NEW not in v for v in vis) for vis, _ in outcomes), outcomes
    problems = restart(tmp_path, kept, job, saved)
    assert not problems, "\n".join(problems)
    # The last disk is the whole story: step 3 committed on every root, retention done.
    last = model.snapshots[-1][1]["strict"]
    for store in sorted(set(job["roots"])):
        assert f"{store}/step-000000000003/manifest.json" in last
        assert f"{store}/step-000000000001/manifest.json" not in last


def _shard_of_rank1(rel: str, is_dir: bool) -> bool:
    return not is_dir and "_shards.rank00001" in rel


def _node1_tmp_dir(rel: str, is_dir: bool) -> bool:
    return is_dir and rel.startswith("node1/.tmp-step-000000000003")


@pytest.mark.parametrize(
    ("job", "skip", "symptom"),
    [
        (SHARED, _shard_of_rank1, "does not verify"),
        (NODES, _shard_of_rank1, "node1: visible step 3 does not verify"),
        (NODES, _node1_tmp_dir, "node1: committed step(s) [3] lost"),
    ],
    ids=["shared-shard", "nodes-shard", "nodes-tmp-dir"],
)
def test_each_fsync_of_a_sharded_commit_is_needed(
    tmp_path: Path,
    recorded: Callable[[dict[str, Any]], Any],
    job: dict[str, Any],
    skip: Callable[[str, bool], bool],
    symptom: str,
) -> None:
    job = {**job, "async": False}
    work, saved = recorded(job)  # the run test_power_cut_during_a_sharded_save checks whole
    _, _, violations = check_every_cut(replay(work, job, skip), tmp_path / "skip", job, saved)
    assert any(symptom in v for v in violations), violations

"""Randomized resharding, a few fixed trials: random DTensor shapes (empty and uneven
shards, 0-d tensors, tensors over a chunk block), dtypes (15) and placements on 1-D and 2-D
meshes (FSDP2 over TP's ``_StridedShard`` too), some tensors plain on either side, through
``mgr.save``/``restore`` or DCP's API over ckptstore; saved on 1-4 ranks and restored on
1-4, then in one process, each byte compared with what was saved
(``tests/multirank/fuzz_scenarios.py``; ``tools/reshard_fuzz.py`` runs campaigns of them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.fuzz_scenarios import make_module_trial, run_module_trial, run_trial, trial_of

#: Seeds whose trials between them save and restore on every world size from 1 to 4, on
#: 2x2 meshes both ways, with plain tensors saved into DTensors and the reverse, float8
#: and unsigned integers wider than a byte, DCP's API over ckptstore on both sides, and
#: ``(_StridedShard, Shard)`` saved and restored into, its rows divisible or not.
SEEDS = (38, 1, 5, 14, 9, 2, 11, 21, 64)
#: The format each of these saves: strided placements whose split factor divides the rows
#: go in the split index (5); others keep format 2's full chunk list.
FORMATS = {64: 5, 9: 2, 2: 4}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_trial_restores_every_byte(tmp_path: Path, seed: int) -> None:
    problems, trial = run_trial(seed, tmp_path / "trial")
    assert problems == [], (problems, trial)
    assert trial["format"] == FORMATS.get(seed, trial["format"])


def test_the_seeds_cover_what_the_docstring_says() -> None:
    trials = [trial_of(seed) for seed in SEEDS]
    assert {t["save_world"] for t in trials} == {1, 2, 3, 4}
    assert {t["restore_world"] for t in trials} == {1, 2, 3, 4}
    assert [2, 2] in [t["save_mesh"] for t in trials]
    assert [2, 2] in [t["restore_mesh"] for t in trials]
    tensors = [x for t in trials for x in t["tensors"]]
    assert any(x["save_plain"] and not x["restore_plain"] for x in tensors)
    assert any(x["restore_plain"] and not x["save_plain"] for x in tensors)
    assert any(0 in x["shape"] for x in tensors)
    assert any(x["shape"] == [] for x in tensors)
    assert any(len(x["shape"]) and x["shape"][-1] >= 40_000 for x in tensors)
    assert any(x["dtype"].startswith("float8") for x in tensors)
    assert any(x["dtype"] in ("uint16", "uint32", "uint64") for x in tensors)
    assert any(t["save_api"] == "dcp" for t in trials)
    assert any(t["restore_api"] == "dcp" for t in trials)
    for side in ("save", "restore"):
        assert any(x[side][0].startswith("X") and not x[f"{side}_plain"] for x in tensors)


#: Module trials that between them save and restore under each parallelism (FSDP2, TP,
#: HSDP, FSDP2 over TP), on 1, 3 and 4 ranks, asynchronously too, with a layer over several
#: chunk blocks and an odd last layer (replicated under TP); and a replicated save (one
#: process) restored into FSDP2 over TP.
MODULE_SEEDS = (17, 3, 7, 67, 167)


@pytest.mark.parametrize("seed", MODULE_SEEDS)
def test_a_random_model_restores_under_another_parallelism(tmp_path: Path, seed: int) -> None:
    problems, trial = run_module_trial(seed, tmp_path / "trial")
    assert problems == [], (problems, trial)


def test_the_module_seeds_cover_what_they_say() -> None:
    trials = [make_module_trial(seed) for seed in MODULE_SEEDS]
    kinds = {"fsdp", "tp", "hsdp", "fsdp_tp"}
    assert {t["save"]["kind"] for t in trials} == kinds | {"plain"}
    assert {t["restore"]["kind"] for t in trials} == kinds
    assert any(3 in (t["save"]["world"], t["restore"]["world"]) for t in trials)
    assert any(t["save_kw"]["async_save"] for t in trials)
    assert any(max(t["dims"]) >= 3000 for t in trials)
    assert any(len(t["bias"]) % 2 for t in trials)

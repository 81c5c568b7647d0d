"""Mutated metadata of a sharded step, the manifest forged to match (``tests/metafuzz.py``;
``tools/meta_fuzz.py`` runs campaigns of it): a fixed run of mutations in the suite, and the
defect its first campaign found, by itself.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import MANIFEST, forge_manifest, replace_payload, step_dir, two_dtensor_steps

from ckptstore import CheckpointManager, CkptStoreError
from tests.metafuzz import check_mutation, make_base, make_plain_base, mutate
from tests.multirank.fuzz_scenarios import saved_format

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("seed", "kind"),
    [(3, "dtensor"), (805, "dtensor"), (6, "plain"), (7, "plain")],
)
def test_forged_metadata_is_refused_or_read_exactly(tmp_path: Path, seed: int, kind: str) -> None:
    # A base store: two DTensor steps saved by a real job (trial seed 3: 2 ranks, format 4;
    # 805: 4 ranks, format 5, _StridedShard in the split index), or two replicated steps
    # saved by this process (6: safetensors, 7: torch's format). Then 32 mutations of
    # step 2, each checked: clear errors or exact bytes, step 1 restored; every 8th also
    # restored by a real job on the trial's restore world (4 a seed: suite time).
    make = make_base if kind == "dtensor" else make_plain_base
    base, trial = make(seed, tmp_path / "base")
    if seed == 805:
        assert saved_format(base) == 5
    rnd = random.Random(seed)
    found = {}
    for i in range(32):
        what, problems = check_mutation(base, trial, tmp_path / "scratch", rnd, wide=i % 8 == 0)
        if problems:
            found[f"#{i} {what}"] = problems
    assert found == {}


def test_mutate_changes_exactly_one_value() -> None:
    doc = {"a": [1, 2, {"b": "x"}], "c": 3.5}
    seen = set()
    for seed in range(200):
        new, what = mutate(json.loads(json.dumps(doc)), random.Random(seed))
        seen.add(what.split(":")[0])
        # As JSON (True is 1 to Python); a swap may pick an equal value.
        assert json.dumps(new) != json.dumps(doc) or what.endswith("swap"), what
    assert {"a", "a/2/b", "c", "(root)"} <= seen


def _key_is_a_list(state_json: bytes, where: str) -> bytes:
    tree = json.loads(state_json)
    node = tree["root"] if where == "root" else tree["root"]["vals"][0]  # or "model"'s dict
    assert node["t"] == "dict"
    node["keys"][0] = [node["keys"][0]]  # ["model"] or ["w"]: a key no encoder writes
    return json.dumps(tree).encode()


def _falls_back(root: Path, values: dict[int, torch.Tensor], state: Any, error: str) -> None:
    """Step 2 is refused with ``error`` by restore(step=2) and load(2); restore() gives 1."""
    with CheckpointManager(root) as mgr:
        with pytest.raises(CkptStoreError, match=error):
            mgr.restore(state(0), step=2)
        target = state(0)
        assert mgr.restore(target) == 1
        assert torch.equal(target["model"]["w"].to_local(), values[1])
        with pytest.raises(CkptStoreError, match=error):
            mgr.load(2)


@pytest.mark.parametrize("where", ["root", "nested"])
def test_a_dict_key_that_is_a_list_is_refused_and_the_good_step_restores(
    mesh: object, tmp_path: Path, where: str
) -> None:
    # The first campaign's finding: a forged state.json whose dict key is a list reached
    # restore's target lookup before the decoder could refuse it, and restore() raised
    # TypeError ("unhashable type: 'list'") instead of falling back.
    root = tmp_path / "s"
    values, state = two_dtensor_steps(mesh, root, 5, (8, 3))
    step = root / step_dir(2)
    forged = _key_is_a_list((step / "state.json").read_bytes(), where)
    replace_payload(step, "state.json", forged)
    _falls_back(root, values, state, "str or int")


def test_a_dtensor_step_whose_manifest_lists_no_index_is_refused(
    mesh: object, tmp_path: Path
) -> None:
    # The second: a forged manifest of a DTensor step without its dtensors.json entry made
    # load() and restore() raise KeyError('dtensors.json').
    root = tmp_path / "s"
    values, state = two_dtensor_steps(mesh, root, 5, (8, 3))
    mpath = root / step_dir(2) / MANIFEST
    mpath.write_bytes(forge_manifest(mpath.read_bytes(), lambda d: d["files"].pop("dtensors.json")))
    _falls_back(root, values, state, "lists no dtensors.json")


@pytest.mark.parametrize(
    ("placements", "version", "error"),
    [
        # A format-4 step spells no _StridedShard: refused, not computed.
        (["_S(0, 1)"], 4, r"placements \['_S\(0, 1\)'\] are not R or S\(dim\)"),
        # Format 5 admits it only before an S(d) of sf ranks.
        (["_S(0, 1)"], 5, r"sharded as \['_S\(0, 1\)'\], not as _S\(d, sf\) then S\(d\)"),
    ],
)
def test_a_strided_placement_the_index_cannot_compute_is_refused_and_the_good_step_restores(
    mesh: object, tmp_path: Path, placements: list[str], version: int, error: str
) -> None:
    root = tmp_path / "s"
    values, state = two_dtensor_steps(mesh, root, 5, (8, 3))
    step = root / step_dir(2)
    index = json.loads((step / "dtensors.json").read_bytes())
    index["tensors"]["model/w"]["placements"] = placements
    replace_payload(step, "dtensors.json", json.dumps(index).encode())
    mpath = step / MANIFEST
    forged = forge_manifest(mpath.read_bytes(), lambda d: d.update(format_version=version))
    mpath.write_bytes(forged)
    _falls_back(root, values, state, error)

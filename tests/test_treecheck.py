"""Deep ``verify`` refuses what a restore refuses in a state file (``codec/treecheck.py``).

Review (s39) #1: deep verify checked only that ``state.json`` was JSON. A step whose state
held a malformed node, a tensor no payload held, or a dtype its payload contradicted
verified OK and did not restore; ``prune`` keeps "the newest step that verifies", and
deleted the older steps that did. The check walks the tree without torch, so it is held
here against the decoder itself: over hundreds of edits of a state of every node type,
the check reports a problem exactly where the decoder refuses.
"""

from __future__ import annotations

import collections
import copy
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import replace_payload, step_dir, step_path
from torch import nn

from ckptstore import CheckpointManager
from ckptstore.codec import safetensors as st
from ckptstore.codec.dtypes import SAFETENSORS_CODES
from ckptstore.codec.tree import TreeDecoder
from ckptstore.codec.treecheck import check_state
from ckptstore.errors import CkptStoreError, IntegrityError, StateMismatchError
from ckptstore.ops.verify import verify_checkpoint
from ckptstore.restore.plan import unwrap
from ckptstore.storage import open_storage


def rich_state() -> dict[str, Any]:
    """A state with a node of every type the tree codec writes (pickles aside)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    base = torch.arange(12, dtype=torch.float32)
    return {
        "model": model,
        "optimizer": opt,
        "step": 7,
        "big": 2**100,
        "nan": float("nan"),
        "tuple": (1, "a", 2.5, None, True),
        "odict": collections.OrderedDict(a=1, b=[1, 2]),
        "counter": collections.Counter(a=2),
        "bytes": b"xy",
        "bytearray": bytearray(b"z"),
        "dtype": torch.float16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "npscalar": np.float32(1.5),
        "ndarray": np.arange(4, dtype=np.int64),
        "base": base,
        "view": base[2:8].view(2, 3),
        "param": nn.Parameter(torch.ones(2)),
        "grad": torch.ones(3, requires_grad=True),
        "ints": torch.arange(5),
        "keys": {1: "int key", "s": {"nested": [torch.zeros(2, 2)]}},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("tree") / "ckpt"
    with CheckpointManager(root, keep=None) as mgr:
        mgr.save(1, rich_state())
    step = root / step_dir(1)
    doc = json.loads((step / "state.json").read_text())
    contents: dict[str, Any] = {}
    for f in step.glob("*.safetensors"):
        data = f.read_bytes()
        header = st.parse_header(data, len(data), f.name)
        contents[f.name.split(".")[0]] = {
            k: (SAFETENSORS_CODES[code], shape) for k, (code, shape, _a, _b) in header.codes.items()
        }
    return root, doc, contents


def decoder_refuses(doc: dict[str, Any], contents: dict[str, Any]) -> bool:
    """Whether a restore's decoder refuses ``doc`` (each payload tensor made from its header)."""

    def get(group: str, key: str) -> torch.Tensor:
        if group not in contents:
            raise IntegrityError(f"no payload file for group {group!r}")
        got = contents[group].get(key)
        if got is None:
            raise IntegrityError(f"tensor {key!r} missing from payload {group!r}")
        dtype, shape = got
        return torch.zeros(shape, dtype=getattr(torch, dtype))

    dec = TreeDecoder(get, where="state.json")
    root = doc["root"]
    try:
        for k, node in zip(root["keys"], root["vals"], strict=True):
            dec.decode(unwrap(node)[1], (k,))
    except CkptStoreError:
        return True
    return False


def _positions(node: Any, out: list[tuple[Any, Any]]) -> None:
    if isinstance(node, dict):
        for k in list(node):
            out.append((node, k))
            _positions(node[k], out)
    elif isinstance(node, list):
        for i in range(len(node)):
            out.append((node, i))
            _positions(node[i], out)


_VALUES: list[Any] = [
    None,
    0,
    -1,
    3,
    2.5,
    True,
    "x",
    "",
    "float",
    "int32",
    "float64",
    "cpu",
    "cuda:0",
    "cuda:x",
    "F32",
    "tensor",
    "view",
    "dict",
    "tupel",
    "zz",
    [],
    [1],
    [-1],
    [2, 3],
    [1.5],
    ["a"],
    {},
    {"t": "dict"},
    {"t": "tensor"},
    1 << 70,
    "00ff",
    "3ff8000000000000",
    "AAAA",
    "!!",
]


def mutate(doc: dict[str, Any], rng: random.Random) -> str:
    spots: list[tuple[Any, Any]] = []
    _positions(doc["root"]["vals"], spots)
    container, key = rng.choice(spots)
    if isinstance(container, dict) and rng.random() < 0.25:
        del container[key]
        return f"del {key!r}"
    value = copy.deepcopy(rng.choice(_VALUES))
    container[key] = value
    return f"{key!r} = {value!r}"


def test_the_check_refuses_exactly_what_the_decoder_refuses(
    saved: tuple[Path, dict[str, Any], dict[str, Any]],
) -> None:
    _, doc, contents = saved
    assert check_state(doc, contents, "state.json") == []
    assert not decoder_refuses(doc, contents)
    rng = random.Random(39)
    refused = 0
    disagree = []
    for i in range(600):
        edited = copy.deepcopy(doc)
        what = mutate(edited, rng)
        mine = check_state(edited, contents, "state.json")
        theirs = decoder_refuses(edited, contents)
        refused += theirs
        if bool(mine) != theirs:
            disagree.append((i, what, mine, theirs))
    assert disagree == [], disagree[:5]
    assert 150 < refused < 590  # both verdicts were exercised


def test_payload_contents_are_held_against_the_state(
    saved: tuple[Path, dict[str, Any], dict[str, Any]],
) -> None:
    _, doc, contents = saved
    edited = copy.deepcopy(contents)
    key = next(iter(edited["model"]))
    dtype, shape = edited["model"][key]
    edited["model"][key] = ("int32" if dtype != "int32" else "float32", shape)
    problems = check_state(doc, edited, "s/state.json")
    assert len(problems) == 1
    assert problems[0].startswith("s/state.json: state['model']")
    assert f"payload model:{key} is torch." in problems[0]
    assert problems[0].endswith("; the checkpoint is corrupt")
    del edited["model"][key]
    assert f"tensor {key!r} missing from payload 'model'" in check_state(doc, edited, "s")[0]
    assert "no payload file for group 'model'" in check_state(doc, {}, "s")[0]
    # A torch zip's contents are unknown here: its references are taken on trust.
    assert check_state(doc, dict.fromkeys(contents), "s") == []


def forge_state(root: Path, step: int, edit: Any) -> None:
    """Edit ``state.json`` of ``step`` and re-sign it in the manifest (a forgery or a bug)."""
    path = step_path(root, step) / "state.json"
    doc = json.loads(path.read_text())
    edit(doc)
    replace_payload(step_path(root, step), "state.json", json.dumps(doc).encode())


def _fc_dtype(doc: dict[str, Any]) -> None:
    model = doc["root"]["vals"][doc["root"]["keys"].index("model")]["v"]
    model["vals"][0]["dtype"] = "int32"


def _odict_keys(doc: dict[str, Any]) -> None:
    model = doc["root"]["vals"][doc["root"]["keys"].index("model")]["v"]
    del model["keys"]


@pytest.mark.parametrize(
    ("edit", "says"),
    [(_fc_dtype, "state.json says torch.int32"), (_odict_keys, "malformed 'odict' node")],
)
def test_prune_keeps_the_older_step_a_step_that_cannot_restore_would_have_cost(
    tmp_path: Path, edit: Any, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptstore.cli import main

    root = tmp_path / "ckpt"
    model = nn.Linear(4, 3)
    with CheckpointManager(root, keep=None) as mgr:
        mgr.save(1, {"model": model})
        mgr.save(2, {"model": model})
    forge_state(root, 2, edit)
    report = verify_checkpoint(open_storage(root), 2)
    assert not report.ok
    assert any(says in p for p in report.problems), report.problems
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    capsys.readouterr()
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1, 2]  # step 1 is the newest that restores: kept
        got = nn.Linear(4, 3)
        # Review (s39) #5: a state its own payload contradicts blamed the model
        # (StateMismatchError, "build the model as it was when saved") and restore()
        # stopped there; it is the step that is corrupt, and restore() goes on to step 1.
        assert mgr.restore({"model": got}) == 1
        assert torch.equal(got.weight, model.weight)
        with pytest.raises(IntegrityError, match=says):
            mgr.restore({"model": nn.Linear(4, 3)}, step=2)
    # A model that truly differs is still told so.
    with (
        CheckpointManager(root) as mgr,
        pytest.raises(StateMismatchError, match="build the model as it was when saved"),
    ):
        mgr.restore({"model": nn.Linear(4, 5)}, step=1)


def test_verify_still_imports_no_torch(
    saved: tuple[Path, dict[str, Any], dict[str, Any]],
) -> None:
    root = saved[0]
    probe = (
        "import sys; from ckptstore.ops.verify import verify_checkpoint; "
        "from ckptstore.storage import open_storage; "
        f"r = verify_checkpoint(open_storage({str(root)!r}), 1); "
        "assert r.ok, r.problems; assert 'torch' not in sys.modules; print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.stdout.strip() == "ok", out.stderr

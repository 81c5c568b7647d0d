"""The command line starts fast: the commands that only read JSON and bytes never import torch
(1.5-2 s before any work; issue 12). Each runs in a fresh interpreter, as a user runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointManager

REPO = Path(__file__).resolve().parents[1]

#: Runs ``python -m ckptstore ARGV`` in this interpreter, then reports what it imported.
_PROBE = """
import json, runpy, sys
sys.argv = ["ckptstore", *json.loads(sys.argv[1])]
try:
    runpy.run_module("ckptstore", run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "numpy", "safetensors", "tqdm") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def probe(*argv: object) -> tuple[int, list[str], str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([str(a) for a in argv])],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    return report["code"], report["heavy"], proc.stdout


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("start") / "ckpt"
    with CheckpointManager(root, keep=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"model": torch.nn.Linear(4, 3), "step": s}, metrics={"loss": 1 / s})
    return root


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["--help"],
        ["ls", "{root}"],
        ["ls", "{root}", "--json"],
        ["verify", "{root}", "--quick"],
        ["verify", "{root}", "--all"],
        ["verify", "{root}/step-000000000002/model.safetensors"],
        ["prune", "{root}", "--keep-last", "1", "--dry-run"],
        ["prune", "{root}", "--keep-best", "1", "--metric", "loss", "--dry-run"],
        ["inspect", "{root}"],
        ["ls", "{root}/nope"],
    ],
)
def test_reading_commands_do_not_import_torch(store: Path, argv: list[str]) -> None:
    code, heavy, out = probe(*[a.format(root=store) for a in argv])
    assert code == (1 if argv[-1].endswith("nope") else 0), out
    assert heavy == [], f"{argv} imported {heavy}"
    if argv[0] == "prune":
        assert "would delete" in out


def test_import_ckptstore_does_not_import_torch() -> None:
    code = (
        "import sys, ckptstore; "
        "from ckptstore import list_store, verify_path, inspect_step, prune_store, KeepLast; "
        "assert 'torch' not in sys.modules; "
        "ckptstore.CheckpointManager; "
        "assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)

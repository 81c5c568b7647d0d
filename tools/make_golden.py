"""Write the golden checkpoints of format version 1 under ``tests/golden/``.

    .venv/bin/python tools/make_golden.py            # (re)write tests/golden/v1-*
    .venv/bin/python tools/make_golden.py --check    # compare today's output, write nothing

The state is built from explicit values (no randomness), so the payload files and
``state.json`` are reproducible byte for byte; only ``manifest.json`` differs between runs
(creation time, library versions). ``tests/test_golden.py`` loads the checked-in stores,
checks every value, and saves :func:`golden_state` again to prove the bytes have not
drifted. Regenerate only for a deliberate format change, together with a new format
version: old checkpoints must keep loading.

``torch.save`` archives are byte-reproducible with a given torch version (torch 2.13 derives
``.data/serialization_id`` from the content), but they belong to torch, not to ckptstore: a
torch upgrade may change them, so the test compares ``.pt`` bytes only under the torch
version that wrote the golden files and their tensors otherwise.
"""

from __future__ import annotations

import argparse
import collections
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstore import CheckpointManager
from ckptstore.layout import LOCK_NAME, MANIFEST_NAME, step_dirname

STEP = 1000
#: golden store directory name -> payload format
FORMATS = {"v1-safetensors": "safetensors", "v1-torch": "torch"}
METRICS = {"loss": 0.5}
METADATA = {"note": "golden v1"}
GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"


def golden_state() -> dict[str, Any]:
    """The state of the golden checkpoint: small, explicit, one of each kind of value."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4 - 0.5)
        model.bias.copy_(torch.tensor([0.25, -1.0]))
    optimizer = {  # shaped like torch.optim.Adam.state_dict(): int keys, a tuple, floats
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.full((2, 3), 0.125),
                "exp_avg_sq": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 64,
            },
            1: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.tensor([-0.5, 0.5]),
                "exp_avg_sq": torch.tensor([0.0, 1.0]),
            },
        },
        "param_groups": [
            {
                "lr": 0.001,
                "betas": (0.9, 0.999),
                "eps": 1e-08,
                "weight_decay": 0.0,
                "amsgrad": False,
                "params": [0, 1],
            }
        ],
    }
    table = torch.arange(8, dtype=torch.int64).reshape(4, 2)
    extra = {
        "bf16": torch.tensor([1.5, -0.0, math.inf, math.nan], dtype=torch.bfloat16),
        "ids": torch.tensor([-(2**40), 0, 2**62 + 1], dtype=torch.int64),
        "mask": torch.tensor([True, False, True, True]),
        "table": table,
        "tied": table,  # the same tensor twice: stored once, loads as one object
        "row": table[1],  # a view: stored as (offset, shape, stride) into "table"
        "scalar": torch.tensor(7, dtype=torch.int32),
        "empty": torch.zeros(0, 2, dtype=torch.float16),
        "tuple": (1, "two", 3.5, None),
        "neg_zero": -0.0,
        "nan": math.nan,
        "ninf": -math.inf,
        "huge": 2**100,
        "text": "ünïcode ✓",
        "bytes": b"\x00\xffck",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "np": np.arange(3, dtype=">f4"),
        "np_scalar": np.float32(1.5),
        "int_keys": {0: "a", 10: "b", 2: "c"},
        "odict": collections.OrderedDict([("z", 1), ("a", [True, False])]),
    }
    return {"model": model, "optimizer": optimizer, "extra": extra, "step": STEP}


def write_store(root: Path, fmt: str) -> Path:
    """Save :func:`golden_state` as step :data:`STEP` into a new store at ``root``.

    Returns:
        The step directory. The store holds nothing else (the writer lock file is removed).
    """
    if root.exists():
        shutil.rmtree(root)
    with CheckpointManager(root, format=fmt) as mgr:
        mgr.save(STEP, golden_state(), metrics=METRICS, metadata=METADATA)
    (root / LOCK_NAME).unlink(missing_ok=True)
    entries = sorted(p.name for p in root.iterdir())
    if entries != [step_dirname(STEP)]:
        msg = f"{root}: expected only {step_dirname(STEP)}, found {entries}"
        raise RuntimeError(msg)
    return root / step_dirname(STEP)


def reproducible_files(step_dir: Path) -> dict[str, bytes]:
    """Every file of a golden step directory except the manifest, name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir()) if p.name != MANIFEST_NAME}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    if not args.check:
        for name, fmt in FORMATS.items():
            step_dir = write_store(GOLDEN / name, fmt)
            total = sum(len(b) for b in reproducible_files(step_dir).values())
            print(f"wrote {step_dir} ({total} bytes besides the manifest)")
        return 0
    drift = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, fmt in FORMATS.items():
            today = reproducible_files(write_store(Path(tmp) / name, fmt))
            golden = reproducible_files(GOLDEN / name / step_dirname(STEP))
            for fname in sorted(set(today) | set(golden)):
                same = today.get(fname) == golden.get(fname)
                drift += not same
                print(f"{name}/{fname}: {'identical' if same else 'DIFFERS'}")
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())

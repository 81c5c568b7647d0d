"""Randomized resharding: random DTensors and models saved on one mesh, restored on another.

    python tools/reshard_fuzz.py [--trials N] [--seed S] [--kind K] [--dir DIR] [--json OUT]

Each trial (``tests/multirank/fuzz_scenarios.py``: :func:`trial_of` makes it from its seed)
draws a save world and a restore world of 1 to 4 ranks, a 1-D or 2-D mesh for each, and 8
tensors: shapes with empty and uneven shards, 0-d tensors, now and then one over a chunk
block (256 KiB); every safetensors dtype torch has; ``Replicate`` or ``Shard(d)`` on each
mesh dimension, independently on the two sides; some tensors plain (not a DTensor) on
either side; a sync or async save; ``io`` direct, buffered or auto on each side; through
``mgr.save``/``mgr.restore`` or DCP's API over ckptstore (``CkptStoreWriter``,
``CkptStoreReader``) on each side, independently. The
tensors are saved by a real gloo job of the save world and restored by one of the restore
world (forked from the test server), each rank comparing its part bit for bit with its
slice of the tensor that was saved; then, in this process, ``load`` and ``restore`` into
plain tensors are compared the same way and ``ckptstore verify`` must pass.

Module trials (odd seeds, or ``--kind modules``; :func:`make_module_trial`): a model of 1
to 5 random Linear layers (uneven sizes, now and then one over several chunk blocks), trained
2 AdamW steps under one parallelism, saved (sync or async), and restored into a model of
other weights and a fresh AdamW under another: FSDP2 on 1 to 4 ranks, tensor parallelism
(column- then row-wise pairs) on 1 to 4, HSDP on 2x2, FSDP2 over TP on 2x2; then in one
process into a plain model. Every full tensor, parameters and moments, is compared by digest.

Prints every failing trial (its spec, and its directory, kept under ``--dir``) and a
summary; exits 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; 0 when every trial restored every byte."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=1, help="the first trial's seed (then +1 each)")
    p.add_argument("--dir", type=Path, help="where trials run (kept when one fails)")
    p.add_argument("--json", metavar="OUT", help="write the summary and failures as JSON")
    p.add_argument(
        "--kind",
        choices=("both", "tensors", "modules"),
        default="both",
        help="tensor trials, module trials, or both (alternating by seed)",
    )
    a = p.parse_args(argv)
    # Imported by name: the trials live with the tests (their workers run scenarios there).
    fuzz = importlib.import_module("tests.multirank.fuzz_scenarios")

    base = a.dir or Path(tempfile.mkdtemp(prefix="reshard-fuzz-"))
    t0 = time.perf_counter()
    failed: list[dict[str, object]] = []
    worlds: dict[str, int] = {}
    apis: dict[str, int] = {}
    formats: dict[str, int] = {}  # the format version each trial saved (5: strided split)
    for seed in range(a.seed, a.seed + a.trials):
        modules = a.kind == "modules" or (a.kind == "both" and seed % 2)
        run = fuzz.run_module_trial if modules else fuzz.run_trial
        problems, trial = run(seed, base / f"trial-{seed}")
        if modules:
            save, restore = trial["save"], trial["restore"]
            pair = f"{save['kind']}@{save['world']}->{restore['kind']}@{restore['world']}"
            api = "modules"
        else:
            pair = f"{trial['save_mesh']}->{trial['restore_mesh']}"
            api = f"{trial['save_api']}->{trial['restore_api']}"
        worlds[pair] = worlds.get(pair, 0) + 1
        apis[api] = apis.get(api, 0) + 1
        fmt = str(trial.get("format"))
        formats[fmt] = formats.get(fmt, 0) + 1
        if problems:
            failed.append({"seed": seed, "problems": problems, "trial": trial})
            print(f"seed {seed}: {pair} FAILED (kept in {base / f'trial-{seed}'})")
            for line in problems:
                print(f"  {line}")
            for t in trial.get("tensors", [trial]):
                print(f"    {t}")
            sys.stdout.flush()
    seconds = time.perf_counter() - t0
    print(
        f"{a.trials} trials (seeds {a.seed}..{a.seed + a.trials - 1}), {len(failed)} failed, "
        f"{seconds:.0f} s; APIs saved -> restored: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(apis.items()))
        + "; format versions saved: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(formats.items()))
        + "; meshes (parallelism@world for modules) saved -> restored: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(worlds.items()))
    )
    if a.json:
        doc = {
            "trials": a.trials,
            "seed": a.seed,
            "failed": failed,
            "seconds": round(seconds, 1),
            "meshes": worlds,
            "apis": apis,
            "formats": formats,
        }
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

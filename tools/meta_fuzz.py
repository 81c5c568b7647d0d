"""Mutated metadata of sharded steps, forged to match: what ckptstore makes of it.

    python tools/meta_fuzz.py [--bases N] [--mutations M] [--seed S] [--json OUT]

For each of ``--bases`` tensor trials (``tests/multirank/fuzz_scenarios.py``; seeds from
``--seed``), a real job of 1 to 4 ranks saves two DTensor steps. Then ``--mutations`` times:
a copy of the store gets one value of one JSON file of step 2 changed (``state.json``, the
chunk index and its per-rank parts, ``_ranks.jsonl``, the manifest), with the manifest
forged to match (``tests/metafuzz.py``), and, in this process, ``load(2)``, ``restore()``,
``ckptstore verify --all`` and ``inspect`` are run on it, each under a deadline, the peak RSS
watched; every ``--wide-every``-th mutation is also restored by a real job on the trial's
restore world (1 to 4 ranks), whose ranks must agree on the step and restore it exactly.

A finding is any of: an exception other than ``CkptStoreError`` (or any from ``restore()``,
as step 1 is intact), a hang, memory beyond the budget, or bytes other than a step's own.
Prints each finding with its mutation and a summary; exits 1 on any.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; 0 when no mutation led to a finding."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bases", type=int, default=10, help="stores saved by real jobs")
    p.add_argument("--mutations", type=int, default=100, help="mutations of each store")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="these trials' DTensor stores instead (e.g. 805 938 979 1017: format 5, "
        "FSDP2 over TP's _StridedShard in the split index)",
    )
    p.add_argument("--dir", type=Path, help="scratch directory")
    p.add_argument(
        "--wide-every",
        type=int,
        default=5,
        help="restore every N-th mutation on the trial's restore world too (0: never)",
    )
    p.add_argument("--json", metavar="OUT", help="the summary and findings as JSON")
    a = p.parse_args(argv)
    # Imported by name: the kit lives with the tests (its base stores come from a test job).
    kit = importlib.import_module("tests.metafuzz")
    saved_format = importlib.import_module("tests.multirank.fuzz_scenarios").saved_format
    # Each refused step is logged ("skipping step 2: ..."): thousands of lines, none a finding.
    logging.getLogger("ckptstore").setLevel(logging.CRITICAL)
    work = a.dir or Path(tempfile.mkdtemp(prefix="meta-fuzz-"))
    t0 = time.perf_counter()
    findings: list[dict[str, object]] = []
    files: dict[str, int] = {}
    formats: dict[str, int] = {}  # the format version of each base store
    n = 0
    seeds = a.seeds or [a.seed + b for b in range(a.bases)]
    for b, seed in enumerate(seeds):
        # Every other store is a replicated one, saved whole by this process.
        make = kit.make_plain_base if b % 2 and not a.seeds else kit.make_base
        base, trial = make(seed, work / f"base-{seed}")
        fmt = str(saved_format(base))
        formats[fmt] = formats.get(fmt, 0) + 1
        rnd = random.Random(seed)
        for i in range(a.mutations):
            wide = a.wide_every > 0 and i % a.wide_every == 0
            what, problems = kit.check_mutation(base, trial, work / "scratch", rnd, wide=wide)
            n += 1
            name = what.split(" ", 1)[0]
            name = "_index.rankN.json" if name.startswith("_index.rank") else name
            files[name] = files.get(name, 0) + 1
            if problems:
                findings.append({"seed": seed, "mutation": i, "what": what, "problems": problems})
                print(f"seed {seed} #{i}: {what}")
                for line in problems:
                    print("  " + line.replace("\n", "\n  "))
                sys.stdout.flush()
    seconds = time.perf_counter() - t0
    print(
        f"{n} mutations of {len(seeds)} stores (seeds {', '.join(map(str, seeds))}), "
        f"{len(findings)} with findings, {seconds:.0f} s; format versions: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(formats.items()))
        + "; files mutated: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(files.items()))
    )
    if a.json:
        doc = {"mutations": n, "bases": len(seeds), "seeds": seeds, "seconds": round(seconds, 1),
               "formats": formats, "files": files, "findings": findings}  # fmt: skip
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

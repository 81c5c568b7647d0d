"""Crash campaign: SIGKILL checkpoint writers at random moments and check every invariant.

The campaign's command line (``tools/crashtest.py``, whose docstring says what is checked):
writer trials per store, distributed trials, upload trials, the summary table and the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path

from crashkit import server as fork_server
from crashkit.common import DIST_SLACK, DIST_TIMEOUT, s3
from crashkit.dist import DistStats, dist_trials
from crashkit.server import Server
from crashkit.uploads import UPLOAD_STEPS, UploadStats, upload_trials
from crashkit.writers import Checker, StoreStats, writer_trials


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def campaign(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    rng = random.Random(args.seed)
    stores = ["local", "s3"] if args.store == "both" else [args.store]
    s3_trials = args.trials if args.s3_trials is None else args.s3_trials
    trials = {"local": args.trials, "s3": s3_trials}
    print(
        f"crashtest: seed {args.seed}; "
        + ", ".join(f"{trials[k]} trials on {k}" for k in stores)
        + f"; {args.dist_trials} distributed trials",
        flush=True,
    )
    results: list[StoreStats] = []
    dstats: DistStats | None = None
    ustats: UploadStats | None = None
    server = Server(writers=any(trials[k] > 0 for k in stores) or args.dist_trials > 0)
    base = tempfile.mkdtemp(prefix="ckptstore-crashtest-")
    try:
        checker: Checker | None = None
        for kind in stores:
            if trials[kind] <= 0:
                continue
            if checker is None:  # the writers' state (its optimizer imports torch._dynamo)
                checker = Checker()
            if kind == "local":

                def make_url() -> str:
                    return tempfile.mkdtemp(prefix="store-", dir=base)

                results.append(
                    writer_trials(
                        "local",
                        trials["local"],
                        rng=rng,
                        server=server,
                        checker=checker,
                        make_url=make_url,
                        options=None,
                        verbose=args.verbose,
                    )
                )
            else:
                with s3() as ep:

                    def make_url_s3() -> str:
                        url: str = ep.url(ep.unique_prefix("crash"))
                        return url

                    results.append(
                        writer_trials(
                            "s3",
                            trials["s3"],
                            rng=rng,
                            server=server,
                            checker=checker,
                            make_url=make_url_s3,
                            options=ep.storage_options,
                            verbose=args.verbose,
                        )
                    )
        if args.dist_trials > 0:
            dstats = dist_trials(args.dist_trials, rng, server, base, args.verbose)
        if args.upload_trials > 0:
            ustats = upload_trials(args.upload_trials, rng, server, base, args.verbose)
    finally:
        server.close()
        import shutil

        from ckptstore.storage import wait_for_deletions

        wait_for_deletions()
        shutil.rmtree(base, ignore_errors=True)
    elapsed = time.monotonic() - t0

    rows = [
        [
            "store",
            "configs",
            "trials",
            "kills",
            "mid-save",
            "mid-prune",
            "in-flight done",
            "violations",
            "elapsed",
        ]
    ]
    for s in results:
        rows.append(
            [
                s.store,
                str(len(s.configs)),
                str(s.trials),
                str(s.kills),
                str(s.killed_mid_save),
                str(s.killed_mid_retention),
                str(s.inflight_committed),
                str(len(s.violations)),
                f"{s.elapsed:.0f}s",
            ]
        )
    if dstats is not None:
        rows.append(
            [
                "dist (2 ranks)",
                "-",
                str(dstats.trials),
                str(dstats.kills),
                "-",
                "-",
                "-",
                str(len(dstats.violations)),
                f"{dstats.elapsed:.0f}s",
            ]
        )
    print()
    print(_table(rows))
    if dstats is not None and dstats.trials:
        phases = ", ".join(f"{k} {v}" for k, v in sorted(dstats.killed_in.items()))
        print(
            f"dist: {dstats.timed_kills} timed kills, {dstats.protocol_kills} at a protocol wait, "
            f"{dstats.frozen} of them a freeze (SIGSTOP) "
            f"(killed in: {phases}); survivors raised BarrierTimeout {dstats.survivor_timeouts}"
            f"/{dstats.kills}; slowest exit {dstats.max_exit_after_kill:.1f}s after the kill "
            f"(barrier_timeout {DIST_TIMEOUT:g}s, allowed {DIST_TIMEOUT + DIST_SLACK:g}s)"
        )
    if ustats is not None:
        print(
            f"uploads: {ustats.kills}/{ustats.trials} uploaders killed (SIGKILL) within "
            f"{ustats.upload_s * 1.1:.2f}s of their first upload (one whole upload of "
            f"{len(UPLOAD_STEPS)} steps: {ustats.upload_s:.2f}s); {ustats.killed_mid_upload} "
            f"left a partial step or multipart upload ({ustats.multipart_left} a multipart "
            f"upload); {ustats.complete_at_kill} replica steps committed at the kills, all "
            f"checked; {ustats.safe_reported} reported safe; violations "
            f"{len(ustats.violations)}; {ustats.elapsed:.0f}s"
        )
    violations = [v for s in results for v in s.violations] + (dstats.violations if dstats else [])
    violations += ustats.violations if ustats else []
    print(f"violations: {len(violations)}; elapsed {elapsed:.0f}s")
    for v in violations:
        print(f"  {v}")
    if args.json:
        doc = {
            "seed": args.seed,
            "trials_per_store": args.trials,
            "stores": [s.to_dict() for s in results],
            "dist": dataclasses.asdict(dstats) if dstats else None,
            "uploads": dataclasses.asdict(ustats) if ustats else None,
            "violations": violations,
            "elapsed": elapsed,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--store", choices=["local", "s3", "both"], default="both")
    p.add_argument("--trials", type=int, default=300, help="writer kills per store")
    p.add_argument("--s3-trials", type=int, help="writer kills on S3 (default: --trials)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dist-trials", type=int, default=20, help="2-rank jobs with a rank killed")
    p.add_argument(
        "--upload-trials", type=int, default=300, help="uploads to S3 killed (replica tier)"
    )
    p.add_argument("--json", metavar="OUT", help="write every figure to OUT")
    p.add_argument("--verbose", action="store_true", help="one line per trial")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return fork_server.serve()
    return campaign(args)

"""``ckptstore verify ROOT|STEP_DIR|FILE [--step N|--all] [--quick]``."""

from __future__ import annotations

import argparse

from ..integrity import VerifyReport
from ..ops.verify import verify_path
from ._common import as_json, step_arg, storage_options, usage_errors
from ._output import Bar, human_bytes, one_line, plural, print_json

NAME = "verify"
HELP = "verify checkpoints of a store, a step directory, or a lone .pt/.safetensors file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``TARGET``, ``--step``/``--all``, ``--quick``."""
    parser.add_argument(
        "target",
        metavar="ROOT|FILE",
        help="store, step directory, a file of a step (checked against its manifest), or a file",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_arg, help="verify this step (default: the newest)")
    which.add_argument("--all", action="store_true", help="verify every committed step")
    parser.add_argument(
        "--quick", action="store_true", help="sizes and headers only, no checksums (fast)"
    )


def run(args: argparse.Namespace) -> int:
    """Verify; exit 1 when anything fails."""
    with Bar("verify", unit="ckpt") as bar, usage_errors():
        reports = verify_path(
            args.target,
            storage_options(args, args.target),
            step=args.step,
            all_steps=args.all,
            deep=not args.quick,
            progress=bar,
        )
    if as_json(args):
        print_json([r.to_dict() for r in reports])
    else:
        print_reports(reports)
    return 0 if all(r.ok for r in reports) else 1


def print_reports(reports: list[VerifyReport]) -> None:
    """``step 100: OK (3 files, 1.2 kB checked)``, or FAILED and one line per problem."""
    for r in reports:
        name = f"step {r.step}" if r.step is not None else r.target
        if r.deleted:
            print(f"{name}: deleted while it was verified (a running job's retention); skipped")
        elif r.ok:
            checked = (
                f"{human_bytes(r.bytes_checked)} checked"
                if r.deep
                else "quick: sizes and headers, no checksums"
            )
            print(f"{name}: OK ({plural(r.files, 'file')}, {checked})")
        else:
            print(f"{name}: FAILED")
            for p in r.problems:
                print(f"    {one_line(p)}")
        if r.elsewhere:
            ranks = ", ".join(str(x) for x in r.elsewhere)
            print(f"    this node's copy: the files of rank(s) {ranks} live on other nodes")
    if len(reports) > 1:
        bad = sum(not r.ok for r in reports)
        gone = sum(r.deleted for r in reports)
        also = f", {gone} deleted meanwhile" if gone else ""
        print(f"{plural(len(reports) - gone, 'checkpoint')} verified, {bad} failed{also}")

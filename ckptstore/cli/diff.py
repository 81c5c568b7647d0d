"""``ckptstore diff ROOT A B``: compare two checkpoints; exit 1 when they differ (like diff)."""

from __future__ import annotations

import argparse
import collections
from typing import TYPE_CHECKING

from ._common import add_root, as_json, step_arg, storage_options
from ._output import print_json, table

if TYPE_CHECKING:
    from ..ops.diff import DiffResult

NAME = "diff"
HELP = "compare two checkpoints: keys added/removed/changed, max |a-b|"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT A B``."""
    add_root(parser)
    parser.add_argument("a", metavar="A", type=step_arg, help="first step")
    parser.add_argument("b", metavar="B", type=step_arg, help="second step")


def run(args: argparse.Namespace) -> int:
    """Compare; exit 0 when identical, 1 when they differ."""
    from ..ops.diff import diff_steps  # torch: imported only when this command runs

    opts = storage_options(args, args.root)
    res = diff_steps(args.root, args.a, args.b, storage_options=opts)
    if as_json(args):
        print_json(res.to_dict())
    else:
        print_diff(res)
    return 1 if res.rows else 0


def print_diff(res: DiffResult) -> None:
    """One line per difference (``+`` added, ``-`` removed, ``~`` changed), then counts."""
    print(f"diff step {res.a} -> step {res.b} ({res.root})")
    for note in res.notes:
        print(f"  note: {note}")
    marks = {"added": "+", "removed": "-", "changed": "~"}
    rows = []
    for r in res.rows:
        if r.change == "changed" and r.max_abs_diff is not None:
            detail = f"{r.a}  max |a-b| {r.max_abs_diff:.6g}"
        elif r.change == "changed":
            detail = f"{r.a} -> {r.b}"
        else:
            detail = r.a or r.b
        rows.append([marks[r.change], r.path, detail])
    if rows:
        print(table(rows, indent="  "))
    counts = collections.Counter(r.change for r in res.rows)
    print(
        f"{res.same} same, {counts['changed']} changed, {counts['added']} added, "
        f"{counts['removed']} removed"
    )

"""``ckptstore rm ROOT --step N [--step M ...] [--force]``: delete steps, atomically."""

from __future__ import annotations

import argparse

from ..ops.steps import delete_steps
from ._common import add_root, add_steps, as_json, storage_options, usage_errors
from ._output import plural, print_json, steps_text

NAME = "rm"
HELP = "delete steps, each atomically (refuses pinned steps and the last good one)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT``, ``--step`` (repeatable), ``--force``."""
    add_root(parser)
    add_steps(parser, "a step to delete (repeat for more)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="delete pinned steps and the last checkpoint that verifies too",
    )


def run(args: argparse.Namespace) -> int:
    """Delete; nothing is deleted when any step is refused."""
    opts = storage_options(args, args.root)
    with usage_errors():
        res = delete_steps(args.root, args.step, force=args.force, storage_options=opts)
    if as_json(args):
        print_json(res.to_dict())
    else:
        done = f": {steps_text(res.deleted)}" if res.deleted else ""
        print(f"deleted {plural(len(res.deleted), 'step')}{done}")
        left = f": {steps_text(res.kept)}" if res.kept else ""
        print(f"{plural(len(res.kept), 'step')} left{left}")
    # A step pinned while it was being deleted is kept (with a warning): not what was asked.
    return 0 if set(res.deleted) == set(args.step) else 1

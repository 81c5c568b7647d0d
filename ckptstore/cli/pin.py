"""``ckptstore pin|unpin ROOT --step N``: protect a step from retention, or stop protecting it."""

from __future__ import annotations

import argparse

from ..ops.steps import pin_steps
from ._common import add_root, add_steps, as_json, storage_options, usage_errors
from ._output import print_json, steps_text

NAME = "pin"
HELP = "pin steps: retention (keep=, ckptstore prune) never deletes them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT``, ``--step`` (repeatable)."""
    add_root(parser)
    add_steps(parser, "the step (repeat for more)")


def run(args: argparse.Namespace) -> int:
    """Pin, or unpin for ``ckptstore unpin``."""
    pinned = args.command == "pin"
    opts = storage_options(args, args.root)
    with usage_errors():
        res = pin_steps(args.root, args.step, pinned=pinned, storage_options=opts)
    if as_json(args):
        print_json(res.to_dict())
        return 0
    word = "pinned" if pinned else "unpinned"
    same = [s for s in res.steps if s not in res.changed]
    if res.changed:
        print(f"{word} step {steps_text(res.changed)}")
    if same:
        print(f"step {steps_text(same)}: already {word}")
    return 0

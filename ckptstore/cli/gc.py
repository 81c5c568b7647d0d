"""``ckptstore gc ROOT``: remove what interrupted saves and deletions left behind."""

from __future__ import annotations

import argparse

from ..ops.steps import gc_store
from ..ops.stores import open_store
from ..tiers import upload_parts
from ._common import add_root, as_json, storage_options
from ._output import print_json

NAME = "gc"
HELP = "remove stale tmp/trash entries of interrupted saves and deletions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT [--pending]``."""
    add_root(parser)
    parser.add_argument(
        "--pending",
        action="store_true",
        help=(
            "object stores: also remove the pending (manifest-less) steps at or above the "
            "newest committed step, which a job's uploaders may still be writing or will "
            "finish after a restart; only for a prefix no job uploads to any more"
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Remove; print each name removed, and on an object store what was kept and why."""
    opts = storage_options(args, args.root)
    removed = gc_store(args.root, opts, pending=args.pending)
    # Object stores (no writer lock): what was kept for the uploaders that may finish it.
    kept: list[str] | None = None
    if not args.pending:
        storage = open_store(args.root, opts)
        if not storage.atomic_rename:
            kept = upload_parts.held(storage)
    if as_json(args):
        print_json({"removed": removed} if kept is None else {"removed": removed, "kept": kept})
        return 0
    kept = kept or []
    if not removed and not kept:
        print("nothing to remove")
    for name in removed:
        print(f"removed {name}")
    for name in kept:
        print(
            f"kept {name}: pending at or above the newest committed step, an upload may still "
            "finish it (`ckptstore gc --pending` removes it)"
        )
    return 0

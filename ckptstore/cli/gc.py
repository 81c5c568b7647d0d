"""``ckptstore gc ROOT``: remove what interrupted saves and deletions left behind."""

from __future__ import annotations

import argparse

from ..steps import gc_store
from ._common import add_root, as_json, storage_options
from ._output import print_json

NAME = "gc"
HELP = "remove stale tmp/trash entries of interrupted saves and deletions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT``."""
    add_root(parser)


def run(args: argparse.Namespace) -> int:
    """Remove; print each name removed."""
    removed = gc_store(args.root, storage_options(args, args.root))
    if as_json(args):
        print_json({"removed": removed})
    elif not removed:
        print("nothing to remove")
    else:
        for name in removed:
            print(f"removed {name}")
    return 0

"""``ckptstore replicate LOCAL_ROOT URL [--watch]``: upload a local store to a replica.

The sidecar form of ``CheckpointManager(..., replica=URL)``, for jobs that do not pass
``replica=`` themselves: the same uploader, the same commit protocol on the replica.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..retention import KeepLast
from ..tiers.replicate import replicate
from ..tiers.twotier import DEFAULT_REPLICA_TIMEOUT
from ._common import add_root, as_json, positive_arg, storage_options
from ._output import print_json, steps_text

NAME = "replicate"
HELP = "upload a local store's committed steps to a replica URL (--watch: keep doing it)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``LOCAL_ROOT URL [--watch] [--interval S] [--keep-last N] [--timeout S]``."""
    add_root(parser, "the local store")
    parser.add_argument("url", metavar="URL", help="the replica: an fsspec URL (s3://bucket/run)")
    parser.add_argument(
        "--watch", action="store_true", help="keep uploading new steps until interrupted"
    )
    parser.add_argument(
        "--interval", type=float, default=10.0, metavar="S", help="seconds between looks (10)"
    )
    parser.add_argument(
        "--keep-last", type=positive_arg, metavar="N", help="replica retention: keep N newest"
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_REPLICA_TIMEOUT,
        metavar="S",
        help="seconds the replica may take to answer before it is given up (60)",
    )


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def stopper(stop: threading.Event) -> Callable[[int, Any], None]:
    """The ``--watch`` signal handler: the first signal sets ``stop``, a second interrupts.

    A stopped watch leaves within about a second (the upload in flight is abandoned); the
    second signal raises ``KeyboardInterrupt`` for whatever still waits.
    """

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    return handler


def run(args: argparse.Namespace) -> int:
    """Upload; with ``--watch`` until SIGINT/SIGTERM. Exit 1 when an upload failed."""
    stop = threading.Event()
    with contextlib.ExitStack() as restore:
        if args.watch and threading.current_thread() is threading.main_thread():
            handler = stopper(stop)
            for sig in (signal.SIGINT, signal.SIGTERM):
                old = signal.signal(sig, handler)
                restore.callback(signal.signal, sig, old)
        res = replicate(
            args.root,
            args.url,
            storage_options(args, args.url),
            keep=KeepLast(args.keep_last) if args.keep_last else None,
            watch=args.watch,
            interval=max(0.1, float(args.interval)),
            stop=stop,
            timeout=float(args.timeout),
        )
    if as_json(args):
        print_json(
            {
                "uploaded": res.uploaded,
                "safe": res.safe,
                "failed": {str(k): v for k, v in res.failed.items()},
            }
        )
    else:
        # Upload order (newest first); "safe" is what this replica holds of this store's
        # saves, verified (see ckptstore.tiers.replica), never what another replica holds.
        did = f"uploaded {steps_text(res.uploaded)}" if res.uploaded else "nothing to upload"
        print(f"{did}; safe on {args.url}: {steps_text(res.safe) or 'none'}")
        for s, why in sorted(res.failed.items()):
            print(f"step {s} failed: {why}")
    return 1 if res.failed else 0

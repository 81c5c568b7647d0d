"""``ckptstore prune ROOT --keep-last N [--keep-best K --metric M] [--keep-every S]``."""

from __future__ import annotations

import argparse

from ..ops.steps import PruneResult, prune_store
from ..retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy
from ._common import UsageError, add_root, as_json, positive_arg, storage_options, usage_errors
from ._output import plural, print_json, steps_text

NAME = "prune"
HELP = "delete checkpoints by retention policy (union of the flags)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT`` and the keep flags."""
    add_root(parser)
    parser.add_argument("--keep-last", type=positive_arg, metavar="N", help="keep the N newest")
    parser.add_argument(
        "--keep-best", type=positive_arg, metavar="K", help="keep the K best by --metric"
    )
    parser.add_argument("--metric", metavar="M", help="metric for --keep-best, e.g. val_loss")
    parser.add_argument("--mode", choices=("min", "max"), default="min", help="best is min or max")
    parser.add_argument(
        "--keep-every", type=positive_arg, metavar="S", help="keep steps divisible by S"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted; delete nothing"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="delete steps not yet on the replica too, and prune one node's root of a job "
        "with node-local roots",
    )


def build_policy(
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
    keep_every: int | None = None,
) -> list[RetentionPolicy]:
    """The retention policies the prune flags ask for (their union is applied).

    Raises:
        UsageError: no keep flag, or ``--keep-best`` without ``--metric`` (or the reverse).
    """
    policies: list[RetentionPolicy] = []
    if keep_last is not None:
        policies.append(KeepLast(keep_last))
    if keep_best is not None:
        if not metric:
            raise UsageError("--keep-best needs --metric NAME (the metric to rank by)")
        policies.append(KeepBest(keep_best, metric, mode))
    elif metric is not None:
        raise UsageError("--metric is only meaningful with --keep-best K")
    if keep_every is not None:
        policies.append(KeepEvery(keep_every))
    if not policies:
        raise UsageError(
            "say what to keep: --keep-last N, --keep-best K --metric M, and/or --keep-every S"
        )
    return policies


def run(args: argparse.Namespace) -> int:
    """Prune (or plan); a metric no checkpoint records is a usage error."""
    policies = build_policy(
        keep_last=args.keep_last,
        keep_best=args.keep_best,
        metric=args.metric,
        mode=args.mode,
        keep_every=args.keep_every,
    )
    opts = storage_options(args, args.root)
    with usage_errors():
        res = prune_store(
            args.root, policies, dry_run=args.dry_run, force=args.force, storage_options=opts
        )
    if as_json(args):
        print_json(res.to_dict())
    else:
        print_prune(res)
    return 0


def print_prune(res: PruneResult) -> None:
    """``would delete 1 step: 10`` / ``kept 2 steps: 9, 100``."""
    if not res.deleted and not res.kept:
        print(f"{res.root}: no checkpoints")
        return
    if not res.deleted:
        print("nothing to delete")
    else:
        done = "would delete" if res.dry_run else "deleted"
        print(f"{done} {plural(len(res.deleted), 'step')}: {steps_text(res.deleted)}")
    kept = "would keep" if res.dry_run else "kept"
    print(f"{kept} {plural(len(res.kept), 'step')}: {steps_text(res.kept)}")
    if res.dry_run:
        print("dry run: nothing was deleted")

"""``ckptstore ls ROOT``: the committed checkpoints of a store, or of each store in a directory."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from typing import Any

from ..ops.listing import Listings, StepInfo, StoreListing, list_stores
from ..storage import open_storage
from ..storage.reach import reaching
from ..tiers import upload_parts
from ._common import add_root, as_json, storage_options
from ._output import created_text, human_bytes, metrics_text, plural, print_json, table

NAME = "ls"
HELP = "list the committed checkpoints of a store (or of each store in a directory)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT [--replica URL]``."""
    add_root(parser, "store directory or fsspec URL, or a directory of stores (Lightning's)")
    parser.add_argument(
        "--replica",
        metavar="URL",
        help="also list this replica of a local store (--storage-option are its options)",
    )


def run(args: argparse.Namespace) -> int:
    """List; exit 1 when a manifest is broken."""
    if args.replica is not None:
        opts = storage_options(args, args.replica)
        res = list_stores(args.root, opts, replica=args.replica)
        root_opts: dict[str, Any] | None = None  # the options are the replica's
    else:
        root_opts = storage_options(args, args.root)
        res = list_stores(args.root, root_opts)
    if as_json(args):
        if res.nested:
            print_json({"root": res.root, "stores": [s.to_dict() for s in res.stores]})
        else:
            print_json([s.to_dict() for s in res.stores[0].steps])
    else:
        print_listings(res, pending_entries(res, root_opts))
    return 1 if any(s.broken for s in res.stores) else 0


def pending_entries(
    res: Listings, storage_options: Mapping[str, Any] | None
) -> dict[str, list[str]]:
    """Per object store, the stale entries ``ckptstore gc`` keeps (``gc --pending`` removes).

    An object store has no writer lock: its manifest-less steps at or above the newest
    committed step may still be finished by an uploader, so ``gc`` keeps them
    (:func:`ckptstore.tiers.upload_parts.held`). A local store's ``gc`` removes every stale
    entry. One more listing, only of an object store that has stale entries.
    """
    out: dict[str, list[str]] = {}
    for store in res.stores:
        if not store.garbage:
            continue
        storage = open_storage(store.root, storage_options)
        if storage.atomic_rename:
            continue
        with reaching(storage.root):
            held = set(upload_parts.held(storage))
        out[store.root] = [name for name in store.garbage if name in held]
    return out


def print_listings(res: Listings, pending: Mapping[str, list[str]] | None = None) -> None:
    """One store as a table; several, each under its root (``ls`` of many directories).

    ``pending``: per store root, the stale entries only ``gc --pending`` removes.
    """
    pending = pending or {}
    if not res.nested:
        print_listing(res.stores[0], pending.get(res.stores[0].root, ()))
        return
    for i, store in enumerate(res.stores):
        print(("\n" if i else "") + f"{store.root}:")
        print_listing(store, pending.get(store.root, ()))
    print(f"\n{plural(len(res.stores), 'store')} in {res.root}")


def _tiers_text(s: StepInfo) -> str:
    if s.tiers == ("replica",):
        return "replica"
    # Not "uploading": a listing cannot know whether an upload runs, or failed.
    return "local+replica" if s.uploaded else "local only"


def ranks_text(ranks: list[int], world: int) -> str:
    """``ranks 0-1 of 4``: the ranks of a node's partial copy, runs collapsed."""
    runs: list[str] = []
    start = prev = None
    for r in [*sorted(ranks), None]:
        if r is not None and prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return f"ranks {','.join(runs) or 'none'} of {world}"


def print_listing(res: StoreListing, pending: Collection[str] = ()) -> None:
    """The steps of one store as an aligned table, then its stale entries.

    A ``here`` column appears when some step is a node's partial copy (node-local roots).
    ``pending``: the stale entries that plain ``gc`` keeps (an object store's pending steps at
    or above the newest committed step), listed apart with ``gc --pending``.
    """
    if not res.steps:
        print(f"{res.root}: no checkpoints")
    else:
        tiers = res.replica is not None
        partial = [s for s in res.steps if s.partial and s.manifest is not None]
        rows = [
            ["step", "created (UTC)", "size", "files", "world", "sharding", "metrics", "pinned"]
            + (["here"] if partial else [])
            + (["tiers"] if tiers else [])
        ]
        for s in res.steps:
            where = [_tiers_text(s)] if tiers else []
            if partial:
                here = "all ranks"
                if s.manifest is None:
                    here = "-"
                elif s.error is not None:
                    here = "BROKEN marker"
                elif s.local_ranks is not None:
                    here = ranks_text(s.local_ranks, s.manifest.world_size)
                where.insert(0, here)
            if s.manifest is None and s.error is None:  # only on the replica
                rows.append([str(s.step), "-", "-", "-", "-", "-", "", "", *where])
                continue
            if s.manifest is None:
                rows.append(
                    [str(s.step), "-", "-", "-", "-", "-", f"BROKEN: {s.error}", "", *where]
                )
                continue
            m = s.manifest
            rows.append(
                [
                    str(s.step),
                    created_text(m),
                    human_bytes(m.total_bytes),
                    str(len(m.files)),
                    str(m.world_size),
                    m.sharding_kind,
                    metrics_text(m.metrics),
                    "yes" if s.pinned else "",
                    *where,
                ]
            )
        print(table(rows, right=(0, 2, 3, 4)))
        total = sum(s.manifest.total_bytes for s in res.steps if s.manifest)
        print(f"{plural(len(res.steps), 'checkpoint')}, {human_bytes(total)}")
        if partial:
            verb = "holds" if len(partial) == 1 else "hold"
            print(
                f"{plural(len(partial), 'step')} {verb} only some ranks' files here (node-local "
                "roots: the other ranks' files are on the other nodes' disks, or the replica)"
            )
        if tiers:
            print(f"replica: {res.replica}")
    stale = [name for name in res.garbage if name not in pending]
    held = [name for name in res.garbage if name in pending]
    if stale:
        n = len(stale)
        print(
            f"{n} stale {'entry' if n == 1 else 'entries'} (interrupted saves or deletions): "
            f"{', '.join(stale)}; `ckptstore gc` removes them"
        )
    if held:
        n = len(held)
        it = "it" if n == 1 else "them"
        print(
            f"{n} pending {'entry' if n == 1 else 'entries'} (manifest-less, at or above the "
            f"newest committed step: an upload may still finish {it}): {', '.join(held)}; "
            f"`ckptstore gc --pending` removes {it} (only for a prefix no job uploads to any more)"
        )

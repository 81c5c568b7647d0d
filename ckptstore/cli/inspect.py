"""``ckptstore inspect ROOT [--step N]``: a checkpoint's manifest and the structure of its state."""

from __future__ import annotations

import argparse
import json

from ..integrity import format_crc
from ..ops.inspect import InspectResult, inspect_step
from ..sharded.chunks import INDEX_FILE
from ._common import add_root, as_json, step_arg, storage_options
from ._output import created_text, human_bytes, metrics_text, print_json, table

NAME = "inspect"
HELP = "show a checkpoint's manifest and the structure of its state"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ROOT``, ``--step``."""
    add_root(parser)
    parser.add_argument("--step", type=step_arg, help="the step (default: the newest)")


def run(args: argparse.Namespace) -> int:
    """Inspect; no payload is read."""
    opts = storage_options(args, args.root)
    res = inspect_step(args.root, args.step, storage_options=opts)
    if as_json(args):
        print_json(res.to_dict())
    else:
        print_inspect(res)
    return 0


def print_inspect(res: InspectResult) -> None:
    """The manifest, the file table, the state's entries and tensors, the sharded tensors."""
    m = res.manifest
    head = [
        ["step", f"{m.step}  ({res.where})"],
        ["created", f"{created_text(m)} UTC"],
        [
            "format",
            f"{m.format}, format version {m.format_version}, world size {m.world_size}, "
            f"{m.sharding_kind}",
        ],
        ["versions", ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items())) or "-"],
        ["metrics", metrics_text(m.metrics) or "-"],
        [
            "metadata",
            json.dumps(dict(m.metadata), sort_keys=True, default=str) if m.metadata else "-",
        ],
        ["pinned", "yes" if res.pinned else "no"],
        ["size", f"{human_bytes(m.total_bytes)} in {len(m.files)} files"],
    ]
    print(table(head))
    print("\nfiles")
    rows = [["name", "size", "crc32c", "codec", "compression", "rank"]]
    for name, e in sorted(m.files.items()):
        rows.append(
            [
                name,
                human_bytes(e.bytes),
                format_crc(e.crc32c),
                e.codec,
                e.compression or "-",
                "-" if e.rank is None else str(e.rank),
            ]
        )
    print(table(rows, right=(1,), indent="  "))
    per_rank = " (rank 0's part of per-rank state)" if m.sharding_kind == "sharded" else ""
    print(f"\nstate{per_rank}")
    for ent in res.entries:
        n = len(ent.tensors)
        extra = f"{n} tensor{'s' * (n != 1)}, {human_bytes(ent.stored_bytes)}" if n else ent.summary
        print(f"  {ent.key!s}: {ent.kind} ({extra})")
        if ent.tensors:
            trows = [["name", "dtype", "shape", "bytes", ""]]
            for t in ent.tensors:
                shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
                trows.append([t.name, t.dtype, shape, human_bytes(t.bytes), t.note])
            print(table(trows, right=(3,), indent="    "))
    if res.sharded_tensors:
        n = len(res.sharded_tensors)
        chunks = sum(t.chunks for t in res.sharded_tensors)
        print(
            f"\nsharded tensors ({n} in {INDEX_FILE}, {chunks} chunks, saved by "
            f"{m.world_size} rank{'s' * (m.world_size != 1)})",
        )
        srows = [["name", "dtype", "shape", "bytes", "mesh", "placements", "chunks"]]
        for sti in res.sharded_tensors:
            srows.append(
                [
                    sti.name,
                    sti.dtype,
                    "[" + ", ".join(str(d) for d in sti.shape) + "]",
                    human_bytes(sti.bytes),
                    sti.mesh_text,
                    ",".join(sti.placements) or "-",
                    str(sti.chunks),
                ]
            )
        print(table(srows, right=(3, 6), indent="  "))

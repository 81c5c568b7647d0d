"""``ckptstore import SOURCE ROOT --step N``: store a foreign checkpoint as a step, no code run."""

from __future__ import annotations

import argparse

from ._common import add_root, as_json, step_arg, storage_options
from ._output import Bar, human_bytes, print_json

NAME = "import"
HELP = (
    "store a torch.save file, a Lightning .ckpt, a .safetensors file or a DCP directory as a "
    "step (no code runs)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``SOURCE ROOT --step N`` and the format of the new step."""
    parser.add_argument(
        "file", metavar="SOURCE", help="FILE.pt, FILE.ckpt, FILE.safetensors, or a DCP directory"
    )
    add_root(parser)
    parser.add_argument("--step", type=step_arg, required=True, help="step to store it as")
    parser.add_argument(
        "--key", default="model", help="entry name for a bare state dict (default: model)"
    )
    parser.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    parser.add_argument("--compression", choices=("zstd",), default=None)
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="a DCP directory: keep its chunks as a sharded step, one chunk in memory at a time "
        "(restores on any world size; --key, --format and --compression do not apply)",
    )
    parser.add_argument(
        "--skip-unsafe",
        action="store_true",
        help="drop the entries that need code to load (listed) instead of refusing the source",
    )


def run(args: argparse.Namespace) -> int:
    """Import; print the notes (what was changed or dropped) and where it went."""
    from ..ops.importers import import_file  # torch: imported only when this command runs

    opts = storage_options(args, args.root)
    if args.sharded:
        from ..errors import ConfigError
        from ..ops.import_dcp import import_dcp_sharded

        if args.format != "safetensors" or args.compression is not None or args.key != "model":
            msg = "--sharded keeps DCP's chunks in safetensors shard files: drop --format, "
            msg += "--compression and --key"
            raise ConfigError(msg)
        with Bar("import", unit="B") as bar:
            res = import_dcp_sharded(
                args.file,
                args.root,
                args.step,
                skip_unsafe=args.skip_unsafe,
                storage_options=opts,
                progress=bar,
            )
    else:
        with Bar("import", unit="phase") as bar:
            res = import_file(
                args.file,
                args.root,
                args.step,
                key=args.key,
                format=args.format,
                compression=args.compression,
                skip_unsafe=args.skip_unsafe,
                storage_options=opts,
                progress=bar,
            )
    if as_json(args):
        print_json(res.to_dict())
    else:
        for note in res.notes:
            print(f"note: {note}")
        print(
            f"imported {res.source} as step {res.step} ({', '.join(res.keys)}; "
            f"{human_bytes(res.bytes)}) into {res.where}"
        )
    return 0

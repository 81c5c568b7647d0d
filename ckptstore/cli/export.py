"""``ckptstore export ROOT --step N OUT``, ``--hf OUT_DIR`` or ``--dcp OUT_DIR``: standard files."""

from __future__ import annotations

import argparse

from ._common import UsageError, add_root, as_json, step_arg, storage_options
from ._output import Bar, human_bytes, plural, print_json

NAME = "export"
HELP = (
    "write a checkpoint as one .safetensors or .pt file, a Hugging Face directory (--hf), or a "
    "DCP directory (--dcp); DTensor (FSDP2/TP) checkpoints are consolidated into full "
    "tensors, except that --dcp keeps their chunks"
)


def _size_arg(text: str) -> int:
    from ..sharded.consolidate import parse_size  # torch: only when the flag is given

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The export flags: ``ROOT --step N OUT``, ``--hf`` and its options, ``--force``."""
    add_root(parser)
    parser.add_argument("--step", type=step_arg, required=True, help="the step to export")
    parser.add_argument(
        "out",
        metavar="OUT",
        help="*.safetensors: model weights; with --hf or --dcp a new directory; else the whole "
        "state",
    )
    parser.add_argument(
        "--hf",
        action="store_true",
        help="write OUT as a Hugging Face checkpoint directory of the entry's weights "
        "(model.safetensors, or shards + model.safetensors.index.json), one tensor at a time",
    )
    parser.add_argument(
        "--dcp",
        action="store_true",
        help="write OUT as a torch.distributed.checkpoint (DCP) directory of the whole state "
        "(.metadata, __0_0.distcp), DTensor chunks kept, one chunk at a time",
    )
    parser.add_argument(
        "--max-shard-size",
        type=_size_arg,
        metavar="SIZE",
        default=None,
        help="with --hf: largest shard, e.g. 5GB (default), 500MB, 2GiB",
    )
    parser.add_argument(
        "--key",
        default=None,
        help="entry to write (.safetensors: default model; .pt: default the whole state)",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help="with --hf: the model's config.json (default: the config the HF integrations "
        "recorded in the checkpoint)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite OUT (a .safetensors or .pt file) if it exists; --hf and --dcp never "
        "overwrite a directory",
    )


def _consolidated_text(world: int | None) -> str:
    if world is None:
        return ""
    return f"; consolidated from the DTensor shards of {plural(world, 'rank')}"


def run(args: argparse.Namespace) -> int:
    """Export one file, or with ``--hf`` a Hugging Face directory."""
    opts = storage_options(args, args.root)
    if args.dcp:
        if args.hf:
            raise UsageError("--dcp and --hf are two formats: give one")
        if args.force:
            raise UsageError("--dcp never overwrites: OUT_DIR must not exist (or be empty)")
        if args.key is not None or args.max_shard_size is not None or args.config is not None:
            raise UsageError(
                "--dcp writes the whole state: --key, --max-shard-size and --config do not apply"
            )
        return _run_dcp(args, opts)
    if args.hf:
        if args.force:
            raise UsageError("--hf never overwrites: OUT_DIR must not exist (or be empty)")
        return _run_hf(args, opts)
    if args.max_shard_size is not None:
        raise UsageError("--max-shard-size applies to --hf only")
    if args.config is not None:
        raise UsageError("--config applies to --hf only")
    from ..ops.export import export_step  # torch: imported only when this command runs

    with Bar("export", unit="phase") as bar:
        res = export_step(
            args.root,
            args.step,
            args.out,
            key=args.key,
            force=args.force,
            storage_options=opts,
            progress=bar,
        )
    if as_json(args):
        print_json(res.to_dict())
    else:
        what = f"entry {res.key!r}" if res.key is not None else "the whole state"
        print(
            f"exported step {res.step} ({what}, {res.tensors} tensors"
            f"{_consolidated_text(res.consolidated_from)}) to {res.out} "
            f"({res.format}, {human_bytes(res.bytes)})"
        )
    return 0


def _run_dcp(args: argparse.Namespace, opts: dict[str, object]) -> int:
    from ..ops.export import export_dcp_step

    res = export_dcp_step(args.root, args.step, args.out, storage_options=opts)
    if as_json(args):
        print_json(res.to_dict())
    else:
        world = res.world_size if res.sharding == "dtensor" else None
        kept = f"; the DTensor chunks of {plural(world, 'rank')} kept" if world else ""
        print(
            f"exported step {res.step} ({res.tensors} tensors in {plural(res.items, 'DCP item')}"
            f"{kept}) to {res.out} (DCP: .metadata, __0_0.distcp, {human_bytes(res.bytes)})"
        )
    return 0


def _run_hf(args: argparse.Namespace, opts: dict[str, object]) -> int:
    from ..ops.export import export_hf_step
    from ..sharded.consolidate import DEFAULT_MAX_SHARD

    with Bar("export", unit="B") as bar:
        hf = export_hf_step(
            args.root,
            args.step,
            args.out,
            key=args.key,
            max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD,
            storage_options=opts,
            progress=bar,
            config=args.config,
        )
    if as_json(args):
        print_json(hf.to_dict())
    else:
        world = hf.world_size if hf.sharding == "dtensor" else None
        shards = [f for f in hf.files if f.endswith(".safetensors")]
        others = [f for f in hf.files if not f.endswith(".safetensors")]
        # The count is of the shards; the index and config follow them, named (it said
        # "4 files:" and named five).
        also = f"; and {', '.join(others)}" if others else ""
        print(
            f"exported step {hf.step} (entry {hf.key!r}, {hf.tensors} tensors, "
            f"{human_bytes(hf.total_size)}{_consolidated_text(world)}) to {hf.out} "
            f"(Hugging Face safetensors, {plural(len(shards), 'shard')}: "
            f"{', '.join(shards)}{also})"
        )
        if not hf.config:
            print(
                "no config.json: the checkpoint records no model config (the HF integrations "
                "record one); from_pretrained needs it: pass --config PATH"
            )
    return 0

"""``ckptstore export ROOT --step N --dcp OUT_DIR``: a step as a plain DCP checkpoint.

For tools that read only ``torch.distributed.checkpoint`` (DCP): ``OUT_DIR`` holds
``.metadata`` and ``__0_0.distcp`` as DCP's ``FileSystemWriter`` lays them out, and
``dcp.load(state_dict, storage_reader=FileSystemReader(OUT_DIR))`` loads it on any world size.

- Every leaf of the state is an item, named as DCP's ``flatten_state_dict`` names the same
  state (``model.net.weight`` for ``{"model": model.state_dict()}``; ``optimizer.state.0.
  exp_avg`` and ``optimizer.param_groups`` items as an optimizer's ``state_dict()`` has
  them), and ``planner_data`` maps each name back to its path.
- A DTensor keeps the chunks it was saved in: each chunk is one item, so a DCP load on any
  world size reads the overlaps it needs. A plain tensor is one chunk.
- Tensors are written one chunk at a time (``torch.save`` of the chunk, as DCP writes
  them), each read from the store and checked against its CRC32C first: the memory held is
  about one chunk, whatever the model's size. Non-tensor leaves are ``torch.save``'d values
  (DCP's bytes items; they hold plain data only).
- ``OUT_DIR`` is completed aside, fsynced and renamed into place: it appears whole or not at
  all, and an existing non-empty directory is never written into.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import torch

from ..manifest import Manifest
from ..sharded.consolidate import StepTensors, _check_out_dir, new_dir_aside
from ..sharded.dcpview import dcp_items, read_piece
from ..storage import Storage

__all__ = ["DCP_DATA", "DCPExportResult", "export_dcp"]

#: The one data file (DCP names them ``__{rank}_{n}.distcp``).
DCP_DATA = "__0_0.distcp"
_METADATA = ".metadata"


@dataclasses.dataclass(frozen=True)
class DCPExportResult:
    """What :func:`export_dcp` wrote."""

    out: str
    step: int
    items: int  # DCP items: a chunk of a tensor, or a non-tensor value
    tensors: int
    bytes: int  # the data file's size
    sharding: str
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


def export_dcp(
    storage: Storage,
    step: int,
    out_dir: str | os.PathLike[str],
    *,
    manifest: Manifest | None = None,
    allow_pickle: bool = False,
) -> DCPExportResult:
    """Write committed ``step`` of ``storage`` as a DCP checkpoint directory (streaming, atomic).

    ``manifest``: the step's, where the caller has read it already.

    Raises:
        PathExistsError: ``out_dir`` exists and is not an empty directory.
        CkptStoreError: per-rank state of several ranks (it has no whole state), or two
            leaves whose DCP names collide (a key holding a dot).
        IntegrityError: the checkpoint is corrupt (nothing is left behind).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    out = os.path.abspath(os.fspath(out_dir))
    _check_out_dir(out)  # before any work (new_dir_aside checks again)
    md: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    planner_data: dict[str, tuple[Any, ...]] = {}
    items = tensors = 0
    src_step = StepTensors(storage, step, manifest=manifest, allow_pickle=allow_pickle)
    with src_step as src, new_dir_aside(out) as tmp:
        with open(os.path.join(tmp, DCP_DATA), "xb") as f:

            def write(fqn: str, offsets: tuple[int, ...] | None, obj: Any) -> None:
                nonlocal items
                start = f.tell()
                torch.save(obj, f)
                key = MetadataIndex(fqn, torch.Size(offsets) if offsets is not None else None)
                storage_data[key] = _StorageInfo(DCP_DATA, start, f.tell() - start)
                items += 1

            for it in dcp_items(src):
                planner_data[it.fqn] = it.path
                md[it.fqn] = it.metadata()
                if it.ref is None:
                    write(it.fqn, None, it.value)
                    continue
                tensors += 1
                for piece in it.chunks:  # one chunk in memory at a time
                    t = read_piece(src, it, piece).contiguous()
                    write(it.fqn, piece[0], t)
                    del t
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        meta = Metadata(state_dict_metadata=md, planner_data=planner_data)
        meta.storage_data = storage_data
        with open(os.path.join(tmp, _METADATA), "xb") as f:
            pickle.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
    m = src.manifest
    return DCPExportResult(
        out=out,
        step=step,
        items=items,
        tensors=tensors,
        bytes=size,
        sharding=m.sharding_kind,
        world_size=m.world_size,
    )

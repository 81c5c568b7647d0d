"""ckptstore steps under ``torch.distributed.checkpoint`` (DCP).

:class:`CkptStoreReader` is a DCP ``StorageReader``: ``dcp.load(state_dict,
storage_reader=CkptStoreReader(root))`` loads a committed step of a ckptstore store (any
format: replicated, per-rank of one rank, DTensor on any world size) into the state dict
the caller holds, on whatever world size runs the load, through DCP's own planner::

    import torch.distributed.checkpoint as dcp
    from ckptstore.dcp import CkptStoreReader

    state = {"model": model.state_dict()}           # FSDP2 DTensors, plain tensors, values
    dcp.load(state, storage_reader=CkptStoreReader("ckpt", step=1000))
    model.load_state_dict(state["model"])

Names are DCP's: each leaf of the stored state is the item ``".".join(path)``, as DCP's
``flatten_state_dict`` names the same state (``model.net.weight`` for ``{"model":
model.state_dict()}``, ``optimizer.state.0.exp_avg`` for an optimizer's ``state_dict()``;
optimizers of DTensor steps are stored keyed by parameter name, as
``get_optimizer_state_dict`` keys them). A DTensor keeps the chunks it was saved in, so each
rank reads only the chunks its shards overlap, and of those only the CRC blocks the overlap
touches, each checked against its CRC32C before a byte is copied into the caller's tensor.
A corrupt byte raises :class:`~ckptstore.IntegrityError` on the rank that read it (DCP
raises it on every rank); the caller's tensors may then hold a partial load, as with any DCP
failure. To fall back to an older step by itself, use ``CheckpointManager.restore``.

``export --dcp`` (:func:`ckptstore.ops.export_dcp.export_dcp`) writes the same items as a
plain DCP directory, for readers that know only DCP's files.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .codec.tree import SUPPORTED_DTYPES
from .errors import CkptStoreError, IntegrityError
from .ops.stores import committed_step, open_store, reaching
from .sharded.chunks import Chunk, read_box
from .sharded.consolidate import StepTensors, TensorRef
from .storage import Storage

__all__ = ["CkptStoreReader", "DCPItem", "dcp_items"]


@dataclasses.dataclass(frozen=True)
class DCPItem:
    """One leaf of a step as DCP sees it.

    Attributes:
        fqn: its DCP name (``".".join(path)``).
        path: where it is in the state (top-level key first).
        ref: the tensor, not read yet; ``None`` for a value.
        value: the value (``None`` for a tensor).
        chunks: ``(offsets, sizes, chunk)`` of each saved piece: a DTensor's saved chunks;
            one piece covering a plain tensor (``chunk`` None); empty for a value.
    """

    fqn: str
    path: tuple[Any, ...]
    ref: TensorRef | None
    value: Any
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], Chunk | None], ...]

    def metadata(self) -> TensorStorageMetadata | BytesStorageMetadata:
        """DCP's description of the item."""
        if self.ref is None:
            return BytesStorageMetadata()
        return TensorStorageMetadata(
            TensorProperties(dtype=SUPPORTED_DTYPES[self.ref.dtype]),
            torch.Size(self.ref.shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in self.chunks],
        )


def dcp_items(src: StepTensors) -> Iterator[DCPItem]:
    """Every leaf of ``src``'s state as a DCP item, in the state's order (nothing read).

    A stored numpy array is a value (DCP's bytes item), as DCP saves one.

    Raises:
        CkptStoreError: two leaves have one DCP name (a key holding a dot).
        IntegrityError: a DTensor leaf missing from the chunk index, an unknown dtype.
    """
    seen: dict[str, tuple[Any, ...]] = {}
    for key in src.keys:
        for path, leaf in src.leaves(key):
            fqn = ".".join(map(str, path))
            if fqn in seen:
                raise CkptStoreError(
                    f"{src.where}: {path} and {seen[fqn]} have the same DCP name {fqn!r}; "
                    "DCP cannot hold both"
                )
            seen[fqn] = path
            if not isinstance(leaf, TensorRef) or leaf.node.get("t") == "ndarray":
                value = src.load(leaf) if isinstance(leaf, TensorRef) else leaf
                yield DCPItem(fqn, path, None, value, ())
                continue
            if leaf.dtype not in SUPPORTED_DTYPES:
                raise IntegrityError(f"{src.where}: tensor at {path} has dtype {leaf.dtype!r}")
            yield DCPItem(fqn, path, leaf, None, tuple(_pieces(src, leaf)))


def _pieces(
    src: StepTensors, ref: TensorRef
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], Chunk | None]]:
    if not ref.sharded:
        yield (0,) * len(ref.shape), tuple(ref.shape), None
        return
    name = ref.node.get("name")
    entry = src.index.tensors.get(name) if src.index is not None and name else None
    if entry is None:
        raise IntegrityError(f"{src.where}: sharded tensor {name!r} is not in the chunk index")
    for c in sorted(entry.chunks, key=lambda c: c.offsets):
        yield c.offsets, c.sizes, c


def read_piece(
    src: StepTensors,
    item: DCPItem,
    piece: tuple[tuple[int, ...], tuple[int, ...], Chunk | None],
    offsets: tuple[int, ...] | None = None,
    lengths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A box of one saved piece of ``item``, every byte checked against its CRC32C first.

    ``offsets``/``lengths`` are relative to the piece (default: all of it).
    """
    _, sizes, chunk = piece
    assert item.ref is not None
    rel = offsets if offsets is not None else (0,) * len(sizes)
    size = lengths if lengths is not None else sizes
    if chunk is None:  # a plain tensor: read whole (payload files hold tensors whole)
        t: torch.Tensor = src.load(item.ref)
        for d, (o, n) in enumerate(zip(rel, size, strict=True)):
            t = t.narrow(d, o, n)
        return t
    assert src.index is not None
    dtype = SUPPORTED_DTYPES[item.ref.dtype]
    return read_box(src._read, chunk, dtype, rel, size, block=src.index.block, where=src.where)


class CkptStoreReader(StorageReader):
    """A DCP ``StorageReader`` over one committed step of a ckptstore store (see the module).

    Args:
        root: the store (a directory or an fsspec URL).
        step: the step to load (default: the newest committed step).
        storage_options: fsspec options for a URL.
        allow_pickle: decode pickled values (only for stores every reader trusts).

    ``checkpoint_id`` (``dcp.load(..., checkpoint_id=ROOT)``) names the store instead.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        step: int | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.root = os.fspath(root) if root is not None else None
        self.step = step
        self.storage_options = dict(storage_options) if storage_options else None
        self.allow_pickle = allow_pickle
        self._src: StepTensors | None = None
        self._items: dict[str, DCPItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins; ``checkpoint_id`` (if given) is the store's root."""
        self.close()
        if checkpoint_id is not None:
            self.root = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local ckptstore store with a committed step."""
        try:
            return bool(open_store(os.fspath(checkpoint_id)).list_steps())
        except Exception:  # not a store, unreachable: not ours to read
            return False

    def _open(self) -> StepTensors:
        if self._src is None:
            if self.root is None:
                raise CkptStoreError("CkptStoreReader: no store given (root or checkpoint_id)")
            storage: Storage = open_store(self.root, self.storage_options)
            with reaching(storage.root):
                step = committed_step(storage, self.step)
            self._src = StepTensors(storage, step, allow_pickle=self.allow_pickle)
            self._items = {it.fqn: it for it in dcp_items(self._src)}
        return self._src

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's items as DCP metadata (read from the manifest, state and index)."""
        self._open()
        md = {fqn: it.metadata() for fqn, it in self._items.items()}
        return Metadata(
            state_dict_metadata=md, planner_data={f: it.path for f, it in self._items.items()}
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to set up: the items are known from :meth:`read_metadata`."""
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as DCP made it."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as DCP made them."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each item of ``plan``: the overlap of a saved chunk, checked, into its target."""
        src = self._open()
        for req in plan.items:
            item = self._items.get(req.storage_index.fqn)
            if item is None:
                raise CkptStoreError(f"{src.where}: no item {req.storage_index.fqn!r}")
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(item.value, buf)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            want = tuple(req.storage_index.offset or ())
            piece = next((p for p in item.chunks if p[0] == want), None)
            if piece is None:
                raise IntegrityError(f"{src.where}: {item.fqn!r} has no chunk at {list(want)}")
            t = read_piece(src, item, piece, tuple(req.storage_offsets), tuple(req.lengths))
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise IntegrityError(
                    f"{src.where}: {item.fqn!r}: read {list(t.size())} for a target of "
                    f"{list(target.size())}"
                )
            target.copy_(t)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        """Close the files this reader opened."""
        if self._src is not None:
            self._src.close()
            self._src = None
        self._items = {}

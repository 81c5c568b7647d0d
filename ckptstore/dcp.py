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

Every rank reads the step's whole chunk index to describe it to DCP (DCP's metadata lists
every chunk of every tensor), so this path costs each rank the index of every saving rank;
``CheckpointManager.restore`` reads only the index parts its shards overlap.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .errors import CkptStoreError, IntegrityError
from .ops.stores import committed_step, open_store, reaching
from .sharded.consolidate import StepTensors
from .sharded.dcpview import DCPItem, dcp_items, read_piece
from .storage import Storage

__all__ = ["CkptStoreReader"]


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
        self._pieces: dict[tuple[str, tuple[int, ...]], Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins; ``checkpoint_id`` (if given) is the store's root."""
        self.close()
        if checkpoint_id is not None:
            self.root = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a ckptstore store (a path or URL) with a committed step."""
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
            # A request names its chunk by offsets: one lookup, not a scan of the tensor's
            # chunks (a one-process load of an N-rank save asks for all N of each tensor).
            self._pieces = {(it.fqn, p[0]): p for it in self._items.values() for p in it.chunks}
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
        try:
            self._read_items(src, plan, planner)
        finally:
            self.close()  # the last call of a load: release the files on every rank
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, src: StepTensors, plan: LoadPlan, planner: LoadPlanner) -> None:
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
            piece = self._pieces.get((item.fqn, want))
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

    def close(self) -> None:
        """Close the files this reader opened."""
        if self._src is not None:
            self._src.close()
            self._src = None
        self._items = {}
        self._pieces = {}

"""Integrations of ckptstore with training frameworks.

Each lives in its own module and imports its framework only when that module is imported,
so ``import ckptstore`` never needs them:

- :mod:`ckptstore.integrations.lightning`: ``CkptStoreIO``, a Lightning ``CheckpointIO``
  plugin (``Trainer(plugins=[CkptStoreIO()])``); with ``ModelParallelStrategy`` it also
  takes over the strategy's sharded save and load (:mod:`.lightning_sharded`).
- :mod:`ckptstore.integrations.torchtitan`: ``CkptStoreCheckpointManager``, torchtitan's
  checkpointer saving through ``ckptstore.dcp.CkptStoreWriter`` (a config change).
- :mod:`ckptstore.integrations.hf`: ``AcceleratorCheckpointer`` (accelerate) and
  ``CkptStoreCallback`` (the transformers ``Trainer``).
"""

from __future__ import annotations

__all__: list[str] = []

"""The ``ckptstore`` logger: every record carries the rank that wrote it.

Records get a ``rank`` attribute (usable in formats as ``%(rank)s``) and, when
torch.distributed runs with more than one rank, their message starts with ``[rank N]`` so
that interleaved logs of a job stay readable with any formatter.
"""

from __future__ import annotations

import logging

__all__ = ["logger"]


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            rank, world = 0, 1
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    rank, world = dist.get_rank(), dist.get_world_size()
            except (ImportError, RuntimeError, ValueError):
                pass
            record.rank = rank
            if world > 1 and isinstance(record.msg, str):
                record.msg = f"[rank {rank}] {record.msg}"
        return True


logger = logging.getLogger("ckptstore")
if not any(isinstance(f, _RankFilter) for f in logger.filters):
    logger.addFilter(_RankFilter())

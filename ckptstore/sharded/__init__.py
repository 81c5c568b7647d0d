"""Sharded (DTensor) state.

Naming, who writes which box, the chunk index, resharding on restore and consolidation into
full tensors.
"""

"""The save pipeline's stages, one module each, run in order by :mod:`.pipeline`.

``admit`` (may the step be saved) -> ``encode`` (capture: state -> tree + tensors) ->
``plan`` (DTensor saves: who writes which box) -> ``staging`` (async saves: one copy into
reused buffers) -> ``begin`` (sharded saves: the tmp directory every rank writes into) ->
``write`` (payload files and their block CRCs) -> ``commit`` (one store) or
``commit_sharded`` (every rank's files, node-local copies) -> ``after_commit`` (the replica
queue, retention, deletion). ``jobs`` holds the typed objects passed between them,
``failures`` the errors a failed save raises, ``phases`` the timings of a save.
"""

"""The restore pipeline's stages, one module each, run in order by :mod:`.reader`.

``select`` (the steps to try, newest first, in either tier) -> ``plan`` (the files and
DTensor leaves this rank reads) -> ``read`` (read and check every block before use;
``partial`` for byte ranges of files) -> ``load`` (check the targets, read into them).
"""

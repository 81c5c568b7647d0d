"""Store operations: the typed functions behind the command line.

List, inspect, diff, verify, export, import, prune, gc, rm, pin: what ``ckptstore`` prints,
for Python users too.
"""

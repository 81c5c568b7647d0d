"""The benchmark behind ``tools/bench.py`` (see its docstring for the modules and the runs).

Not part of ckptstore: importable with tools/ on ``sys.path``, as ``python tools/bench.py``
has it. Importing the package imports none of its modules.
"""

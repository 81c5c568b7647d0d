"""The crash campaign behind ``tools/crashtest.py`` (see its docstring for what it checks).

Not part of ckptstore: importable with tools/ on ``sys.path``, as ``python tools/crashtest.py``
has it. Importing the package imports none of its modules.
"""

"""The package's version, in a module of its own.

Modules that record it (manifests, the CLI's ``--version``) import it from here, not from
the package, which imports them.
"""

__version__ = "0.1.0"

"""mkdocs hooks: README.md becomes the site's home page and CONTRIBUTING.md one of its pages.

Both live at the repository's root, where GitHub shows them, and link to the docs as
``docs/<page>.md``. On the site they are ``index.md`` and ``contributing.md`` next to the
other pages, so their links are rewritten to match; everything else (broken links, missing
anchors) is left to ``mkdocs build --strict`` to catch, exactly as for the pages in docs/.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent.parent
#: Site page name -> file at the repository's root.
ROOT_PAGES = {"index.md": "README.md", "contributing.md": "CONTRIBUTING.md"}
_LINKS = [
    (re.compile(r"\]\(docs/"), "]("),
    (re.compile(r"\]\(README\.md"), "](index.md"),
    (re.compile(r"\]\(CONTRIBUTING\.md"), "](contributing.md"),
]


def site_text(text: str) -> str:
    """A root page's markdown with its links pointing at the site's pages."""
    for pattern, repl in _LINKS:
        text = pattern.sub(repl, text)
    return text


def on_files(files: Files, config: Any) -> Files:
    """Add the root pages, generated from the files at the repository's root."""
    for name, source in ROOT_PAGES.items():
        if files.get_file_from_path(name) is not None:
            msg = f"docs/{name} would shadow {source}: the site's {name} is made from {source}"
            raise RuntimeError(msg)
        text = (REPO / source).read_text(encoding="utf-8")
        files.append(File.generated(config, name, content=site_text(text)))
    return files

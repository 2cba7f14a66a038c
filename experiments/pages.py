"""The repository's Markdown pages that hold generated tables: README.md and the documentation
site's pages (docs/). A table is found by its markers, ``<!-- table: NAME -->`` (written by
``experiments.readme_tables``) or ``<!-- leaderboard: NAME -->`` (``experiments.leaderboard``),
wherever it lives, so that a table can move between pages without a change of code."""

from __future__ import annotations

import glob
import os
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def markdown_pages(root: str = REPO) -> List[str]:
    """README.md and every page under docs/, in a stable order."""
    pages = [os.path.join(root, "README.md")]
    pages += sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
    return [p for p in pages if os.path.isfile(p)]


def pages_holding(marker: str, root: str = REPO) -> List[str]:
    """The pages whose text holds `marker` (e.g. ``<!-- table: synthetic -->``)."""
    found = []
    for page in markdown_pages(root):
        with open(page, encoding="utf-8") as f:
            if marker in f.read():
                found.append(page)
    return found

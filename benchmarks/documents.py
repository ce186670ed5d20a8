"""A benchmark's results as JSON, and the Markdown page rendered from them beside it.

Every page is rendered from its JSON, never edited by hand: `write` saves both after a
run, `render_again` rewrites the page from saved JSON (after a change to the renderer).

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     path = os.path.join(directory, "results.json")
    ...     write(path, {"n": 3}, "PAGE.md", lambda document: f"n = {document['n']}")
    ...     render_again(path, "PAGE.md", lambda document: f"n is {document['n']}")
    ...     open(os.path.join(directory, "PAGE.md")).read()
    'n is 3'
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

Renderer = Callable[[dict[str, Any]], str]


def write(path: str, document: dict[str, Any], page: str, render: Renderer) -> None:
    """Saves `document` to `path` as JSON and `render(document)` beside it as `page`."""
    with open(path, "w") as f:
        json.dump(document, f, indent=2, default=str)
    render_again(path, page, render)


def render_again(path: str, page: str, render: Renderer) -> None:
    """Writes `page` beside `path` from the JSON saved there."""
    with open(path) as f:
        document = json.load(f)
    with open(os.path.join(os.path.dirname(path), page), "w") as f:
        f.write(render(document))

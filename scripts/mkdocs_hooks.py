"""MkDocs hooks (``hooks:`` in mkdocs.yml).

The changelog page (docs/changelog.md) shows CHANGELOG.md, whose links are written from the repository root
(``docs/performance.md``) so that they work where the file is read on its own. On the site the page lives in docs/,
so the hook includes the file itself with those links made relative to the page (a snippet include would keep them
as written, and ``mkdocs build --strict`` reports each as a missing page).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the changelog page's source: the include the hook replaces
CHANGELOG_PAGE = ("changelog.md", '--8<-- "CHANGELOG.md"')


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """The changelog page's markdown: CHANGELOG.md with ``](docs/`` links rewritten; other pages as they are."""
    name, include = CHANGELOG_PAGE
    if page.file.src_uri != name or markdown.strip() != include:
        return markdown
    text = (Path(config["config_file_path"]).parent / "CHANGELOG.md").read_text(encoding="utf-8")
    return text.replace("](docs/", "](")

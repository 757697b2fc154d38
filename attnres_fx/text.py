"""Plain-text tables, the one format every report of the package prints."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces, a dashed rule under the header."""
    rows = [tuple(str(cell) for cell in row) for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells):
        return indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])

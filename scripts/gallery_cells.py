"""What every gallery notebook's cells are made of (``scripts/make_gallery.py`` writes them)."""

from __future__ import annotations

Cell = tuple[str, ...]
"""``(kind, source, *tags)``: kind "md" or "code"; a "result" tag marks the cell the gallery's
test checks."""
LOAD: Cell = ("code", "%load_ext skyward_jupyter")
DOWN: Cell = ("code", "%sky down")

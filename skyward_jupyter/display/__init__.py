"""Views of a pool, folded from its events: the cell's output, the panel, the text fallback."""

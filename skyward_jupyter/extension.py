"""Wiring for ``%load_ext skyward_jupyter``: one session per shell, its magics and displays."""

from __future__ import annotations

import threading
from typing import Any

from .auto_cells import AutoCells
from .completion import rank_names_matcher
from .display import values
from .display.views import PoolViews
from .magics import SkyMagics
from .providers import DEFAULT, provider_class
from .registry import Registry
from .session import Session
from .written import WRITES

_SESSION_ATTR = "_skyward_session"
_CELLS_ATTR = "_skyward_auto_cells"
_MATCHER_ATTR = "_skyward_matcher"


def load(shell: Any) -> None:
    if getattr(shell, _SESSION_ATTR, None) is not None:
        return
    views = PoolViews(shell)
    registry = Registry()  # what the Jupyter server's "Sky" panel reads
    cells = AutoCells(shell)
    session = Session(
        announce=views.announce,
        views=views,
        listeners=[registry],
        namespace=shell.user_ns,
        auto_cells=cells,
        shells_own=shell.user_ns_hidden,
    )
    cells.install()
    setattr(shell, _CELLS_ATTR, cells)
    views.attach(session.down_pool)
    registry.attach(views.request_shutdown)
    setattr(shell, _SESSION_ATTR, session)
    shell.register_magics(SkyMagics(shell, session))
    matcher = rank_names_matcher(session)  # Tab completes the head rank's names too
    shell.Completer.custom_matchers.append(matcher)
    setattr(shell, _MATCHER_ATTR, matcher)
    values.register(shell)
    # Get the default provider ready (the local one: torch imported in its rank template) while
    # the user writes the first cell.
    prewarm = provider_class(DEFAULT).prewarm
    threading.Thread(target=prewarm, name="skyward-prewarm", daemon=True).start()


def unload(shell: Any) -> None:
    session: Session | None = getattr(shell, _SESSION_ATTR, None)
    if session is not None:
        session.down_all()
        setattr(shell, _SESSION_ATTR, None)
        WRITES.close()  # the session's watches on large globals go with it
    cells: AutoCells | None = getattr(shell, _CELLS_ATTR, None)
    if cells is not None:
        cells.uninstall()
        setattr(shell, _CELLS_ATTR, None)
    matcher = getattr(shell, _MATCHER_ATTR, None)
    if matcher in shell.Completer.custom_matchers:
        shell.Completer.custom_matchers.remove(matcher)
    setattr(shell, _MATCHER_ATTR, None)

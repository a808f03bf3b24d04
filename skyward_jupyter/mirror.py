"""``--mirror``: the notebook's own versions of the distributions behind what its cells use,
as requirements every node installs where it lacks them or has other versions.

What the cells use is read from the notebook's namespace: the modules bound there
(``import numpy as np``) and the modules that define its functions and classes
(``from tabulate import tabulate``). torch is not among them: each node's builder gives it the
notebook's version in the build for its accelerator (:func:`.agent.environments.torch_build`);
nor are this package and cloudpickle (checked at connect). A distribution installed from a
local directory (an editable checkout) cannot be installed from an index, and is named as left
out.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

NEVER = frozenset({"torch", "skyward-jupyter", "cloudpickle"})
"""Distributions (normalised names) that are never mirrored."""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def modules_in(namespace: Mapping[str, Any]) -> set[str]:
    """Top-level names of the modules bound in ``namespace`` or defining what is bound there."""
    found = set()
    for name, value in namespace.items():
        if name.startswith("_"):
            continue  # IPython's own (_, __, _i1, ...)
        module = value.__name__ if isinstance(value, types.ModuleType) else None
        if module is None and isinstance(value, type | types.FunctionType):
            module = getattr(value, "__module__", None)
        if module:
            found.add(module.split(".", 1)[0])
    return found


def notebook_requirements(modules: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``dist==version`` for the distributions behind ``modules`` (sorted), and the
    distributions left out because only this machine can install them (local directories).
    """
    owners = metadata.packages_distributions()
    dists = {
        dist
        for module in modules
        if module not in sys.stdlib_module_names
        for dist in owners.get(module, ())
        if _normal(dist) not in NEVER
    }
    pinned, local = [], []
    for dist in sorted(dists, key=_normal):
        found = metadata.distribution(dist)
        origin = found.read_text("direct_url.json")
        if origin and "dir_info" in json.loads(origin):
            local.append(dist)
        else:
            pinned.append(f"{dist}=={found.version}")
    return tuple(pinned), tuple(local)

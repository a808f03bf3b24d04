"""The wheel ships the prebuilt side panel, the server extension's enabling config and the
built-in providers' entry points.

The wheel is built from this checkout (the hook packs the panel built by ``make setup``; from a
clean tree it would run npm itself) and installed into a scratch prefix, whose Jupyter then lists
the panel as enabled: a user of the wheel needs no Node.js.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from skyward_jupyter.providers import BUILT_IN

ROOT = Path(__file__).resolve().parents[1]
DATA = "skyward_jupyter-0.1.0.data/data"


def test_the_wheel_ships_the_panel_enabled(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("skyward_jupyter-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    panel = f"{DATA}/share/jupyter/labextensions/skyward-jupyter"
    assert {f"{panel}/package.json", f"{panel}/install.json", f"{panel}/static/style.js"} <= names
    assert any(n.startswith(f"{panel}/static/remoteEntry.") for n in names)
    charts = "skyward_jupyter/display/static"  # the panel's charts draw without internet
    assert {f"{charts}/uPlot.iife.min.js", f"{charts}/chart.js", f"{charts}/chart.css"} <= names
    config = f"{DATA}/etc/jupyter/jupyter_server_config.d/skyward_jupyter.json"
    enabled = json.loads(zipfile.ZipFile(wheel).read(config))
    assert enabled["ServerApp"]["jpserver_extensions"]["skyward_jupyter"] is True
    # The built-in providers are found as any plugin's are: by their entry points.
    points = zipfile.ZipFile(wheel).read("skyward_jupyter-0.1.0.dist-info/entry_points.txt")
    declared = dict(re.findall(r"^(\w+) = (\S+)$", points.decode(), re.M))
    assert "[skyward_jupyter.providers]" in points.decode() and declared == BUILT_IN, points

    prefix = tmp_path / "prefix"
    subprocess.run(
        # --ignore-installed: without it pip would first uninstall this checkout's editable
        # install from the test's own environment.
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
         "--prefix", str(prefix), str(wheel)],
        check=True,
    )  # fmt: skip
    listing = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"],
        env={**os.environ, "JUPYTER_PATH": str(prefix / "share" / "jupyter"), "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", listing.stdout + listing.stderr)  # colours
    section = text.split(str(prefix / "share" / "jupyter" / "labextensions"), 1)[1]
    first = section.strip().splitlines()[0]
    # Exact words: "disabled" contains "enabled".
    assert first.split()[:4] == ["skyward-jupyter", "v0.1.0", "enabled", "OK"], text

"""A real JupyterLab server and a real headless Chromium, for the browser tests.

The server runs from this virtualenv on a free loopback port with its own token, config,
runtime and settings directories (so nothing of the developer's Jupyter setup leaks in), and is
ended with its whole process group: kernels, and through them their rank processes, go with it.
Chromium is Debian's (``/usr/bin/chromium``, installed by ``.ci/run``); Playwright never
downloads a browser here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .conftest import wait_for

CHROMIUM = os.environ.get("SKYWARD_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
SERVER_EXTENSION_CONFIG = (
    Path(__file__).resolve().parents[1]
    / "jupyter-config"
    / "jupyter_server_config.d"
    / "skyward_jupyter.json"
)
_CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass(frozen=True)
class Lab:
    url: str
    token: str
    root: Path

    @property
    def runtime_dir(self) -> Path:
        return self.root / ".jupyter-home" / "runtime"

    def page_url(self, path: str) -> str:
        return f"{self.url}/{path}?token={self.token}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextmanager
def jupyter_lab(root: Path) -> Iterator[Lab]:
    """Run ``jupyter lab`` serving ``root`` until the block ends."""
    token = secrets.token_hex(16)
    port = _free_port()
    home = root / ".jupyter-home"
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    # The server extension, enabled as an install enables it (the editable dev install may not
    # have put the file under the environment's etc/jupyter).
    server_config = home / "config" / "jupyter_server_config.d"
    server_config.mkdir(parents=True)
    shutil.copy(SERVER_EXTENSION_CONFIG, server_config)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
    }
    env.pop("SKYWARD_REGISTRY_DIR", None)  # kernels and server meet in the runtime dir's registry
    log = (root / "lab.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
            f"--port={port}", "--ip=127.0.0.1", f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={home / 'settings'}",
            "--ServerApp.open_browser=False",
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(f"{url}/api/status?token={token}"), 60, "JupyterLab to serve")
        yield Lab(url, token, root)
    finally:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@contextmanager
def chromium_page() -> Iterator[object]:
    """A Playwright page in headless Debian Chromium."""
    from playwright.sync_api import sync_playwright

    if not shutil.which(CHROMIUM):
        raise AssertionError(
            f"{CHROMIUM} not found: the browser tests need Debian's chromium "
            "(apt-get install chromium; .ci/run installs it)"
        )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=_CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            yield page
        finally:
            browser.close()


def screenshot(page: object, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    return path

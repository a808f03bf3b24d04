"""A real JupyterLab server and a real headless Chromium, for the browser tests.

The server runs from this virtualenv on a loopback port the system gives it, with its own token,
config, runtime and settings directories (so nothing of the developer's Jupyter setup leaks in),
and is ended with its whole process group: kernels, and through them their rank processes, go
with it. Its kernels talk over IPC sockets in the runtime directory: no port of theirs can be
taken by another test's process between being picked and being bound.
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
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient

from .conftest import outputs_of, reply_of, wait_for

CHROMIUM = os.environ.get("SKYWARD_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
CHECKOUT = Path(__file__).resolve().parents[1]
DOCS = CHECKOUT / "docs" if os.environ.get("SKYWARD_PICTURES") == "docs" else ARTIFACTS
"""Where the README's pictures go, each made by the browser test that shows what it pictures:
``docs/`` when ``make pictures`` asks for them (``SKYWARD_PICTURES=docs``), else beside the other
artifacts, so that a test run leaves the checkout as it found it."""
BUILT_PANEL = CHECKOUT / "skyward_jupyter" / "labextension"
"""This checkout's build of the side panel (make labextension), when there is one."""
SERVER_EXTENSION_CONFIG = (
    CHECKOUT / "jupyter-config" / "jupyter_server_config.d" / "skyward_jupyter.json"
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
    runtime_dir: Path

    def page_url(self, path: str) -> str:
        return f"{self.url}/{path}?token={self.token}"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _server_info(runtime: Path) -> dict[str, Any]:
    """The server's own account of itself (port, URL), written once it listens; {} before."""
    for info in runtime.glob("jpserver-*.json"):
        with contextlib.suppress(OSError, ValueError):  # not written whole yet
            return dict(json.loads(info.read_text()))
    return {}


@contextmanager
def jupyter_lab(root: Path) -> Iterator[Lab]:
    """Run ``jupyter lab`` serving ``root`` until the block ends."""
    token = secrets.token_hex(16)
    home = root / ".jupyter-home"
    # Short, so that the kernels' IPC socket paths fit a socket address (108 bytes).
    runtime = Path(tempfile.mkdtemp(prefix="skyward-lab-", dir="/tmp"))
    settings = home / "settings" / "@jupyterlab"
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    # A notebook opened while the lab is still loading may otherwise ask which kernel to start
    # (a modal that blocks "Run All"), under load only.
    (settings / "notebook-extension").mkdir()
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"autoStartDefaultKernel": True})
    )
    # The server extension, enabled as an install enables it (the editable dev install may not
    # have put the file under the environment's etc/jupyter).
    server_config = home / "config" / "jupyter_server_config.d"
    server_config.mkdir(parents=True)
    shutil.copy(SERVER_EXTENSION_CONFIG, server_config)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(runtime),
    }
    # The side panel of this checkout, ahead of any the environment links to (the first found
    # of a name wins), so that a build here is the one tested.
    if (BUILT_PANEL / "package.json").exists():
        (home / "data" / "labextensions").mkdir(parents=True)
        (home / "data" / "labextensions" / "skyward-jupyter").symlink_to(BUILT_PANEL)
        env["JUPYTER_PATH"] = os.pathsep.join(
            filter(None, [str(home / "data"), os.environ.get("JUPYTER_PATH")])
        )
    env.pop("SKYWARD_REGISTRY_DIR", None)  # kernels and server meet in the runtime dir's registry
    log = (root / "lab.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
            "--port=0", "--ip=127.0.0.1", f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={home / 'settings'}",
            "--ServerApp.open_browser=False", "--KernelManager.transport=ipc",
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: _server_info(runtime), 60, "JupyterLab to say where it serves")
        url = f"http://127.0.0.1:{_server_info(runtime)['port']}"
        wait_for(lambda: _ready(f"{url}/api/status?token={token}"), 60, "JupyterLab to serve")
        yield Lab(url, token, root, runtime)
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
        shutil.rmtree(runtime, ignore_errors=True)


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


def picture(element: object, name: str, where: Path = DOCS) -> Path:
    """A PNG of one element (a panel, not the page: small enough to commit), by default for
    the README (see :data:`DOCS`).
    """
    where.mkdir(exist_ok=True)
    path = where / f"{name}.png"
    element.screenshot(path=str(path))  # type: ignore[attr-defined]
    return path


def api(
    lab: Lab,
    method: str,
    path: str,
    body: object = None,
    *,
    token: str | None = "",
    headers: dict[str, str] | None = None,
    opener: urllib.request.OpenerDirector | None = None,
) -> tuple[int, Any]:
    """``(status, JSON body or raw bytes)``; ``token=None`` sends no credentials."""
    all_headers = dict(headers or {})
    if token is not None:
        all_headers["Authorization"] = f"token {token or lab.token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(lab.url + path, data, all_headers, method=method)
    try:
        with (opener or urllib.request.build_opener()).open(request, timeout=120) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as error:
        raw, status = error.read(), error.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw


def end_kernels(lab: Lab) -> None:
    """Shut down every kernel of the lab, and with them their pools (a test's ranks end with
    the test, though the lab serves the module's next test).
    """
    status, kernels = api(lab, "GET", "/api/kernels")
    assert status == 200, kernels
    for kernel in kernels:
        api(lab, "DELETE", f"/api/kernels/{kernel['id']}")


def rank_pids(pool: dict[str, Any]) -> set[int]:
    """The pids of a pool's ranks, as the REST API lists them."""
    return {r["pid"] for node in pool["nodes"] for r in node["ranks"]}


class Kernel:
    """A kernel started through the server's REST API, driven over its connection file.

    With ``notebook``, the kernel is that notebook's (a session, as JupyterLab opens one).
    """

    def __init__(self, lab: Lab, notebook: str | None = None) -> None:
        self.lab = lab
        if notebook is None:
            status, body = api(lab, "POST", "/api/kernels", {"name": "python3"})
            assert status == 201, body
            self.id: str = body["id"]
        else:
            session = {
                "path": notebook,
                "name": notebook,
                "type": "notebook",
                "kernel": {"name": "python3"},
            }
            status, body = api(lab, "POST", "/api/sessions", session)
            assert status == 201, body
            self.id = body["kernel"]["id"]
        connection = lab.runtime_dir / f"kernel-{self.id}.json"
        wait_for(connection.exists, 30, "the kernel's connection file")
        self.connection = connection
        self.client = self._connect()
        self._wait_for_ready(60)

    def _connect(self) -> BlockingKernelClient:
        client = BlockingKernelClient(connection_file=str(self.connection))
        client.load_connection_file()
        client.start_channels()
        return client

    def _wait_for_ready(self, timeout: float) -> None:
        """Wait for the kernel's first reply. The server writes the connection file before the
        kernel listens: under load the client's heartbeat may miss its first beats and call the
        kernel dead while the server still runs it; then connect again, until the deadline.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
                return
            except RuntimeError:
                alive = api(self.lab, "GET", f"/api/kernels/{self.id}")[0] == 200
                if not alive or time.monotonic() > deadline:
                    raise
                self.client.stop_channels()
                self.client = self._connect()

    def run(self, code: str, timeout: float = 120) -> str:
        """Run ``code``; its stdout, stderr and error as text (an error fails the test)."""
        reply, text = self.collect(self.client.execute(code), timeout)
        assert reply["status"] == "ok", text
        return text

    def collect(self, msg_id: str, timeout: float, until: str | None = None) -> tuple[Any, str]:
        """Outputs of request ``msg_id`` until it ends (or, with ``until``, that text shows)."""
        deadline = time.monotonic() + timeout
        text = ""
        for msg in outputs_of(self.client, msg_id, deadline, f"request {msg_id}"):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text += content["text"]
            elif kind == "error":
                text += f"{content['ename']}: {content['evalue']}\n"
            if until is not None and until in text:
                return None, text
        return reply_of(self.client, msg_id, deadline, f"request {msg_id}"), text

    def pid(self) -> int:
        return int(self.run("import os; print(os.getpid())").strip())

    def close(self) -> None:
        self.client.stop_channels()
        api(self.lab, "DELETE", f"/api/kernels/{self.id}")

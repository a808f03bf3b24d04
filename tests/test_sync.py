"""The notebook's directories on nodes that do not share its files (private SSH test hosts).

What a user meets: the ranks run in a copy of the notebook's directory, kept in step before
every cell, with only changed files travelling, ignore files honoured, bad input named, and what
the notebook sends leaving it once whatever the number of nodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool, PoolError
from skyward_jupyter.events import PoolMessage
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider

from .conftest import agents_among, ssh_hosts_fixture, wait_for
from .hosts import Hosts, available, ssh_hosts

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


hosts = ssh_hosts_fixture(3, "sync-hosts")


def _provider(hosts: Hosts, which: tuple[int, ...] = (0, 1), **changes: object) -> SSHProvider:
    options = SSHOptions(
        identity=str(hosts.client_key),
        known_hosts=str(hosts.known_hosts),
        python=hosts.python,
        connect_timeout=5,
    )
    return SSHProvider(
        [Host(hosts[i].address, hosts.user, hosts[i].port) for i in which],
        dataclasses.replace(options, **changes),  # type: ignore[arg-type]
    )


def _ssh_options(hosts: Hosts, **more: object) -> dict[str, object]:
    """The pool options (as the magics give them) of an SSH pool on host 0."""
    return {
        "hosts": f"{hosts.user}@{hosts[0].address}:{hosts[0].port}",
        "identity": str(hosts.client_key),
        "known_hosts": str(hosts.known_hosts),
        "python": hosts.python,
        **more,
    }


def _project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "mymod.py").write_text("VALUE = 1\ndef f():\n    return VALUE\n")
    (root / "data.csv").write_text("x\n1\n2\n")
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "tool.py").write_text("NAME = 'tool'\n")
    (root / ".gitignore").write_text("*.log\nbuild/\n")
    (root / ".skyignore").write_text("secret.txt\n")
    (root / "run.log").write_text("ignored by git\n")
    (root / "secret.txt").write_text("ignored by .skyignore\n")
    (root / "build").mkdir(exist_ok=True)
    (root / "build" / "big.bin").write_bytes(b"\0" * 1000)
    return root


def _touch_later(path: Path, text: str) -> None:
    """Rewrite ``path`` with a clearly newer mtime (a scan trusts an unchanged stat)."""
    path.write_text(text)
    later = time.time() + 10
    os.utime(path, (later, later))


LOOK = (
    "import os, sys\n"
    "import mymod, pkg.tool\n"
    "here = sorted(set(os.listdir('.')) - {'__pycache__'})\n"
    "paths = [os.path.realpath(p) for p in sys.path]\n"
    "(mymod.f(), pkg.tool.NAME, open('data.csv').read().split(), here,"
    " os.getcwd().startswith(os.path.expanduser('~')), os.getcwd() in paths)"
)


def test_the_directory_travels_and_stays_in_step(hosts: Hosts, tmp_path: Path) -> None:
    root = _project(tmp_path / "project")
    with Pool(nodes=2, provider=_provider(hosts), sync=[str(root)]) as pool:
        result = pool.run(LOOK)
        assert result.ok, result.errors
        for value in result.values:
            f, name, rows, listing, under_home, on_path = value
            assert (f, name, rows) == (1, "tool", ["x", "1", "2"])
            # .gitignore (run.log, build/) and .skyignore (secret.txt) are honoured
            assert listing == [".gitignore", ".skyignore", "data.csv", "mymod.py", "pkg"]
            assert under_home and on_path
        first = pool._transfer.sent
        assert [(files, size) for _, files, size in first] == [(6, sum(
            (root / n).stat().st_size
            for n in (".gitignore", ".skyignore", "data.csv", "mymod.py", "pkg/__init__.py",
                      "pkg/tool.py")
        ))]  # fmt: skip
        assert Path(first[0][0]) == root

        # Nothing changed: nothing travels.
        assert pool.run("mymod.f()").values == [1, 1]
        assert len(pool._transfer.sent) == 1

        # One module edited, one file added: only those travel, and the module is re-imported
        # on the ranks before the cell (the cell does not import it again).
        _touch_later(root / "mymod.py", "VALUE = 2\ndef f():\n    return VALUE\n")
        (root / "new.txt").write_text("new")
        result = pool.run("(mymod.f(), open('new.txt').read())")
        assert result.values == [(2, "new")] * 2, result.errors
        assert [files for _, files, _ in pool._transfer.sent[1:]] == [2]

        # A file the ranks made in their directory survives the next sync (nothing lost).
        assert pool.run("open('made_on_rank.txt', 'w').write('mine')").ok
        _touch_later(root / "data.csv", "x\n3\n")
        after = pool.run("(open('data.csv').read().split(), open('made_on_rank.txt').read())")
        assert after.values == [(["x", "3"], "mine")] * 2, after.errors


def test_a_global_from_a_module_beside_the_notebook_loads_on_the_ranks(
    hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook global whose class lives in a module beside the notebook is pickled by
    reference: the ranks can only load it once the directory is on their sys.path.
    """
    root = _project(tmp_path / "project")
    (root / "shapes.py").write_text(
        "class Square:\n    def __init__(self, n):\n        self.n = n\n"
    )
    monkeypatch.syspath_prepend(str(root))
    import shapes  # type: ignore[import-not-found]

    with Pool(nodes=2, provider=_provider(hosts), sync=[str(root)]) as pool:
        result = pool.run("sq.n * 2", {"sq": shapes.Square(21)})
        assert result.values == [42, 42], result.errors
    sys.modules.pop("shapes", None)


def test_bad_directories_are_named_before_any_machine(hosts: Hosts, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(PoolError, match=f"{missing}"):
        Pool(nodes=1, provider=_provider(hosts, (0,)), sync=[str(missing)]).start()
    big = tmp_path / "big"
    big.mkdir()
    (big / "weights.bin").write_bytes(b"\1" * 300_000)
    (big / "small.py").write_text("x = 1\n")
    started = time.monotonic()
    with pytest.raises(PoolError) as raised:
        Pool(
            nodes=1, provider=_provider(hosts, (0,)), sync=[str(big)], sync_cap_bytes=100_000
        ).start()
    message = str(raised.value)
    assert "weights.bin" in message and ".skyignore" in message and "--sync-cap" in message
    assert time.monotonic() - started < 5  # no host was contacted
    assert not _agents(hosts)


def test_a_full_disk_on_a_host_is_named_and_the_pool_stays_usable(tmp_path: Path) -> None:
    """A small home and a small ``/dev/shm`` (as in a container): a large global that memory
    has no room for is kept on disk instead, and the user is told; a full home is named.
    """
    with ssh_hosts(1, tmp_path / "hosts", home_size="4m", shm_size="2m") as small:
        root = tmp_path / "project"
        root.mkdir()
        (root / "ok.py").write_text("X = 1\n")
        with Pool(nodes=1, provider=_provider(small, (0,)), sync=[str(root)]) as pool:
            assert pool.run("__import__('ok').X").values == [1]
            (root / "huge.bin").write_bytes(os.urandom(6 << 20))
            with pytest.raises(PoolError) as raised:
                pool.run("1")
            message = str(raised.value)
            assert small[0].address in message and "No space left on device" in message
            assert f"/home/{small.user}" in message
            (root / "huge.bin").unlink()
            assert pool.run("__import__('ok').X").values == [1]  # the copy was not touched
        # two ranks share a large value through the node's store: /dev/shm has no room for it
        with Pool(nodes=1, procs_per_node=2, provider=_provider(small, (0,)), sync=()) as pool:
            large = os.urandom(3 << 20)
            result = pool.run("__import__('hashlib').sha256(large).hexdigest()", {"large": large})
            assert result.values == [hashlib.sha256(large).hexdigest()] * 2, result.errors
            said = [n for n in result.notes if "did not fit in /dev/shm" in n]
            assert len(said) == 1 and "--shm-size" in said[0], result.notes
            again = pool.run("len(large)", {"large": large[::-1]})  # another value: no new note
            assert again.values == [len(large)] * 2 and again.notes == (), again


def test_a_host_that_shares_the_notebooks_files_runs_in_them(tmp_path: Path) -> None:
    """Hosts on the notebook's own filesystem (an NFS home): nothing is copied."""
    root = _project(tmp_path / "project")
    with (
        ssh_hosts(2, tmp_path / "hosts", private=False) as shared,
        Pool(nodes=2, provider=_provider(shared), sync=[str(root)]) as pool,
    ):
        result = pool.run("(__import__('os').getcwd(), __import__('mymod').f())")
        assert result.values == [(str(root), 1)] * 2, result.errors
        assert pool._transfer.sent == []


def test_a_large_global_leaves_the_notebook_once(hosts: Hosts, tmp_path: Path) -> None:
    """Three hosts, a 24 MiB global: the notebook's bytes on the wire stay about 1x its size
    (the other hosts fetch it from the head); without the relay they would be 3x.
    """
    import numpy as np

    tx = Path(f"/sys/class/net/{hosts.bridge}/statistics/tx_bytes")
    value = np.random.default_rng(0).random(3 << 20)  # 24 MiB
    with Pool(nodes=3, provider=_provider(hosts, (0, 1, 2)), sync=()) as pool:
        before = int(tx.read_text())
        result = pool.run("float(x.sum())", {"x": value})
        sent = int(tx.read_text()) - before
        assert result.values == [float(value.sum())] * 3, result.errors
    assert value.nbytes < sent < 1.3 * value.nbytes, sent / value.nbytes


def _agents(hosts: Hosts) -> list[int]:
    return agents_among(pid for i in range(len(hosts)) for pid in hosts.pids(i))


@pytest.fixture(autouse=True)
def _no_remote_ranks_left(hosts: Hosts) -> Iterator[None]:
    yield
    wait_for(lambda: not _agents(hosts), 15, "remote ranks to end")


def test_a_script_in_the_synced_directory_runs_from_the_nodes_copy(
    hosts: Hosts, tmp_path: Path
) -> None:
    """``%sky run train.py`` on hosts without the notebook's files: the script runs in the
    node's copy of its directory, so the module and the data beside it are found.
    """
    from skyward_jupyter.protocol import Script

    root = _project(tmp_path / "project")
    (root / "scripts").mkdir()
    (root / "scripts" / "helper.py").write_text("def f():\n    return 1\n")
    (root / "scripts" / "rows.csv").write_text("x\n1\n2\n")
    script = root / "scripts" / "train.py"
    script.write_text(
        "import os, sys, helper\n"
        "rows = open('rows.csv').read().split()\n"
        "print('script', helper.f(), rows, sys.argv[1:], os.path.basename(sys.argv[0]))\n"
    )
    with Pool(nodes=2, provider=_provider(hosts), sync=[str(root)]) as pool:
        seen: list[str] = []
        result = pool.run(
            script.read_text(),
            filename=str(script),
            script=Script(str(script), ("--epochs", "1")),
            observer=lambda e: seen.append(getattr(e, "text", "")),
        )
        assert result.ok, result.errors
    assert "script 1 ['x', '1', '2'] ['--epochs', '1'] train.py" in "".join(seen)


def _copies(hosts: Hosts, i: int) -> list[str]:
    """The sync copies on host i, seen from inside it (no network needed)."""
    return _listing(hosts, i, ".cache/skyward_jupyter/sync")


def test_secrets_and_links_out_stay_behind_and_the_first_sync_says_so(
    hosts: Hosts, tmp_path: Path
) -> None:
    root = _project(tmp_path / "project")
    (root / ".ssh").mkdir()
    (root / ".ssh" / "id_ed25519").write_text("PRIVATE KEY")
    (root / ".aws").mkdir()
    (root / ".aws" / "credentials").write_text("aws_secret_access_key = x")
    (root / ".env").write_text("TOKEN=x")
    (root / "server.pem").write_text("PRIVATE KEY")
    (root / "weights.bin").write_bytes(b"\1" * 50_000)
    (root / "passwd").symlink_to("/etc/passwd")
    messages: list[str] = []
    with Pool(nodes=2, provider=_provider(hosts), sync=[str(root)]) as pool:
        pool.subscribe(lambda e: messages.append(e.text) if isinstance(e, PoolMessage) else None)
        result = pool.run(
            "import os\nsorted(os.path.join(d, f)[2:] for d, _, fs in os.walk('.') for f in fs)"
        )
        assert result.ok, result.errors
        for listing in result.values:
            assert listing == [
                ".gitignore", ".skyignore", "data.csv", "mymod.py", "pkg/__init__.py",
                "pkg/tool.py", "weights.bin",
            ]  # fmt: skip
        said = "\n".join(messages)
        assert f"syncing {root} to the nodes: 7 files" in said
        assert "largest: weights.bin (48.8 KiB)" in said
        assert "4 files (.aws/credentials, .env, .ssh/id_ed25519, server.pem)" in said
        assert "passwd -> /etc/passwd" in said and "not followed" in said
        assert list(result.notes) == messages  # the text fallback: the cell's result says it
        # Later syncs say nothing unless what is left out changes.
        (root / "more.txt").write_text("x")
        assert pool.run("1").notes == ()
        (root / "id_rsa").write_text("PRIVATE KEY")
        assert any("id_rsa" in note for note in pool.run("1").notes)


def test_the_copy_goes_with_the_last_pool_using_it_unless_kept(
    hosts: Hosts, tmp_path: Path
) -> None:
    root = _project(tmp_path / "project")
    first = Pool(nodes=1, provider=_provider(hosts, (0,)), sync=[str(root)]).start()
    second = Pool(nodes=1, provider=_provider(hosts, (0,)), sync=[str(root)]).start()
    try:
        assert first.run("__import__('mymod').f()").values == [1]
        assert second.run("__import__('mymod').f()").values == [1]
        assert len(_copies(hosts, 0)) == 1  # one copy per notebook directory, shared
        first.close()
        # The other pool of the same directory still works in it.
        assert second.run("open('data.csv').read().split()").values == [["x", "1", "2"]]
        assert len(_copies(hosts, 0)) == 1
    finally:
        first.close()
        second.close()
    wait_for(lambda: not _copies(hosts, 0), 10, "the copy to be removed")

    with Pool(nodes=1, provider=_provider(hosts, (0,)), sync=[str(root)]) as kept:
        assert kept.run("1").ok
        kept.close(keep_files=True)
    assert len(_copies(hosts, 0)) == 1
    # %sky clean on a named host removes it, and says so
    from skyward_jupyter.session import Session

    lines = Session().clean(_ssh_options(hosts, accept_new_host_keys=None))
    assert len(lines) == 1 and "removed 1 synced directory and 1 package version" in lines[0]
    assert not _copies(hosts, 0)


def test_the_copy_goes_also_when_a_cells_forked_child_held_it(hosts: Hosts, tmp_path: Path) -> None:
    """A process the cell forked (a DataLoader worker, a multiprocessing pool) inherits the
    rank's hold on the copy: the rank ends it before it lets go, so the copy still goes.
    """
    root = _project(tmp_path / "project")
    pool = Pool(nodes=1, provider=_provider(hosts, (0,)), sync=[str(root)]).start()
    try:
        forked = pool.run(
            "import os, time\n"
            "child = os.fork()\n"
            "if child == 0:\n"
            "    time.sleep(600)\n"
            "    os._exit(0)\n"
            "child"
        )
        assert forked.ok, forked.errors
        assert len(_copies(hosts, 0)) == 1
    finally:
        pool.close()
    wait_for(lambda: not _copies(hosts, 0), 10, "the copy to be removed")


def test_a_node_removes_its_copy_when_the_notebook_is_gone(hosts: Hosts, tmp_path: Path) -> None:
    """The notebook's process is killed (no shutdown reaches the ranks): the node's rank sees
    its channel close and removes the copy on its way out.
    """
    root = _project(tmp_path / "project")
    h = hosts[1]
    notebook = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from skyward_jupyter import Pool\n"
            "from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider\n"
            f"options = SSHOptions(identity={str(hosts.client_key)!r}, "
            f"known_hosts={str(hosts.known_hosts)!r}, python={hosts.python!r})\n"
            f"provider = SSHProvider([Host({h.address!r}, {hosts.user!r}, {h.port})], options)\n"
            f"pool = Pool(nodes=1, provider=provider, sync=[{str(root)!r}]).start()\n"
            "assert pool.run('1').ok\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert notebook.stdout is not None and notebook.stdout.readline() == "ready\n"
        assert len(_copies(hosts, 1)) == 1
        notebook.kill()
        notebook.wait(10)
        wait_for(lambda: not _copies(hosts, 1), 20, "the node to remove its copy")
    finally:
        notebook.kill()
        notebook.wait(10)


def test_a_home_directory_synced_by_default_asks_for_sync(
    hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skyward_jupyter.session import USER_ERRORS, Session

    home = _project(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    session = Session(announce=lambda _: None)
    spec = session.spec_from(_ssh_options(hosts))
    with pytest.raises(USER_ERRORS) as raised:
        session.entry(None, spec)
    message = str(raised.value)
    assert "\n" not in message and str(home) in message and "--sync" in message
    assert not _agents(hosts)  # no machine was started
    chosen = session.spec_from({"sync": (str(home),)}, spec)
    try:
        entry = session.entry(None, chosen)
        assert entry.pool.run("__import__('mymod').f()").values == [1]
    finally:
        session.down_all()


def test_a_pool_replaced_on_the_same_hosts_keeps_their_copy(
    hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cell with other options replaces the pool on the same host: the new pool works in the
    copy the old one left (nothing travels again, what the ranks made there is still there);
    ``%sky down`` removes it.
    """
    from skyward_jupyter.session import Session

    root = _project(tmp_path / "project")
    monkeypatch.chdir(root)
    session = Session(announce=lambda _: None)
    spec = session.spec_from(_ssh_options(hosts, sync=(str(root),)))
    try:
        first = session.entry(None, spec)
        assert first.pool.run("open('made.txt', 'w').write('by a rank')").ok
        other = session.spec_from({"env": (("SOME_SETTING", "1"),)}, spec)
        replaced = session.entry(None, other)
        assert replaced.pool is not first.pool
        assert replaced.pool.run("open('made.txt').read()").values == ["by a rank"]
    finally:
        session.down_all()
    wait_for(lambda: not _copies(hosts, 0), 10, "%sky down to remove the copy")


def test_sky_clean_says_each_hosts_outcome_and_cleans_a_custom_cache_and_copy(
    hosts: Hosts, tmp_path: Path
) -> None:
    """One unreachable host does not hide the others' reports; a provider's own cache
    directory is the one cleaned.
    """
    import asyncio

    root = _project(tmp_path / "project")
    custom = _provider(hosts, (0,), cache_dir="custom-cache")
    with Pool(nodes=1, provider=custom, sync=[str(root)]) as pool:
        assert pool.run("1").ok
        pool.close(keep_files=True)
    assert _copies(hosts, 0) and _listing(hosts, 0, "custom-cache")
    refused = Host(hosts[0].address, hosts.user, 2299)
    both = SSHProvider([*custom.hosts, refused], custom.options)
    lines = asyncio.run(both.clean())
    assert len(lines) == 2
    assert "removed 1 synced directory and 1 package version" in lines[0], lines
    assert lines[1].startswith(f"{refused}: connection refused on port 2299"), lines
    assert not _copies(hosts, 0) and not _listing(hosts, 0, "custom-cache")


def _listing(hosts: Hosts, i: int, under_home: str) -> list[str]:
    """What a directory of the login's home on host i holds."""
    where = f"/home/{hosts.user}/{under_home}"
    out = subprocess.run(
        hosts.inside_argv(i, "sh", "-c", f"ls -1 {where} 2>/dev/null || true"),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def test_a_long_clean_stops_on_ctrl_c() -> None:
    """``%sky clean`` waits for its hosts in a way Ctrl-C interrupts: the work is cancelled."""
    import _thread
    import asyncio
    import threading

    from skyward_jupyter.session import _interruptible

    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _interruptible(slow())
    assert time.monotonic() - started < 5
    wait_for(cancelled.is_set, 5, "the clean's work to be cancelled")

"""The pool registry: the record files a kernel's pools publish for the Jupyter server."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter import procs, registry
from skyward_jupyter.registry import Registry, writer
from skyward_jupyter.server import pools as served
from skyward_jupyter.session import PoolSpec, Session

from .conftest import TEMPLATE, agent_pids, wait_for


def _record(pool_id: str | None = None, **changes: Any) -> dict[str, Any]:
    record = {
        "format": registry.FORMAT,
        "id": pool_id or registry.new_pool_id(),
        "name": "default",
        "owner": registry.Owner.current().as_dict(),
        "created_at": 1.0,
        "started_at": 100.0,
        "price_per_hour": None,
        "currency": None,
        "teardown": {"provider": "local", "ranks": [], "templates": []},
    }
    record.update(changes)
    return record


# --------------------------------------------------------------------------- the files


def test_directory_and_files_are_private(tmp_path: Path) -> None:
    directory = registry.ensure_dir(tmp_path / "a" / "skyward")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    record = _record()
    path = registry.write_record(directory, record)
    assert path.name == f"{record['id']}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert registry.read_record(directory, record["id"]) == record
    registry.request_shutdown(directory, record["id"])
    assert stat.S_IMODE(registry.down_path(directory, record["id"]).stat().st_mode) == 0o600

    open_dir = tmp_path / "shared"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(registry.RegistryError, match="open to other users"):
        registry.ensure_dir(open_dir)


def test_a_record_is_replaced_whole(tmp_path: Path) -> None:
    """Readers racing a writer see the old record or the new one, never part of one."""
    directory = registry.ensure_dir(tmp_path / "skyward")
    pool_id = registry.new_pool_id()
    registry.write_record(directory, _record(pool_id, blob="0" * 100_000))
    stop = threading.Event()
    seen: set[str] = set()

    def write() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            registry.write_record(directory, _record(pool_id, blob=str(n % 10) * 100_000))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(500):
            text = (directory / f"{pool_id}.json").read_text()
            blob = json.loads(text)["blob"]  # a torn file would not parse
            assert len(blob) == 100_000 and len(set(blob)) == 1
            seen.add(blob[0])
    finally:
        stop.set()
        writer.join()
    assert len(seen) > 1  # the reads did overlap the writes
    assert os.listdir(directory) == [f"{pool_id}.json"]  # no temporary file left behind


def test_a_failed_write_keeps_the_old_record_and_leaves_nothing(tmp_path: Path) -> None:
    directory = registry.ensure_dir(tmp_path / "skyward")
    record = _record()
    registry.write_record(directory, record)
    with pytest.raises(TypeError):
        registry.write_record(directory, {**record, "bad": object()})
    assert registry.read_record(directory, record["id"]) == record
    assert os.listdir(directory) == [f"{record['id']}.json"]


def test_readers_skip_what_is_not_a_record(tmp_path: Path) -> None:
    directory = registry.ensure_dir(tmp_path / "skyward")
    good = _record(created_at=2.0)
    older = _record(created_at=1.0)
    for r in (good, older):
        registry.write_record(directory, r)
    (directory / ".0123456789ab.xyz.tmp").write_text("{")
    (directory / "notes.json").write_text("{}")
    (directory / "0123456789ab.json").write_text('{"format": 99, "id": "0123456789ab"}')
    (directory / "ba9876543210.json").write_text("{not json")
    registry.request_shutdown(directory, good["id"])
    assert [r["id"] for r in registry.read_records(directory)] == [older["id"], good["id"]]
    with pytest.raises(ValueError):
        registry.record_path(directory, "../../etc/passwd")
    registry.remove_record(directory, good["id"])
    assert not registry.shutdown_requested(directory, good["id"])
    assert [r["id"] for r in registry.read_records(directory)] == [older["id"]]
    assert registry.read_records(tmp_path / "none") == []


def test_a_file_that_is_no_record_of_this_shape_neither_blocks_nor_breaks_a_listing(
    tmp_path: Path,
) -> None:
    """What a crash, a hand or another version left under a record's name: a pipe (which would
    block a reader), a directory, a link (to an endless device), a file far too large, JSON
    nested beyond Python's limit, ``NaN``, and fields of another shape. Each is skipped, the
    good record is listed, and a shutdown request replaces a link rather than writing through.
    """
    directory = registry.ensure_dir(tmp_path / "skyward")
    good = _record()
    registry.write_record(directory, good)

    def planted() -> Path:
        return directory / f"{registry.new_pool_id()}.json"

    os.mkfifo(planted())
    planted().mkdir()
    planted().symlink_to("/dev/zero")
    with open(planted(), "wb") as huge:
        huge.truncate(1 << 30)  # sparse: a gibibyte to read, nothing on disk
    planted().write_text("[" * 100_000)
    owner = registry.Owner.current().as_dict()
    for changes in (
        {"created_at": float("nan")},
        {"owner": {**owner, "pid": "abc"}},
        {"nodes": 5},
        {"nodes": ["x"]},
        {"nodes": [{"ranks": [{"pid": "x"}]}]},
        {"price_per_hour": "1"},
        {"name": 5},
    ):
        bad = _record(**changes)
        (directory / f"{bad['id']}.json").write_text(json.dumps(bad))
    started = time.monotonic()
    assert [r["id"] for r in registry.read_records(directory)] == [good["id"]]
    assert time.monotonic() - started < 10  # nothing waited on the pipe or read the gigabyte
    assert served.listing(directory, set()) != []
    victim = tmp_path / "victim"
    victim.write_text("the user's own file")
    registry.down_path(directory, good["id"]).symlink_to(victim)
    registry.request_shutdown(directory, good["id"])
    assert victim.read_text() == "the user's own file"
    assert registry.shutdown_requested(directory, good["id"])


def test_process_start_tells_a_process_from_its_reused_pid() -> None:
    me = procs.process_start(os.getpid())
    assert me is not None and procs.process_alive(os.getpid(), me)
    assert not procs.process_alive(os.getpid(), "proc:1")
    child = subprocess.Popen(["true"])
    wait_for(lambda: procs.process_start(child.pid) is None, 10, "the child to end")
    child.wait()  # it was a zombie until now; both count as ended
    assert not procs.process_alive(child.pid, None)


# ------------------------------------------------------------------- the server's view


def test_orphans_as_the_server_sees_them(tmp_path: Path) -> None:
    directory = registry.ensure_dir(tmp_path / "skyward")
    child = subprocess.Popen(["sleep", "60"])
    child_start = procs.process_start(child.pid)
    child.kill()
    child.wait()
    me = registry.Owner.current()
    here = socket.gethostname()
    cases = {
        "live, this server's": (me.pid, me.start, here, "k1", False),
        "live, kernel unknown here": (me.pid, me.start, here, "k9", True),
        "live, no kernel (terminal IPython)": (me.pid, me.start, here, None, False),
        "owner dead": (child.pid, child_start, here, "k1", True),
        "pid reused": (me.pid, "proc:1", here, "k1", True),
    }
    for name, (pid, start, host, kernel, orphan) in cases.items():
        record = _record(
            owner=registry.Owner(pid, start, host, kernel).as_dict(), price_per_hour=2.0
        )
        pool = served.public(record, {"k1"}, directory, now=100.0 + 1800)
        assert pool["orphan"] is orphan, name
        assert "teardown" not in pool and "format" not in pool
        gone = pool["owner"]["alive"] is False  # shown gone: its uptime and cost stop counting
        assert pool["state"] == ("gone" if gone else None), name
        spent = None if gone else 1.0
        assert pool["cost"] == {"price_per_hour": 2.0, "spent": spent, "currency": None}
        assert pool["uptime_s"] == (None if gone else 1800)

    elsewhere = _record(owner=registry.Owner(1, None, "another-machine", "k2").as_dict())
    assert served.owner_alive(elsewhere) is None
    assert not served.concerns(elsewhere, {"k1"})  # another machine's server shows it
    assert served.concerns(elsewhere, {"k2"})  # unless its kernel is one of ours


def _nodes(*ranks: tuple[int, str]) -> list[dict[str, Any]]:
    """One node holding ranks given as (pid, hostname), each last said to be ready."""
    return [
        {
            "index": 0,
            "state": "ready",
            "ranks": [{"rank": i, "state": "ready", "pid": pid, "hostname": host}
                      for i, (pid, host) in enumerate(ranks)],
        }
    ]  # fmt: skip


def test_liveness_is_checked_before_a_records_state_is_shown(tmp_path: Path) -> None:
    """A record says what its kernel last wrote; the server checks that its kernel and its
    ranks' processes still run before showing it, and shows ``gone`` (greyed) when not.
    """
    directory = registry.ensure_dir(tmp_path / "skyward")
    here = socket.gethostname()
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["sleep", "60"])
    dead_start = procs.process_start(dead.pid)
    dead.kill()
    dead.wait()
    try:
        cases = {
            "all ranks run": (_nodes((live.pid, here), (live.pid, here)), None),
            "one rank of two ended": (_nodes((live.pid, here), (dead.pid, here)), None),
            "a rank elsewhere": (_nodes((dead.pid, here), (dead.pid, "elsewhere")), None),
            "not started yet": ([], None),
            "every rank ended": (
                _nodes((dead.pid, here), (dead.pid, here)),
                "its ranks' processes ended",
            ),
        }
        for name, (nodes, why) in cases.items():
            record = _record(state="ready", nodes=nodes)
            pool = served.public(record, set(), directory, now=400.0)
            assert pool["gone_why"] == why, name
            assert pool["state"] == ("gone" if why else "ready"), name
            assert pool["uptime_s"] == (None if why else 300.0), name  # gone: not counting

        owner = registry.Owner(dead.pid, dead_start, here, "k1").as_dict()
        record = _record(owner=owner, state="ready", nodes=_nodes((live.pid, here)))
        pool = served.public(record, {"k1"}, directory, now=400.0)
        assert pool["state"] == "gone" and pool["gone_why"] == "its kernel's process ended"
        assert pool["uptime_s"] is None and pool["orphan"] is True
    finally:
        live.kill()
        live.wait()


def test_one_vocabulary_of_states() -> None:
    """Every rank state has its word, tone and meaning, which the server sends to the side
    panel and the cell's panel colours by; ``gone`` is the side panel's own.
    """
    from skyward_jupyter.display.panel_html import state_label
    from skyward_jupyter.events import RankState
    from skyward_jupyter.model import STATE_WORDS, TONE_COLOURS, state_words

    assert set(STATE_WORDS) == {s.value for s in RankState} | {"gone"}
    assert {w.tone for w in STATE_WORDS.values()} <= set(TONE_COLOURS)
    assert state_words()["idle"] == {
        "word": "idle",
        "tone": "good",
        "meaning": "ran a cell; waiting for the next one",
    }
    label = state_label(RankState.READY)
    assert 'title="started; no cell has run on it yet"' in label
    assert f"color: {TONE_COLOURS['good']}" in label


# -------------------------------------------------------------------- the kernel's side


@pytest.fixture
def session(tmp_path: Path) -> Iterator[tuple[Session, Registry]]:
    reg = Registry(tmp_path / "skyward")
    session = Session(announce=lambda text: None, listeners=[reg])
    reg.attach(session.down_pool)
    try:
        yield session, reg
    finally:
        session.down_all()
        reg.close()


def test_a_pool_is_registered_while_it_lives(session: tuple[Session, Registry]) -> None:
    session_, reg = session
    entry = session_.entry("train", PoolSpec(nodes=2, env=(("API_TOKEN", "hunter2"),)))
    pool_id = reg.pool_id(entry)
    assert pool_id is not None
    path = reg.directory / f"{pool_id}.json"
    text = path.read_text()  # written when the pool became ready, not later
    record = json.loads(text)
    assert "hunter2" not in text and "API_TOKEN" not in text  # no secrets on disk
    assert record["format"] == registry.FORMAT and record["id"] == pool_id
    assert record["name"] == "train" and record["provider"] == "local"
    assert record["owner"] == registry.Owner.current().as_dict()
    assert record["owner"]["kernel_id"] is None  # not a kernel
    assert record["ready"] is True and record["state"] == "ready"
    assert record["started_at"] <= record["ready_at"] <= record["updated_at"]
    assert record["price_per_hour"] is None
    ranks = [r for node in record["nodes"] for r in node["ranks"]]
    assert [n["index"] for n in record["nodes"]] == [0, 1]
    assert [r["rank"] for r in ranks] == [0, 1]
    pids = {r["pid"] for r in ranks}
    assert pids == {r.hello.pid for r in entry.pool.ranks if r.hello} and pids <= agent_pids()
    teardown = record["teardown"]
    assert {(r["pid"], r["start"]) for r in teardown["ranks"]} == {
        (pid, procs.process_start(pid)) for pid in pids
    }
    assert {t["pid"] for t in teardown["templates"]} == agent_pids(TEMPLATE)

    # Rank states reach the record from the registry's thread.
    entry.pool.run("x = 1")
    wait_for(lambda: json.loads(path.read_text())["state"] == "idle", 10, "the record to say idle")

    session_.down("train")
    assert not path.exists()  # gone with the pool, at once
    assert os.listdir(reg.directory) == []
    wait_for(
        lambda: "skyward-registry" not in {t.name for t in threading.enumerate()},
        5,
        "the registry's thread to end with its last pool",
    )


def test_records_are_rewritten_a_few_times_a_second_at_most(
    session: tuple[Session, Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    session_, reg = session
    entry = session_.entry(None, PoolSpec(nodes=2))
    writes: list[float] = []
    real_write = writer.write_record

    def counted(directory: Path, record: dict[str, Any]) -> Path:
        writes.append(record["updated_at"])
        return real_write(directory, record)

    monkeypatch.setattr(writer, "write_record", counted)
    started = time.monotonic()
    cells = 0
    while time.monotonic() - started < 1.0:  # every cell: two state changes on every rank
        entry.pool.run("pass")
        cells += 1
    elapsed = time.monotonic() - started
    assert cells >= 5
    assert len(writes) <= elapsed / reg.interval + 2


def test_the_server_asks_and_the_session_shuts_the_pool_down(
    session: tuple[Session, Registry],
) -> None:
    session_, reg = session
    entry = session_.entry(None, PoolSpec(nodes=2))
    pool_id = reg.pool_id(entry)
    assert pool_id is not None
    pids = {r.hello.pid for r in entry.pool.ranks if r.hello}
    registry.request_shutdown(reg.directory, pool_id)
    # What the server waits for: record and request both gone, once the pool has ended.
    wait_for(lambda: not os.listdir(reg.directory), 30, "the pool's record to go")
    assert session_.status() == "no pools"
    assert not pids & agent_pids()


def test_close_removes_every_record_and_stops_writing(
    session: tuple[Session, Registry],
) -> None:
    session_, reg = session
    entry = session_.entry(None, PoolSpec(nodes=1))
    assert len(os.listdir(reg.directory)) == 1
    reg.close()  # what happens at exit
    assert os.listdir(reg.directory) == []
    entry.pool.run("pass")  # state changes after close write nothing
    reg.pool_started(entry)
    assert os.listdir(reg.directory) == []


def test_an_unusable_directory_does_not_stop_pools(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    reg = Registry(blocked / "skyward")
    session = Session(announce=lambda text: None, listeners=[reg])
    try:
        entry = session.entry(None, PoolSpec(nodes=1))
        assert entry.pool.run("1 + 1").values == [2]
    finally:
        session.down_all()
        reg.close()

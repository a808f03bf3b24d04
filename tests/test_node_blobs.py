"""A node's store of large values, in one process on real files: what its ranks map, what
they are told when the node's fetch failed, whose folder it uses, and what a sweep removes.

(The store in a pool of 8 hosts is tests/test_fanout.py.)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pwd
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from skyward_jupyter.agent import node_blobs
from skyward_jupyter.agent.node_blobs import SWEEP_AFTER, NodeBlobs
from skyward_jupyter.agent.relay import RelayError

BLOB = secrets.token_bytes(1 << 20)
DIGEST = hashlib.sha256(BLOB).hexdigest()


def test_ranks_map_one_copy_each_writing_its_own_pages_and_hear_why_one_will_not_come(
    tmp_path: Path,
) -> None:
    (tmp_path / "disk").mkdir()
    first, other = (NodeBlobs("token", 3, tmp_path, tmp_path / "disk") for _ in range(2))
    first.open()
    other.open()
    first.publish(DIGEST, BLOB)
    (mine, spilled), (theirs, _) = (s.wait(DIGEST, len(BLOB), 5) for s in (first, other))
    assert not spilled  # memory had room
    mine[0] = (BLOB[0] + 1) % 256
    assert theirs.tobytes() == BLOB and (first.dir / DIGEST).read_bytes() == BLOB
    first.drop((DIGEST,))
    assert mine[1:].tobytes() == BLOB[1:]  # a mapping outlives its file
    first.fail(DIGEST, "node 3 could not fetch a value: the relay of node 1 was gone")
    with pytest.raises(RelayError, match=r"node 3 could not fetch .* node 1 was gone"):
        other.wait(DIGEST, len(BLOB), 5)
    with pytest.raises(RelayError, match="did not reach this node in 0 s"):
        other.wait("0" * 64, 1, 0)


def test_a_folder_another_user_made_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a folder another user owns")
    planted = NodeBlobs("token", 0, tmp_path, tmp_path / "disk")
    planted.dir.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    os.chown(planted.dir, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(OSError, match="not a private directory of this user"):
        NodeBlobs("token", 0, tmp_path, tmp_path / "disk").open()


def test_another_user_cannot_take_the_place_of_a_pools_values_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user makes folders where a user's values could go, at every name they can know
    (the user's id): a pool's own folder, named by its secret, is still made, private, in
    ``/dev/shm`` and the temporary folder themselves, and nothing of theirs is touched.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a folder another user owns")
    nobody = pwd.getpwnam("nobody")
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    for base in (shm, disk):
        base.mkdir(mode=0o1777)
        for squat in (f"skyward-{os.getuid()}", f"skyward-values-{os.getuid()}-"):
            (base / squat).mkdir(mode=0o755)
            os.chown(base / squat, nobody.pw_uid, nobody.pw_gid)
    monkeypatch.setattr(node_blobs, "_SHM", shm)  # where the machine's are, as a node has them
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    store = NodeBlobs(secrets.token_hex(16), 0)
    store.open()
    assert store.dir.parent == shm and oct(store.dir.stat().st_mode & 0o777) == "0o700"
    store.publish(DIGEST, BLOB)
    assert store.wait(DIGEST, len(BLOB), 5)[0].tobytes() == BLOB
    assert store.sweep() == []  # their folders are not this user's to sweep
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        [f"skyward-{os.getuid()}", f"skyward-values-{os.getuid()}-", store.dir.name]
    )


def test_a_sweep_removes_only_old_folders_no_rank_holds(tmp_path: Path) -> None:
    live, dead, young = (
        NodeBlobs(t, 0, tmp_path, tmp_path / "disk") for t in ("live", "dead", "young")
    )
    live.open()
    dead.open()
    young.open()
    for gone in (dead, young):  # their ranks are gone
        assert gone._lock is not None
        os.close(gone._lock)
    old = os.stat(dead.dir).st_mtime - SWEEP_AFTER - 1
    for store in (live, dead):
        os.utime(store.dir, (old, old))
    assert NodeBlobs("new", 0, tmp_path, tmp_path / "disk").sweep() == [dead.dir]
    assert live.dir.is_dir() and young.dir.is_dir() and not dead.dir.exists()


def test_a_sweep_takes_the_folders_an_earlier_version_left(tmp_path: Path) -> None:
    """Pools' folders an earlier version kept in ``skyward-<uid>/`` (a killed pool's stays): a
    sweep removes the old ones no rank holds, keeps a held one, and the folder once empty.
    """
    legacy = tmp_path / f"skyward-{os.getuid()}"
    legacy.mkdir(mode=0o700)
    dead, held = legacy / "a-n0", legacy / "b-n0"
    for folder in (dead, held):
        folder.mkdir(mode=0o700)
        (folder / ".lock").touch()
    lock = os.open(held / ".lock", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_SH)
    old = os.stat(dead).st_mtime - SWEEP_AFTER - 1
    for folder in (dead, held):
        os.utime(folder, (old, old))
    try:
        assert NodeBlobs("new", 0, tmp_path, tmp_path).sweep() == [dead]
        assert held.is_dir()
    finally:
        os.close(lock)
    assert NodeBlobs("new", 0, tmp_path, tmp_path).sweep() == [held]
    assert not legacy.exists()
    legacy.mkdir(mode=0o700)  # left empty
    assert NodeBlobs("new", 0, tmp_path, tmp_path).sweep() == [] and not legacy.exists()


def test_a_value_memory_has_no_room_for_is_kept_on_disk_and_shared_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory filesystem would be left with less than its free share: the value goes to
    the disk directory, every rank maps it from there, and it is dropped and swept from there.
    """
    memory, disk = tmp_path / "shm", tmp_path / "disk"
    memory.mkdir()
    disk.mkdir()
    monkeypatch.setattr(node_blobs, "KEEP_FREE", 1.0)  # no room left to give
    first, other = (NodeBlobs("token", 1, memory, disk) for _ in range(2))
    first.open()
    other.open()
    first.publish(DIGEST, BLOB)
    assert (first.spill / DIGEST).read_bytes() == BLOB and not (first.dir / DIGEST).exists()
    view, spilled = other.wait(DIGEST, len(BLOB), 5)
    assert spilled and view.tobytes() == BLOB
    first.drop((DIGEST,))
    assert not (first.spill / DIGEST).exists()
    # its pool gone (no rank holds its folder in memory) and old: a sweep takes both folders
    for store in (first, other):
        assert store._lock is not None
        os.close(store._lock)
    old = os.stat(first.dir).st_mtime - SWEEP_AFTER - 1
    for path in (first.dir, first.spill):
        os.utime(path, (old, old))
    live = NodeBlobs("live", 1, memory, disk)  # an old spill of a pool still running
    live.open()
    live.spill.mkdir(mode=0o700)
    os.utime(live.spill, (old, old))
    assert NodeBlobs("new", 1, memory, disk).sweep() == [first.dir, first.spill]
    assert not first.spill.exists() and live.spill.is_dir()


def test_a_sweep_never_follows_a_spill_folder_another_user_planted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool's spill folder is a link someone else put there (to a folder of the user's own),
    and an old one too: a sweep removes nothing through them, and a value meant for the first
    is refused in one line.
    """
    precious = tmp_path / "projects"
    (precious / "thesis").mkdir(parents=True)
    old = os.stat(precious).st_mtime - SWEEP_AFTER - 1
    os.utime(precious / "thesis", (old, old))
    (tmp_path / "shm").mkdir()
    disk = tmp_path / "disk"
    disk.mkdir()
    store = NodeBlobs("token", 0, tmp_path / "shm", disk)
    store.spill.symlink_to(precious)
    stale = NodeBlobs("gone", 0, tmp_path / "shm", disk).spill
    stale.symlink_to(precious)
    os.utime(stale, (old, old), follow_symlinks=False)
    store.open()
    assert store.sweep() == [] and (precious / "thesis").is_dir()
    monkeypatch.setattr(node_blobs, "KEEP_FREE", 1.0)
    with pytest.raises(OSError, match="not a private directory of this user"):
        store.publish(DIGEST, BLOB)


def test_a_value_neither_memory_nor_a_temporary_folder_in_memory_has_room_for_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the temporary folder is a tmpfs too, spilling there would take the memory it was
    to spare: the value is refused, saying where and what to do, and the ranks hear why.
    """
    monkeypatch.setattr(node_blobs, "KEEP_FREE", 1.0)  # no room left to give
    shm = Path("/dev/shm")
    if not node_blobs._in_memory(shm):
        pytest.skip("this machine has no /dev/shm in memory")
    token = secrets.token_hex(8)
    bases = (shm / f"skyward-test-{token}", shm / f"skyward-test-{token}-tmp")
    for base in bases:
        base.mkdir()
    first, other = (NodeBlobs(token, 1, *bases) for _ in "ab")
    try:
        first.open()
        other.open()
        with pytest.raises(
            OSError, match=rf"fit neither in {bases[0]} nor in {bases[1]}, which is"
        ):
            first.publish(DIGEST, BLOB)
        assert not (first.spill / DIGEST).exists() and not (first.dir / DIGEST).exists()
        first.fail(DIGEST, "no room on node 1")  # a short note still goes
        with pytest.raises(RelayError, match="no room on node 1"):
            other.wait(DIGEST, len(BLOB), 5)
    finally:
        for store in (first, other):
            if store._lock is not None:
                os.close(store._lock)
        for base in bases:
            shutil.rmtree(base, ignore_errors=True)

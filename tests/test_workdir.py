"""The notebook's working directory travels to nodes that do not share its filesystem.

The notebook side (skyward_jupyter.workdir) picks the files and packs what a node lacks; the
node side (skyward_jupyter.agent.workdir) keeps a copy in step. Real files in tmp_path, no mocks.

Unreadable files: tests run as root here, and root reads a chmod 000 file. The test of that
error therefore scans with the effective uid of ``nobody`` (seteuid, restored after) when it
runs as root, and as itself otherwise.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter.agent.workdir import WorkdirCopy, removal_leftovers, remove_tree
from skyward_jupyter.workdir import Manifest, Scanner, SyncError, bundle, human_bytes

CAP = 10 * 2**20
ROOT = Path(__file__).resolve().parents[1]


def write(root: Path, rel: str, data: bytes | str = b"x", mode: int = 0o644) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


def paths(manifest: Manifest) -> list[str]:
    return [f.path for f in manifest.files]


def sync(manifest: Manifest, copy: WorkdirCopy) -> Path:
    """What the pool does for a node: send what it lacks, then switch."""
    need = copy.missing(f.digest for f in manifest.files)
    copy.add_objects(bundle(manifest, need))
    return copy.switch(manifest.entries)


def age(root: Path) -> None:
    """Files written an hour ago: not "racy", so the stat cache may trust them."""
    old = time.time_ns() - 3600 * 10**9
    for path in root.rglob("*"):
        os.utime(path, ns=(old, old), follow_symlinks=False)


def tar_of(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """Run the block as a user that permission bits apply to (see the module's docstring)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory that ``nobody`` can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="sky-workdir-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


# -- which files travel ---------------------------------------------------------------------


def test_gitignore_applies_to_its_own_directory_and_below(tmp_path: Path) -> None:
    write(tmp_path, ".gitignore", "*.log\n/build/\n")
    write(tmp_path, "sub/.gitignore", "*.tmp\n/local.txt\n")
    for rel in ("a.py", "a.log", "a.tmp", "build/out.o", "sub/b.tmp", "sub/b.log", "sub/b.py"):
        write(tmp_path, rel)
    write(tmp_path, "sub/build/kept.o")  # /build/ is anchored at the root
    write(tmp_path, "sub/local.txt")  # /local.txt is anchored at sub/
    write(tmp_path, "sub/deeper/local.txt")
    write(tmp_path, "local.txt")
    assert paths(Scanner(tmp_path, CAP).scan()) == [
        ".gitignore",
        "a.py",
        "a.tmp",  # the subdirectory's pattern does not reach up
        "local.txt",
        "sub/.gitignore",
        "sub/b.py",
        "sub/build/kept.o",
        "sub/deeper/local.txt",
    ]


def test_a_negated_pattern_keeps_a_file(tmp_path: Path) -> None:
    write(tmp_path, ".gitignore", "*.log\n!keep.log\n")
    write(tmp_path, "sub/.gitignore", "!drop.log\n")
    for rel in ("a.log", "keep.log", "sub/keep.log", "sub/drop.log", "sub/other.log"):
        write(tmp_path, rel)
    assert paths(Scanner(tmp_path, CAP).scan()) == [
        ".gitignore",
        "keep.log",
        "sub/.gitignore",
        "sub/drop.log",  # a deeper .gitignore overrides a shallower one
        "sub/keep.log",
    ]


def test_skyignore_at_the_root_has_the_last_word(tmp_path: Path) -> None:
    write(tmp_path, ".gitignore", "*.csv\n")
    write(tmp_path, ".skyignore", "data/\n*.ckpt\n!needed.csv\n")
    for rel in ("data/big.bin", "sub/data/x", "m.ckpt", "sub/n.ckpt", "needed.csv", "o.csv"):
        write(tmp_path, rel)
    write(tmp_path, "train.py")
    assert paths(Scanner(tmp_path, CAP).scan()) == [
        ".gitignore",
        ".skyignore",
        "needed.csv",
        "train.py",
    ]


def test_git_caches_and_checkpoints_never_travel(tmp_path: Path) -> None:
    for rel in (
        ".git/HEAD",
        "__pycache__/m.cpython-311.pyc",
        "pkg/__pycache__/x.pyc",
        ".ipynb_checkpoints/nb-checkpoint.ipynb",
        "pkg/.ipynb_checkpoints/y",
        "stray.pyc",
        "pkg/__init__.py",
    ):
        write(tmp_path, rel)
    assert paths(Scanner(tmp_path, CAP).scan()) == ["pkg/__init__.py"]


def test_symlinks_inside_travel_as_content_and_those_leading_out_are_named(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    write(outside, "real.txt", "content")
    root = tmp_path / "root"
    write(root, "a.txt")
    write(root, "data/rows.csv", "x,y\n")
    (root / "rows.csv").symlink_to(root / "data" / "rows.csv")
    (root / "link.txt").symlink_to(outside / "real.txt")
    (root / "passwd").symlink_to("/etc/passwd")
    (root / "dirlink").symlink_to(outside)
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(root / "fifo")  # reading it would block the scan
    manifest = Scanner(root, CAP).scan()
    assert paths(manifest) == ["a.txt", "data/rows.csv", "rows.csv"]
    assert manifest.files[2].size == len("x,y\n")
    assert manifest.outside == (
        f"dirlink -> {outside.resolve()}",
        f"link.txt -> {(outside / 'real.txt').resolve()}",
        "passwd -> /etc/passwd",
    )


SECRET_FILES = (
    ".ssh/id_ed25519",
    ".ssh/config",
    ".aws/credentials",
    ".gnupg/private-keys-v1.d/k.key",
    ".netrc",
    ".git-credentials",
    ".env",
    ".env.local",
    "deploy/server.pem",
    "certs/tls.key",
    "keys/id_rsa",
    ".config/gcloud/application_default_credentials.json",
    "work/.config/gcloud/credentials.db",
    ".azure/accessTokens.json",
    ".kube/config",
    ".docker/config.json",
    ".bash_history",
    ".zsh_history",
    ".python_history",
    ".ipython/profile_default/history.sqlite",
    "notes/history.sqlite",
    ".ssh/id_ecdsa_sk",
    "keys/id_ed25519",
    "keys/id_dsa",
    "certs/client.p12",
    "certs/client.pfx",
    ".local/share/jupyter/runtime/jpserver-1234.json",
    ".local/share/jupyter/runtime/kernel-5678.json",
    "Library/Jupyter/runtime/skyward/pool.json",
    ".jupyter/jupyter_server_config.json",
    ".cache/huggingface/token",
    ".cache/huggingface/stored_tokens",
    ".kaggle/kaggle.json",
    ".config/gh/hosts.yml",
    ".npmrc",
    ".vault-token",
    # where names ignore case (macOS's and Windows's disks): the same files
    "certs/TLS.KEY",
    "keys/ID_RSA",
    ".ENV",
    ".SSH/known_hosts",
)


def test_keys_and_credentials_stay_behind_and_are_listed(tmp_path: Path) -> None:
    for rel in SECRET_FILES:
        write(tmp_path, rel, "secret")
    write(tmp_path, "train.py")
    write(tmp_path, "id_utils.py")  # a module, not a key: the ranks import it
    write(tmp_path, "keys/id_rsa.pub", "a public key")
    write(tmp_path, "keys/id_ed25519.pub", "a public key")
    write(tmp_path, "keys/ID_RSA.PUB", "a public key")
    write(tmp_path, ".config/other/settings.json")
    write(tmp_path, ".cache/huggingface/hub/model.bin")  # a model: not a token
    write(tmp_path, ".gitignore", ".bash_history\n")  # ignored: not a secret left out, just out
    (tmp_path / "innocent.txt").symlink_to(tmp_path / ".ssh" / "id_ed25519")
    manifest = Scanner(tmp_path, CAP).scan()
    assert paths(manifest) == [
        ".cache/huggingface/hub/model.bin",
        ".config/other/settings.json",
        ".gitignore",
        "id_utils.py",
        "keys/ID_RSA.PUB",
        "keys/id_ed25519.pub",
        "keys/id_rsa.pub",
        "train.py",
    ]
    secrets = set(SECRET_FILES) - {".bash_history"} | {"innocent.txt"}
    assert set(manifest.secrets) == secrets


def test_a_skyignore_negation_sends_a_secret(tmp_path: Path) -> None:
    for rel in (".env", ".env.local", ".aws/credentials", ".aws/config", "deploy/server.pem"):
        write(tmp_path, rel, "secret")
    write(tmp_path, ".skyignore", "!.env\n!.aws/\n")
    manifest = Scanner(tmp_path, CAP).scan()
    assert paths(manifest) == [".aws/config", ".aws/credentials", ".env", ".skyignore"]
    assert manifest.secrets == (".env.local", "deploy/server.pem")


def test_a_sync_of_a_secret_directory_itself_sends_it(tmp_path: Path) -> None:
    write(tmp_path, ".aws/credentials", "secret")
    write(tmp_path, ".ssh/id_ed25519", "secret")
    named = Scanner(tmp_path / ".aws", CAP).scan()
    assert (paths(named), named.secrets) == (["credentials"], ())
    # The notebook's working directory by default is not a choice: id_* still stays behind.
    default = Scanner(tmp_path / ".ssh", CAP, chosen=False).scan()
    assert (paths(default), default.secrets) == ([], ("id_ed25519",))


def test_a_home_directory_is_synced_only_when_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    write(home, "notes.txt")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SyncError) as raised:
        Scanner(home, CAP, chosen=False).scan()
    message = str(raised.value)
    assert "\n" not in message and str(home) in message and "--sync" in message
    assert paths(Scanner(home, CAP, chosen=True).scan()) == ["notes.txt"]


def test_over_the_cap_names_the_largest_files_and_the_way_out(tmp_path: Path) -> None:
    for i in range(1, 8):
        write(tmp_path, f"f{i}.bin", b"\0" * (i * 1024))
    with pytest.raises(SyncError) as err:
        Scanner(tmp_path, 20 * 1024).scan()
    message = str(err.value)
    assert "28.0 KiB" in message and "20.0 KiB" in message and str(tmp_path) in message
    for i in range(3, 8):
        assert f"{human_bytes(i * 1024)}  f{i}.bin" in message
    assert "f2.bin" not in message and "f1.bin" not in message
    assert ".skyignore" in message and "--sync-cap" in message
    write(tmp_path, ".skyignore", "f7.bin\nf6.bin\n")
    assert Scanner(tmp_path, 20 * 1024).scan().total_bytes == 15 * 1024 + len("f7.bin\nf6.bin\n")


def test_an_unreadable_file_is_named_with_the_way_out(shared_tmp: Path) -> None:
    write(shared_tmp, "ok.txt")
    write(shared_tmp, "private.bin", mode=0o000)
    scanner = Scanner(shared_tmp, CAP)
    with unprivileged(), pytest.raises(SyncError) as err:
        scanner.scan()
    assert str(shared_tmp / "private.bin") in str(err.value)
    assert "`private.bin`" in str(err.value) and ".skyignore" in str(err.value)
    write(shared_tmp, ".skyignore", "private.bin\n")
    with unprivileged():
        assert paths(scanner.scan()) == [".skyignore", "ok.txt"]


def test_a_missing_root_is_named(tmp_path: Path) -> None:
    with pytest.raises(SyncError, match=str(tmp_path / "gone")):
        Scanner(tmp_path / "gone", CAP).scan()
    write(tmp_path, "file")
    with pytest.raises(SyncError, match="not a directory"):
        Scanner(tmp_path / "file", CAP).scan()


def test_a_second_scan_hashes_only_what_changed(tmp_path: Path) -> None:
    for i in range(5):
        write(tmp_path, f"m{i}.py", f"x = {i}\n")
    age(tmp_path)
    scanner = Scanner(tmp_path, CAP)
    first = scanner.scan()
    assert scanner.hashed == 5
    assert scanner.scan() == first and scanner.hashed == 0
    write(tmp_path, "m2.py", "x = 22\n")
    changed = scanner.scan()
    assert scanner.hashed == 1 and changed.digest != first.digest
    assert changed.files[2].digest != first.files[2].digest


def test_a_rewrite_that_keeps_size_and_mtime_is_still_seen(tmp_path: Path) -> None:
    path = write(tmp_path, "cfg.py", "lr = 0.1\n")
    age(tmp_path)
    scanner = Scanner(tmp_path, CAP)
    before = scanner.scan()
    old = path.stat()
    path.write_text("lr = 0.2\n")  # same size, same inode
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))  # as `cp -p` would leave it
    after = scanner.scan()
    assert scanner.hashed == 1 and after.files[0].digest != before.files[0].digest


def test_a_file_modified_just_before_a_scan_is_hashed_again(tmp_path: Path) -> None:
    write(tmp_path, "fresh.py")  # a write later in the same clock tick would keep its stat
    scanner = Scanner(tmp_path, CAP)
    scanner.scan()
    scanner.scan()
    assert scanner.hashed == 1


def test_the_manifest_digest_follows_content_and_mode(tmp_path: Path) -> None:
    path = write(tmp_path, "run.sh", "echo\n")
    scanner = Scanner(tmp_path, CAP)
    first = scanner.scan()
    assert scanner.scan().digest == first.digest and first.total_bytes == 5
    path.chmod(0o755)
    assert scanner.scan().digest != first.digest


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * 2**30, 2**50)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
        "1024.0 TiB",
    ]


# -- a node's copy --------------------------------------------------------------------------


def test_round_trip_reproduces_files_and_modes(tmp_path: Path) -> None:
    src = tmp_path / "nb"
    files = {
        "a.txt": (b"hello\n", 0o644),
        "bin/run.sh": (b"#!/bin/sh\necho hi\n", 0o755),
        "deep/er/data.bin": (os.urandom(300_000), 0o600),
        "empty/__init__.py": (b"", 0o644),
        "same1.txt": (b"twin", 0o644),
        "same2.sh": (b"twin", 0o755),  # one content, two modes
    }
    for rel, (data, mode) in files.items():
        write(src, rel, data, mode)
    manifest = Scanner(src, CAP).scan()
    blob = bundle(manifest, {f.digest for f in manifest.files})
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert sorted(tar.getnames()) == sorted({f.digest for f in manifest.files})
    copy = WorkdirCopy(tmp_path / "store", "nbkey")
    assert copy.missing(f.digest for f in manifest.files) == {f.digest for f in manifest.files}
    copy.add_objects(blob)
    assert copy.missing(f.digest for f in manifest.files) == set()
    current = copy.switch(manifest.entries)
    assert current == tmp_path / "store" / "nbkey" / "current" and current.is_symlink()
    assert current.resolve().name == manifest.digest
    got = {p.relative_to(current).as_posix() for p in current.rglob("*") if p.is_file()}
    assert got == set(files)
    for rel, (data, mode) in files.items():
        assert (current / rel).read_bytes() == data
        # read and execute bits travel; write bits do not (the content is shared)
        assert stat.S_IMODE((current / rel).stat().st_mode) == (mode & 0o555) | 0o400, rel


def test_bundle_refuses_a_file_that_changed_since_the_scan(tmp_path: Path) -> None:
    write(tmp_path, "a.py", "x = 1\n")
    manifest = Scanner(tmp_path, CAP).scan()
    write(tmp_path, "a.py", "x = 2\n")
    with pytest.raises(SyncError, match=f"{tmp_path / 'a.py'} changed since"):
        bundle(manifest, {manifest.files[0].digest})


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/" + "0" * 64, "0" * 63, "A" * 64])
def test_add_objects_refuses_names_that_are_not_digests(tmp_path: Path, name: str) -> None:
    copy = WorkdirCopy(tmp_path / "store", "k")
    with pytest.raises(ValueError, match="not a file named by a sha256"):
        copy.add_objects(tar_of({name: b"data"}))
    assert not (tmp_path / "escape").exists()
    assert os.listdir(copy.objects) == []


def test_add_objects_refuses_a_damaged_member(tmp_path: Path) -> None:
    write(tmp_path / "nb", "a.txt", "good")
    manifest = Scanner(tmp_path / "nb", CAP).scan()
    digest = manifest.files[0].digest
    copy = WorkdirCopy(tmp_path / "store", "k")
    with pytest.raises(ValueError, match=f"bundle member {digest} holds content"):
        copy.add_objects(tar_of({digest: b"evil"}))
    assert copy.missing([digest]) == {digest} and os.listdir(copy.objects) == []


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../../x", "a//b", "./a"])
def test_switch_refuses_paths_that_leave_the_tree(tmp_path: Path, path: str) -> None:
    copy = WorkdirCopy(tmp_path / "store", "k")
    with pytest.raises(ValueError, match="relative"):
        copy.switch([(path, 0o644, "0" * 64)])


def test_a_damaged_object_is_asked_for_again(tmp_path: Path) -> None:
    write(tmp_path / "nb", "a.txt", "good")
    manifest = Scanner(tmp_path / "nb", CAP).scan()
    copy = WorkdirCopy(tmp_path / "store", "k")
    current = sync(manifest, copy)
    (current / "a.txt").write_text("oops")  # root ignores the read-only bits
    assert copy.missing([manifest.files[0].digest]) == {manifest.files[0].digest}


def test_a_file_the_ranks_made_is_carried_to_the_next_tree(tmp_path: Path) -> None:
    src = tmp_path / "nb"
    write(src, "train.py", "v1")
    write(src, "old.py")
    copy = WorkdirCopy(tmp_path / "store", "k")
    scanner = Scanner(src, CAP)
    current = sync(scanner.scan(), copy)
    (current / "ckpt").mkdir()
    (current / "ckpt" / "step1.pt").write_bytes(b"weights")
    (current / "log.txt").write_text("rank log")
    (src / "old.py").unlink()
    write(src, "train.py", "v2")
    current = sync(scanner.scan(), copy)
    assert (current / "ckpt" / "step1.pt").read_bytes() == b"weights"
    assert (current / "log.txt").read_text() == "rank log"
    assert (current / "train.py").read_text() == "v2"
    assert not (current / "old.py").exists()  # a synced file the notebook deleted stays deleted


def test_the_notebooks_file_wins_over_a_rank_file_at_the_same_path(tmp_path: Path) -> None:
    src = tmp_path / "nb"
    write(src, "train.py")
    write(src, "pkg/a.py")
    copy = WorkdirCopy(tmp_path / "store", "k")
    scanner = Scanner(src, CAP)
    current = sync(scanner.scan(), copy)
    (current / "results.csv").write_text("from a rank")
    (current / "out").write_text("a rank's file where the notebook will have a directory")
    (current / "pkg" / "made.txt").write_text("a rank's file where the notebook will have a file")
    write(src, "results.csv", "from the notebook")
    write(src, "out/plot.png", "png")
    shutil.rmtree(src / "pkg")
    write(src, "pkg", "now a file")
    current = sync(scanner.scan(), copy)
    assert (current / "results.csv").read_text() == "from the notebook"
    assert (current / "out" / "plot.png").read_text() == "png"
    assert (current / "pkg").read_text() == "now a file"


def test_switch_replaces_current_atomically_and_keeps_one_previous_tree(tmp_path: Path) -> None:
    src = tmp_path / "nb"
    copy = WorkdirCopy(tmp_path / "store", "k")
    scanner = Scanner(src, CAP)
    ids = []
    for version in range(3):
        for i in range(50):
            write(src, f"d/f{i}", f"{version}-{i}")
        ids.append(scanner.scan().digest)
        sync(scanner.scan(), copy)
    assert os.readlink(copy.current) == f"trees/{ids[2]}"
    assert set(os.listdir(copy.trees)) == {ids[1], f"{ids[1]}.json", ids[2], f"{ids[2]}.json"}
    assert len(os.listdir(copy.objects)) == 100  # the first version's contents are gone too
    assert sorted(os.listdir(copy.dir)) == [".lock", "current", "objects", "trees"]
    # a reader in another process never finds `current` missing or a tree half built
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(copy.current)], stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 3
        version = 3
        while time.monotonic() < deadline:
            for i in range(50):
                write(src, f"d/f{i}", f"{version}-{i}")
            sync(scanner.scan(), copy)
            version += 1
    finally:
        reader.terminate()
        out, _ = reader.communicate()
    looks, bad = map(int, out.split())
    assert looks > 100 and bad == 0, out


_READER = """
import os, signal, sys
current, looks, bad = sys.argv[1], 0, 0
def done(*_):
    print(looks, bad, flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, done)
while True:
    try:
        bad += len(os.listdir(os.path.join(current, "d"))) != 50
    except FileNotFoundError:
        bad += 1
    looks += 1
"""


def test_ranks_switching_at_once_build_one_tree(tmp_path: Path) -> None:
    src = tmp_path / "nb"
    for i in range(200):
        write(src, f"f{i}", str(i))
    manifest = Scanner(src, CAP).scan()
    copy = WorkdirCopy(tmp_path / "store", "k")
    copy.add_objects(bundle(manifest, {f.digest for f in manifest.files}))
    start = threading.Barrier(4)
    results: list[object] = []

    def rank() -> None:
        start.wait()
        try:
            results.append(WorkdirCopy(tmp_path / "store", "k").switch(manifest.entries))
        except Exception as e:  # noqa: BLE001 - reported below
            results.append(e)

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [copy.current] * 4
    assert sorted(os.listdir(copy.trees)) == [manifest.digest, f"{manifest.digest}.json"]
    (copy.current / "rank-file").write_text("kept")
    tree = copy.current.resolve().stat().st_ino
    assert copy.switch(manifest.entries) == copy.current  # the same state again: nothing to do
    assert copy.current.resolve().stat().st_ino == tree
    assert (copy.current / "rank-file").read_text() == "kept"


def test_a_write_error_names_the_path(tmp_path: Path) -> None:
    """A full disk surfaces as an OSError naming the file; a file-size limit stands in for it."""
    code = (
        "import resource, signal, sys\n"
        "from skyward_jupyter.agent.workdir import WorkdirCopy\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    WorkdirCopy(sys.argv[1], 'k').add_objects(sys.stdin.buffer.read())\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e.filename)\n"
    )
    write(tmp_path / "nb", "big.bin", os.urandom(2 << 20))
    manifest = Scanner(tmp_path / "nb", CAP).scan()
    blob = bundle(manifest, {manifest.files[0].digest})
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store")],
        input=blob,
        capture_output=True,
        cwd=ROOT,
        check=True,
    )
    kind, name = done.stdout.decode().split()
    assert kind == "OSError" and name.startswith(str(tmp_path / "store" / "k" / "objects"))


def test_a_copy_goes_with_the_last_process_holding_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, "a.txt", "a" * 100)
    copy = WorkdirCopy(tmp_path / "base", "key")
    sync(Scanner(root, CAP).scan(), copy)
    first, second = copy.hold(), copy.hold()  # two ranks (or two pools) working in it
    assert copy.release(first, remove=True) is None and copy.dir.is_dir()
    assert copy.remove_if_unused() is None and copy.dir.is_dir()
    taken = copy.release(second, remove=True)
    assert taken is not None and not copy.dir.exists()
    remove_tree(taken)
    kept = WorkdirCopy(tmp_path / "base", "kept")
    sync(Scanner(root, CAP).scan(), kept)
    assert kept.release(kept.hold(), remove=False) is None and kept.dir.is_dir()
    assert (kept.remove_if_unused() or 0) >= 100 and not kept.dir.exists()
    assert os.listdir(tmp_path / "base") == []


def test_a_removed_copy_is_whole_or_absent_and_leftovers_are_swept(tmp_path: Path) -> None:
    """Removal renames the copy away under its lock: whoever comes for the copy next makes a
    fresh one, never works in a half-deleted one; a deletion cut short is swept later.
    """
    root = tmp_path / "root"
    write(root, "a.txt", "a" * 100)
    base = tmp_path / "base"
    copy = WorkdirCopy(base, "key")
    sync(Scanner(root, CAP).scan(), copy)
    taken = copy.release(copy.hold(), remove=True)
    assert taken is not None and taken.parent == base
    assert taken.name == f".removing-key-{os.getpid()}"
    assert (taken / "current" / "a.txt").read_text() == "a" * 100  # moved whole
    assert not copy.dir.exists()
    sync(Scanner(root, CAP).scan(), copy)  # the next pool: a fresh copy beside the dying one
    assert (copy.current / "a.txt").read_text() == "a" * 100
    assert removal_leftovers(base) == []  # this process is deleting it: not a leftover
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    cut_short = taken.rename(base / f".removing-key-{int(gone.stdout)}")
    assert removal_leftovers(base) == [cut_short]

"""Tests for skyward_jupyter.runtime: topology, sharding, metrics and output control."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from skyward_jupyter import runtime
from skyward_jupyter.runtime import (
    InstanceInfo,
    Peer,
    instance_info,
    local_metrics,
    log,
    set_metric_sink,
    shard,
    shard_size,
    silent,
    stderr,
    stdout,
)

TOPOLOGY_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SKYWARD_POOL",
)

WORLDS = range(1, 5)
LENGTHS = range(12)


@pytest.fixture(autouse=True)
def _clean_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts outside a pool, with no sink and no recorded metrics."""
    for name in TOPOLOGY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "_local_records", [])
    set_metric_sink(None)
    try:
        yield
    finally:
        set_metric_sink(None)


def _set_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def _interleave(shards: list[list[Any]]) -> list[Any]:
    """Undo striding: position k + j*w of the order is shards[k][j]."""
    world = len(shards)
    total = sum(len(s) for s in shards)
    order: list[Any] = [None] * total
    for k, part in enumerate(shards):
        for j, item in enumerate(part):
            order[k + j * world] = item
    return order


# ------------------------------------------------------------------------------ shard: striding


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_shard_strides_by_rank(world: int, n: int) -> None:
    data = list(range(100, 100 + n))
    shards = [shard(data, rank=k, world_size=world) for k in range(world)]
    for k, part in enumerate(shards):
        assert part == [data[i] for i in range(k, n, world)]
        assert part == data[k::world]
        assert len(part) == shard_size(n, k, world)
    union = [item for part in shards for item in part]
    assert sorted(union) == data  # covers everything ...
    assert len(set(union)) == len(union) == n  # ... exactly once


# ------------------------------------------------------------------------------ shard: shuffle


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_shuffle_is_one_permutation_shared_by_all_ranks(world: int, n: int, seed: int) -> None:
    data = list(range(n))
    shards = []
    for k in range(world):
        # Each rank is its own process with its own global random state; it must not matter.
        random.seed(1000 + k)
        np.random.seed(2000 + k)
        torch.manual_seed(3000 + k)
        shards.append(shard(data, shuffle=True, seed=seed, rank=k, world_size=world))
    union = [item for part in shards for item in part]
    assert sorted(union) == data
    assert len(set(union)) == n
    # The ranks striped one common permutation: the one a world of one sees.
    assert _interleave(shards) == shard(data, shuffle=True, seed=seed, rank=0, world_size=1)


def test_shuffle_permutes_and_depends_on_seed() -> None:
    data = list(range(50))
    a = shard(data, shuffle=True, seed=0, rank=0, world_size=1)
    again = shard(data, shuffle=True, seed=0, rank=0, world_size=1)
    b = shard(data, shuffle=True, seed=1, rank=0, world_size=1)
    assert a == again
    assert sorted(a) == sorted(b) == data
    assert a != data
    assert a != b
    # Per rank too: a different seed gives rank 0 a different share.
    assert shard(data, shuffle=True, seed=0, rank=0, world_size=2) != shard(
        data, shuffle=True, seed=1, rank=0, world_size=2
    )


def test_no_shuffle_keeps_order_regardless_of_seed() -> None:
    data = list(range(20))
    assert shard(data, rank=0, world_size=1) == data
    assert shard(data, shuffle=False, seed=7, rank=0, world_size=1) == data
    assert shard(data, shuffle=False, seed=7, rank=1, world_size=3) == data[1::3]


# ------------------------------------------------------------------------- shard: aligned arrays


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", [0, 1, 7, 11, 64])
def test_several_arrays_stay_aligned(world: int, n: int) -> None:
    x = np.arange(n)
    y = x * 10
    z = [f"item{i}" for i in range(n)]
    t = torch.arange(n) * 100
    seen: list[int] = []
    for k in range(world):
        xs, ys, zs, ts = shard(x, y, z, t, shuffle=True, seed=5, rank=k, world_size=world)
        assert np.array_equal(ys, xs * 10)
        assert zs == [f"item{i}" for i in xs]
        assert torch.equal(ts, torch.as_tensor(xs) * 100)
        seen.extend(int(i) for i in xs)
    assert sorted(seen) == list(range(n))


def test_aligned_shuffle_actually_shuffles() -> None:
    x = np.arange(40)
    xs, ys = shard(x, x * 10, shuffle=True, seed=3, rank=0, world_size=1)
    assert not np.array_equal(xs, x)
    assert np.array_equal(ys, xs * 10)


def test_unequal_lengths_raise_with_the_lengths() -> None:
    with pytest.raises(ValueError, match=r"\[5, 4\]"):
        shard(list(range(5)), list(range(4)), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"\[3, 3, 2\]"):
        shard(np.zeros(3), torch.zeros(3), [1, 2], rank=0, world_size=2)


def test_no_arrays_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        shard(rank=0, world_size=1)


# ------------------------------------------------------------------------------ shard: drop_last


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last_gives_every_rank_the_same_count(world: int, n: int, shuffle: bool) -> None:
    data = list(range(n))
    shards = [
        shard(data, shuffle=shuffle, seed=9, drop_last=True, rank=k, world_size=world)
        for k in range(world)
    ]
    for k, part in enumerate(shards):
        assert len(part) == n // world
        assert len(part) == shard_size(n, k, world, drop_last=True)
    union = [item for part in shards for item in part]
    assert len(union) == len(set(union)) == n - n % world
    assert set(union) <= set(data)
    if not shuffle:
        # Without a shuffle, the dropped items are the tail.
        assert sorted(union) == data[: n - n % world]


# ----------------------------------------------------------------------- shard: type preservation


def test_list_stays_list() -> None:
    out = shard([1, 2, 3, 4, 5], rank=1, world_size=2)
    assert type(out) is list
    assert out == [2, 4]


def test_tuple_stays_tuple() -> None:
    out = shard((1, 2, 3, 4, 5), rank=0, world_size=2)
    assert type(out) is tuple
    assert out == (1, 3, 5)


def test_range_becomes_list() -> None:
    out = shard(range(10), rank=2, world_size=3)
    assert type(out) is list
    assert out == [2, 5, 8]


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.uint8, np.float64, np.bool_])
@pytest.mark.parametrize("n", [0, 1, 10])
def test_numpy_array_stays_numpy_with_dtype(dtype: Any, n: int) -> None:
    x = (np.arange(n) % 3).astype(dtype)
    out = shard(x, shuffle=True, seed=2, rank=0, world_size=2)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.dtype(dtype)
    assert len(out) == (n + 1) // 2


def test_numpy_2d_shards_rows() -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    out = shard(x, rank=1, world_size=4)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32
    assert out.shape == (3, 3)
    assert np.array_equal(out, x[[1, 5, 9]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 10])
def test_torch_tensor_stays_tensor_with_dtype(dtype: torch.dtype, n: int) -> None:
    x = torch.arange(n).to(dtype)
    out = shard(x, shuffle=True, seed=2, rank=1, world_size=3)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype
    assert len(out) == shard_size(n, 1, 3)


def test_torch_2d_shards_rows() -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    out = shard(x, rank=0, world_size=3)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (3, 3)
    assert torch.equal(out, x[[0, 3, 6]])


def test_single_array_is_returned_unwrapped() -> None:
    arr = shard(np.arange(6), rank=0, world_size=2)
    assert isinstance(arr, np.ndarray)
    assert not isinstance(arr, tuple)
    assert np.array_equal(arr, [0, 2, 4])
    ten = shard(torch.arange(6), rank=0, world_size=2)
    assert isinstance(ten, torch.Tensor)
    lst = shard([0, 1, 2, 3], rank=0, world_size=2)
    assert lst == [0, 2]


def test_several_arrays_return_a_tuple_of_their_types() -> None:
    out = shard(np.arange(6), torch.arange(6), list(range(6)), range(6), rank=1, world_size=2)
    assert type(out) is tuple
    assert len(out) == 4
    a, t, lst, rng = out
    assert isinstance(a, np.ndarray)
    assert isinstance(t, torch.Tensor)
    assert type(lst) is list
    assert type(rng) is list
    assert lst == rng == [1, 3, 5]
    two = shard([1, 2], [3, 4], rank=0, world_size=1)
    assert two == ([1, 2], [3, 4])


# ------------------------------------------------------------------- shard: rank from environment


def test_shard_reads_rank_and_world_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_rank(monkeypatch, 1, 3)
    data = list(range(10))
    assert shard(data) == [1, 4, 7]
    # drop_last and shuffle use the env world too.
    assert len(shard(data, drop_last=True)) == 3
    assert shard(data, shuffle=True, seed=4) == shard(
        data, shuffle=True, seed=4, rank=1, world_size=3
    )


def test_explicit_rank_or_world_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_rank(monkeypatch, 1, 3)
    data = list(range(10))
    assert shard(data, rank=0) == [0, 3, 6, 9]
    assert shard(data, world_size=2) == [1, 3, 5, 7, 9]
    assert shard(data, rank=0, world_size=1) == data


def test_outside_a_pool_shard_is_identity() -> None:
    data = list(range(7))
    assert shard(data) == data


@pytest.mark.parametrize(("rank", "world"), [(3, 3), (4, 3), (-1, 3), (0, 0), (1, 1)])
def test_bad_rank_raises(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="outside a world"):
        shard([1, 2, 3], rank=rank, world_size=world)


def test_bad_rank_from_env_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_rank(monkeypatch, 3, 3)
    with pytest.raises(ValueError, match="rank 3"):
        shard([1, 2, 3])
    # An explicit rank beyond the env world also fails.
    _set_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError):
        shard([1, 2, 3], rank=2)


# -------------------------------------------------------------------------------- instance_info


def _pool(accelerators: tuple[int, int] = (2, 2)) -> str:
    return json.dumps(
        {
            "name": "trainers",
            "provider": "aws",
            "nodes": [
                {"node": i, "addr": f"10.0.0.{i}", "ranks": [2 * i, 2 * i + 1], "accelerators": a}
                for i, a in enumerate(accelerators)
            ],
        }
    )


def test_instance_info_outside_a_pool() -> None:
    info = instance_info()
    assert isinstance(info, InstanceInfo)
    assert info.rank == 0
    assert info.node == 0
    assert info.local_rank == 0
    assert info.world_size == 1
    assert info.local_world_size == 1
    assert info.is_head is True
    assert info.total_nodes == 1
    assert info.head_port is None
    assert info.head_addr == "127.0.0.1"
    assert info.pool is None
    assert len(info.peers) == 1
    assert info.peers[0].ranks == (0,)


def test_instance_info_ignores_empty_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
    info = instance_info()
    assert (info.rank, info.world_size, info.local_rank, info.head_port) == (0, 1, 0, None)


def _set_pool_env(
    monkeypatch: pytest.MonkeyPatch, *, rank: int, node: int, accelerators: tuple[int, int]
) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("NODE_RANK", str(node))
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("SKYWARD_POOL", _pool(accelerators))


def test_instance_info_inside_a_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_pool_env(monkeypatch, rank=1, node=0, accelerators=(2, 2))
    info = instance_info()
    assert info.node == 0
    assert info.rank == 1
    assert info.local_rank == 1
    assert info.world_size == 4
    assert info.local_world_size == 2
    assert info.total_nodes == 2
    assert info.is_head is False
    assert info.head_addr == "10.0.0.0"
    assert info.head_port == 29500
    assert isinstance(info.head_port, int)
    assert info.accelerators == 2
    assert info.pool == "trainers"
    assert info.peers == (
        Peer(node=0, addr="10.0.0.0", ranks=(0, 1), accelerators=2),
        Peer(node=1, addr="10.0.0.1", ranks=(2, 3), accelerators=2),
    )


def test_instance_info_head_and_this_nodes_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_pool_env(monkeypatch, rank=0, node=0, accelerators=(2, 8))
    head = instance_info()
    assert head.is_head is True
    assert head.accelerators == 2
    _set_pool_env(monkeypatch, rank=3, node=1, accelerators=(2, 8))
    other = instance_info()
    assert other.is_head is False
    assert (other.node, other.rank, other.local_rank) == (1, 3, 1)
    assert other.accelerators == 8
    assert [p.addr for p in other.peers] == ["10.0.0.0", "10.0.0.1"]
    assert [p.ranks for p in other.peers] == [(0, 1), (2, 3)]


def test_pool_shards_by_rank_not_node(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two ranks on one node must get different data.
    data = list(range(8))
    _set_pool_env(monkeypatch, rank=0, node=0, accelerators=(2, 2))
    first = shard(data)
    _set_pool_env(monkeypatch, rank=1, node=0, accelerators=(2, 2))
    second = shard(data)
    assert first == [0, 4]
    assert second == [1, 5]


# ------------------------------------------------------------------------------------------ log


def test_log_records_floats_locally() -> None:
    log(step=1, loss=1, acc=np.float32(0.5), lr=torch.tensor(0.25), n=np.int64(3))
    log(loss=2.5)
    log(step=0, t=torch.tensor(7, dtype=torch.int32), a=np.array(1.5))
    records = local_metrics()
    assert records == [
        (1, {"loss": 1.0, "acc": 0.5, "lr": 0.25, "n": 3.0}),
        (None, {"loss": 2.5}),
        (0, {"t": 7.0, "a": 1.5}),
    ]
    for _, values in records:
        for value in values.values():
            assert type(value) is float


def test_local_metrics_is_a_copy() -> None:
    log(step=1, loss=1.0)
    local_metrics().clear()
    assert local_metrics() == [(1, {"loss": 1.0})]


@pytest.mark.parametrize("bad", ["abc", None, [1.0], {"a": 1}, object(), 1 + 2j])
def test_log_rejects_non_numbers_naming_the_metric(bad: Any) -> None:
    with pytest.raises(TypeError, match="'val_loss'"):
        log(step=1, loss=1.0, val_loss=bad)
    assert local_metrics() == []


def test_log_refuses_an_int_too_large_for_a_float_naming_the_metric() -> None:
    with pytest.raises(ValueError, match="log\\(\\): metric 'big' is too large for a float"):
        log(step=1, loss=1.0, big=10**400)
    with pytest.raises(ValueError, match="total is too large"):
        log(step=1, total=10**400, loss=1.0)
    assert local_metrics() == []


def test_log_rejects_multi_element_numpy_array() -> None:
    with pytest.raises(TypeError, match="'batch'"):
        log(batch=np.array([1.0, 2.0]))
    assert local_metrics() == []


@pytest.mark.parametrize("step", [1.0, "3", 2.5])
def test_log_rejects_non_int_step(step: Any) -> None:
    with pytest.raises(TypeError, match="step"):
        log(step=step, loss=1.0)
    assert local_metrics() == []


def test_log_goes_to_the_sink_and_not_locally() -> None:
    received: list[tuple[int | None, dict[str, float]]] = []
    set_metric_sink(lambda step, values: received.append((step, values)))
    try:
        log(step=2, loss=np.float64(0.5), n=3)
        log(acc=torch.tensor(0.75))
    finally:
        set_metric_sink(None)
    assert received == [(2, {"loss": 0.5, "n": 3.0}), (None, {"acc": 0.75})]
    assert all(type(v) is float for _, values in received for v in values.values())
    assert local_metrics() == []
    # With the sink removed, records are kept locally again.
    log(step=3, loss=0.1)
    assert local_metrics() == [(3, {"loss": 0.1})]
    assert len(received) == 2


def test_sink_not_called_on_invalid_metrics() -> None:
    received: list[Any] = []
    set_metric_sink(lambda step, values: received.append((step, values)))
    try:
        with pytest.raises(TypeError):
            log(step=1, loss="nope")
        with pytest.raises(TypeError):
            log(step=1.5, loss=1.0)
    finally:
        set_metric_sink(None)
    assert received == []


# ------------------------------------------------------------------------------- output control


def test_stdout_head_context_manager(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with stdout(only="head"):
        print("from rank zero")
    assert "from rank zero" in capsys.readouterr().out

    _set_rank(monkeypatch, 1, 2)
    with stdout(only="head"):
        print("from rank one")
    assert "from rank one" not in capsys.readouterr().out
    # The stream is back after the block.
    print("after")
    assert capsys.readouterr().out == "after\n"


def test_stdout_default_is_head(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set_rank(monkeypatch, 1, 2)
    with stdout():
        print("hidden")
    assert capsys.readouterr().out == ""


def test_stdout_head_decorator(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    @stdout(only="head")
    def report(x: int) -> int:
        print(f"value {x}")
        return x * 2

    assert report(3) == 6
    assert capsys.readouterr().out == "value 3\n"

    # The rank is read when the function runs, not when it was decorated.
    _set_rank(monkeypatch, 1, 2)
    assert report(4) == 8
    assert capsys.readouterr().out == ""
    assert report.__name__ == "report"


def test_stdout_only_callable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    control = stdout(only=lambda info: info.rank == 1)
    with control:
        print("rank zero")
    assert capsys.readouterr().out == ""

    _set_rank(monkeypatch, 1, 2)
    with control:
        print("rank one")
    assert capsys.readouterr().out == "rank one\n"


def test_stdout_only_all(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set_rank(monkeypatch, 1, 2)
    with stdout(only="all"):
        print("everyone")
    assert capsys.readouterr().out == "everyone\n"


@pytest.mark.parametrize("only", ["heads", "Head", "", None, 0, "rank0"])
def test_invalid_only_raises(only: Any) -> None:
    with pytest.raises(ValueError, match="only="):
        stdout(only=only)
    with pytest.raises(ValueError, match="only="):
        stderr(only=only)


def test_stderr_head(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with stderr(only="head"):
        print("err zero", file=sys.stderr)
    assert "err zero" in capsys.readouterr().err

    _set_rank(monkeypatch, 1, 2)
    with stderr(only="head"):
        print("err one", file=sys.stderr)
        print("out one")  # stderr() leaves stdout alone
    captured = capsys.readouterr()
    assert "err one" not in captured.err
    assert captured.out == "out one\n"

    @stderr(only="head")
    def warn() -> str:
        print("warned", file=sys.stderr)
        return "done"

    assert warn() == "done"
    assert capsys.readouterr().err == ""


def test_stdout_leaves_stderr_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set_rank(monkeypatch, 1, 2)
    with stdout(only="head"):
        print("out", file=sys.stdout)
        print("err", file=sys.stderr)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "err\n"


def test_streams_restored_after_exception(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set_rank(monkeypatch, 1, 2)
    with pytest.raises(RuntimeError, match="boom"), stdout(only="head"), stderr(only="head"):
        print("hidden")
        raise RuntimeError("boom")
    print("visible")
    print("visible err", file=sys.stderr)
    captured = capsys.readouterr()
    assert captured.out == "visible\n"
    assert captured.err == "visible err\n"


def test_decorated_recursion_restores_streams(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set_rank(monkeypatch, 1, 2)

    @stdout(only="head")
    def countdown(n: int) -> int:
        print(n)
        return 0 if n == 0 else 1 + countdown(n - 1)

    assert countdown(3) == 3
    print("after")
    assert capsys.readouterr().out == "after\n"


def _noisy() -> int:
    print("to stdout")
    print("to stderr", file=sys.stderr)
    return 42


def test_silent_bare_decorator(capsys: pytest.CaptureFixture[str]) -> None:
    @silent
    def f() -> int:
        return _noisy()

    assert f() == 42
    assert f.__name__ == "f"
    assert capsys.readouterr() == ("", "")


def test_silent_called_decorator(capsys: pytest.CaptureFixture[str]) -> None:
    @silent()
    def f() -> int:
        return _noisy()

    assert f() == 42
    assert capsys.readouterr() == ("", "")


def test_silent_context_manager(capsys: pytest.CaptureFixture[str]) -> None:
    with silent():
        result = _noisy()
    assert result == 42
    assert capsys.readouterr() == ("", "")
    # Streams are back afterwards.
    _noisy()
    assert capsys.readouterr() == ("to stdout\n", "to stderr\n")


def test_silent_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for rank in range(3):
        _set_rank(monkeypatch, rank, 3)
        with silent():
            _noisy()
        assert capsys.readouterr() == ("", "")


# ------------------------------------------------------------ edge cases of the inputs


def test_log_rejects_numeric_string() -> None:
    with pytest.raises(TypeError, match="'loss'"):
        log(loss="1.5")


def test_log_rejects_multi_element_tensor_with_type_error() -> None:
    with pytest.raises(TypeError, match="'batch'"):
        log(batch=torch.tensor([1.0, 2.0]))


def test_accelerators_follow_node_field_not_list_order(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = {
        "nodes": [
            {"node": 1, "addr": "10.0.0.1", "ranks": [2, 3], "accelerators": 8},
            {"node": 0, "addr": "10.0.0.0", "ranks": [0, 1], "accelerators": 2},
        ]
    }
    monkeypatch.setenv("SKYWARD_POOL", json.dumps(pool))
    monkeypatch.setenv("NODE_RANK", "1")
    assert instance_info().accelerators == 8


def test_empty_pool_var_is_treated_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYWARD_POOL", "")
    assert instance_info().total_nodes == 1

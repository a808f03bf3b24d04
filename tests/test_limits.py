"""Every number a user gives is finite and in range, checked where it comes in (the magics'
parsers are tested through a real kernel in test_magics.py): the Pool API and the spec refuse
the same values with the same words, before anything starts.
"""

from __future__ import annotations

import math

import pytest

from skyward_jupyter import limits
from skyward_jupyter.limits import MAX_RANKS, LimitError
from skyward_jupyter.pool import Pool
from skyward_jupyter.providers import provider_class
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.spec import PoolSpec


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"nodes": 0}, "--nodes: must be from 1 to 1024"),
        ({"nodes": 100_000}, "got 100000"),
        ({"nodes": 2.5}, "--nodes: expected a whole number"),
        ({"nodes": 600, "procs_per_node": 2}, "1200 ranks; a pool has at most 1024"),
        ({"heartbeat_timeout": math.nan}, "--heartbeat-timeout: expected a finite number"),
        ({"heartbeat_timeout": math.inf}, "--heartbeat-timeout: expected a finite number"),
        ({"desync_after": 0.0}, "--desync-after: must be more than 0"),
        ({"pg_timeout": math.nan}, "pg_timeout: expected a finite number"),
        ({"heartbeat_interval": 0.0}, "heartbeat_interval: must be from 0.01 to 60 seconds"),
        ({"interrupt_grace": math.inf}, "interrupt_grace: expected a finite number"),
        ({"start_timeout": -1.0}, "start_timeout: must be more than 0"),
        ({"sync_cap_bytes": math.nan}, "sync_cap_bytes: expected a whole number"),
        ({"sync_cap_bytes": 0}, "sync_cap_bytes: must be from 1 to"),
    ],
)
def test_the_pool_api_refuses_numbers_out_of_range(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(LimitError) as caught:
        Pool(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(caught.value)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, 0.0, -1.0, 1e300])
def test_a_cells_timeout_is_checked_before_anything_runs(timeout: float) -> None:
    with pytest.raises(LimitError, match="--timeout"):
        Pool().run("pass", timeout=timeout)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nodes", MAX_RANKS + 1),
        ("procs_per_node", 0),
        ("heartbeat_timeout", math.nan),
        ("desync_after", math.inf),
        ("sync_cap", math.nan),
        ("sync_cap", math.inf),
        ("idle_timeout", -0.5),
        ("idle_timeout", math.nan),
    ],
)
def test_a_spec_cannot_hold_a_number_out_of_range(field: str, value: float) -> None:
    with pytest.raises(LimitError, match=rf"^--{field.replace('_', '-')}: "):
        PoolSpec(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("provider", ["slurm", "ray"])
def test_a_providers_options_cannot_hold_a_number_out_of_range(provider: str) -> None:
    """However they are made: parsed from the magics' text, or built by a program."""
    options = provider_class(provider).Options
    with pytest.raises(LimitError, match=r"^--gpus-per-node: must be from 0 to 64 GPUs"):
        options(gpus_per_node=-1)  # type: ignore[call-arg]
    with pytest.raises(ProviderError, match=r"^--gpus-per-node: must be from 0 to 64 GPUs"):
        options.from_given({"gpus_per_node": "65"})


def test_the_ceiling_on_ranks_names_itself() -> None:
    with pytest.raises(LimitError) as caught:
        PoolSpec(nodes=64, procs_per_node=32)
    assert "2048 ranks; a pool has at most 1024 (skyward_jupyter.limits.MAX_RANKS)" in str(
        caught.value
    )
    assert PoolSpec(nodes=32, procs_per_node=32).nodes == 32  # exactly the ceiling is allowed


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999", "", "5 s", "0x10"])
def test_option_text_that_is_no_finite_number_is_refused(text: str) -> None:
    with pytest.raises(LimitError, match=r"^--heartbeat-timeout: "):
        limits.HEARTBEAT_TIMEOUT.parse(text)

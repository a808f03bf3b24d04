"""``--keras-backend``: Keras 3 on the backend the pool chose, data parallel over every rank
with JAX (issue 16).

The training cell is written as the Keras distribution guide writes multi-process code: a
``DataParallel`` over every device, each process feeding its own shard of the data (the pool's
``shard``), no seed set by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.frameworks import Frameworks
from skyward_jupyter.results import PoolError
from skyward_jupyter.session import Session

TRAIN = """
import keras, numpy as np
from skyward_jupyter import shard

devices = keras.distribution.list_devices()
data_parallel = keras.distribution.DataParallel(devices=devices)
data_parallel.auto_shard_dataset = False  # each rank feeds its own shard
keras.distribution.set_distribution(data_parallel)

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
x_mine, y_mine = shard(x, y)

model = keras.Sequential([
    keras.Input((8,)),
    keras.layers.Dense(16, activation="relu"),
    keras.layers.Dense(1, activation="sigmoid"),
])
model.compile(optimizer="adam", loss="binary_crossentropy")
history = model.fit(x_mine, y_mine, batch_size=32, epochs=4, verbose=0)
weights = [np.asarray(w.value.addressable_data(0)) for w in model.weights]
(keras.backend.backend(), len(devices), float(x_mine.sum()), history.history["loss"],
 float(sum(w.sum() for w in weights)), float(sum(np.abs(w).sum() for w in weights)))
"""


def test_data_parallel_over_every_rank_trains_one_model() -> None:
    session = Session(announce=lambda _: None)
    try:
        spec = session.spec_from({"keras_backend": "jax", "nodes": 2})
        assert spec.describe().endswith("keras on jax")
        result = session.run_cell(TRAIN, {}, spec=spec, timeout=240).raise_for_errors()
    finally:
        session.down_all()
    (
        (backend0, devices0, data0, loss0, sum0, abs0),
        (backend1, devices1, data1, loss1, sum1, abs1),
    ) = result.values
    assert (backend0, devices0) == (backend1, devices1) == ("jax", 2)
    assert data0 != data1, "each rank trained on its own shard"
    assert loss0[-1] < loss0[0], loss0
    # One model: the same weights on both ranks after training on different data (averaged
    # gradients), from the same start (the pool agreed on Keras's seed).
    assert (sum0, abs0) == (sum1, abs1) and loss0 == loss1


def test_the_torch_backend_is_keras_backend_on_every_rank() -> None:
    with Pool(nodes=2, frameworks=Frameworks(keras_backend="torch")) as pool:
        cell = "import keras, torch.distributed as dist\n"
        result = pool.run(cell + "(keras.backend.backend(), dist.get_world_size())")
        assert result.raise_for_errors().values == [("torch", 2), ("torch", 2)]


def test_keras_imported_before_the_pool_could_choose_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site hook that imports Keras with its own backend, as a machine's image may have."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.environ['KERAS_BACKEND'] = 'torch'\nimport keras\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(PoolError) as raised:
        Pool(nodes=2, frameworks=Frameworks(jax=True, keras_backend="jax")).start()
    message = str(raised.value)
    assert message.startswith("rank 0 (node 0, ")
    assert "keras was imported with the 'torch' backend before the pool could set" in message
    assert "KERAS_BACKEND=jax" in message and "\n" not in message

"""The gallery's JAX and Keras-on-JAX notebooks (``scripts/make_gallery.py`` writes them)."""

from __future__ import annotations

from gallery_cells import DOWN, LOAD, Cell

JAX: dict[str, list[Cell]] = {}

JAX["07_jax"] = [
    (
        "md",
        """
# JAX across processes

`--framework jax` calls `jax.distributed.initialize` on every rank before the first cell (the
head runs the coordinator), so `jax.devices()` lists every process's devices and one mesh spans
them. On this CPU pool JAX's collectives run over gloo; on GPUs the same cells run over NCCL.
""",
    ),
    LOAD,
    (
        "code",
        """
%%sky --nodes 2 --framework jax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("data",))
psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh,
                             in_specs=P("data"), out_specs=P()))
mine = np.array([jax.process_index() + 1.0])          # 1 on rank 0, 2 on rank 1
total = psum(jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), mine))
print(f"{jax.process_count()} processes, {len(jax.devices())} devices: psum {float(total[0])}")
""",
    ),
    (
        "md",
        """
A data-parallel training loop: the parameters are replicated, each batch is split between the
processes (each rank feeds its own shard), and `jax.jit` inserts the gradient all-reduce.
""",
    ),
    (
        "code",
        """
%%sky
from skyward_jupyter import instance_info, shard

replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
rng = np.random.default_rng(0)
true_w = np.array([2.0, -3.0, 0.5], dtype=np.float32)
x = rng.normal(size=(4096, 3)).astype(np.float32)
y = x @ true_w + 1.0
x_mine, y_mine = shard(x, y)

def loss_fn(params, xb, yb):
    w, b = params
    return jnp.mean((xb @ w + b - yb) ** 2)

@jax.jit
def step(params, xb, yb):
    loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

params = jax.device_put((jnp.zeros(3), jnp.zeros(())), replicated)
for epoch in range(5):
    for i in range(0, len(x_mine), 256):
        xb = jax.make_array_from_process_local_data(by_batch, x_mine[i:i + 256])
        yb = jax.make_array_from_process_local_data(by_batch, y_mine[i:i + 256])
        params, loss = step(params, xb, yb)
    if instance_info().is_head:
        print(f"epoch {epoch}: loss {float(loss):.5f}")
""",
    ),
    (
        "code",
        """
%%sky
w = np.asarray(params[0].addressable_data(0))
{"processes": jax.process_count(), "devices": len(jax.devices()), "psum": float(total[0]),
 "loss": round(float(loss), 5), "w": np.round(w, 2).tolist(),
 "b": round(float(params[1].addressable_data(0)), 2)}
""",
        "result",
    ),
    DOWN,
]

JAX["08_keras_jax"] = [
    (
        "md",
        """
# Keras 3 on JAX, data parallel over the pool

`--keras-backend jax` sets `KERAS_BACKEND` on every rank before anything imports Keras, and
sets up JAX across the ranks, agreeing on Keras's random seed so every rank builds the same
initial model. A `DataParallel` distribution over all devices then trains one model: each rank
feeds its shard of the data (`shard`), and the gradients are averaged across ranks.
""",
    ),
    LOAD,
    (
        "code",
        """
%%sky --nodes 2 --keras-backend jax
import keras
import numpy as np
from skyward_jupyter import instance_info, shard

devices = keras.distribution.list_devices()
data_parallel = keras.distribution.DataParallel(devices=devices)
data_parallel.auto_shard_dataset = False     # each rank feeds its own shard
keras.distribution.set_distribution(data_parallel)

keras.utils.set_random_seed(0)               # the same on every rank: a reproducible run
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 20)).astype("float32")
y = (x[:, :5].sum(axis=1) > 0).astype("int32")
x_mine, y_mine = shard(x, y)

model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
history = model.fit(x_mine, y_mine, batch_size=64, epochs=5,
                    verbose=2 if instance_info().is_head else 0)
""",
    ),
    (
        "code",
        """
%%sky --all
# The same weights on both ranks: one model, trained on both ranks' data.
checksum = float(sum(np.asarray(w.value.addressable_data(0)).sum() for w in model.weights))
{"backend": keras.backend.backend(), "devices": len(devices),
 "accuracy": round(history.history["accuracy"][-1], 3), "checksum": round(checksum, 5)}
""",
        "result",
    ),
    DOWN,
]

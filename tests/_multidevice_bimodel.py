"""A `BiModel` training step on a mesh of 8 devices.

Run by `tests/test_bimodel.py::test_sharded_over_a_mesh_of_eight_devices` in a fresh
interpreter, because the number of fake CPU devices must be set before JAX is
imported. Two layouts: the `BiModel` replicated with the batch sharded (data
parallelism), and its 2-D weights sharded over a `model` axis (tensor parallelism),
master and compute copy alike. Prints one line of JSON with what it measured; the
test makes the assertions.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_multidevice_bimodel.py
"""

import os


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import json  # noqa: E402
import sys  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import eqx_amp  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import TransformerBlock  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")

DIM, SEQ, BATCH = 16, 8, 8
# Plain SGD, so that the update is proportional to the gradient and the sharded
# step can be compared with the one-device step (Adam normalises tiny gradients, so
# float16 rounding differences between reduction orders would be amplified).
optimizer = optax.sgd(0.1)


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@eqx.filter_jit
def step(bimodel, opt_state, loss_scale, x, y):
    (loss, grads), loss_scale, grads_finite = eqx_amp.filter_value_and_grad(loss_fn)(
        bimodel, x, y, loss_scale=loss_scale
    )
    params = eqx.filter(bimodel.master, eqx.is_inexact_array)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_bimodel = bimodel.apply_updates(updates)
    bimodel, opt_state = eqx_amp.select_tree(
        grads_finite, (new_bimodel, new_opt_state), (bimodel, opt_state)
    )
    return bimodel, opt_state, loss_scale, loss, grads_finite


def init(bimodel):
    return optimizer.init(eqx.filter(bimodel.master, eqx.is_inexact_array))


def invariant(bimodel) -> bool:
    expected = eqx_amp.cast_tree(
        bimodel.master, bimodel.policy.compute_dtype, bimodel.filter_spec
    )
    return all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        for a, b in zip(jtu.tree_leaves(bimodel.compute), jtu.tree_leaves(expected))
        if eqx.is_array(a)
    )


def shard_arrays(tree, sharding_of):
    arrays, static = eqx.partition(tree, eqx.is_array)
    shardings = jtu.tree_map(sharding_of, arrays)
    return eqx.combine(jax.device_put(arrays, shardings), static)


kx, ky = jr.split(jr.key(1))
x = jr.normal(kx, (BATCH, SEQ, DIM))
y = jr.normal(ky, (BATCH, SEQ, DIM))
policy = eqx_amp.Policy(jnp.float32, jnp.float16, jnp.float32)
bimodel = eqx_amp.BiModel(TransformerBlock(DIM, 2, key=jr.key(0)), policy=policy)
loss_scale = eqx_amp.DynamicLossScale(2.0**12)

reference, *_ = step(bimodel, init(bimodel), loss_scale, x, y)


def run(mesh, model_sharding_of):
    data = NamedSharding(mesh, P("data"))
    sharded = shard_arrays(bimodel, model_sharding_of)
    sharded_x, sharded_y = jax.device_put((x, y), data)
    opt_state = eqx.filter_shard(init(sharded), NamedSharding(mesh, P()))
    scale = eqx.filter_shard(loss_scale, NamedSharding(mesh, P()))
    new, _, _, _, grads_finite = step(sharded, opt_state, scale, sharded_x, sharded_y)
    diffs = [
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jtu.tree_leaves(new.master), jtu.tree_leaves(reference.master))
        if eqx.is_array(a)
    ]
    weight = new.master.mlp.layers[0].weight
    return new, {
        "grads_finite": bool(grads_finite),
        "invariant": invariant(new),
        "master_changed": not eqx.tree_equal(new.master, bimodel.master),
        "max_abs_diff_to_one_device": max(diffs),
        "output_devices": len(weight.sharding.device_set),
    }


devices = np.array(jax.devices())
report = {"devices": len(devices)}

data_mesh = Mesh(devices, ("data",))
_, report["replicated"] = run(data_mesh, lambda _: NamedSharding(data_mesh, P()))

tp_mesh = Mesh(devices.reshape(4, 2), ("data", "model"))


def tensor_parallel(leaf):
    if leaf.ndim == 2 and leaf.shape[0] % 2 == 0:
        return NamedSharding(tp_mesh, P("model", None))
    return NamedSharding(tp_mesh, P())


new, report["tensor_parallel"] = run(tp_mesh, tensor_parallel)
spec = new.master.mlp.layers[0].weight.sharding.spec
report["tensor_parallel"]["weight_sharding"] = list(spec) + [None] * (2 - len(spec))

print(json.dumps(report))

"""Data-parallel loss scaling under `jax.shard_map` on 8 devices.

Run by `tests/test_grad.py::test_shard_map_on_eight_devices` in a fresh interpreter,
because the number of fake CPU devices must be set before JAX is imported. Prints one
line of JSON with what it measured; the test makes the assertions.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_multidevice_grad.py
"""

import os


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import json  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P

import eqx_amp  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")

AXIS = "data"
mesh = Mesh(np.array(jax.devices()), (AXIS,))
n_devices = len(jax.devices())
k_model, k_x, k_y = jr.split(jr.key(0), 3)
model = eqx.nn.MLP(4, "scalar", 16, 1, key=k_model)
params, static = eqx.partition(model, eqx.is_array)
x = jr.normal(k_x, (4 * n_devices, 4))
y = jr.normal(k_y, (4 * n_devices,))


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def local_loss(model, x, y):
    """The loss of this device's shard, in float16 compute."""
    return mse(eqx_amp.filter_amp(model, policy="mixed_float16"), x, y)


def global_loss(model, x, y):
    """The mean loss over every device: the recipe for mean gradients."""
    return jax.lax.pmean(local_loss(model, x, y), AXIS)


def per_device(tree):
    """Gives each output a leading device axis, so each device's copy comes back."""
    return jax.tree_util.tree_map(lambda a: a[None], tree)


#
# One training step, skipped with select_tree when the gradients are not finite.
#

grad_fn = eqx_amp.filter_value_and_grad(global_loss, axis_name=AXIS)


def step(params, loss_scale, x, y):
    model = eqx.combine(params, static)
    (_, grads), new_scale, finite = grad_fn(model, x, y, loss_scale=loss_scale)
    updates = jax.tree_util.tree_map(lambda g: -0.1 * g, grads)
    new_model = eqx.apply_updates(model, updates)
    model = eqx_amp.select_tree(finite, new_model, model)
    out = (eqx.filter(model, eqx.is_array), new_scale.loss_scale, new_scale.counter)
    return per_device((*out, finite))


def data_parallel(fn):
    """`fn(replicated, replicated, x_shard, y_shard)` on every device, jitted."""
    specs = (P(), P(), P(AXIS), P(AXIS))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(AXIS)))


sharded_step = data_parallel(step)


def run_step(x):
    scale = eqx_amp.DynamicLossScale(2.0**10, period=1000)
    new_params, loss_scale, counter, finite = sharded_step(params, scale, x, y)
    leaves = jax.tree_util.tree_leaves(params)
    new_leaves = jax.tree_util.tree_leaves(new_params)
    unchanged = [
        all(
            np.asarray(new[i]).tobytes() == np.asarray(old).tobytes()
            for new, old in zip(new_leaves, leaves)
        )
        for i in range(n_devices)
    ]
    return {
        "grads_finite": np.asarray(finite).tolist(),
        "loss_scale": np.asarray(loss_scale).tolist(),
        "counter": np.asarray(counter).tolist(),
        "params_unchanged": unchanged,
        "params_changed": [not u for u in unchanged],
        "params_finite": bool(eqx_amp.all_finite(new_params)),
    }


finite_step = run_step(x)
# A NaN in the shard of device 3 only.
nan_step = run_step(x.at[3 * 4 + 1, 2].set(jnp.nan))


#
# The same step in the short form: the loss scale in the optimizer state.
#

optim = eqx_amp.loss_scaling(optax.sgd(0.1), eqx_amp.DynamicLossScale(2.0**10))


def short_step(params, opt_state, x, y):
    model = eqx.combine(params, static)
    grad_fn = eqx_amp.scaled_value_and_grad(global_loss, axis_name=AXIS)
    (_, grads), opt_state = grad_fn(model, x, y, opt_state=opt_state)
    updates, opt_state = optim.update(grads, opt_state, params)
    new_params = eqx.apply_updates(params, updates)
    scale = opt_state.loss_scale
    out = (
        new_params,
        scale.loss_scale,
        opt_state.total_notfinite,
        opt_state.last_finite,
    )
    return per_device(out)


sharded_short_step = data_parallel(short_step)


def run_short_step(x):
    new_params, loss_scale, total_notfinite, finite = sharded_short_step(
        params, optim.init(params), x, y
    )
    new_leaves = jax.tree_util.tree_leaves(new_params)
    explicit = jax.tree_util.tree_leaves(
        sharded_step(params, eqx_amp.DynamicLossScale(2.0**10, period=1000), x, y)[0]
    )
    return {
        "grads_finite": np.asarray(finite).tolist(),
        "loss_scale": np.asarray(loss_scale).tolist(),
        "total_notfinite": np.asarray(total_notfinite).tolist(),
        "same_as_explicit": all(
            np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
            for a, b in zip(new_leaves, explicit)
        ),
    }


short_finite_step = run_short_step(x)
short_nan_step = run_short_step(x.at[3 * 4 + 1, 2].set(jnp.nan))


#
# What JAX does with the gradients of replicated parameters.
#


def float32_local(model, x, y):
    return mse(model, x, y)


def float32_global(model, x, y):
    return jax.lax.pmean(mse(model, x, y), AXIS)


def gradient_of(loss, check_vma):
    g = eqx_amp.filter_grad(loss, axis_name=AXIS)

    def fn(params, x, y):
        grads, _, _ = g(
            eqx.combine(params, static), x, y, loss_scale=eqx_amp.NoOpLossScale()
        )
        return per_device(eqx.filter(grads, eqx.is_array))

    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(P(), P(AXIS), P(AXIS)),
        out_specs=P(AXIS),
        check_vma=check_vma,
    )
    return jax.jit(mapped)(params, x, y)


reference = jax.tree_util.tree_leaves(eqx.filter_grad(mse)(model, x, y))
ref_flat = jnp.concatenate([r.ravel() for r in reference])
semantics = {}
identical = True
for check_vma in (True, False):
    for name, loss in (("local_loss", float32_local), ("global_loss", float32_global)):
        grads = jax.tree_util.tree_leaves(gradient_of(loss, check_vma))
        flat = jnp.concatenate([g.reshape(n_devices, -1) for g in grads], axis=1)
        identical &= bool(jnp.all(flat == flat[0]))
        ratio = jnp.vdot(flat[0], ref_flat) / jnp.vdot(ref_flat, ref_flat)
        prefix = "check_vma" if check_vma else "no_check_vma"
        semantics[f"{prefix}_{name}"] = float(ratio)
semantics["identical_on_devices"] = identical

print(
    json.dumps(
        {
            "devices": n_devices,
            "finite_step": finite_step,
            "nan_step": nan_step,
            "short_finite_step": short_finite_step,
            "short_nan_step": short_nan_step,
            "semantics": semantics,
        }
    )
)

"""What the training-state tests share: a small MLP, its data and loss, and a
bit-for-bit comparison of two states."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

import eqx_amp


BF16 = jnp.bfloat16
BF16_MASTER = "p=bf16,c=bf16,o=f32"


def small_mlp(key, dtype=jnp.float32, out=4):
    model = eqx.nn.MLP(8, out, 32, 2, key=key)
    return eqx_amp.cast_tree(model, dtype)


def regression_data(key, n=64):
    kx, ky = jr.split(key)
    return jr.normal(kx, (n, 8)), jr.normal(ky, (n, 4))


def mse_loss(model, x, y):
    out = jax.vmap(model)(x.astype(BF16) if is_bfloat16(model) else x)
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def is_bfloat16(model):
    return jtu.tree_leaves(eqx.filter(model, eqx.is_inexact_array))[0].dtype == BF16


def float_params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def assert_bitwise_equal(a, b):
    a_leaves, a_def = jtu.tree_flatten(a)
    b_leaves, b_def = jtu.tree_flatten(b)
    assert a_def == b_def
    for x, y in zip(a_leaves, b_leaves):
        if eqx.is_array(x):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(
                np.asarray(x).reshape(-1).view(np.uint8),
                np.asarray(y).reshape(-1).view(np.uint8),
            )
        else:
            assert x == y or (callable(x) and x is y)

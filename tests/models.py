"""Small real models shared by the tests: the layers users actually train."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr


class TransformerBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, heads: int, *, key):
        k1, k2 = jr.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):  # x: (seq, dim)
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jr.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.norm1 = eqx.nn.GroupNorm(2, 8)
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)
        self.norm2 = eqx.nn.GroupNorm(2, 8)
        self.head = eqx.nn.Linear(8, 10, key=k3)

    def __call__(self, x):  # x: (1, 8, 8)
        x = jax.nn.relu(self.norm1(self.conv1(x)))
        x = jax.nn.relu(self.norm2(self.conv2(x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


class BatchNormNet(eqx.Module):
    layers: eqx.nn.Sequential

    def __init__(self, *, key):
        k1, k2 = jr.split(key)
        self.layers = eqx.nn.Sequential(
            [
                eqx.nn.Linear(6, 16, key=k1),
                eqx.nn.BatchNorm(16, axis_name="batch", mode="batch"),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(16, 3, key=k2),
            ]
        )

    def __call__(self, x, state):
        return self.layers(x, state)

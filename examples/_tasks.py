"""The two tasks the training examples share: a small CNN on scikit-learn's digits
and a character-level transformer on *Alice's Adventures in Wonderland*."""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax


TEXT = pathlib.Path(__file__).resolve().parent / "data" / "alice29.txt"


#
# The digits CNN.
#


class DigitsCNN(eqx.Module):
    first: eqx.nn.Conv2d
    second: eqx.nn.Conv2d
    hidden: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.first = eqx.nn.Conv2d(1, 32, 3, padding=1, key=k1)
        self.second = eqx.nn.Conv2d(32, 32, 3, padding=1, key=k2)
        self.hidden = eqx.nn.Linear(32 * 16, 64, key=k3)
        self.head = eqx.nn.Linear(64, 10, key=k4)

    def __call__(self, x):
        x = jax.nn.relu(self.first(x))
        x = jax.nn.relu(self.second(x))
        x = x.reshape(32, 4, 2, 4, 2).mean(axis=(2, 4)).reshape(-1)  # 2x2 pooling
        return self.head(jax.nn.relu(self.hidden(x)))


def digits(seed: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    labels = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    split = len(order) * 3 // 4
    return (images[order[:split]], labels[order[:split]]), (
        images[order[split:]],
        labels[order[split:]],
    )


#
# The character-level transformer.
#


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim, heads, key):
        k1, k2, k3 = jr.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.down = eqx.nn.Linear(4 * dim, dim, key=k3)

    def __call__(self, x):
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), dtype=bool))
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y, mask=causal)
        y = jax.vmap(self.up)(jax.vmap(self.norm2)(x))
        return x + jax.vmap(self.down)(jax.nn.gelu(y))


class CharTransformer(eqx.Module):
    embedding: eqx.nn.Embedding
    positions: jax.Array
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, dim, heads, layers, block, key):
        keys = jr.split(key, layers + 3)
        self.embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.positions = 0.02 * jr.normal(keys[1], (block, dim))
        self.blocks = tuple(Block(dim, heads, k) for k in keys[3:])
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, key=keys[2])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens) + self.positions[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def characters():
    text = TEXT.read_text(encoding="utf-8")
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.int32)
    vocab = -(-len(chars) // 16) * 16  # padded: fp8 GEMMs want multiples of 16
    return ids, vocab


#
# Batches and the loss.
#


def digit_batches(train, seed: int, batch: int = 128):
    """`batches(step) -> (images, labels)`: random rows of the training split."""
    x, y = train
    rng = np.random.default_rng(seed)

    def batches(_):
        rows = rng.integers(0, len(y), batch)
        return x[rows], y[rows]

    return batches


def character_batches(ids, seed: int, block: int = 64, batch: int = 32):
    """`batches(step) -> (inputs, targets)`: random windows of the text, the
    targets shifted by one character."""
    rng = np.random.default_rng(seed)

    def batches(_):
        starts = rng.integers(0, len(ids) - block - 1, batch)
        windows = np.stack([ids[s : s + block + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]

    return batches


def cross_entropy(logits, labels):
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

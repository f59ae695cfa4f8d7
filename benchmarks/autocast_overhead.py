"""Trace + compile time of a training step with `autocast` against the plain step.

    python benchmarks/autocast_overhead.py [--layers 4] [--dim 128] [--repeats 3]

Each repeat builds fresh step functions (so no trace cache is hit) and measures the
variants interleaved, so machine drift hits them alike. Prints medians and ratios.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_amp


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim, heads, key):
        k1, k2 = jr.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, vocab, dim, layers, key):
        keys = jr.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.blocks = [Block(dim, 4, k) for k in keys[1:-1]]
        self.head = eqx.nn.Linear(dim, vocab, key=keys[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


def make_step(optimizer, amp: bool):
    def loss_fn(model, tokens, targets):
        forward = eqx_amp.autocast(model) if amp else model
        logits = jax.vmap(forward)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(model, opt_state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    return eqx.filter_jit(step)


def measure(step, *args):
    start = time.perf_counter()
    lowered = step.lower(*args)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    return traced, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = Transformer(256, args.dim, args.layers, jr.key(0))
    optimizer = optax.adam(1e-3)
    # optax's bias correction mixes float and int32 scalars.
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    tokens = jnp.zeros((8, args.seq), jnp.int32)
    results = {"fp32": [], "autocast": []}
    for _ in range(args.repeats):
        for name in results:
            step = make_step(optimizer, amp=name == "autocast")
            results[name].append(measure(step, model, opt_state, tokens, tokens))

    print(
        f"transformer: {args.layers} layers, dim {args.dim}, seq {args.seq}, "
        f"backend {jax.default_backend()}, median of {args.repeats}"
    )
    print(f"{'variant':<10} {'trace+lower s':>14} {'compile s':>10} {'total s':>8}")
    totals = {}
    for name, runs in results.items():
        trace = statistics.median(r[0] for r in runs)
        compile_ = statistics.median(r[1] for r in runs)
        totals[name] = statistics.median(r[0] + r[1] for r in runs)
        print(f"{name:<10} {trace:>14.3f} {compile_:>10.3f} {totals[name]:>8.3f}")
    print(
        f"autocast/fp32 trace+compile: {totals['autocast'] / totals['fp32']:.2f}x "
        "(target <= 1.5x)"
    )


if __name__ == "__main__":
    main()

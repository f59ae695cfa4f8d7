"""How much does skipping non-finite steps add to the compiled training step?

A training step of a small transformer (float16 compute through
`eqx_amp.filter_amp`, dynamic loss scaling, `optax.adam`) is compiled four ways:

- `no skip`: the update is always applied;
- `select_tree`: `eqx_amp.select_tree(grads_finite, new, old)`, one `lax.cond` over
  the whole (model, optimizer state) tree;
- `per-leaf select`: a `lax.select` per leaf, as `jmp.select_tree` does;
- `apply_if_finite`: `optax.apply_if_finite(optax.adam(...), ...)`.

It prints the number of HLO instructions of each compiled program (lines of
`compiled.as_text()` holding ' = ') and the ratio to `no skip`. The counts are
deterministic for a given JAX/XLA version and backend; no timing is involved.

    python benchmarks/skip_overhead.py
    python benchmarks/skip_overhead.py --depth 8 --width 128
"""

import argparse
from collections.abc import Callable

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

    def __init__(self, width: int, heads: int, *, key):
        k1, k2 = jr.split(key)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(
            width, width, 4 * width, 1, activation=jax.nn.gelu, key=k2
        )

    def __call__(self, x):  # x: (seq, width)
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list[Block]
    head: eqx.nn.Linear

    def __init__(self, depth: int, width: int, *, key):
        keys = jr.split(key, depth + 2)
        self.embed = eqx.nn.Linear(8, width, key=keys[0])
        self.blocks = [Block(width, 4, key=k) for k in keys[1:-1]]
        self.head = eqx.nn.Linear(width, 1, key=keys[-1])

    def __call__(self, x):  # x: (seq, 8)
        x = jax.vmap(self.embed)(x)
        for block in self.blocks:
            x = block(x)
        return jnp.mean(jax.vmap(self.head)(x))


def _loss(model, x, y):
    amp_model = eqx_amp.filter_amp(model, policy="mixed_float16")
    return jnp.mean((jax.vmap(amp_model)(x) - y) ** 2)


_grad_fn = eqx_amp.filter_value_and_grad(_loss)


def _per_leaf_select(pred, a, b):
    a_dynamic, static = eqx.partition(a, eqx.is_array)
    b_dynamic, _ = eqx.partition(b, eqx.is_array)
    chosen = jax.tree_util.tree_map(
        lambda x, y: jax.lax.select(pred, x, y), a_dynamic, b_dynamic
    )
    return eqx.combine(chosen, static)


def _standard_promotion(optim: optax.GradientTransformation):
    """`optim` with its update traced under standard dtype promotion: optax's adam
    mixes Python floats and int32 counters (`b1 ** count`), which fails under
    `jax_numpy_dtype_promotion="strict"`, and the tests run strict."""

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return optim.update(updates, state, params)

    return optax.GradientTransformation(optim.init, update)


def make_steps(
    optim: optax.GradientTransformation,
) -> tuple[dict[str, Callable], optax.GradientTransformation]:
    """The training steps, each `(model, opt_state, loss_scale, x, y) -> same`, and
    the `apply_if_finite` optimizer (whose state the last step needs)."""
    guarded = _standard_promotion(
        optax.apply_if_finite(optim, max_consecutive_errors=10)
    )
    optim = _standard_promotion(optim)

    def no_skip(model, opt_state, loss_scale, x, y):
        (_, grads), loss_scale, _ = _grad_fn(model, x, y, loss_scale=loss_scale)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss_scale

    def skip_with(select):
        def step(model, opt_state, loss_scale, x, y):
            (_, grads), loss_scale, finite = _grad_fn(
                model, x, y, loss_scale=loss_scale
            )
            updates, new_opt_state = optim.update(grads, opt_state, model)
            new_model = eqx.apply_updates(model, updates)
            model, opt_state = select(
                finite, (new_model, new_opt_state), (model, opt_state)
            )
            return model, opt_state, loss_scale

        return step

    def apply_if_finite(model, opt_state, loss_scale, x, y):
        (_, grads), loss_scale, _ = _grad_fn(model, x, y, loss_scale=loss_scale)
        updates, opt_state = guarded.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss_scale

    return {
        "no skip": no_skip,
        "select_tree": skip_with(eqx_amp.select_tree),
        "per-leaf select": skip_with(_per_leaf_select),
        "apply_if_finite": apply_if_finite,
    }, guarded


def count_instructions(step: Callable, *args) -> int:
    """HLO instructions of the compiled `step`: lines of its text with ' = '."""
    params, static = eqx.partition(args[0], eqx.is_array)

    def jittable(params, *rest):
        model, opt_state, loss_scale = step(eqx.combine(params, static), *rest)
        return eqx.filter(model, eqx.is_array), opt_state, loss_scale

    text = jax.jit(jittable).lower(params, *args[1:]).compile().as_text()
    return sum(" = " in line for line in text.splitlines())


ALL_STEPS = ("no skip", "select_tree", "per-leaf select", "apply_if_finite")


def instruction_counts(
    model: eqx.Module, x: jax.Array, y: jax.Array, names: tuple[str, ...] = ALL_STEPS
) -> dict[str, int]:
    """Compiles the training steps of `make_steps` called `names` for `model` on a
    batch `(x, y)`, and returns their numbers of HLO instructions."""
    optim = optax.adam(1e-3)
    steps, guarded = make_steps(optim)
    params = eqx.filter(model, eqx.is_array)
    loss_scale = eqx_amp.DynamicLossScale()
    counts = {}
    for name in names:
        opt_state = (guarded if name == "apply_if_finite" else optim).init(params)
        counts[name] = count_instructions(
            steps[name], model, opt_state, loss_scale, x, y
        )
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=64, help="model width")
    parser.add_argument("--seq", type=int, default=16, help="sequence length")
    args = parser.parse_args()
    model = Transformer(args.depth, args.width, key=jr.key(0))
    x = jnp.ones((4, args.seq, 8))
    y = jnp.ones((4,))
    counts = instruction_counts(model, x, y)
    base = counts["no skip"]
    print(
        f"HLO instructions of one training step, Transformer(depth={args.depth}, "
        f"width={args.width}), backend {jax.default_backend()}, jax {jax.__version__}"
    )
    print(f"| {'skipping':<16} | {'instructions':>12} | {'ratio':>6} |")
    print(f"|{'-' * 18}|{'-' * 14}|{'-' * 8}|")
    for name, count in counts.items():
        print(f"| {name:<16} | {count:>12} | {count / base:>6.2f} |")


if __name__ == "__main__":
    main()

"""A character-level GPT trained with float32 master weights and a float16 compute copy.

The text is *Alice's Adventures in Wonderland* (public domain; shipped as
`examples/data/alice29.txt`, see `examples/data/README.md`). The same small
GPT-style transformer (pre-norm blocks of causal self-attention and an MLP), from the
same initial weights and on the same minibatches, is trained twice:

- `fp32`:    the plain Equinox model, float32 everywhere;
- `bimodel`: `eqx_amp.BiModel(model, policy="p=f32,c=f16,o=f32")`. The optimiser
  updates the float32 master weights; the forward and backward passes read the
  float16 compute copy, so the gradients are computed in float16 (a gradient tree
  about half the size), and the weights are cast once per step, in
  `bimodel.apply_updates`. Layer norms stay in float32. A `DynamicLossScale` keeps
  small float16 gradients from underflowing, and steps whose gradients overflow are
  skipped with `eqx_amp.select_tree` (optionally recomputed first, `--redo-on-nan`).

At the end it prints a table: final training and validation loss of both runs, the
memory of the compiled training step (`compiled.memory_analysis()`), the bytes of
forward values saved for the backward pass, the bytes of the gradient tree the
backward pass produces, the bytes of the weights held, the skipped steps and the time
per step.

    python examples/bimodel_transformer.py
    python examples/bimodel_transformer.py --steps 3000 --dim 128 --layers 4 --block-size 128

On a CPU, XLA runs float16 matmuls by converting them to float32, so the float16 run
gains little speed there and `memory_analysis()` moves little; the saved activations
and the gradient tree show the saving every backend gets. `tqdm` is optional (a
progress bar).
"""

import argparse
import pathlib
import statistics
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from _reporting import (
    compiled_memory,
    fmt_bytes,
    print_memory_analysis,
    progress,
    step_bytes,
)
from jaxtyping import Array, Float, Int, PyTree

import eqx_amp


DEFAULT_TEXT = pathlib.Path(__file__).resolve().parent / "data" / "alice29.txt"


#
# Data.
#


class CharData:
    """A text as int32 character ids, split 90/10 into training and validation."""

    def __init__(self, path: pathlib.Path):
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([index[c] for c in text], dtype=np.int32)
        split = len(ids) * 9 // 10
        self.train, self.val = ids[:split], ids[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batches(
        self, ids: np.ndarray, n: int, batch_size: int, block_size: int, seed: int
    ):
        """`n` batches of random windows: inputs and next-character targets, each
        (batch_size, block_size)."""
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            starts = rng.integers(0, len(ids) - block_size - 1, size=batch_size)
            windows = np.stack([ids[s : s + block_size + 1] for s in starts])
            out.append((windows[:, :-1], windows[:, 1:]))
        return out


#
# Model.
#


class Block(eqx.Module):
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

    def __call__(self, x: Float[Array, "seq dim"], mask) -> Float[Array, "seq dim"]:
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class GPT(eqx.Module):
    token_embedding: eqx.nn.Embedding
    position_embedding: Float[Array, "block dim"]
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, block_size: int, *, key
    ):
        keys = jr.split(key, layers + 3)
        self.token_embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.position_embedding = 0.02 * jr.normal(keys[1], (block_size, dim))
        self.blocks = tuple(Block(dim, heads, key=k) for k in keys[3:])
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, key=keys[2])

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        seq = tokens.shape[0]
        x = jax.vmap(self.token_embedding)(tokens) + self.position_embedding[:seq]
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))  # causal
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss_fn(model: Callable, inputs: Int[Array, "b t"], targets: Int[Array, "b t"]):
    """Mean next-character cross-entropy. `model` is the plain GPT or the `BiModel`
    (called the same way; its logits are float32, by the policy's output dtype)."""
    logits = jax.vmap(model)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


#
# Training steps.
#


def make_fp32_step(optimizer: optax.GradientTransformation) -> Callable:
    def step(model, opt_state, loss_scale, inputs, targets):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, inputs, targets)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (
            eqx.apply_updates(model, updates),
            opt_state,
            loss_scale,
            loss,
            jnp.array(True),
        )

    return step


def make_bimodel_step(
    optimizer: optax.GradientTransformation, redo_on_nan: int
) -> Callable:
    def step(bimodel, opt_state, loss_scale, inputs, targets):
        # 1. Gradients with respect to the float16 compute copy, unscaled into float32.
        (loss, grads), loss_scale, grads_finite = eqx_amp.filter_value_and_grad(
            loss_fn, redo_on_nan=redo_on_nan
        )(bimodel, inputs, targets, loss_scale=loss_scale)
        # 2. A float32 optax update against the float32 master weights.
        params = eqx.filter(bimodel.master, eqx.is_inexact_array)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        # 3. Add to the master, cast once to the new compute copy.
        new_bimodel = bimodel.apply_updates(updates)
        # 4. Skip the step (model and optimiser state) if the gradients overflowed.
        bimodel, opt_state = eqx_amp.select_tree(
            grads_finite, (new_bimodel, new_opt_state), (bimodel, opt_state)
        )
        return bimodel, opt_state, loss_scale, loss, grads_finite

    return step


def compile_step(step: Callable, *args):
    """`step` compiled with `jax.jit` over its array leaves (the rest is static), so
    that the `jax.stages.Compiled` object, with its `memory_analysis()`, is at hand.
    Returns a function of the same arguments."""
    dynamic, static = eqx.partition(args, eqx.is_array)

    def on_arrays(dynamic):
        out = step(*eqx.combine(dynamic, static))
        return eqx.partition(out, eqx.is_array)[0]

    out_static = eqx.partition(eqx.filter_eval_shape(step, *args), eqx.is_array)[1]
    compiled = jax.jit(on_arrays).lower(dynamic).compile()

    def run(*args):
        out = compiled(eqx.partition(args, eqx.is_array)[0])
        return eqx.combine(out, out_static)

    return run, compiled


#
# Measurements.
#


def tree_bytes(tree: PyTree) -> int:
    """Bytes of the arrays (or `jax.ShapeDtypeStruct`s) of `tree`."""
    return sum(
        x.size * x.dtype.itemsize
        for x in jtu.tree_leaves(tree)
        if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    )


def differentiable(model) -> tuple[Callable, PyTree]:
    """The loss as a function of what the gradients are taken with respect to: the
    float32 parameters, or the BiModel's compute copy."""
    if isinstance(model, eqx_amp.BiModel):
        wrt, static = eqx.partition(model.compute, eqx.is_inexact_array)
        return (
            lambda p, *a: loss_fn(model.with_compute(eqx.combine(p, static)), *a)
        ), wrt
    wrt, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, *a: loss_fn(eqx.combine(p, static), *a)), wrt


def saved_activation_bytes(model, inputs, targets) -> int:
    """Bytes of the forward values JAX's autodiff keeps for the backward pass: the
    leaves of the function `jax.vjp` returns, their shapes and dtypes found by
    `jax.eval_shape` without running anything. A count before XLA's fusion, and it
    includes the weights the backward pass reads (float16 for the BiModel)."""
    loss_of, wrt = differentiable(model)

    def residuals(wrt):
        _, vjp_fn = jax.vjp(lambda p: loss_of(p, inputs, targets), wrt)
        return jtu.tree_leaves(vjp_fn)

    return tree_bytes(jax.eval_shape(residuals, wrt))


def gradient_bytes(model, inputs, targets) -> int:
    """Bytes of the gradient tree the backward pass produces (before unscaling)."""
    loss_of, wrt = differentiable(model)
    return tree_bytes(jax.eval_shape(jax.grad(loss_of), wrt, inputs, targets))


#
# Training.
#


def train(
    name: str, model, step: Callable, optimizer, loss_scale, batches, val_batches
) -> dict:
    if isinstance(model, eqx_amp.BiModel):
        params = eqx.filter(model.master, eqx.is_inexact_array)
    else:
        params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    inputs, targets = batches[0]
    run, compiled = compile_step(step, model, opt_state, loss_scale, inputs, targets)
    measured = {
        "memory": compiled_memory(compiled),
        "saved": saved_activation_bytes(model, inputs, targets),
        "grads": gradient_bytes(model, inputs, targets),
        "weights": tree_bytes(model),
    }

    times, losses, skipped = [], [], 0
    bar = progress(range(len(batches)), total=len(batches), desc=name)
    for i in bar:
        inputs, targets = batches[i]
        start = time.perf_counter()
        model, opt_state, loss_scale, loss, finite = run(
            model, opt_state, loss_scale, inputs, targets
        )
        loss = float(loss)  # Waits for the step, so the time below is honest.
        times.append(time.perf_counter() - start)
        skipped += not bool(finite)
        losses.append(loss)
        if hasattr(bar, "set_postfix") and (i + 1) % 10 == 0:
            bar.set_postfix(loss=f"{statistics.fmean(losses[-10:]):.3f}")
        elif (
            not hasattr(bar, "set_postfix") and (i + 1) % max(1, len(batches) // 5) == 0
        ):
            print(f"  {name} step {i + 1}/{len(batches)}: loss {loss:.3f}")

    evaluate = eqx.filter_jit(loss_fn)
    val_loss = statistics.fmean(float(evaluate(model, x, y)) for x, y in val_batches)
    tail = max(1, len(losses) // 10)
    warmup = min(5, len(times) - 1)
    return {
        "name": name,
        "model": model,
        "train_loss": statistics.fmean(losses[-tail:]),
        "val_loss": val_loss,
        "skipped": skipped,
        "loss_scale": float(loss_scale.loss_scale),
        "step_time": statistics.median(times[warmup:]),
        **measured,
    }


#
# Reporting.
#


def ratio(a, b) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def print_summary(results: list[dict]) -> None:
    print_memory_analysis(results)

    header = (
        f"{'variant':<8} | {'train loss':>10} | {'val loss':>8} | {'step memory':>11} | "
        f"{'saved activations':>17} | {'gradient tree':>13} | {'weights':>9} | "
        f"{'skipped':>7} | {'step time':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['name']:<8} | {r['train_loss']:>10.4f} | {r['val_loss']:>8.4f} | "
            f"{fmt_bytes(step_bytes(r['memory'])):>11} | {fmt_bytes(r['saved']):>17} | "
            f"{fmt_bytes(r['grads']):>13} | {fmt_bytes(r['weights']):>9} | "
            f"{r['skipped']:>7} | {r['step_time'] * 1e3:>6.1f} ms"
        )
    print(
        "(train loss: mean over the last tenth of the steps; val loss: mean over the\n"
        " validation batches; step memory: argument + output + temp bytes of the\n"
        " compiled step; saved activations: forward values kept for the backward pass;\n"
        " gradient tree: what the backward pass produces; weights: bytes held (the\n"
        " BiModel holds float32 master weights plus the float16 copy); step time:\n"
        " median, for information only)"
    )
    fp32, bi = results
    print(
        f"\nbimodel/fp32: val loss {bi['val_loss']:.4f} vs {fp32['val_loss']:.4f} "
        f"({bi['val_loss'] - fp32['val_loss']:+.5f}), step memory "
        f"{ratio(step_bytes(bi['memory']), step_bytes(fp32['memory']))}, saved "
        f"activations {ratio(bi['saved'], fp32['saved'])}, gradient tree "
        f"{ratio(bi['grads'], fp32['grads'])}, weights {ratio(bi['weights'], fp32['weights'])}"
    )
    print(
        f"bimodel: {bi['skipped']} skipped step(s), final loss scale {bi['loss_scale']:g}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--text",
        type=pathlib.Path,
        default=DEFAULT_TEXT,
        help="a UTF-8 text file to train on (default: Alice in Wonderland)",
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64, help="context length")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument(
        "--compute-dtype", choices=("float16", "bfloat16"), default="float16"
    )
    parser.add_argument(
        "--loss-scale", type=float, default=2.0**15, help="initial dynamic loss scale"
    )
    parser.add_argument(
        "--redo-on-nan",
        type=int,
        default=0,
        help="recompute overflowing gradients at a lower scale this many times",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    wall_start = time.perf_counter()

    for name in (
        "steps",
        "batch_size",
        "block_size",
        "dim",
        "heads",
        "layers",
        "val_batches",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.dim % args.heads:
        parser.error("--dim must be a multiple of --heads")
    if args.redo_on_nan < 0:
        parser.error("--redo-on-nan must be 0 or more")
    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    data = CharData(args.text)
    if len(data.val) <= args.block_size + 1:
        parser.error("the text is too short for this --block-size")

    policy = eqx_amp.Policy(jnp.float32, args.compute_dtype, jnp.float32)
    model = GPT(
        data.vocab_size,
        args.dim,
        args.heads,
        args.layers,
        args.block_size,
        key=jr.key(args.seed),
    )
    n_params = sum(x.size for x in jtu.tree_leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"{args.text.name}: {len(data.train) + len(data.val):,} characters, vocabulary "
        f"{data.vocab_size}; GPT with {n_params:,} parameters; backend "
        f"{jax.default_backend()}; policy {policy}"
    )
    batches = data.batches(
        data.train, args.steps, args.batch_size, args.block_size, args.seed
    )
    val_batches = data.batches(
        data.val, args.val_batches, args.batch_size, args.block_size, args.seed + 1
    )
    optimizer = optax.adam(args.learning_rate)

    results = []
    # Both runs start from the same weights and see the same minibatches.
    fp32 = train(
        "fp32",
        model,
        make_fp32_step(optimizer),
        optimizer,
        eqx_amp.NoOpLossScale(),
        batches,
        val_batches,
    )
    print(
        f"fp32 final loss: train {fp32['train_loss']:.4f}, val {fp32['val_loss']:.4f}"
    )
    results.append(fp32)

    bimodel = eqx_amp.BiModel(model, policy=policy)
    bi = train(
        "bimodel",
        bimodel,
        make_bimodel_step(optimizer, args.redo_on_nan),
        optimizer,
        eqx_amp.DynamicLossScale(args.loss_scale),
        batches,
        val_batches,
    )
    print(f"bimodel final loss: train {bi['train_loss']:.4f}, val {bi['val_loss']:.4f}")
    results.append(bi)

    print_summary(results)
    print(f"\nwall time: {time.perf_counter() - wall_start:.1f} s")


if __name__ == "__main__":
    main()

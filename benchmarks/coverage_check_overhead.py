"""Trace + compile time of a `filter_amp` training step with the coverage check
(the first traced call of a model class under a policy) against without it.

    python benchmarks/coverage_check_overhead.py [--models transformer,rnn] [--repeats 7]

A jitted `eqx.filter_value_and_grad` + optax adam step. `transformer` is
`autocast_overhead.py`'s (most FLOPs in bfloat16: the check reads the jaxpr's
matmuls and evaluates it); `rnn` is equinox's `train_rnn` example, whose carry is
made in float32 (the check also runs `precision_report`'s census, and warns).
Each repeat builds fresh steps and turns the check on again (so it runs) or off,
in alternating order, so machine drift hits both alike. Prints medians and ratios.
"""

import argparse
import statistics
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from autocast_overhead import Transformer, measure

import eqx_amp


class RNN(eqx.Module):
    """equinox's `train_rnn` example: a GRU over the sequence, a linear head."""

    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, hidden, key):
        k1, k2 = jr.split(key)
        self.cell = eqx.nn.GRUCell(2, hidden, key=k1)
        self.head = eqx.nn.Linear(hidden, 1, key=k2)

    def __call__(self, xs):
        hidden = jnp.zeros(self.cell.hidden_size)  # float32, as in the example
        out, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), hidden, xs)
        return self.head(out)


def make_step(optimizer, model_name):
    def loss_fn(model, xs, ys):
        out = jax.vmap(eqx_amp.filter_amp(model))(xs)
        if model_name == "transformer":
            return optax.softmax_cross_entropy_with_integer_labels(out, ys).mean()
        return jnp.mean((out[:, 0] - ys) ** 2)

    def step(model, opt_state, xs, ys):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, xs, ys)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    return eqx.filter_jit(step)


def inputs(model_name, args):
    if model_name == "transformer":
        model = Transformer(256, args.dim, args.layers, jr.key(0))
        tokens = jnp.zeros((8, args.seq), jnp.int32)
        return model, tokens, tokens
    model = RNN(args.dim, jr.key(0))
    return model, jnp.ones((32, args.seq, 2)), jnp.ones((32,))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,rnn")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"backend {jax.default_backend()}, median of {args.repeats}, interleaved")
    print(f"{'model':<12} {'check':<6} {'trace+lower s':>14} {'compile s':>10} "
          f"{'total s':>8} warned")  # fmt: skip
    for model_name in args.models.split(","):
        model, xs, ys = inputs(model_name, args)
        optimizer = optax.adam(1e-3)
        # optax's bias correction mixes float and int32 scalars.
        with jax.numpy_dtype_promotion("standard"):
            opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        runs = {"off": [], "on": []}
        warned = {"off": 0, "on": 0}
        for repeat in range(args.repeats):
            order = ["off", "on"] if repeat % 2 == 0 else ["on", "off"]
            for name in order:
                eqx_amp.diagnostics.check_coverage(name == "on")
                step = make_step(optimizer, model_name)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with jax.numpy_dtype_promotion("standard"):
                        runs[name].append(measure(step, model, opt_state, xs, ys))
                category = eqx_amp.diagnostics.CoverageWarning
                warned[name] += any(w.category is category for w in caught)
        totals = {}
        for name, times in runs.items():
            trace = statistics.median(t[0] for t in times)
            compile_ = statistics.median(t[1] for t in times)
            totals[name] = statistics.median(t[0] + t[1] for t in times)
            print(
                f"{model_name:<12} {name:<6} {trace:>14.3f} {compile_:>10.3f} "
                f"{totals[name]:>8.3f} {warned[name]}/{args.repeats}"
            )
        print(
            f"{model_name}: with/without check trace+compile "
            f"{totals['on'] / totals['off']:.3f}x (target <= 1.05x)"
        )
    eqx_amp.diagnostics.check_coverage(True)


if __name__ == "__main__":
    main()

"""Per-layer telemetry on a float16 run: the output gradients drift into float16's
subnormals and flush to zero while the loss stalls, and a loss scale fixes it.

    python examples/telemetry_underflow.py [--steps 600] [--every 100]

An MLP regresses small targets (of about 3e-5, so the output gradients are about
1e-7) with `filter_amp` in float16 and Adam. Without loss scaling, float16 holds
nearly all of those gradients as subnormals (a few bits each) or flushes them to
zero, and the loss stalls near 1e-8; with `eqx_amp.DynamicLossScale` they are
normal float16 values and the loss keeps falling.
Every `--every` steps the step runs under `eqx_amp.diagnostics.telemetry` (the other
steps run the step itself, whose program has no telemetry in it), and the table
shows the loss and the worst output-gradient row.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_amp


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(optimizer):
    def step(model, opt_state, loss_scale, x, y):
        (loss, grads), loss_scale, finite = eqx_amp.filter_value_and_grad(loss_fn)(
            model, x, y, loss_scale=loss_scale
        )
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_model = eqx.apply_updates(model, updates)
        model, opt_state = eqx_amp.select_tree(
            finite, (new_model, new_opt_state), (model, opt_state)
        )
        return model, opt_state, loss_scale, loss

    return step


def worst_gradient(stats) -> tuple[str, float, float]:
    """The output-gradient row with the most subnormal or flushed values."""
    rows = [r for r in stats.rows() if r.role == "output gradient"]
    worst = max(rows, key=lambda r: r.subnormal + (r.underflow or 0.0))
    return worst.layer, worst.subnormal, worst.underflow or 0.0


def train(name, loss_scale, args, x, y):
    model = eqx_amp.filter_amp(
        eqx.nn.MLP(32, 1, args.width, 3, key=jr.key(0)),
        policy="params=float32,compute=float16",
    )
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(optimizer)
    plain = eqx.filter_jit(step)
    measured = eqx.filter_jit(eqx_amp.diagnostics.telemetry(step))
    rows = []
    for i in range(args.steps + 1):
        if i % args.every == 0:
            (model, opt_state, loss_scale, loss), stats = measured(
                model, opt_state, loss_scale, x, y
            )
            layer, subnormal, flushed = worst_gradient(stats)
            rows.append((name, i, float(loss), layer, subnormal, flushed))
        else:
            model, opt_state, loss_scale, loss = plain(
                model, opt_state, loss_scale, x, y
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target", type=float, default=3e-5)
    args = parser.parse_args()
    x = jr.normal(jr.key(1), (256, 32))
    y = args.target * jnp.sin(x[:, :1] + x[:, 1:2])  # small targets: small gradients
    rows = train("no loss scale", eqx_amp.NoOpLossScale(), args, x, y)
    rows += train("DynamicLossScale", eqx_amp.DynamicLossScale(), args, x, y)
    print(
        f"{'run':<17}| {'step':>4} | {'loss':>9} | {'worst output gradient':<22}"
        f"| {'subnormal':>9} | {'flushed':>7}"
    )
    for name, i, loss, layer, subnormal, flushed in rows:
        print(
            f"{name:<17}| {i:>4} | {loss:>9.3g} | {layer:<22}"
            f"| {100 * subnormal:>8.1f}% | {100 * flushed:>6.1f}%"
        )


if __name__ == "__main__":
    main()

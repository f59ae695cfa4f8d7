"""Per-layer telemetry on fp8 training: with current scaling no fp8 cast saturates
and almost nothing flushes to zero; without scales, most of the gradients flush to
zero in e4m3 from the first step, and the activation into the head grows past
e4m3's largest value (448) until the run diverges.

    python examples/telemetry_fp8.py [--steps 150] [--every 50]

The digits CNN of `examples/fp8_training.py`, trained with `eqx_amp.autocast` and
Adam in two of that script's ways, from the same weights on the same batches:
`fp8` (`eqx_amp.fp8.TENSORWISE`: each tensor scaled from its own amax before the
cast) and `fp8, no scaling` (the same casts to float8_e4m3fn with no scale). Every
step runs under `eqx_amp.diagnostics.telemetry`, to catch the first step on which an
fp8 cast overflows (a real run would collect every N steps). It prints, every
`--every` steps and at that first overflow, the loss and the worst fp8 rows; then,
at that step (the last step if none overflowed), each fp8 cast of both runs side by
side and both runs' `summary()`.
"""

import argparse

import equinox as eqx
import jax.random as jr
import optax
from _tasks import DigitsCNN, cross_entropy, digit_batches, digits
from fp8_training import VARIANTS

import eqx_amp


RUNS = ("fp8", "fp8, no scaling")


def make_step(rules, optimizer):
    def loss_fn(model, x, y):
        forward = eqx_amp.autocast(
            eqx.filter_vmap(model), policy="mixed_bfloat16", rules=rules
        )
        return cross_entropy(forward(x), y)

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    return eqx.filter_jit(eqx_amp.diagnostics.telemetry(step))


def train(name, args):
    """Every step's loss and telemetry."""
    train_split, _ = digits(args.seed)
    batches = digit_batches(train_split, args.seed)
    model = DigitsCNN(jr.key(args.seed))
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(VARIANTS[name], optimizer)
    history = []
    for i in range(args.steps + 1):
        (model, opt_state, loss), stats = step(model, opt_state, *batches(i))
        history.append((float(loss), stats))
    return history


def fp8_rows(stats):
    return [r for r in stats.rows() if r.dtype.startswith("float8")]


def worst(rows, key, show):
    """The worst row by `key`, as `show(row)` and the row's layer and role."""
    row = max(rows, key=key)
    if not any(key(row)):
        return show(row)
    return f"{show(row)} {row.layer} {row.role}"


def overflowed(row):
    return (row.nonfinite, row.overflow or 0.0)


def flushed(row):
    return (row.underflow or 0.0,)


def show_overflow(row):
    return f"{100 * (row.overflow or 0.0):.3g}% / {100 * row.nonfinite:.3g}%"


def show_underflow(row):
    return f"{100 * (row.underflow or 0.0):.3g}%"


def side_by_side(telemetry):
    """One line per layer and role that some run casts to fp8: per run, the fp8
    dtype, amax, scale and the underflow, subnormal and overflow fractions."""
    casts = {  # the worst row of each layer and role (`rows()` puts it first)
        name: {
            (r.layer, r.role): r
            for r in reversed(fp8_rows(stats))
            if r.underflow is not None
        }
        for name, stats in telemetry.items()
    }
    keys = sorted(set().union(*casts.values()))
    width = max(len(f"{layer} {role}") for layer, role in keys)
    cell = "{:<6}{:>9}{:>9}{:>8}{:>8}{:>8}"
    lines = [
        (" " * width + "".join(f" | {name:<48}" for name in casts)).rstrip(),
        f"{'layer role':<{width}}"
        + f" | {cell.format('dtype', 'amax', 'scale', 'under', 'subn', 'over')}"
        * len(casts),
    ]
    for layer, role in keys:
        line = f"{layer + ' ' + role:<{width}}"
        for by_key in casts.values():
            r = by_key.get((layer, role))
            if r is None:
                line += f" | {'(not fp8)':<48}"
                continue
            dtype = r.dtype.removeprefix("float8_").removesuffix("fn")
            scale = "-" if r.scale is None else f"{r.scale:.3g}"
            line += " | " + cell.format(
                dtype,
                f"{r.amax:.3g}",
                scale,
                *(percent(v) for v in (r.underflow, r.subnormal, r.overflow)),
            )
        lines.append(line.rstrip())
    return "\n".join(lines)


def percent(fraction):
    return f"{100 * fraction:.3g}%"


def first_overflow(history):
    for i, (_, stats) in enumerate(history):
        if any((r.overflow or 0.0) > 0 or r.nonfinite > 0 for r in stats.rows()):
            return i
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = {name: train(name, args) for name in RUNS}
    overflow = first_overflow(runs["fp8, no scaling"])
    at = args.steps if overflow is None else overflow
    head = "worst fp8 overflow / inf or NaN"
    print(f"{'run':<16}| {'step':>4} | {'loss':>7} | {head:<44}| worst fp8 underflow")
    for name, history in runs.items():
        for i, (loss, stats) in enumerate(history):
            if i % args.every == 0 or i == overflow:
                rows = fp8_rows(stats)
                print(
                    f"{name:<16}| {i:>4} | {loss:>7.4g} | "
                    f"{worst(rows, overflowed, show_overflow):<44}| "
                    f"{worst(rows, flushed, show_underflow)}"
                )
    first = "no fp8 cast overflowed" if overflow is None else "the first overflow"
    print(f"\nstep {at} ({first}), each fp8 cast of both runs:")
    print(side_by_side({name: history[at][1] for name, history in runs.items()}))
    for name, history in runs.items():
        print(f"\n{name}, step {at}, `summary(top=6)`:")
        print(history[at][1].summary(top=6))


if __name__ == "__main__":
    main()

"""Finding and fixing a float16 overflow with `find_nonfinite` and `precision_report`.

A heteroscedastic regression model predicts a mean and a log-variance, and turns the
log-variance into a variance with `exp`. Fit to targets measured in the hundreds, it
learns log-variances around 12. In float32 that is fine. Under
`filter_amp(..., policy="mixed_float16")` the whole head runs in float16, and
`exp(12) > 65504`, the largest float16: the variance is inf and the loss NaN.

    python examples/debug_overflow.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import eqx_amp


class GaussianHead(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        with jax.named_scope("GaussianHead"):
            mean, log_var = self.linear(x)
            return mean, jnp.exp(log_var)


class Regressor(eqx.Module):
    body: eqx.nn.MLP
    head: GaussianHead

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.body = eqx.nn.MLP(4, 16, 32, 2, key=k1)
        self.head = GaussianHead(eqx.nn.Linear(16, 2, key=k2))

    def __call__(self, x):
        return self.head(self.body(x))


def nll(model, x, y):
    mean, var = model(x)
    return 0.5 * (jnp.log(var) + (y - mean) ** 2 / var)


def main():
    model = Regressor(jr.key(0))
    # Stand-in for training on targets in the hundreds: a log-variance bias of 12.
    model = eqx.tree_at(lambda m: m.head.linear.bias, model, jnp.array([300.0, 12.0]))
    x, y = jnp.array([0.9, -0.7, 0.8, 0.6]), jnp.float32(320.0)
    amp = eqx_amp.filter_amp(model, policy="mixed_float16")
    summary = [("float32", nll(model, x, y), eqx_amp.find_nonfinite(nll, model, x, y))]
    print("float32 loss:", summary[0][1])
    amp_loss = nll(amp, x, y)
    print("float16 loss:", amp_loss)

    print("\n>>> eqx_amp.find_nonfinite(nll, amp, x, y)")
    found = eqx_amp.find_nonfinite(nll, amp, x, y)
    print(found)
    summary.append(("filter_amp float16", amp_loss, found))

    print("\nTry: keep the head in float32 at its call boundary.")
    spec = eqx_amp.keep(model, GaussianHead)
    kept = eqx_amp.filter_amp(model, policy="mixed_float16", filter_spec=spec)
    kept_loss = nll(kept, x, y)
    print("float16 loss:", kept_loss)
    # Still inf: the head computes exp in float32 now, but hands its output back to
    # float16 code at its boundary, and a variance of 1.6e5 has no float16 value.
    found = eqx_amp.find_nonfinite(nll, kept, x, y)
    print(found)
    summary.append(("filter_amp float16, head kept", kept_loss, found))

    print("\nFix 1: never materialise the variance; the float32 loss uses log_var.")
    stable_loss = stable_nll(model, x, y, amp=True)
    found = eqx_amp.find_nonfinite(stable_nll, model, x, y, amp=True)
    print("float16 loss:", stable_loss, "| find_nonfinite:", found)
    summary.append(("fix 1: loss from log_var", stable_loss, found))

    print("\nFix 2: op-level autocast, whose default rules run exp in float32.")
    autocast_model = eqx_amp.autocast(model, policy="mixed_float16")
    autocast_loss = nll(autocast_model, x, y)
    print("float16 loss:", autocast_loss)
    found = eqx_amp.find_nonfinite(nll, autocast_model, x, y)
    summary.append(("fix 2: autocast float16", autocast_loss, found))
    report = eqx_amp.precision_report(autocast_model, x)
    exp_sites = [s for s in report.full_precision_ops if s.primitive == "exp"]
    print(
        f"matmul FLOPs in float16: {report.low_precision_share:.0%};",
        "exp runs in",
        exp_sites[0].dtypes,
        "under",
        repr(exp_sites[0].scope),
    )
    print_summary(summary)


def print_summary(rows) -> None:
    """The session in one table: variant | loss | the first non-finite op that
    `find_nonfinite` names (primitive, scope, file:line)."""

    def first_op(found):
        if found is None:
            return "none"
        where = found.source.replace("\\", "/").rsplit("/", 1)[
            -1
        ]  # file:line (function)
        return (
            f"`{found.primitive}` in scope '{found.scope or '<no scope>'}' at {where}"
        )

    cells = [
        (name, f"{float(loss):.4f}", first_op(found)) for name, loss, found in rows
    ]
    header = ("variant", "loss", "first non-finite op")
    widths = [max(len(row[i]) for row in (header, *cells)) for i in range(2)]
    print()
    print(f"{header[0]:<{widths[0]}} | {header[1]:>{widths[1]}} | {header[2]}")
    print(f"{'-' * widths[0]}-+-{'-' * widths[1]}-+-{'-' * len(header[2])}")
    for name, loss, op in cells:
        print(f"{name:<{widths[0]}} | {loss:>{widths[1]}} | {op}")


def stable_nll(model, x, y, amp):
    def mean_and_log_var(x):
        return model.head.linear(model.body(x))

    forward = (
        eqx_amp.filter_amp(mean_and_log_var, policy="mixed_float16")
        if amp
        else (mean_and_log_var)
    )
    mean, log_var = forward(x)  # float32: filter_amp's output dtype
    return 0.5 * (log_var + (y - mean) ** 2 * jnp.exp(-log_var))


if __name__ == "__main__":
    main()

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
    print("float32 loss:", nll(model, x, y))
    print("float16 loss:", nll(amp, x, y))

    print("\n>>> eqx_amp.find_nonfinite(nll, amp, x, y)")
    print(eqx_amp.find_nonfinite(nll, amp, x, y))

    print("\nTry: keep the head in float32 at its call boundary.")
    spec = eqx_amp.keep(model, GaussianHead)
    kept = eqx_amp.filter_amp(model, policy="mixed_float16", filter_spec=spec)
    print("float16 loss:", nll(kept, x, y))
    # Still inf: the head computes exp in float32 now, but hands its output back to
    # float16 code at its boundary, and a variance of 1.6e5 has no float16 value.
    print(eqx_amp.find_nonfinite(nll, kept, x, y))

    print("\nFix 1: never materialise the variance; the float32 loss uses log_var.")
    print("float16 loss:", stable_nll(model, x, y, amp=True), "| find_nonfinite:",
          eqx_amp.find_nonfinite(stable_nll, model, x, y, amp=True))

    print("\nFix 2: op-level autocast, whose default rules run exp in float32.")
    autocast_model = eqx_amp.autocast(model, policy="mixed_float16")
    print("float16 loss:", nll(autocast_model, x, y))
    report = eqx_amp.precision_report(autocast_model, x)
    exp_sites = [s for s in report.full_precision_ops if s.primitive == "exp"]
    print(f"matmul FLOPs in float16: {report.low_precision_share:.0%};",
          "exp runs in", exp_sites[0].dtypes, "under", repr(exp_sites[0].scope))


def stable_nll(model, x, y, amp):
    def mean_and_log_var(x):
        return model.head.linear(model.body(x))

    forward = eqx_amp.filter_amp(mean_and_log_var, policy="mixed_float16") if amp else (
        mean_and_log_var
    )
    mean, log_var = forward(x)  # float32: filter_amp's output dtype
    return 0.5 * (log_var + (y - mean) ** 2 * jnp.exp(-log_var))


if __name__ == "__main__":
    main()

"""Flax NNX: train a small CNN in float32 and with `eqx_amp.autocast` in bfloat16.

`autocast` works on any JAX function, so it works on a Flax NNX model written as
one: `nnx.split` the model into its graph definition, its parameters and the rest of
its state, and write the forward pass as a pure function of those states that
`nnx.merge`s the model inside. That function is what `autocast` wraps.

The data is scikit-learn's bundled digits set (1797 8x8 grey images, 10 classes; no
download). A CNN with BatchNorm, LayerNorm and Dropout, from the same initial
weights, with the same minibatches and the same dropout keys, is trained twice:

- `fp32`: the pure forward function as it is;
- `amp`:  the same function under `eqx_amp.autocast(forward, policy=...)`.
  Convolutions and matmuls run in bfloat16, and so do the bias adds after them
  (`autocast` treats `nnx.Param` variables as parameters, which follow the
  activations they meet; batch statistics are data); the normalisation statistics run in
  float32. The logits, the loss and the gradients (w.r.t. the float32 parameters)
  are float32, so the optax code does not change, and BatchNorm's running
  statistics stay float32.

At the end it prints test accuracy, final training loss, the bytes of forward
values saved for the backward pass and the time per step of both, then what ran in
which dtype (`eqx_amp.precision_report` of the amp forward pass).

    python examples/flax_nnx.py
    python examples/flax_nnx.py --epochs 30 --full-report

Needs `flax` (`pip install "eqx_amp[flax]"`) and `scikit-learn`; `tqdm` is optional
(a progress bar).
"""

import argparse
import collections
import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from _reporting import fmt_bytes, progress
from flax import nnx
from quickstart import make_batch_orders  # the same minibatches as the quickstart
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import eqx_amp


#
# Data and model.
#


def load_data(seed: int):
    """Digits as (N, 8, 8, 1) float32 images in [0, 1] (Flax convolutions are
    channels-last) and int32 labels, with a fixed, stratified 75/25 split."""
    digits = load_digits()
    # Pixel values are integers 0..16.
    images = (digits.images / 16.0).astype(np.float32)[:, :, :, None]
    labels = digits.target.astype(np.int32)
    return train_test_split(
        images, labels, test_size=0.25, random_state=seed, stratify=labels
    )


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(32, rngs=rngs)
        self.linear1 = nnx.Linear(32 * 4 * 4, 64, rngs=rngs)
        self.norm3 = nnx.LayerNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # (b, 8, 8, 1) -> (b, 10)
        x = nnx.relu(self.norm1(self.conv1(x)))
        x = nnx.relu(self.norm2(self.conv2(x)))
        x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))  # (b, 4, 4, 32)
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.gelu(self.norm3(self.linear1(x))))
        return self.linear2(x)


#
# The model as pure functions of its states: what `autocast` wraps.
#


def make_functions(graphdef: nnx.GraphDef) -> tuple[Callable, Callable]:
    def forward(params, rest, images):
        """A training forward pass: the logits, and `rest` (BatchNorm's running
        statistics, Dropout's RNG counter) as the pass updated it."""
        # `copy=True`: `rest` is not differentiated, so its Variables belong to the
        # trace outside `jax.grad`, and NNX refuses BatchNorm's writes to them from
        # inside it. Fresh Variables belong to the trace that merges them.
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(images)
        _, _, rest = nnx.split(model, nnx.Param, ...)
        return logits, rest

    def predict(params, rest, images):
        model = nnx.merge(graphdef, params, rest, copy=True)
        model.eval()  # BatchNorm reads its running statistics; no dropout
        return model(images)

    return forward, predict


#
# Loss and training step.
#


def make_loss(forward: Callable) -> Callable:
    def loss_fn(params, rest, images, labels):
        logits, rest = forward(params, rest, images)
        # The amp logits are float32 (the policy's output dtype): so is the loss.
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, rest

    return loss_fn


def make_step(forward: Callable, optimizer: optax.GradientTransformation):
    loss_fn = make_loss(forward)

    @jax.jit
    def step(params, rest, opt_state, images, labels):
        # Gradients w.r.t. the float32 parameters arrive in float32.
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, rest, images, labels
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    return step


def saved_activation_bytes(forward: Callable, params, rest, images, labels) -> int:
    """Bytes of the forward values JAX's autodiff keeps for the backward pass: the
    leaves of the function `jax.vjp` returns, at the dtypes the forward pass made
    them (on CPU, compiled memory barely changes with bfloat16, which XLA computes
    in float32 there)."""
    loss_fn = make_loss(forward)

    def residuals(params):
        _, vjp_fn = jax.vjp(lambda p: loss_fn(p, rest, images, labels)[0], params)
        return jtu.tree_leaves(vjp_fn)

    shapes = jax.eval_shape(residuals, params)
    return sum(s.size * s.dtype.itemsize for s in shapes)


#
# Training.
#


def train(
    name: str,
    forward: Callable,
    predict: Callable,
    state: tuple,
    data: tuple,
    batch_orders: list[list[np.ndarray]],
    learning_rate: float,
) -> dict:
    x_train, x_test, y_train, y_test = data
    params, rest = state
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    step = make_step(forward, optimizer)
    x0, y0 = x_train[batch_orders[0][0]], y_train[batch_orders[0][0]]
    saved = saved_activation_bytes(forward, params, rest, x0, y0)

    batches = [b for order in batch_orders for b in order]
    steps_per_epoch = len(batch_orders[0])
    times, losses = [], []
    bar = progress(range(len(batches)), total=len(batches), desc=name)
    for i in bar:
        images, labels = x_train[batches[i]], y_train[batches[i]]
        start = time.perf_counter()
        params, rest, opt_state, loss = step(params, rest, opt_state, images, labels)
        loss = float(loss)  # Waits for the step, so the time below is honest.
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if (i + 1) % steps_per_epoch == 0 and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{statistics.mean(losses[-steps_per_epoch:]):.4f}")

    logits = jax.jit(predict)(params, rest, x_test)
    # The first steps include compilation.
    warmup = min(5, len(times) - 1)
    return {
        "name": name,
        "accuracy": float(jnp.mean(jnp.argmax(logits, axis=-1) == y_test)),
        "loss": statistics.mean(losses[-steps_per_epoch:]),
        "saved": saved,
        "step_time": statistics.median(times[warmup:]),
        "params": params,
        "rest": rest,
    }


#
# Reporting.
#


def print_summary(results: list[dict]) -> None:
    header = (
        f"{'variant':<8} | {'test accuracy':>13} | {'final train loss':>16} | "
        f"{'saved activations':>17} | {'step time':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['name']:<8} | {r['accuracy']:>13.2%} | {r['loss']:>16.4f} | "
            f"{fmt_bytes(r['saved']):>17} | {r['step_time'] * 1e3:>6.2f} ms"
        )
    print(
        "(final train loss: mean over the last epoch; saved activations: forward\n"
        " values kept for the backward pass; step time: median per step, for\n"
        " information only)"
    )
    fp32, amp = results
    stats_dtypes = sorted({str(x.dtype) for x in jtu.tree_leaves(amp["rest"])})
    print(
        f"\namp - fp32 test accuracy: "
        f"{100 * (amp['accuracy'] - fp32['accuracy']):+.2f} points; amp parameter "
        f"dtypes: {sorted({str(x.dtype) for x in jtu.tree_leaves(amp['params'])})}; "
        f"amp state dtypes: {stats_dtypes}"
    )


def _where(source: str) -> str:
    """`_normalize (flax/nnx/nn/normalization.py)` from a report's source line."""
    path, _, function = source.partition(" (")
    path = path.rpartition(":")[0]
    path = path.rpartition("site-packages/")[2] if "site-packages/" in path else path
    function = function.rstrip(")").partition(".<locals>")[0]
    return f"{function} ({os.path.basename(path) if os.path.isabs(path) else path})"


def print_precision_report(
    report: eqx_amp.diagnostics.PrecisionReport, full: bool
) -> None:
    print("\nwhat the amp forward pass runs in which dtype (eqx_amp.precision_report):")
    if full:
        print(report)
        return
    print(dataclasses.replace(report, full_precision_ops=()))
    # The full list names every site; grouped by the function it is in, it says
    # which layers compute in float32 and with which ops.
    by_function: dict[str, collections.Counter] = collections.defaultdict(
        collections.Counter
    )
    for site in report.full_precision_ops:
        by_function[_where(site.source)][site.primitive] += site.count
    print("\nfloat32 arithmetic, by the function it is in (--full-report: each site):")
    for where, ops in by_function.items():
        print(f"  {where}: " + ", ".join(f"{op} x{n}" for op, n in ops.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policy",
        default="params=float32,compute=bfloat16,output=float32",
        help="an eqx_amp policy string, e.g. mixed_bfloat16 or p=f32,c=bf16,o=f32",
    )
    parser.add_argument(
        "--full-report", action="store_true", help="print every full-precision site"
    )
    args = parser.parse_args(argv)
    wall_start = time.perf_counter()

    try:
        policy = str(eqx_amp.get_policy(args.policy))
    except ValueError as e:
        parser.error(str(e))
    data = load_data(args.seed)
    x_train, x_test = data[0], data[1]
    if not 1 <= args.batch_size <= len(x_train) or args.epochs < 1:
        parser.error(
            f"need --epochs >= 1 and 1 <= --batch-size <= {len(x_train)} (the number "
            "of training images)"
        )
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images, backend "
        f"{jax.default_backend()}, amp policy {policy}"
    )

    model = CNN(nnx.Rngs(params=args.seed, dropout=args.seed + 1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    forward, predict = make_functions(graphdef)
    amp_forward = eqx_amp.autocast(forward, policy=policy)
    amp_predict = eqx_amp.autocast(predict, policy=policy)
    batch_orders = make_batch_orders(
        len(x_train), args.batch_size, args.epochs, args.seed
    )

    results = []
    for name, fwd, pred in (
        ("fp32", forward, predict),
        ("amp", amp_forward, amp_predict),
    ):
        # Both runs start from the same states and see the same minibatches.
        result = train(
            name, fwd, pred, (params, rest), data, batch_orders, args.learning_rate
        )
        print(f"{name} test accuracy: {result['accuracy']:.2%}")
        results.append(result)

    print_summary(results)
    images = x_train[batch_orders[0][0]]
    report = eqx_amp.precision_report(amp_forward, params, rest, images)
    print_precision_report(report, args.full_report)
    print(f"\nwall time: {time.perf_counter() - wall_start:.1f} s")


if __name__ == "__main__":
    main()

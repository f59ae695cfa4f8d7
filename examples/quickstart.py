"""Quickstart: train a small CNN in float32 and in mixed precision with `filter_amp`.

The data is scikit-learn's bundled digits set (1797 8x8 grey images, 10 classes; no
download). The same CNN, from the same initial weights and with the same minibatch
order, is trained twice:

- `fp32`: the plain Equinox model;
- `amp`:  the same model wrapped by `eqx_amp.filter_amp(model, policy=...)` inside the
  loss. Convolutions and the linear layer run in bfloat16; the GroupNorm layers stay
  in float32; the logits, the loss and the gradients are float32, so the optax code
  does not change.

At the end it prints a table comparing test accuracy, final training loss, the
memory of the compiled training step (`compiled.memory_analysis()`), the bytes of
forward values saved for the backward pass, and the time per step.

    python examples/quickstart.py
    python examples/quickstart.py --epochs 20 --policy "p=f32,c=bf16,o=f32"

Needs `scikit-learn`; `tqdm` is optional (a progress bar).
"""

import argparse
import statistics
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
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
from jaxtyping import Array, Float, Int
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import eqx_amp


#
# Data and model.
#


def load_data(seed: int):
    """Digits as (N, 1, 8, 8) float32 images in [0, 1] and int32 labels, with a fixed,
    stratified 75/25 train/test split."""
    digits = load_digits()
    # Pixel values are integers 0..16.
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int32)
    return train_test_split(
        images, labels, test_size=0.25, random_state=seed, stratify=labels
    )


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    pool: eqx.nn.AvgPool2d
    linear: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        key1, key2, key3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 16, kernel_size=3, padding=1, key=key1)
        self.norm1 = eqx.nn.GroupNorm(groups=4, channels=16)
        self.conv2 = eqx.nn.Conv2d(16, 32, kernel_size=3, padding=1, key=key2)
        self.norm2 = eqx.nn.GroupNorm(groups=8, channels=32)
        self.pool = eqx.nn.AvgPool2d(kernel_size=2, stride=2)
        self.linear = eqx.nn.Linear(32 * 4 * 4, 10, key=key3)

    def __call__(self, x: Float[Array, "1 8 8"]) -> Float[Array, "10"]:
        x = jax.nn.relu(self.norm1(self.conv1(x)))
        x = jax.nn.relu(self.norm2(self.conv2(x)))
        x = self.pool(x)  # (32, 4, 4)
        return self.linear(x.reshape(-1))


#
# Loss and training step. `policy=None` is the plain float32 model.
#


def forward(model: CNN, images: Float[Array, "b 1 8 8"], policy: str | None):
    if policy is not None:
        # Wrapping inside the loss means the cast copies of the weights are part of
        # the differentiated function: gradients come back in float32, for the
        # float32 master weights that the optimiser updates.
        model = eqx_amp.filter_amp(model, policy=policy)
    return jax.vmap(model)(images)


def loss_fn(
    model: CNN, images: Float[Array, "b 1 8 8"], labels: Int[Array, " b"], policy
) -> Float[Array, ""]:
    logits = forward(model, images, policy)
    # The AMP output dtype is float32, so the softmax and the mean are float32.
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_step(optimizer: optax.GradientTransformation, policy: str | None) -> Callable:
    def step(model, opt_state, images, labels):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, images, labels, policy)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


@eqx.filter_jit
def accuracy(model: CNN, images, labels, policy: str | None) -> Float[Array, ""]:
    # The AMP variant is evaluated in mixed precision too: that is how it would run.
    predictions = jnp.argmax(forward(model, images, policy), axis=-1)
    return jnp.mean(predictions == labels)


#
# Memory measurements.
#


def saved_activation_bytes(model: CNN, images, labels, policy: str | None) -> int:
    """Bytes of the forward values JAX's autodiff keeps for the backward pass.

    On CPU, XLA runs bfloat16 convolutions and matmuls by converting them to float32
    internally, so the compiled step's `memory_analysis()` barely changes with AMP.
    The residuals of `jax.vjp` do not depend on the backend: they are the arrays the
    backward pass reads, at the dtypes the forward pass produced them. The function
    `jax.vjp` returns is a pytree (a `Partial`) whose leaves are exactly these
    residuals. `jax.eval_shape` gives their shapes and dtypes without running
    anything. This is a count before XLA's own optimisations (fusion can avoid
    materialising some of them), and it includes the bfloat16 copies of the weights
    the AMP forward pass reads.
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_of_params(params):
        return loss_fn(eqx.combine(params, static), images, labels, policy)

    def residuals(params):
        _, vjp_fn = jax.vjp(loss_of_params, params)
        return jtu.tree_leaves(vjp_fn)

    shapes = jax.eval_shape(residuals, params)
    return sum(s.size * s.dtype.itemsize for s in shapes)


#
# Training.
#


def train(
    name: str,
    model: CNN,
    data: tuple,
    batch_orders: list[list[np.ndarray]],
    learning_rate: float,
    policy: str | None,
) -> dict:
    x_train, x_test, y_train, y_test = data
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(optimizer, policy)

    # Compile once, ahead of time: the compiled step reports its memory and is also
    # what the loop calls (it takes the same arguments as `step`).
    x0, y0 = x_train[batch_orders[0][0]], y_train[batch_orders[0][0]]
    compiled_step = eqx.filter_jit(step).lower(model, opt_state, x0, y0).compile()
    memory = compiled_memory(compiled_step)
    saved = saved_activation_bytes(model, x0, y0, policy)

    batches = [b for order in batch_orders for b in order]
    steps_per_epoch = len(batch_orders[0])
    times, epoch_losses = [], []
    bar = progress(range(len(batches)), total=len(batches), desc=name)
    for i in bar:
        images, labels = x_train[batches[i]], y_train[batches[i]]
        start = time.perf_counter()
        model, opt_state, loss = compiled_step(model, opt_state, images, labels)
        loss = float(loss)  # Waits for the step, so the time below is honest.
        times.append(time.perf_counter() - start)
        epoch_losses.append(loss)
        if (i + 1) % steps_per_epoch == 0 and hasattr(bar, "set_postfix"):
            last_epoch = epoch_losses[-steps_per_epoch:]
            bar.set_postfix(loss=f"{sum(last_epoch) / len(last_epoch):.4f}")

    # The step is compiled already; the first few calls still warm up caches.
    warmup = min(5, len(times) - 1)
    last_epoch = epoch_losses[-steps_per_epoch:]
    return {
        "name": name,
        "accuracy": float(accuracy(model, x_test, y_test, policy)),
        "loss": sum(last_epoch) / len(last_epoch),
        "memory": memory,
        "saved": saved,
        "step_time": statistics.median(times[warmup:]),
    }


def make_batch_orders(
    n: int, batch_size: int, epochs: int, seed: int
) -> list[list[np.ndarray]]:
    """One shuffled list of minibatch indices per epoch (the last partial batch is
    dropped, so every step has the same shape and compiles once)."""
    rng = np.random.default_rng(seed)
    orders = []
    for _ in range(epochs):
        perm = rng.permutation(n)
        orders.append(
            [perm[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
        )
    return orders


#
# Reporting.
#


def print_summary(results: list[dict]) -> None:
    print_memory_analysis(results)

    header = (
        f"{'variant':<8} | {'test accuracy':>13} | {'final train loss':>16} | "
        f"{'compiled step memory':>20} | {'saved activations':>17} | {'step time':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['name']:<8} | {r['accuracy']:>13.2%} | {r['loss']:>16.4f} | "
            f"{fmt_bytes(step_bytes(r['memory'])):>20} | "
            f"{fmt_bytes(r['saved']):>17} | {r['step_time'] * 1e3:>6.2f} ms"
        )
    print(
        "(final train loss: mean over the last epoch; compiled step memory: argument\n"
        " + output + temp bytes; saved activations: forward values kept for the\n"
        " backward pass; step time: median per step, for information only)"
    )

    def ratio(a, b):
        return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"

    fp32, amp = results
    print(
        f"\namp/fp32: compiled step memory "
        f"{ratio(step_bytes(amp['memory']), step_bytes(fp32['memory']))}, "
        f"saved activations {ratio(amp['saved'], fp32['saved'])}, "
        f"step time {ratio(amp['step_time'], fp32['step_time'])}, "
        f"accuracy difference {100 * (amp['accuracy'] - fp32['accuracy']):+.2f} points"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policy",
        default="mixed_bfloat16",
        help="an eqx_amp policy string, e.g. mixed_bfloat16 or p=f32,c=bf16,o=f32",
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
        f"digits: {len(x_train)} train / {len(x_test)} test images, "
        f"backend {jax.default_backend()}, amp policy {policy}"
    )
    model = CNN(jax.random.key(args.seed))
    batch_orders = make_batch_orders(
        len(x_train), args.batch_size, args.epochs, args.seed
    )

    results = []
    for name, run_policy in (("fp32", None), ("amp", policy)):
        # Both runs start from the same weights and see the same minibatches.
        result = train(
            name,
            model,
            data,
            batch_orders,
            args.learning_rate,
            run_policy,
        )
        print(f"{name} test accuracy: {result['accuracy']:.2%}")
        results.append(result)

    print_summary(results)
    print(f"\nwall time: {time.perf_counter() - wall_start:.1f} s")


if __name__ == "__main__":
    main()

"""Data-parallel training in float16 with dynamic loss scaling, over a device mesh.

An MLP classifies scikit-learn's bundled digits (1797 8x8 images, 10 classes; no
download). Every step, each device of a one-axis `jax.sharding.Mesh` gets a slice of
the batch; the parameters are replicated. Inside `jax.shard_map`:

- the model runs in float16 compute through `eqx_amp.filter_amp(model,
  policy="mixed_float16")` (float32 parameters, logits and loss);
- `eqx_amp.filter_value_and_grad(..., axis_name="data")` scales the loss, unscales
  the gradients in float32, averages them over the devices and agrees on whether
  they are finite, so every device takes (or skips) the same step and adjusts the
  `DynamicLossScale` identically;
- `eqx_amp.select_tree` skips the update (model and optimizer state) on a non-finite
  step.

The loss function returns the *global* mean loss (`lax.pmean` of the local one):
under `shard_map`, JAX already sums the gradients of replicated parameters over the
devices, so that is what makes them the gradient of the mean.

On a machine with one accelerator (or none), it runs on 8 simulated CPU devices; with
several accelerators, on those. `--inject-nan STEP` puts a NaN into one device's
slice of the batch at that step, to show every device skip it.

    python examples/data_parallel.py
    python examples/data_parallel.py --steps 3000 --batch-size 512 --inject-nan 100

`tqdm` is optional (a progress bar); without scikit-learn, synthetic data is used.
"""

import os


# Must be set before JAX is imported; it only affects the CPU backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _reporting import progress  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int  # noqa: E402

import eqx_amp  # noqa: E402


AXIS = "data"


#
# Data.
#


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flattened digits in [0, 1] and int32 labels, split 75/25 into train and test
    (or a synthetic 10-class problem of the same shape without scikit-learn)."""
    rng = np.random.default_rng(seed)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("scikit-learn not found: using synthetic data.")
        centres = rng.normal(size=(10, 64))
        labels = rng.integers(0, 10, size=1797).astype(np.int32)
        images = centres[labels] + rng.normal(scale=2.0, size=(1797, 64))
        images = ((images - images.min()) / np.ptp(images)).astype(np.float32)
    else:
        digits = load_digits()
        images = (digits.data / 16.0).astype(np.float32)
        labels = digits.target.astype(np.int32)
    order = rng.permutation(len(labels))
    split = len(order) * 3 // 4
    train, test = order[:split], order[split:]
    return images[train], labels[train], images[test], labels[test]


def batches(x, y, batch_size: int, steps: int, seed: int):
    """`steps` random minibatches (without replacement within an epoch)."""
    rng = np.random.default_rng(seed)
    per_epoch = len(y) // batch_size
    step = 0
    while True:
        order = rng.permutation(len(y))
        for i in range(per_epoch):
            if step == steps:
                return
            idx = order[i * batch_size : (i + 1) * batch_size]
            yield x[idx], y[idx]
            step += 1


#
# Model, loss and the sharded training step.
#


def loss_fn(model, images: Float[Array, "b 64"], labels: Int[Array, " b"]):
    amp_model = eqx_amp.filter_amp(model, policy="mixed_float16")
    logits = jax.vmap(amp_model)(images)  # float32: the policy's output dtype
    local = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    # The mean over every device's slice (equal slices): JAX sums the gradients of
    # replicated parameters over the axis, so this makes them the mean gradient.
    return jax.lax.pmean(local, AXIS)


grad_fn = eqx_amp.filter_value_and_grad(loss_fn, axis_name=AXIS)


def make_train_step(mesh: Mesh, static, optimizer: optax.GradientTransformation):
    def step(params, opt_state, loss_scale, images, labels):
        model = eqx.combine(params, static)
        (loss, grads), loss_scale, grads_finite = grad_fn(
            model, images, labels, loss_scale=loss_scale
        )
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = eqx.apply_updates(params, updates)
        params, opt_state = eqx_amp.select_tree(
            grads_finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, loss_scale, loss, grads_finite

    sharded = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), P(), P(), P(AXIS), P(AXIS)),
        out_specs=P(),
    )
    return jax.jit(sharded, donate_argnums=(0, 1))


@eqx.filter_jit
def accuracy(model, images, labels) -> Float[Array, ""]:
    amp_model = eqx_amp.filter_amp(model, policy="mixed_float16")
    return jnp.mean(jnp.argmax(jax.vmap(amp_model)(images), axis=-1) == labels)


#
# Training.
#


def choose_devices() -> list:
    devices = jax.devices()
    if len(devices) >= 2:
        return devices
    return jax.devices("cpu")  # 8 simulated devices (see XLA_FLAGS above)


def main():
    parser = argparse.ArgumentParser(
        description="Data-parallel float16 training with dynamic loss scaling."
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch")
    parser.add_argument("--width", type=int, default=128, help="MLP hidden width")
    parser.add_argument("--depth", type=int, default=2, help="MLP hidden layers")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--loss-scale", type=float, default=2.0**15, help="initial")
    parser.add_argument("--period", type=int, default=100, help="growth period")
    parser.add_argument(
        "--inject-nan",
        type=int,
        default=-1,
        metavar="STEP",
        help="put a NaN into device 0's slice at this step",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    devices = choose_devices()
    mesh = Mesh(np.array(devices), (AXIS,))
    if args.batch_size % len(devices):
        parser.error(f"--batch-size must be a multiple of {len(devices)} devices")
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P(AXIS))

    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = eqx.nn.MLP(64, 10, args.width, args.depth, key=jax.random.key(args.seed))
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(args.learning_rate)
    )
    opt_state = optimizer.init(params)
    loss_scale = eqx_amp.DynamicLossScale(args.loss_scale, period=args.period)
    params, opt_state, loss_scale = jax.device_put(
        (params, opt_state, loss_scale), replicated
    )
    train_step = make_train_step(mesh, static, optimizer)

    losses, skipped, scales = [], [], []
    start = compiled_at = time.perf_counter()
    data = batches(x_train, y_train, args.batch_size, args.steps, args.seed)
    for i, (images, labels) in enumerate(progress(data, args.steps, "data parallel")):
        if i == args.inject_nan:
            images = images.copy()
            images[0, 0] = np.nan  # row 0 lives on device 0
        images, labels = jax.device_put((images, labels), sharded)
        params, opt_state, loss_scale, loss, finite = train_step(
            params, opt_state, loss_scale, images, labels
        )
        if i == 0:
            jax.block_until_ready(params)
            compiled_at = time.perf_counter()
        losses.append(loss)
        skipped.append(~finite)
        scales.append(loss_scale.loss_scale)
    jax.block_until_ready(params)
    end = time.perf_counter()

    losses = np.asarray(losses)
    skipped = np.asarray(skipped)
    scales = np.asarray(scales)
    model = eqx.combine(params, static)
    test_accuracy = float(accuracy(model, x_test, y_test))
    train_accuracy = float(accuracy(model, x_train, y_train))
    finite_losses = losses[np.isfinite(losses)]
    tail = finite_losses[-max(1, len(finite_losses) // 10) :]

    rows = [
        ("devices", f"{len(devices)} x {devices[0].platform}"),
        ("steps", f"{args.steps} (global batch {args.batch_size})"),
        (
            "skipped steps",
            f"{int(skipped.sum())} at {np.flatnonzero(skipped).tolist()[:8]}",
        ),
        (
            "loss scale",
            f"{args.loss_scale:g} -> {float(scales[-1]):g} (min {float(scales.min()):g})",
        ),
        ("train loss", f"{float(finite_losses[0]):.4f} -> {float(tail.mean()):.4f}"),
        ("train accuracy", f"{train_accuracy:.2%}"),
        ("test accuracy", f"{test_accuracy:.2%}"),
        ("params finite", str(bool(eqx_amp.all_finite(params)))),
        ("first step (compile)", f"{compiled_at - start:.2f} s"),
        (
            "time per step",
            f"{(end - compiled_at) / max(1, args.steps - 1) * 1e3:.2f} ms",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    print(f"| {'':<{width}} | result")
    print(f"|{'-' * (width + 2)}|{'-' * 40}")
    for name, value in rows:
        print(f"| {name:<{width}} | {value}")


if __name__ == "__main__":
    main()

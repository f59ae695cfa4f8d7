"""fp8 matmuls in training: does a model trained with them land where bfloat16 does?

Two models, each trained from the same weights on the same batches, for a few seeds,
with `eqx_amp.autocast` in seven ways:

- `bf16`: the default rules (matmuls and convolutions in bfloat16);
- `fp8`: `rules={dot_general: eqx_amp.fp8.TENSORWISE, conv_general_dilated: eqx_amp.fp8.TENSORWISE}`, current
  scaling (each tensor scaled from its own absolute maximum before it is cast);
- `mxfp8`: `eqx_amp.fp8.MXFP8`, a power-of-two scale per block of 32 values along
  each product's contracting dimension (Blackwell's recipe);
- `nvfp4`: `eqx_amp.fp8.NVFP4`, forward products in NVFP4 (4-bit e2m1 values, an
  e4m3 scale per 16 values and a float32 one per tensor), backward ones in MXFP8;
- `nvfp4, 4-bit backward`: `eqx_amp.fp8.NVFP4.with_nvfp4_backward()`, every product
  in NVFP4 by NVIDIA's recipe (weights in 16 x 16 tiles, gradients rounded
  stochastically, a random Hadamard rotation of the weight gradients' inputs);
- `fp8, delayed scaling`: the `fp8` rules with `eqx_amp.fp8.DelayedScaling`, each
  matmul's tensors scaled from the largest amax of their last 16 steps (kept as
  state; convolutions keep current scaling);
- `fp8, no scaling` (the ablation): the same casts to `float8_e4m3fn` with no scale,
  written as a user rule; the backward pass then casts gradients to e4m3 unscaled too.

The models: a small CNN on scikit-learn's digits (8x8 images; its first convolution
has one input channel and its head 10 outputs, so those stay in bfloat16, as
`precision_report` says), and a character-level transformer on *Alice's Adventures in
Wonderland* (`examples/data/alice29.txt`). It prints, per model and variant, the
final loss (mean over seeds, and its spread) and the test accuracy for the digits.

    python examples/fp8_training.py
    python examples/fp8_training.py --seeds 3 --steps 400

On a CPU the fp8 values are multiplied in float32, so this measures the numbers, not
the speed. `tqdm` is optional.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from _tasks import (
    CharTransformer,
    DigitsCNN,
    character_batches,
    characters,
    cross_entropy,
    digit_batches,
    digits,
)

import eqx_amp


E4M3 = jnp.float8_e4m3fn


def _unscaled_fp8(compute_dtype, original_dtypes, *invals, **params):
    """The ablation, as an autocast rule: operands cast to e4m3 with no scale."""
    return [v.astype(E4M3).astype(compute_dtype) for v in invals], params


VARIANTS = {
    "bf16": None,
    "fp8": {
        jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE,
        jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE,
    },
    # Blackwell's block-scaled recipe: a power-of-two scale per 32 values along each
    # product's contracting dimension (convolutions stay tensorwise fp8).
    "mxfp8": {
        jax.lax.dot_general_p: eqx_amp.fp8.MXFP8,
        jax.lax.conv_general_dilated_p: eqx_amp.fp8.MXFP8,
    },
    # Blackwell's 4-bit recipe, forward products only: e2m1 values with an e4m3
    # scale per 16 and a float32 one per tensor; backward products in MXFP8.
    "nvfp4": {
        jax.lax.dot_general_p: eqx_amp.fp8.NVFP4,
        jax.lax.conv_general_dilated_p: eqx_amp.fp8.NVFP4,
    },
    # NVIDIA's 4-bit training recipe: the backward products in NVFP4 too.
    "nvfp4, 4-bit backward": {
        jax.lax.dot_general_p: eqx_amp.fp8.NVFP4.with_nvfp4_backward(),
        jax.lax.conv_general_dilated_p: eqx_amp.fp8.NVFP4,
    },
    "fp8, delayed scaling": {
        jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE,
        jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE,
    },
    "fp8, no scaling": {
        jax.lax.dot_general_p: _unscaled_fp8,
        jax.lax.conv_general_dilated_p: _unscaled_fp8,
    },
}
# The variants whose matmuls take delayed scales (`eqx_amp.fp8.delayed`).
DELAYED = {"fp8, delayed scaling"}


#
# Training.
#


def train(model, rules, batches, steps, learning_rate, delayed=False):
    """Adam on `batches(step) -> (inputs, targets)`; returns the model and the mean
    loss of the last 10% of the steps. With `delayed`, the fp8 matmuls take delayed
    scales, the state initialised on the first batch."""
    forward = lambda m: eqx_amp.autocast(  # noqa: E731
        eqx.filter_vmap(m), policy="mixed_bfloat16", rules=rules
    )
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(model, inputs, targets):
        return cross_entropy(forward(model)(inputs), targets)

    def scaled_loss(diff, inputs, targets):
        model, scaling = diff
        with eqx_amp.fp8.delayed(scaling):
            return loss_fn(model, inputs, targets)

    scaling = None
    if delayed:
        scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, *batches(0))

    @eqx.filter_jit
    def step(model, opt_state, scaling, inputs, targets):
        if scaling is None:
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, inputs, targets)
        else:
            loss, (grads, observed) = eqx.filter_value_and_grad(scaled_loss)(
                (model, scaling), inputs, targets
            )
            scaling = scaling.update(observed)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, scaling, loss

    losses = []
    for i in range(steps):
        model, opt_state, scaling, loss = step(model, opt_state, scaling, *batches(i))
        losses.append(float(loss))
    tail = max(1, steps // 10)
    return model, forward, float(np.mean(losses[-tail:]))


def run_digits(seed, rules, steps, delayed=False):
    train_split, (x_test, y_test) = digits(seed)
    batches = digit_batches(train_split, seed)
    model, forward, loss = train(
        DigitsCNN(jr.key(seed)), rules, batches, steps, 3e-3, delayed
    )
    accuracy = float(jnp.mean(jnp.argmax(forward(model)(x_test), -1) == y_test))
    return loss, accuracy


def run_characters(seed, rules, steps, data, delayed=False):
    ids, vocab = data
    batches = character_batches(ids, seed)
    model = CharTransformer(vocab, 64, 4, 2, 64, jr.key(seed))
    return train(model, rules, batches, steps, 3e-3, delayed)[2], None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    text_data = characters()
    tasks = {
        "digits CNN": lambda seed, rules, delayed: run_digits(
            seed, rules, args.steps, delayed
        ),
        "char transformer": lambda seed, rules, delayed: run_characters(
            seed, rules, args.steps, text_data, delayed
        ),
    }
    print("| model | variant | final loss (mean ± sd) | test accuracy | vs bf16 |")
    print("|---|---|---|---|---|")
    for task, run in tasks.items():
        results = {}
        for name, rules in VARIANTS.items():
            delayed = name in DELAYED
            results[name] = [run(seed, rules, delayed) for seed in range(args.seeds)]
        base = np.mean([loss for loss, _ in results["bf16"]])
        for name, runs in results.items():
            losses = np.array([loss for loss, _ in runs])
            accuracies = [a for _, a in runs if a is not None]
            accuracy = f"{100 * np.mean(accuracies):.1f}%" if accuracies else "-"
            relative = f"{100 * (losses.mean() / base - 1):+.1f}% loss"
            print(
                f"| {task} | {name} | {losses.mean():.4f} ± {losses.std():.4f} | "
                f"{accuracy} | {relative} |"
            )


if __name__ == "__main__":
    main()

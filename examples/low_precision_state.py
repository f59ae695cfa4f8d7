"""Half the training state: bfloat16 weights with compensated updates and low-precision
Adam moments, against float32 master weights.

Two models (a digits CNN, a character-level transformer), each trained from the same
weights on the same batches for a few seeds, with AdamW and a warmup + cosine
learning-rate schedule, in five ways:

- `f32`: everything float32 (no mixed precision);
- `AMP, f32 master`: `BiModel(model, policy="mixed_bfloat16")`, float32 master
    weights and moments, bfloat16 compute copy (the reference);
- `bf16 + Kahan, bf16 moments`: a bfloat16 model, `optax.chain(low_precision_moments(
    ..., "bfloat16"), kahan_summation())` and `eqx_amp.optim.apply_updates`;
- `bf16 + SR, 8-bit moments`: a bfloat16 model, `optax.chain(low_precision_moments(
    ..., "8bit"), stochastic_rounding(key))` and `eqx_amp.optim.apply_updates`;
- `bf16, no compensation` (the ablation): a bfloat16 model trained by plain
    `optax.adamw` (whose moments then are bfloat16 too, rounded to nearest).

All run the model with `filter_amp` semantics (matmuls in bfloat16, norms in float32).
It prints, per model and variant, the bytes per weight of the whole training state
(weights + compute copy + optimizer state, summed from the arrays), the final loss
(mean over seeds, and its spread) and, for the digits, the test accuracy.

    python examples/low_precision_state.py
    python examples/low_precision_state.py --seeds 3 --steps 600

`tqdm` is optional.
"""

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple

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


BF16_MASTER = "p=bf16,c=bf16,o=f32"


class Variant(NamedTuple):
    """A way to hold the training state: `start(model, optimizer) -> (held, opt_state)`,
    `step(held, opt_state, grads) -> (held, opt_state)`, `runnable(held)` (the
    model to call and differentiate)."""

    start: Callable[[Any, optax.GradientTransformation], tuple[Any, Any]]
    step: Callable[[Any, Any, Any, optax.GradientTransformation], tuple[Any, Any]]
    runnable: Callable[[Any], Any]
    policy: str = "mixed_bfloat16"


def _trainable(model):
    return eqx.filter(model, eqx.is_inexact_array)


def _plain(dtype, wrap=lambda optimizer: optimizer, policy="mixed_bfloat16"):
    """A model stored in `dtype`, an optax optimizer (wrapped by `wrap`), updates
    applied by `eqx_amp.optim.apply_updates` (rounded once to the weight's dtype)."""

    def start(model, optimizer):
        model = eqx_amp.cast_tree(model, dtype)
        return model, wrap(optimizer).init(_trainable(model))

    def step(model, opt_state, grads, optimizer):
        updates, opt_state = wrap(optimizer).update(grads, opt_state, _trainable(model))
        return eqx_amp.optim.apply_updates(model, updates), opt_state

    return Variant(start, step, lambda model: model, policy)


def _bimodel(policy, wrap=lambda optimizer: optimizer):
    def start(model, optimizer):
        bimodel = eqx_amp.BiModel(model, policy=policy)
        return bimodel, wrap(optimizer).init(_trainable(bimodel.master))

    def step(bimodel, opt_state, grads, optimizer):
        updates, opt_state = wrap(optimizer).update(
            grads, opt_state, _trainable(bimodel.master)
        )
        return bimodel.apply_updates(updates), opt_state

    return Variant(start, step, lambda bimodel: bimodel.compute)


VARIANTS = {
    "f32": _plain(jnp.float32, policy="float32"),
    "AMP, f32 master": _bimodel("mixed_bfloat16"),
    "bf16 + Kahan, bf16 moments": _plain(
        jnp.bfloat16,
        lambda optimizer: optax.chain(
            eqx_amp.optim.low_precision_moments(optimizer, "bfloat16"),
            eqx_amp.optim.kahan_summation(),
        ),
        policy=BF16_MASTER,
    ),
    "bf16 + SR, 8-bit moments": _plain(
        jnp.bfloat16,
        lambda optimizer: optax.chain(
            eqx_amp.optim.low_precision_moments(optimizer, "8bit"),
            eqx_amp.optim.stochastic_rounding(jr.key(0)),
        ),
    ),
    "bf16, no compensation": _plain(jnp.bfloat16),
}


def state_bytes_per_weight(held, opt_state) -> float:
    """Bytes of every array of the training state (weights, compute copy, optimizer
    state) per trainable weight."""
    arrays = [x for x in jax.tree.leaves((held, opt_state)) if eqx.is_array(x)]
    model = held.master if isinstance(held, eqx_amp.BiModel) else held
    weights = sum(x.size for x in jax.tree.leaves(_trainable(model)))
    return sum(x.nbytes for x in arrays) / weights


def train(model, variant: Variant, batches, steps, peak_learning_rate):
    """AdamW with warmup and cosine decay on `batches(step) -> (inputs, targets)`.
    Returns the trained model (callable), the losses, and the state's bytes per
    weight."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, peak_learning_rate, max(1, steps // 10), steps, peak_learning_rate / 100
    )
    optimizer = optax.adamw(schedule, weight_decay=1e-4)
    held, opt_state = variant.start(model, optimizer)
    per_weight = state_bytes_per_weight(held, opt_state)

    def forward(model):
        return eqx_amp.filter_amp(eqx.filter_vmap(model), policy=variant.policy)

    @eqx.filter_jit
    def step(held, opt_state, inputs, targets):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: cross_entropy(forward(m)(inputs), targets)
        )(variant.runnable(held))
        held, opt_state = variant.step(held, opt_state, grads, optimizer)
        return held, opt_state, loss

    losses = []
    for i in range(steps):
        held, opt_state, loss = step(held, opt_state, *batches(i))
        losses.append(float(loss))
    return forward(variant.runnable(held)), losses, per_weight


def run_digits(seed, variant, steps):
    train_split, (x_test, y_test) = digits(seed)
    batches = digit_batches(train_split, seed)
    model = DigitsCNN(jr.key(seed))
    forward, losses, per_weight = train(model, variant, batches, steps, 3e-3)
    accuracy = float(jnp.mean(jnp.argmax(forward(x_test), -1) == y_test))
    return losses, accuracy, per_weight


def run_characters(seed, variant, steps, data):
    ids, vocab = data
    batches = character_batches(ids, seed)
    model = CharTransformer(vocab, 64, 4, 2, 64, jr.key(seed))
    _, losses, per_weight = train(model, variant, batches, steps, 3e-3)
    return losses, None, per_weight


def final_loss(losses) -> float:
    """The mean loss of the last 10% of the steps."""
    return float(np.mean(losses[-max(1, len(losses) // 10) :]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    # Standard promotion, as optax needs: bfloat16 weights meet float32 updates.
    jax.config.update("jax_numpy_dtype_promotion", "standard")
    text_data = characters()
    tasks = {
        "digits CNN": lambda seed, v: run_digits(seed, v, args.steps),
        "char transformer": lambda seed, v: run_characters(
            seed, v, args.steps, text_data
        ),
    }
    print(
        "| model | variant | bytes/weight | final loss (mean ± sd) | test accuracy "
        "| vs f32 master |"
    )
    print("|---|---|---|---|---|---|")
    for task, run in tasks.items():
        results = {
            name: [run(seed, variant) for seed in range(args.seeds)]
            for name, variant in VARIANTS.items()
        }
        base = np.mean([final_loss(r[0]) for r in results["AMP, f32 master"]])
        base_accuracy = [r[1] for r in results["AMP, f32 master"]]
        for name, runs in results.items():
            finals = np.array([final_loss(r[0]) for r in runs])
            accuracies = [r[1] for r in runs if r[1] is not None]
            accuracy = f"{100 * np.mean(accuracies):.1f}%" if accuracies else "-"
            versus = f"{100 * (finals.mean() / base - 1):+.2f}% loss"
            if accuracies:
                points = 100 * (np.mean(accuracies) - np.mean(base_accuracy))
                versus += f", {points:+.1f} pts"
            print(
                f"| {task} | {name} | {runs[0][2]:.2f} | {finals.mean():.4f} ± "
                f"{finals.std():.4f} | {accuracy} | {versus} |"
            )


if __name__ == "__main__":
    main()

"""How far apart the magnitudes in one 8-bit block may be: Adam with 8-bit and
bfloat16 moments against float32 Adam, on one block of 256 weights whose gradients
are of two magnitudes, `1` and `10**-decades`.

    python benchmarks/moment_range.py

Each weight's gradient is its magnitude times a fixed sign times noise (1 + 0.5 N(0,
1)), for 200 steps of Adam (learning rate 1e-3) from zero. Reported: how far the small
weights end from float32 Adam's, relative to float32's (median and largest over the
128 small weights, 5 seeds). The large weights stay within a percent throughout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_amp


STEPS, LEARNING_RATE, SEEDS = 200, 1e-3, 5


def final_weights(optimizer, magnitudes, seed):
    signs = jnp.where(jnp.arange(256) % 3 == 0, -1.0, 1.0)

    @jax.jit
    def step(weights, state, key):
        noise = 1 + 0.5 * jax.random.normal(key, (256,))
        grads = magnitudes * signs * noise
        updates, state = optimizer.update(grads, state, weights)
        return weights + updates, state

    weights = jnp.zeros(256)
    state = optimizer.init(weights)
    for key in jax.random.split(jax.random.key(seed), STEPS):
        weights, state = step(weights, state, key)
    return np.asarray(weights)


def main():
    print("| decades apart | 8-bit moments | bfloat16 moments |")
    print("|---|---|---|")
    for decades in (0, 2, 4, 6, 8):
        small = np.arange(256) % 2 == 1
        magnitudes = jnp.asarray(np.where(small, 10.0**-decades, 1.0), jnp.float32)
        errors = {"8bit": [], "bfloat16": []}
        for seed in range(SEEDS):
            reference = final_weights(optax.adam(LEARNING_RATE), magnitudes, seed)
            for storage in errors:
                optimizer = eqx_amp.optim.low_precision_moments(
                    optax.adam(LEARNING_RATE), storage, key=jax.random.key(seed)
                )
                weights = final_weights(optimizer, magnitudes, seed)
                errors[storage].append(
                    np.abs(weights - reference)[small] / np.abs(reference)[small]
                )
        cells = [
            f"{np.median(errors[s]):.1%} (largest {np.max(errors[s]):.1%})"
            for s in ("8bit", "bfloat16")
        ]
        print(f"| {decades} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        main()

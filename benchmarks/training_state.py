"""The training state's bytes per weight, and what its update costs, for the ways
eqx_amp can hold it.

    python benchmarks/training_state.py                  # the CPU preset
    python benchmarks/training_state.py --preset gpu     # GPT-2 small + a ResNet
    python benchmarks/run.py --preset state              # the same (CPU preset)

Configurations (AdamW; bfloat16 compute in all but `f32 Adam`):

- `f32 Adam`: a float32 model and optax's AdamW.
- `AMP, f32 master`: `BiModel(model, policy="mixed_bfloat16")`: float32 master,
    bfloat16 compute copy, float32 moments.
- `master_weights`: a bfloat16 model, `eqx_amp.optim.master_weights(optax.adamw(...))`:
    the float32 master lives in the optimizer state.
- `bf16 + Kahan, bf16 moments`: a bfloat16 model, `optax.chain(low_precision_moments(
    adamw, "bfloat16"), kahan_summation())`, `eqx_amp.optim.apply_updates`.
- `bf16 + SR, 8-bit moments`: a bfloat16 model, `optax.chain(low_precision_moments(
    adamw, "8bit"), stochastic_rounding(key))`, `eqx_amp.optim.apply_updates`.

*Bytes/weight* sums every array of the state a run keeps between steps (weights,
compute copy, optimizer state) and divides by the number of trainable weights; the
gradient tree, which lives within a step, is not counted. The steps (forward,
backward, update) are compiled and timed side by side, one step of each in turn;
*update* is the optimizer update and its application alone, compiled and timed the
same way, as a share of its configuration's whole step.
"""

import argparse
import pathlib
import statistics
import sys
import time


_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # the checkout's eqx_amp, installed or not

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402
from _models import LEARNING_RATE, PRESETS, cross_entropy, make_task  # noqa: E402

import eqx_amp  # noqa: E402


STEPS = {"tiny": 3, "cpu": 10, "gpu": 30}
BF16_MASTER = "p=bf16,c=bf16,o=f32"


def _trainable(model):
    return eqx.filter(model, eqx.is_inexact_array)


class Config:
    """How one configuration holds the state and steps it."""

    def __init__(self, name, start, update, runnable, policy="mixed_bfloat16"):
        self.name, self.start, self.update = name, start, update
        self.runnable, self.policy = runnable, policy


def configurations() -> list[Config]:
    adamw = lambda: optax.adamw(LEARNING_RATE)  # noqa: E731

    def optax_on(dtype, optimizer, policy="mixed_bfloat16", name=""):
        def start(model):
            model = eqx_amp.cast_tree(model, dtype)
            return model, optimizer.init(_trainable(model))

        def update(model, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, _trainable(model))
            return eqx_amp.optim.apply_updates(model, updates), opt_state

        return Config(name, start, update, lambda m: m, policy)

    def bimodel(policy, optimizer, name):
        def start(model):
            held = eqx_amp.BiModel(model, policy=policy)
            return held, optimizer.init(_trainable(held.master))

        def update(held, opt_state, grads):
            updates, opt_state = optimizer.update(
                grads, opt_state, _trainable(held.master)
            )
            return held.apply_updates(updates), opt_state

        return Config(name, start, update, lambda b: b.compute)

    master = eqx_amp.optim.master_weights(adamw())

    def master_start(model):
        model = eqx_amp.cast_tree(model, jnp.bfloat16)
        return model, master.init(model)

    return [
        optax_on(jnp.float32, adamw(), "float32", "f32 Adam"),
        bimodel("mixed_bfloat16", adamw(), "AMP, f32 master"),
        Config(
            "master_weights",
            master_start,
            lambda m, s, g: _applied(m, *master.update(g, s, m)),
            lambda m: m,
        ),
        optax_on(
            jnp.bfloat16,
            optax.chain(
                eqx_amp.optim.low_precision_moments(adamw(), "bfloat16"),
                eqx_amp.optim.kahan_summation(),
            ),
            BF16_MASTER,
            "bf16 + Kahan, bf16 moments",
        ),
        optax_on(
            jnp.bfloat16,
            optax.chain(
                eqx_amp.optim.low_precision_moments(adamw(), "8bit"),
                eqx_amp.optim.stochastic_rounding(jr.key(0)),
            ),
            name="bf16 + SR, 8-bit moments",
        ),
    ]


def _applied(model, updates, opt_state):
    return eqx_amp.optim.apply_updates(model, updates), opt_state


def bytes_per_weight(held, opt_state) -> float:
    arrays = [x for x in jax.tree.leaves((held, opt_state)) if eqx.is_array(x)]
    model = held.master if isinstance(held, eqx_amp.BiModel) else held
    weights = sum(x.size for x in jax.tree.leaves(_trainable(model)))
    return sum(x.nbytes for x in arrays) / weights


def measure(task, config: Config) -> dict:
    held, opt_state = config.start(task.model)
    per_weight = bytes_per_weight(held, opt_state)

    def forward(model):
        return eqx_amp.filter_amp(eqx.filter_vmap(model), policy=config.policy)

    def grads_of(held, inputs, labels):
        return eqx.filter_value_and_grad(
            lambda m: cross_entropy(forward(m)(inputs), labels)
        )(config.runnable(held))

    def step(held, opt_state, inputs, labels):
        loss, grads = grads_of(held, inputs, labels)
        held, opt_state = config.update(held, opt_state, grads)
        return held, opt_state, loss

    inputs, labels = task.batch(0)
    _, grads = eqx.filter_jit(grads_of)(held, inputs, labels)
    step_c = eqx.filter_jit(step).lower(held, opt_state, inputs, labels).compile()
    update_c = eqx.filter_jit(config.update).lower(held, opt_state, grads).compile()
    return {
        "name": config.name,
        "bytes_per_weight": per_weight,
        "state": (held, opt_state, grads),
        "step": step_c,
        "update": update_c,
        "step_s": [],
        "update_s": [],
    }


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - start


def run(model_name: str, preset: str, steps: int) -> list[dict]:
    with jax.numpy_dtype_promotion("standard"):
        task = make_task(model_name, PRESETS[preset][model_name])
        results = [measure(task, c) for c in configurations()]
        for i in range(steps + 1):  # the first round warms up, untimed
            inputs, labels = task.batch(i)
            for r in results:
                held, opt_state, grads = r["state"]
                (held, opt_state, _), step_s = _timed(
                    r["step"], held, opt_state, inputs, labels
                )
                _, update_s = _timed(r["update"], held, opt_state, grads)
                r["state"] = (held, opt_state, grads)
                if i:
                    r["step_s"].append(step_s)
                    r["update_s"].append(update_s)
    return results


def table(model_name: str, description: str, results: list[dict]) -> str:
    base = statistics.median(results[1]["step_s"])
    lines = [
        f"{model_name}: {description}",
        "",
        "| configuration | bytes/weight | step (median) | vs AMP f32 master | update "
        "| update / step |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        step_s = statistics.median(r["step_s"])
        update_s = statistics.median(r["update_s"])
        lines.append(
            f"| {r['name']} | {r['bytes_per_weight']:.2f} | {1e3 * step_s:.2f} ms | "
            f"{step_s / base:.3f}x | {1e3 * update_s:.2f} ms | "
            f"{100 * update_s / step_s:.1f}% |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--models", default="gpt,cnn")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    steps = STEPS[args.preset] if args.steps is None else max(1, args.steps)
    print(
        f"eqx_amp training-state benchmark: backend {jax.default_backend()}, "
        f"preset {args.preset}, {steps} steps per configuration, interleaved\n"
    )
    for name in args.models.split(","):
        results = run(name, args.preset, steps)
        description = PRESETS[args.preset][name].describe()
        print(table(name, description, results) + "\n", flush=True)


if __name__ == "__main__":
    main()

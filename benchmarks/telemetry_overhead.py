"""Step time with per-layer telemetry collected every step, against the same step
without it, on the benchmark models.

    python benchmarks/telemetry_overhead.py [--preset cpu] [--steps 20] [--repeats 5]

Both steps are compiled first; then each repeat times `--steps` steps of each,
interleaved so that machine drift hits them alike. Prints the median step times and
their ratio (the target: at most 1.03). Steps without collection run `step` itself,
so they cost nothing extra: only the measured step is timed against it here.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
from _models import PRESETS, make_task
from _variants import autocast, autocast_fp8, filter_amp

import eqx_amp


VARIANTS = {
    "filter_amp f16": filter_amp("f16"),
    "autocast bf16": autocast("bf16"),
    "autocast fp8": autocast_fp8("bf16"),
}


def _compiled(step, state, batch):
    dynamic, static = eqx.partition(state, eqx.is_array)

    def flat(dynamic, batch):
        out = step(eqx.combine(dynamic, static), batch)
        return eqx.filter(out, eqx.is_array)

    return jax.jit(flat).lower(dynamic, batch).compile(), dynamic


def _time(compiled, dynamic, batch, steps: int) -> float:
    out = compiled(dynamic, batch)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(steps):
        out = compiled(dynamic, batch)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--models", default="gpt,cnn", help="comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"{'model':<6}{'variant':<16}{'plain ms':>10}{'measured ms':>13}{'ratio':>8}")
    for name in args.models.split(","):
        task = make_task(name, PRESETS[args.preset][name])
        batch = task.batch(0)
        for label, build in VARIANTS.items():
            built = build(task)
            plain, dynamic = _compiled(built.step, built.state, batch)
            measured, _ = _compiled(
                eqx_amp.diagnostics.telemetry(built.step), built.state, batch
            )
            times = {"plain": [], "measured": []}
            for _ in range(args.repeats):
                times["plain"].append(_time(plain, dynamic, batch, args.steps))
                times["measured"].append(_time(measured, dynamic, batch, args.steps))
            p, m = (statistics.median(times[k]) for k in ("plain", "measured"))
            print(f"{name:<6}{label:<16}{1e3 * p:>10.2f}{1e3 * m:>13.2f}{m / p:>8.3f}")


if __name__ == "__main__":
    main()

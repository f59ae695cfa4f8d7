"""Step time with per-layer telemetry collected every step, against the same step
without it, on the benchmark models; or, with `--h100`, what the two steps compiled
for an H100 (no GPU needed, as `h100_aot.py` does) move and launch.

    python benchmarks/telemetry_overhead.py [--preset cpu] [--steps 20] [--repeats 5]
    python benchmarks/telemetry_overhead.py --h100 [--preset gpu --config depth=4,batch=8]

Both steps are compiled first; then each repeat times `--steps` steps of each,
interleaved so that machine drift hits them alike. Prints the median step times and
their ratio (the target: at most 1.03). Steps without collection run `step` itself,
so they cost nothing extra: only the measured step is timed against it here. With
`--h100`: the bytes every kernel reads and writes and the kernels launched, from the
optimised HLO with cuBLAS GEMMs (`_gpu_hlo.roofline`), and their ratios (the targets:
at most 1.10x the bytes and 1.3x the kernels).
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
from _models import PRESETS, make_task, with_overrides
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


def _h100(args) -> None:
    """The plain and the measured step of each model and variant, compiled for an
    H100: bytes moved and kernels launched, and their ratios."""
    import h100_aot
    from _gpu_hlo import roofline

    sharding = h100_aot.h100_sharding()
    print(f"{'model':<6}{'variant':<16}{'plain GB':>10}{'measured GB':>13}"
          f"{'ratio':>7}{'kernels':>9}{'measured':>10}{'ratio':>7}")  # fmt: skip
    for name in args.models.split(","):
        task = make_task(name, with_overrides(PRESETS[args.preset][name], args.config))
        batch = task.batch(0)
        for label, build in VARIANTS.items():
            built = build(task)
            rows = []
            dynamic, static = eqx.partition(built.state, eqx.is_array)
            for step in (built.step, eqx_amp.diagnostics.telemetry(built.step)):

                def flat(dynamic, batch, step=step):
                    out = step(eqx.combine(dynamic, static), batch)
                    return eqx.filter(out, eqx.is_array)

                compiled = h100_aot.compile_for_h100(
                    flat, dynamic, batch, sharding=sharding, triton_gemm=False
                )
                roof = roofline(compiled.as_text())
                moved = roof["gemm_bytes"] + sum(roof["non_gemm_bytes"].values())
                rows.append((moved / 1e9, roof["kernels"]))
            (pb, pk), (mb, mk) = rows
            print(f"{name:<6}{label:<16}{pb:>10.3f}{mb:>13.3f}{mb / pb:>7.2f}"
                  f"{pk:>9}{mk:>10}{mk / pk:>7.2f}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--models", default="gpt,cnn", help="comma-separated")
    parser.add_argument("--config", default="", help="size overrides: depth=4,batch=8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--h100", action="store_true",
                        help="bytes and kernels of the steps compiled for an H100")  # fmt: skip
    args = parser.parse_args()
    if args.h100:
        _h100(args)
        return
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"{'model':<6}{'variant':<16}{'plain ms':>10}{'measured ms':>13}{'ratio':>8}")
    for name in args.models.split(","):
        task = make_task(name, with_overrides(PRESETS[args.preset][name], args.config))
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

"""The bytes an optimizer update moves on an H100, from its compiled program.

    python benchmarks/state_update_aot.py                     # GPT-2-small-sized weights
    python benchmarks/state_update_aot.py --config depth=2    # smaller, quicker

The update of each training-state configuration of `training_state.py` (the
optimizer's `update` and `eqx_amp.optim.apply_updates`: what runs between the
gradients and the next step's weights), compiled for one H100 without a GPU (as
`h100_aot.py` does: the CUDA plugin and `h100_sxm.txtpb`), read by
`_gpu_hlo.roofline`: the bytes every kernel reads and writes (operands + results),
the kernels launched, and the time at 80% of the H100's bandwidth. The weights are
those of the GPT of the `gpu` preset (GPT-2 small: 12 blocks x 768, vocab 32768;
124M weights), never materialised: the compile sees their shapes only.

The floor is what the state itself weighs: each weight, moment and buffer read once
and written once, and the gradient read once. float32 Adam's is 28 bytes per
weight (weight 4 + gradient 4 + two moments 8, read; weight and moments written).
"""

import argparse
import json
import pathlib
import re
import sys


_HERE = pathlib.Path(__file__).resolve().parent
SLUGS = (
    "f32_adam", "amp_f32_master", "master_weights", "bf16_kahan_bf16_moments",
    "bf16_sr_8_bit_moments",
)  # fmt: skip


def configurations() -> dict:
    """slug -> `training_state.Config`, the training state's configurations
    (`f32_adam`, `amp_f32_master`, `master_weights`, `bf16_kahan_bf16_moments`,
    `bf16_sr_8_bit_moments`)."""
    import training_state

    return {slug(c.name): c for c in training_state.configurations()}


def slug(name: str) -> str:
    return "_".join(re.findall(r"[a-z0-9]+", name.lower()))


def measure(config, model) -> dict:
    """Compile `config`'s update for an H100 and read its bytes from the HLO."""
    import _gpu_hlo
    import equinox as eqx
    import h100_aot
    import jax

    held, opt_state = eqx.filter_eval_shape(config.start, model)
    runnable = config.runnable(held)
    # The gradients have the dtypes of the leaves differentiated (bfloat16 for a
    # bfloat16 model or a BiModel's compute copy).
    grads = eqx.filter(runnable, _is_floating)
    state = (held, opt_state, grads)
    dynamic, static = eqx.partition(state, _is_shaped)

    def update(dynamic):
        held, opt_state, grads = eqx.combine(dynamic, static)
        held, opt_state = config.update(held, opt_state, grads)
        return eqx.filter(held, eqx.is_array), eqx.filter(opt_state, eqx.is_array)

    sharding = h100_aot.h100_sharding()
    compiled = h100_aot.compile_for_h100(
        update, dynamic, sharding=sharding, triton_gemm=False
    )
    text = compiled.as_text()
    roof = _gpu_hlo.roofline(text)
    weights = sum(x.size for x in jax.tree.leaves(eqx.filter(runnable, _is_floating)))
    state_bytes = sum(
        x.size * x.dtype.itemsize
        for x in jax.tree.leaves((held, opt_state))
        if _is_shaped(x)
    )
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(grads))
    memory = compiled.memory_analysis()
    return {
        "name": config.name,
        "weights": weights,
        "state_bytes_per_weight": state_bytes / weights,
        # Read the state and the gradients, write the state: no update can move less.
        "floor_bytes": 2 * state_bytes + grad_bytes,
        "bytes": sum(roof["non_gemm_bytes"].values()) + roof["gemm_bytes"],
        "kernels": roof["kernels"],
        "time_s": roof["time_s"],
        "temp_bytes": memory.temp_size_in_bytes,
        "hlo": text,
    }


def _is_shaped(x) -> bool:
    import equinox as eqx
    import jax

    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _is_floating(x) -> bool:
    import jax.numpy as jnp

    return _is_shaped(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def markdown(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| configuration | state B/weight | floor B/weight | moved B/weight | "
        "moved ×floor | moved ×f32 Adam | kernels | µs (80% of 3.35 TB/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        w = r["weights"]
        lines.append(
            f"| {r['name']} | {r['state_bytes_per_weight']:.2f} | "
            f"{r['floor_bytes'] / w:.2f} | {r['bytes'] / w:.2f} | "
            f"{r['bytes'] / r['floor_bytes']:.2f} | {r['bytes'] / base['bytes']:.2f} | "
            f"{r['kernels']} | {r['time_s'] * 1e6:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="",
                        help="the GPT's sizes overridden, e.g. depth=2")  # fmt: skip
    parser.add_argument("--only", default="",
                        help="comma-separated configurations (all by default): "
                        + ", ".join(SLUGS))  # fmt: skip
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--hlo", help="write each optimised module into this folder")
    args = parser.parse_args(argv)
    import h100_aot

    missing = h100_aot.plugin_missing()
    if missing:
        print(f"state_update_aot: {missing}", file=sys.stderr)
        return 2
    h100_aot.h100_devices(1)  # the plugin must start before the model is built
    import jax
    from _models import PRESETS, with_overrides

    config = with_overrides(PRESETS["gpu"]["gpt"], args.config)
    with jax.numpy_dtype_promotion("standard"):
        model = _abstract_gpt(config)
        chosen = configurations()
        if args.only:
            chosen = {k: chosen[k] for k in args.only.split(",")}
        rows = []
        for config_ in chosen.values():
            row = measure(config_, model)
            rows.append(row)
            print(
                f"{row['name']}: {row['bytes'] / row['weights']:.2f} B/weight moved, "
                f"{row['kernels']} kernels",
                flush=True,
            )
    print(f"\n{config.describe()}: {rows[0]['weights'] / 1e6:.1f}M weights\n")
    print(markdown(rows))
    if args.hlo:
        folder = pathlib.Path(args.hlo)
        folder.mkdir(parents=True, exist_ok=True)
        for r in rows:
            (folder / f"{slug(r['name'])}.hlo").write_text(r["hlo"])
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "hlo"} for r in rows])
        )
    return 0


def _abstract_gpt(config):
    """The preset's GPT with its weights as shapes only (a GPT-2-small's 124M float32
    weights need not exist to compile its update)."""
    import equinox as eqx
    import jax.random as jr
    from _models import GPT

    return eqx.filter_eval_shape(
        lambda: GPT(
            config.vocab, config.width, config.depth, config.heads, config.seq,
            key=jr.key(0),
        )
    )  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(_HERE))
    sys.path.insert(1, str(_HERE.parent))
    sys.exit(main())

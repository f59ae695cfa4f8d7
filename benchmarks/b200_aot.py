"""MXFP8 and NVFP4 training steps compiled for a B200 on a machine without a GPU.

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    python benchmarks/run.py --preset b200-aot                  # GPT and Llama, CPU sizes
    python benchmarks/b200_aot.py --size gpu --models gpt
    python benchmarks/b200_aot.py --size gpu --models llama --config depth=1

As `h100_aot.py` does for an H100, from `b200.txtpb` beside this file: XLA's B200
target config (`xla/backends/gpu/target_config/specs/`, without the fields jax 0.10's
XLA rejects) with cuDNN 9.10 (`dnn_version_info`). The cuDNN version matters: from
9.8 XLA hands JAX's block-scaled product (`jax.nn.scaled_matmul`, which
`eqx_amp.fp8.MXFP8` is built on) to cuDNN's block-scaled GEMM,
`__cudnn$blockScaledDot`; with an older one the same program silently becomes a
dequantise fusion and a float32 GEMM. Every step is compiled with Triton GEMMs off
(`xla_gpu_enable_triton_gemm=False`: the other GEMMs are cuBLAS calls), and checked:
every product eqx_amp made an MXFP8 one (under its `eqx_amp.fp8` scope) is
`__cudnn$blockScaledDot`, the forward ones and the backward ones (under
`transpose(...)`), one forward and two backward per MXFP8 matmul; an NVFP4 one's
forward product reads e2m1 operands (`fp4_products`), its backward ones MXFP8.

For each step: the products by kind, the roofline on a B200 (`_gpu_hlo.roofline`
with `_gpu_hlo.B200`: bf16 2250, fp8 4500, fp4 9000 TFLOP/s dense at 70%, 8 TB/s at
80%) beside
the hand-cast bfloat16 step's, and the bytes of forward values saved for the
backward pass beside bfloat16's (`jax.vjp`'s residuals, as `run.py` counts them).
Exit status 1 if an MXFP8 product is not a cuDNN block-scaled GEMM.
"""

import argparse
import functools as ft
import json
import pathlib
import re
import sys
import time

from h100_aot import deviceless_devices, plugin_missing


TARGET = pathlib.Path(__file__).resolve().parent / "b200.txtpb"
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}
# The bfloat16 baselines, every MXFP8 road, NVFP4 forward products (and every
# product, by NVIDIA's recipe), and tensorwise fp8 for comparison.
VARIANTS = (
    "hand_bf16", "autocast_mxfp8", "filter_amp_mxfp8", "bimodel_mxfp8",
    "filter_amp_nvfp4", "filter_amp_nvfp4_training", "autocast_fp8",
)  # fmt: skip
_BACKWARD = re.compile(r"transpose\(")


def b200_sharding():
    """A sharding on one deviceless B200."""
    import jax

    return jax.sharding.SingleDeviceSharding(deviceless_devices("b200", TARGET)[0])


def builders() -> dict:
    """Each variant's builder (`Task -> Built`): the MXFP8 roads built here as
    `_variants` builds its fp8 ones, the others from `_variants`."""
    import _variants
    import jax

    import eqx_amp

    own = {}
    rules = (
        ("mxfp8", eqx_amp.fp8.MXFP8),
        ("nvfp4", eqx_amp.fp8.NVFP4),
        ("nvfp4_training", eqx_amp.fp8.NVFP4.with_nvfp4_backward()),
    )
    for name, rule in rules:
        autocast = ft.partial(eqx_amp.autocast, rules={jax.lax.dot_general_p: rule})
        filter_amp = ft.partial(eqx_amp.filter_amp, fp8=rule)
        own[f"autocast_{name}"] = _variants.wrapped(autocast)("bf16")
        own[f"filter_amp_{name}"] = _variants.wrapped(filter_amp)("bf16")
        own[f"bimodel_{name}"] = _variants.bimodel("bf16", fp8=rule)
    own["filter_amp_mxfp8_paying"] = _variants.wrapped(
        ft.partial(eqx_amp.filter_amp, fp8=eqx_amp.fp8.MXFP8.where_it_pays())
    )("bf16")
    attention = {jax.lax.dot_general_p: eqx_amp.fp8.MXFP8.with_activation_products()}
    own["autocast_mxfp8_attention"] = _variants.wrapped(
        ft.partial(eqx_amp.autocast, rules=attention)
    )("bf16")
    return {**{n: v.build for n, v in _variants.VARIANTS.items()}, **own}


def block_scaled_check(text: str) -> dict:
    """The block-scaled products of a compiled program: forward and backward
    `__cudnn$blockScaledDot` calls, those of them reading NVFP4 operands, and the
    products eqx_amp made block-scaled ones that are something else."""
    import _gpu_hlo

    found = _gpu_hlo.products(text)
    mx = [p for p in found if p.asked_for_fp8 and "mxfp8" in p.op_name]
    cudnn = [p for p in mx if p.call == _gpu_hlo.BLOCK_SCALED_DOT]
    backward = sum(bool(_BACKWARD.search(p.op_name)) for p in cudnn)
    return {
        "block_scaled_forward": len(cudnn) - backward,
        "block_scaled_backward": backward,
        # NVFP4's forward products (`eqx_amp.fp8.NVFP4`): e2m1 operands.
        "fp4_products": sum(p.reads == ("f4e2m1fn", "f4e2m1fn") for p in cudnn),
        "mxfp8_not_cudnn": [
            {"call": p.call, "reads": list(p.reads), "op_name": p.op_name}
            for p in mx
            if p.call != _gpu_hlo.BLOCK_SCALED_DOT
        ],
        "products": _gpu_hlo.summary(found),
    }


def compile_variant(model: str, variant: str, size: str, sharding, config="") -> dict:
    """One variant's training step compiled for the B200 of `sharding`: its MXFP8
    products, roofline, temporaries and saved residuals."""
    import _gpu_hlo
    import _measure
    from _models import PRESETS, make_task, with_overrides
    from h100_aot import compile_for_h100

    task = make_task(model, with_overrides(PRESETS[size][model], config))
    built = builders()[variant](task)
    step, dynamic = _measure.jittable(built.step, built.state)
    start = time.perf_counter()
    compiled = compile_for_h100(
        step, dynamic, task.batch(0), sharding=sharding, triton_gemm=False
    )
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    return {
        "variant": variant,
        **block_scaled_check(text),
        "roofline": _gpu_hlo.roofline(text, _gpu_hlo.B200),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "saved": _measure.saved_residuals(built.loss_of, built.diff_args)["bytes"],
        "compile_s": seconds,
    }


def markdown(results: dict) -> str:
    """One table per model: each variant's products, its MXFP8 products by
    direction, the roofline beside the hand-cast bfloat16 step's, saved bytes."""
    import _gpu_hlo

    lines = []
    for model, rows in results.items():
        hand = next((r for r in rows if r["variant"] == "hand_bf16"), None)
        kinds = " | ".join(f"{k} GB" for k in _gpu_hlo.NON_GEMM_KINDS)
        lines += [
            f"### {model}: compiled for a B200 (cuDNN 9.10)",
            "",
            "| variant | products | blockScaledDot fwd / bwd / not | "
            f"GEMM TFLOP (fp4 / fp8 / bf16 / f32) | {kinds} | kernels | ms | ×hand | "
            "ms +launches | ×hand | ideal ×hand | saved MiB | saved ×hand |",
            "|---|---|---|---|" + "---:|" * (len(_gpu_hlo.NON_GEMM_KINDS) + 8),
        ]
        for r in rows:
            roof = r["roofline"]
            base = hand["roofline"] if hand else None
            flops = " / ".join(
                f"{roof['gemm_flops'].get(d, 0) / 1e12:.2f}"
                for d in ("fp4", "fp8", "bf16", "f32")
            )
            cells = [
                f"{roof['non_gemm_bytes'][k] / 1e9:.2f}"
                for k in _gpu_hlo.NON_GEMM_KINDS
            ]

            def ideal(roof=roof, base=base):
                return f"{_gpu_hlo.ideal_ratio(roof, base):.2f}" if base else "-"

            def ratio(key, roof=roof, base=base):
                return f"{roof[key] / base[key]:.2f}" if base and base[key] else "-"

            saved = (
                f"{r['saved'] / hand['saved']:.2f}" if hand and hand["saved"] else "-"
            )
            products = ", ".join(f"{n} {k}" for k, n in r["products"].items())
            lines.append(
                f"| {r['variant']} | {products} | {r['block_scaled_forward']} / "
                f"{r['block_scaled_backward']} / {len(r['mxfp8_not_cudnn'])} | "
                f"{flops} | " + " | ".join(cells) + f" | {roof['kernels']} | "
                f"{roof['time_s'] * 1e3:.2f} | {ratio('time_s')} | "
                f"{roof['time_s_with_launches'] * 1e3:.2f} | "
                f"{ratio('time_s_with_launches')} | {ideal(roof)} | "
                f"{r['saved'] / 2**20:.1f} | "
                f"{saved} |"
            )
        lines.append("")
    return "\n".join(lines)


def compile_mxfp8_fsdp(devices: int = 8, width: int = 256) -> dict:
    """An MLP's training step (two `eqx.nn.Linear`, `width` -> `4 * width` ->
    `width`, MXFP8 products by `filter_amp`) under `jax.shard_map` FSDP on
    `devices` deviceless B200s in one host, its weights gathered by
    `gather_params` in bfloat16 and in MXFP8: for each, the collectives XLA's GPU
    pipeline leaves (by kind and dtype, `_gpu_hlo.collectives`) and the products
    (`block_scaled_check`)."""
    import _gpu_hlo
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import eqx_amp

    mesh = jax.sharding.Mesh(
        np.array(deviceless_devices("b200", TARGET, devices)), ("data",)
    )
    k1, k2 = jr.split(jr.key(0))
    mlp = eqx.nn.Sequential(
        [
            eqx.nn.Linear(width, 4 * width, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(4 * width, width, key=k2),
        ]
    )
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    specs = jax.tree.map(lambda _: PartitionSpec("data"), params)
    mxfp8 = eqx_amp.fp8.MXFP8

    def spec(shape, dtype, s):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))

    out = {}
    for name, fp8 in (("bf16", None), ("mxfp8", mxfp8)):

        def loss(shards, x, fp8=fp8):
            gathered = eqx_amp.sharding.gather_params(
                shards, "data", specs=specs, fp8=fp8
            )
            model = eqx.filter_vmap(eqx.combine(gathered, static))
            y = eqx_amp.filter_amp(model, fp8=mxfp8)(x).astype(jnp.float32)
            return jax.lax.pmean(jnp.mean(y**2), "data")

        step = jax.shard_map(
            jax.grad(loss),
            mesh=mesh,
            in_specs=(specs, PartitionSpec("data")),
            out_specs=specs,
        )
        args = (
            jax.tree.map(lambda x, s: spec(x.shape, x.dtype, s), params, specs),
            spec((devices * 128, width), jnp.bfloat16, PartitionSpec("data")),
        )
        text = jax.jit(step).lower(*args).compile(NO_TRITON_GEMM).as_text()
        out[name] = {
            "collectives": _gpu_hlo.collectives(text),
            **block_scaled_check(text),
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "cpu", "gpu"), default="cpu",
                        help="the model sizes of that preset")  # fmt: skip
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--config", default="",
                        help="the preset's sizes overridden, e.g. depth=1")  # fmt: skip
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the tables here")
    args = parser.parse_args(argv)
    missing = plugin_missing()
    if missing:
        print(f"--preset b200-aot: {missing}", file=sys.stderr)
        return 2
    sharding = b200_sharding()
    results = {}
    for model in args.models.split(","):
        results[model] = []
        for variant in args.variants.split(","):
            row = compile_variant(model, variant, args.size, sharding, args.config)
            results[model].append(row)
            print(
                f"{model} {variant}: blockScaledDot forward "
                f"{row['block_scaled_forward']}, backward "
                f"{row['block_scaled_backward']}, MXFP8 not cuDNN "
                f"{len(row['mxfp8_not_cudnn'])}; roofline "
                f"{row['roofline']['time_s'] * 1e3:.2f} ms; compiled in "
                f"{row['compile_s']:.0f} s",
                flush=True,
            )
    table = markdown(results)
    print("\n" + table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table)
    failures = [
        (model, r["variant"], p)
        for model, rows in results.items()
        for r in rows
        for p in r["mxfp8_not_cudnn"]
    ]
    for model, variant, p in failures:
        print(f"NOT BLOCK-SCALED: {model} {variant}: {p['call']} reads {p['reads']}: "
              f"{p['op_name']}")  # fmt: skip
    # Each MXFP8 matmul: one forward and two backward block-scaled GEMMs.
    unpaired = [
        (model, r["variant"])
        for model, rows in results.items()
        for r in rows
        if r["block_scaled_backward"] != 2 * r["block_scaled_forward"]
    ]
    for model, variant in unpaired:
        print(f"BACKWARD NOT BLOCK-SCALED: {model} {variant}")
    return 1 if failures or unpaired else 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))
    sys.exit(main())

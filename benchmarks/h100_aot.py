"""Every variant's training step compiled for an H100 on a machine without a GPU.

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    python benchmarks/run.py --preset h100-aot          # the CPU preset's models
    python benchmarks/h100_aot.py --size gpu --models gpt
    python benchmarks/h100_aot.py --fsdp 8              # FSDP steps' collectives

JAX compiles for a GPU it does not have (deviceless ahead-of-time compilation) from
the CUDA plugin and a description of the device (`h100_sxm.txtpb`: an H100 SXM, its
CUDA runtime version included, without which XLA emits no fp8 GEMM). Each step is
compiled twice: with XLA's defaults (no autotuning without a device, so GEMMs become
Triton fusions) and with `xla_gpu_enable_triton_gemm=False` (GEMMs become cuBLAS
calls, and an fp8 one is `__cublas$lt$matmul$f8`: a direct check that a product is an
fp8 GEMM). From the optimised HLO (`_gpu_hlo.py`): the products by kind and dtype,
the fp8 products eqx_amp asked for that are not fp8, fusions and converts, and
`memory_analysis()` beside the hand-cast step.

From the compile with cuBLAS GEMMs, a roofline (`_gpu_hlo.roofline`): each GEMM at
70% of the H100 SXM's dense peak for its dtype (bf16 989, fp8 1979, f32 67 TFLOP/s)
or its bytes at 80% of 3.35 TB/s, whichever is slower; every other kernel at its
bytes (operands + results); optionally 3 us per kernel launched. Non-GEMM bytes are
told apart by kind: quantisation (a kernel writing fp8), amax (a max-reduction:
softmax's too), epilogue (a kernel reading an fp8 GEMM's output), layout (copies,
transposes) and other. `--roofline` compiles that way only:

    python benchmarks/h100_aot.py --roofline --size gpu --models gpt --config depth=4,batch=8
    python benchmarks/h100_aot.py --roofline --size gpu --models llama

What this cannot show: the kernels the autotuner picks on a real H100 (it may prefer
cuBLAS or Triton per shape), caches, the overlap of kernels, and time. The roofline
is for ratios between programs compiled alike; `--preset gpu` measures time when a
GPU is there (on an H100 the fp8 steps' measured ratios to bf16 were within 0.08 of
the roofline's with launches).
"""

import argparse
import json
import os
import pathlib
import sys
import time


TARGET = pathlib.Path(__file__).resolve().parent / "h100_sxm.txtpb"
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}
# The variants compiled by default: the baselines, every eqx_amp road in bfloat16 and
# float16, and every fp8 road.
VARIANTS = (
    "fp32", "hand_bf16", "filter_amp_bf16", "autocast_bf16", "bimodel_bf16",
    "filter_amp_f16", "autocast_f16", "bimodel_f16", "autocast_fp8",
    "autocast_fp8_rowwise", "filter_amp_fp8", "bimodel_fp8",
)  # fmt: skip
MiB = 2**20


def plugin_missing() -> str | None:
    """Why an H100 compile cannot run here (no CUDA plugin), or None."""
    try:
        import jax_cuda12_plugin  # noqa: F401
    except ImportError:
        return (
            "the CUDA plugin is not installed: pip install "
            '"jax[cuda12]==<this jax version>" (no GPU needed)'
        )
    return None


def deviceless_devices(name: str, target: pathlib.Path, count: int = 1) -> list:
    """`count` deviceless GPUs of the kind `name` (`"h100"`, `"b200"`) in one host,
    described by XLA's target config `target`, to shard `jax.ShapeDtypeStruct`s over
    so that `jax.jit(f).lower(...)` compiles for them. The environment variable must
    be set before JAX starts its backends (the plugin refuses a machine without CUDA
    otherwise)."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda",
        topology_name=name,
        target_config=target.read_text(),
        topology=f"1x1x{count}",
    )
    return list(topology.devices)


def h100_devices(count: int = 1) -> list:
    """`count` deviceless H100s in one host (`deviceless_devices`)."""
    return deviceless_devices("h100", TARGET, count)


def h100_sharding():
    """A sharding on one deviceless H100."""
    import jax

    return jax.sharding.SingleDeviceSharding(h100_devices(1)[0])


def compile_for_h100(fn, *args, sharding, triton_gemm: bool = True):
    """`jax.jit(fn)` compiled for the H100 of `sharding`, for arguments shaped as
    `args` (arrays or `jax.ShapeDtypeStruct`s)."""
    import jax

    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    lowered = jax.jit(fn).lower(*jax.tree.map(spec, args))
    return lowered.compile(compiler_options=None if triton_gemm else NO_TRITON_GEMM)


def analyse(compiled) -> dict:
    """Products, kernels and memory of one compiled program."""
    import _gpu_hlo

    text = compiled.as_text()
    found = _gpu_hlo.products(text)
    memory = compiled.memory_analysis()
    return {
        "products": _gpu_hlo.summary(found),
        "not_fp8": [
            {"call": p.call, "reads": list(p.reads), "op_name": p.op_name}
            for p in _gpu_hlo.not_fp8(found)
        ],
        "asked_for_fp8": sum(p.asked_for_fp8 for p in found),
        # Scales applied after the GEMM by another kernel (rowwise ones must be).
        "fp8_gemms_writing_f32": sum(
            p.kind == "cublas-fp8" and p.writes == "f32" for p in found
        ),
        **_gpu_hlo.kernels(text),
        "roofline": _gpu_hlo.roofline(text),
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
    }


def compile_variant(
    model: str,
    variant: str,
    size: str,
    sharding,
    ways=("default", "cublas"),
    config: str = "",
) -> dict:
    """One variant's training step, compiled each of `ways`: with XLA's defaults
    (`"default"`) and with Triton GEMMs off (`"cublas"`); `config` overrides the
    preset's sizes (`"depth=4,batch=8"`)."""
    import _measure
    from _models import PRESETS, make_task, with_overrides
    from _variants import VARIANTS as ALL

    task = make_task(model, with_overrides(PRESETS[size][model], config))
    built = ALL[variant].build(task)
    step, dynamic = _measure.jittable(built.step, built.state)
    out = {"variant": variant}
    for name in ways:
        triton = name == "default"
        start = time.perf_counter()
        compiled = compile_for_h100(
            step, dynamic, task.batch(0), sharding=sharding, triton_gemm=triton
        )
        out[name] = {**analyse(compiled), "compile_s": time.perf_counter() - start}
    return out


def compile_fsdp_variant(model: str, variant: str, size: str, devices: list) -> dict:
    """One variant's training step for H100s in one host, FSDP-sharded: every
    floating array of the state with a leading axis divisible by the device count
    (weights, optimizer moments) split along it, the batch along its first axis;
    the collectives XLA's GPU pipeline leaves, by kind and dtype."""
    import _gpu_hlo
    import _measure
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _models import PRESETS, make_task
    from _variants import VARIANTS as ALL
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    n = len(devices)

    def spec(x, shard):
        split = shard(x) and x.shape[0] % n == 0
        sharding = NamedSharding(
            mesh, PartitionSpec("fsdp") if split else PartitionSpec()
        )
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def is_weight(x):
        # `jnp.issubdtype`: numpy does not count bfloat16 as floating, which left
        # a BiModel's bfloat16 compute copy replicated.
        return x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)

    task = make_task(model, PRESETS[size][model])
    built = ALL[variant].build(task)
    step, dynamic = _measure.jittable(built.step, built.state)
    compiled = (
        jax.jit(step)
        .lower(
            jax.tree.map(lambda x: spec(x, is_weight), dynamic),
            jax.tree.map(lambda x: spec(x, lambda x: x.ndim >= 1), task.batch(0)),
        )
        .compile(compiler_options=NO_TRITON_GEMM)
    )
    text = compiled.as_text()
    return {
        "variant": variant,
        "collectives": _gpu_hlo.collectives(text),
        "all_reduces": _gpu_hlo.all_reduces(text),
        "products": _gpu_hlo.summary(_gpu_hlo.products(text)),
    }


def _products_text(products: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in products.items()) or "-"


def markdown(results: dict) -> str:
    """One table per model: GEMM kinds with Triton GEMMs off, Triton's reads with
    XLA's defaults, fusions, converts and temporaries beside the hand-cast step."""
    lines = []
    for model, rows in results.items():
        hand = next((r for r in rows if r["variant"] == "hand_bf16"), None)
        lines += [
            f"### {model}",
            "",
            "| variant | products, Triton GEMMs off | fp8 asked / not fp8 | "
            "products, XLA defaults | fusions | converts | temp MiB | temp ×hand |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            cublas, default = r["cublas"], r["default"]
            ratio = (
                f"{default['temp_bytes'] / hand['default']['temp_bytes']:.2f}"
                if hand and hand["default"]["temp_bytes"]
                else "-"
            )
            lines.append(
                f"| {r['variant']} | {_products_text(cublas['products'])} | "
                f"{cublas['asked_for_fp8']} / {len(cublas['not_fp8'])} | "
                f"{_products_text(default['products'])} | {default['fusions']} | "
                f"{default['converts']} | {default['temp_bytes'] / MiB:.1f} | {ratio} |"
            )
        lines.append("")
    return "\n".join(lines)


def roofline_markdown(results: dict) -> str:
    """One table per model: each variant's roofline (Triton GEMMs off, so every
    GEMM is a cuBLAS call), its GEMM FLOPs by dtype, bytes by kind of kernel,
    kernels, temporaries and time beside the hand-cast step's."""
    import _gpu_hlo

    lines = []
    for model, rows in results.items():
        hand = next((r for r in rows if r["variant"] == "hand_bf16"), None)
        base = hand["cublas"]["roofline"] if hand else None
        kinds = " | ".join(f"{k} GB" for k in _gpu_hlo.NON_GEMM_KINDS)
        lines += [
            f"### {model}: roofline on an H100 SXM",
            "",
            f"| variant | GEMM TFLOP (fp8 / bf16 / f32) | GEMM GB | {kinds} | "
            "non-GEMM GB | kernels | temp GiB | ms | ×hand | ms +launches | ×hand | "
            "ideal ×hand |",
            "|---|---|---:|" + "---:|" * (len(_gpu_hlo.NON_GEMM_KINDS) + 8),
        ]
        for r in rows:
            roof = r["cublas"]["roofline"]
            flops = " / ".join(
                f"{roof['gemm_flops'].get(d, 0) / 1e12:.2f}"
                for d in ("fp8", "bf16", "f32")
            )
            non_gemm = roof["non_gemm_bytes"]
            cells = [f"{non_gemm[k] / 1e9:.2f}" for k in _gpu_hlo.NON_GEMM_KINDS]

            def ideal(roof=roof, base=base):
                return f"{_gpu_hlo.ideal_ratio(roof, base):.2f}" if base else "-"

            def ratio(key, roof=roof):
                return f"{roof[key] / base[key]:.2f}" if base and base[key] else "-"

            lines.append(
                f"| {r['variant']} | {flops} | {roof['gemm_bytes'] / 1e9:.2f} | "
                + " | ".join(cells)
                + f" | {sum(non_gemm.values()) / 1e9:.2f} | {roof['kernels']} | "
                f"{r['cublas']['temp_bytes'] / 2**30:.2f} | "
                f"{roof['time_s'] * 1e3:.2f} | {ratio('time_s')} | "
                f"{roof['time_s_with_launches'] * 1e3:.2f} | "
                f"{ratio('time_s_with_launches')} | {ideal(roof)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("cpu", "gpu"), default="cpu",
                        help="the model sizes of that preset")  # fmt: skip
    parser.add_argument("--models", default="gpt,cnn")
    parser.add_argument("--config", default="",
                        help="the preset's sizes overridden, e.g. depth=4,batch=8")  # fmt: skip
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--roofline", action="store_true",
                        help="compile with Triton GEMMs off only (the roofline's "
                        "compile), not with XLA's defaults too")  # fmt: skip
    parser.add_argument("--fsdp", type=int, default=0, metavar="N",
                        help="instead, each step FSDP-sharded over N H100s: its "
                        "collectives by kind and dtype")  # fmt: skip
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the tables here")
    args = parser.parse_args(argv)
    missing = plugin_missing()
    if missing:
        print(f"--preset h100-aot: {missing}", file=sys.stderr)
        return 2
    if args.fsdp:
        return fsdp_main(args)
    sharding = h100_sharding()
    results = {}
    for model in args.models.split(","):
        results[model] = []
        for variant in args.variants.split(","):
            ways = ("cublas",) if args.roofline else ("default", "cublas")
            row = compile_variant(
                model, variant, args.size, sharding, ways, config=args.config
            )
            results[model].append(row)
            print(
                f"{model} {variant}: {_products_text(row['cublas']['products'])}; "
                f"fp8 asked {row['cublas']['asked_for_fp8']}, not fp8 "
                f"{len(row['cublas']['not_fp8'])}",
                flush=True,
            )
    table = roofline_markdown(results)
    if not args.roofline:
        table = markdown(results) + "\n" + table
    print("\n" + table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table)
    failures = [
        (model, r["variant"], p)
        for model, rows in results.items()
        for r in rows
        for p in r["cublas"]["not_fp8"]
    ]
    for model, variant, p in failures:
        print(f"NOT FP8: {model} {variant}: {p['call']} reads {p['reads']}: "
              f"{p['op_name']}")  # fmt: skip
    return 1 if failures else 0


def fsdp_markdown(results: dict, devices: int) -> str:
    """Per model: each variant's collectives (bytes a device receives, by kind and
    dtype) beside the hand-cast step's."""
    lines = []
    for model, rows in results.items():
        hand = next((r for r in rows if r["variant"] == "hand_bf16"), None)
        lines += [
            f"### {model}, FSDP over {devices} H100s",
            "",
            "| variant | all-gather | reduce-scatter | all-reduce (count) | "
            "all-to-all | all-gather bytes ×hand | all collective bytes ×hand |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            c = r["collectives"]

            def of(kind, c=c):
                return (
                    ", ".join(
                        f"{k.split()[1]} {v / 1024:.0f}K"
                        for k, v in c.items()
                        if k.startswith(kind + " ") and not k.endswith("count")
                    )
                    or "-"
                )

            def gathered(c):
                return sum(
                    v
                    for k, v in c.items()
                    if k.startswith("all-gather ") and "count" not in k
                )

            def total(c):
                return sum(v for k, v in c.items() if "count" not in k)

            ratio = (
                f"{gathered(c) / gathered(hand['collectives']):.2f}"
                if hand and gathered(hand["collectives"])
                else "-"
            )
            all_ratio = (
                f"{total(c) / total(hand['collectives']):.2f}"
                if hand and total(hand["collectives"])
                else "-"
            )
            lines.append(
                f"| {r['variant']} | {of('all-gather')} | {of('reduce-scatter')} | "
                f"{of('all-reduce')} ({c.get('all-reduce count', 0)}) | "
                f"{of('all-to-all')} | {ratio} | {all_ratio} |"
            )
        lines.append("")
    return "\n".join(lines)


def fsdp_main(args) -> int:
    devices = h100_devices(args.fsdp)
    results = {}
    for model in args.models.split(","):
        results[model] = []
        for variant in args.variants.split(","):
            row = compile_fsdp_variant(model, variant, args.size, devices)
            results[model].append(row)
            print(f"{model} {variant}: {row['collectives']}", flush=True)
    table = fsdp_markdown(results, args.fsdp)
    print("\n" + table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))
    sys.exit(main())

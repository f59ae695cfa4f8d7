"""Benchmark suite: speed, memory and compile cost of mixed-precision training steps
against float32, a hand-cast bfloat16 model and the peer libraries.

    python benchmarks/run.py                         # the CPU preset, a few minutes
    python benchmarks/run.py --preset gpu            # GPT-2 small + a ResNet, on a GPU
    python benchmarks/run.py --preset sharded        # collectives of FSDP/TP steps
    python benchmarks/run.py --preset state          # training-state bytes, update cost
    python benchmarks/run.py --preset h100-aot       # compiled for an H100, no GPU needed
    python benchmarks/run.py --preset b200-aot       # MXFP8, NVFP4 steps compiled for a B200
    python benchmarks/run.py --models gpt --variants fp32,hand_bf16,filter_amp_bf16
    python benchmarks/run.py --json results.json --markdown table.md

Variants (`--variants`, comma-separated, or `default`, `eqx_amp`, `all`):

- `fp32`: the plain model. `hand_bf16`: the ideal, written by hand: the floating
  parameters except the norm layers cast to bfloat16 once per step, bfloat16
  inputs, norm layers in float32 (inputs cast up, outputs cast down), float32 loss.
- `filter_amp_*`, `autocast_*`, `bimodel_*`: eqx_amp, in bfloat16 (no loss scaling)
  and in float16 (`eqx_amp.filter_value_and_grad` with a `DynamicLossScale`,
  non-finite steps skipped by `eqx_amp.select_tree`; a `BiModel` differentiated
  by the same `eqx_amp.filter_value_and_grad`).
- `jmp_bf16`, `mpx_bf16`, `jaxamp_bf16`: the peers, each as its README recommends
  (`pip install -e ".[benchmarks]"`). A peer that is not installed or does not run on
  this JAX is reported with its error, not hidden.

Everything runs in one process, variants interleaved: each trace+compile repeat goes
round the variants (in a rotated order), and the training steps go round the
variants one step at a time, so drift in the machine hits all variants alike. The
measurements are described in `benchmarks/_measure.py`; the targets checked at the
end are those of DESIGN.md ("Performance targets").
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import traceback


_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # the checkout's eqx_amp, installed or not

import _measure  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
from _models import (  # noqa: E402
    PRESETS,
    count_params,
    cross_entropy,
    make_task,
    with_overrides,
)
from _variants import DEFAULT_VARIANTS, EQX_AMP_ONLY, VARIANTS, Variant  # noqa: E402


STEPS = {"tiny": 3, "cpu": 12, "gpu": 30}
REPEATS = {"tiny": 1, "cpu": 3, "gpu": 1}
MiB = 2**20

# DESIGN.md, "Performance targets".
STEP_TOLERANCE = 1.02
COMPILE_LIMITS = {"filter_amp_bf16": 1.25, "autocast_bf16": 1.5}


#
# Running one model.
#


def _first_line(e: BaseException) -> str:
    """The first line of the error, and the innermost frame it was raised in."""
    lines = f"{type(e).__name__}: {e}".strip().splitlines()
    text = lines[0] if lines else type(e).__name__
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        where = frames[-1]
        filename = where.filename.split("site-packages/")[-1]
        text += f" (at {filename}:{where.lineno}: `{(where.line or '').strip()}`)"
    return text


def run_model(name: str, config, variants: list[Variant], args) -> dict:
    task = make_task(name, config)
    print(
        f"\n== {task.description} ({count_params(task.model):,} parameters)", flush=True
    )
    results = {v.name: {"variant": v.name, "family": v.family, "dtype": v.dtype,
                        "scaling": v.scaling, "status": "ok"} for v in variants}  # fmt: skip
    live = []
    for v in variants:
        why = v.unavailable()
        if why is None:
            live.append(v)
        else:
            results[v.name].update(status="not installed", error=why)
            print(f"   {v.name}: {why}", flush=True)

    # Trace + lower and compile, R timed rounds, each visiting the variants in a
    # rotated order; the executables of round 0 are the ones measured and run. An
    # untimed compile of the first variant on the tiny preset of this model warms
    # JAX's own caches first, so that the first variant timed does not pay for them.
    if live:
        warm = make_task(name, PRESETS["tiny"][name])
        try:
            built = live[0].build(warm)
            _measure.lower_and_compile(built.step, built.state, warm.batch(0))
        except Exception:  # noqa: BLE001 - a failure is reported in round 0
            pass
    first = {}
    timings = {v.name: [] for v in live}
    for r in range(args.repeats):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for v in order:
            if results[v.name]["status"] != "ok":
                continue
            try:
                built = v.build(task)
                out = _measure.lower_and_compile(built.step, built.state, task.batch(0))
            except Exception as e:  # noqa: BLE001 - a failing variant is reported
                results[v.name].update(status="failed", error=_first_line(e))
                if args.verbose:
                    traceback.print_exc()
                print(f"   {v.name}: failed: {_first_line(e)}", flush=True)
                continue
            if r == 0:
                first[v.name] = (built, out)
            timings[v.name].append((out["trace_lower_s"], out["compile_s"]))
            print(f"   {v.name}: traced+lowered in {out['trace_lower_s']:.1f} s, "
                  f"compiled in {out['compile_s']:.1f} s", flush=True)  # fmt: skip
        print(f"   trace+compile round {r + 1}/{args.repeats} done", flush=True)
    ok = [v for v in live if results[v.name]["status"] == "ok"]

    # Static measurements of the round-0 executables.
    for v in ok:
        built, out = first[v.name]
        res = results[v.name]
        runs = timings[v.name]
        res["trace_lower_s"] = statistics.median(t for t, _ in runs)
        res["compile_s"] = statistics.median(c for _, c in runs)
        res["trace_compile_s"] = statistics.median(t + c for t, c in runs)
        res["trace_compile_runs"] = runs
        res["memory"] = _measure.memory(out["compiled"])
        res["hlo_program"] = _measure.hlo_stats(out["lowered"].as_text(dialect="hlo"))
        res["hlo_compiled"] = _measure.hlo_stats(out["compiled"].as_text())
        try:
            res["saved"] = _measure.saved_residuals(built.loss_of, built.diff_args)
        except Exception as e:  # noqa: BLE001
            res["saved"] = {"error": _first_line(e)}

    # Training steps, one step of every variant at a time. Step 0 (the first
    # execution) is not timed.
    states = {v.name: first[v.name][1]["dynamic"] for v in ok}
    step_times = {v.name: [] for v in ok}
    losses = {v.name: [] for v in ok}
    for i in range(args.steps):
        batch = task.batch(i)
        for v in ok:
            if results[v.name]["status"] != "ok":
                continue
            compiled = first[v.name][1]["compiled"]
            try:
                states[v.name], times, ls = _measure.time_steps(
                    compiled, states[v.name], [batch]
                )
            except Exception as e:  # noqa: BLE001
                results[v.name].update(status="failed", error=_first_line(e))
                continue
            if i > 0:
                step_times[v.name].extend(times)
            losses[v.name].extend(ls)
    print(f"   {args.steps} training steps done", flush=True)

    # The loss after K steps, of each variant's float32 master weights evaluated in
    # float32 on the first batch.
    @eqx.filter_jit
    def eval_loss(model, x, y):
        return cross_entropy(jax.vmap(model)(x), y)

    x, y = task.batch(0)
    initial = float(eval_loss(task.model, x, y))
    for v in ok:
        res = results[v.name]
        if res["status"] != "ok":
            continue
        built, out = first[v.name]
        state = eqx.combine(states[v.name], out["static_state"])
        res["step_s"] = (
            statistics.median(step_times[v.name]) if step_times[v.name] else None
        )
        res["step_times_s"] = step_times[v.name]
        res["train_losses"] = losses[v.name]
        res["final_loss"] = float(eval_loss(built.master(state), x, y))
    _add_ratios(results)
    return {
        "description": task.description,
        "params": count_params(task.model),
        "initial_loss": initial,
        "variants": results,
    }


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _add_ratios(results: dict) -> None:
    fp32 = results.get("fp32", {})
    hand = results.get("hand_bf16", {})
    for res in results.values():
        if res["status"] != "ok":
            continue
        mem = res["memory"].get("total_bytes")
        saved = res["saved"].get("bytes")
        res["ratios"] = {
            "trace_compile_vs_fp32": _ratio(
                res["trace_compile_s"], fp32.get("trace_compile_s")
            ),
            "trace_compile_vs_hand": _ratio(
                res["trace_compile_s"], hand.get("trace_compile_s")
            ),
            "trace_vs_fp32": _ratio(res["trace_lower_s"], fp32.get("trace_lower_s")),
            "step_vs_fp32": _ratio(res.get("step_s"), fp32.get("step_s")),
            "step_vs_hand": _ratio(res.get("step_s"), hand.get("step_s")),
            "memory_vs_hand": _ratio(mem, hand.get("memory", {}).get("total_bytes")),
            "saved_vs_hand": _ratio(saved, hand.get("saved", {}).get("bytes")),
            "memory_vs_fp32": _ratio(mem, fp32.get("memory", {}).get("total_bytes")),
            "saved_vs_fp32": _ratio(saved, fp32.get("saved", {}).get("bytes")),
        }
        if fp32.get("final_loss") is not None:
            res["final_loss_minus_fp32"] = res["final_loss"] - fp32["final_loss"]


#
# Reporting.
#


COLUMNS = (
    "variant", "dtype", "scaling", "trace+lower s", "compile s", "t+c ×fp32", "×hand",
    "compiled MiB", "×hand", "saved MiB", "×hand", "step ms", "×fp32", "×hand",
    "converts", "half mm", "instrs", "loss@K", "Δ fp32",
)  # fmt: skip


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table_rows(model: dict) -> list[list[str]]:
    rows = []
    for name, res in model["variants"].items():
        head = [name, res["dtype"], res["scaling"]]
        if res["status"] != "ok":
            error = res.get("error", "").replace("|", "\\|")
            rows.append(head + [f"**{res['status']}**: {error}"]
                        + [""] * (len(COLUMNS) - 4))  # fmt: skip
            continue
        r = res["ratios"]
        prog, comp = res["hlo_program"], res["hlo_compiled"]
        mem = res["memory"].get("total_bytes")
        saved = res["saved"].get("bytes")
        rows.append(head + [
            _fmt(res["trace_lower_s"], ".2f"),
            _fmt(res["compile_s"], ".2f"),
            _fmt(r["trace_compile_vs_fp32"], ".2f"),
            _fmt(r["trace_compile_vs_hand"], ".2f"),
            _fmt(None if mem is None else mem / MiB, ".2f"),
            _fmt(r["memory_vs_hand"], ".2f"),
            _fmt(None if saved is None else saved / MiB, ".2f"),
            _fmt(r["saved_vs_hand"], ".2f"),
            _fmt(None if res.get("step_s") is None else res["step_s"] * 1e3, ".1f"),
            _fmt(r["step_vs_fp32"], ".2f"),
            _fmt(r["step_vs_hand"], ".2f"),
            str(comp["converts"]),
            f"{comp['half_matmuls']} ({prog['half_matmuls']})/{prog['matmuls']}"
            + (f", fp8 {prog['fp8_matmuls']}" if prog.get("fp8_matmuls") else ""),
            str(comp["instructions"]),
            _fmt(res.get("final_loss"), ".4f"),
            _fmt(res.get("final_loss_minus_fp32"), "+.4f"),
        ])  # fmt: skip
    return rows


def markdown_table(model: dict) -> str:
    aligns = ["---" if i < 3 else "---:" for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(aligns) + "|"]
    for row in table_rows(model):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def compact_table(models: dict) -> str:
    """One row per variant, a few ratios per model: the table for the README."""
    names = list(dict.fromkeys(n for m in models.values() for n in m["variants"]))
    head = ["variant"]
    for mname in models:
        head += [f"{mname} saved ×hand", f"{mname} step ×hand", f"{mname} t+c ×fp32"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|" + "---:|" * (len(head) - 1)]  # fmt: skip
    for name in names:
        cells = [name]
        for model in models.values():
            res = model["variants"].get(name)
            if res is None or res["status"] != "ok":
                status = "—" if res is None else res["status"]
                cells += [status, "", ""]
                continue
            r = res["ratios"]
            cells += [_fmt(r["saved_vs_hand"], ".2f"), _fmt(r["step_vs_hand"], ".2f"),
                      _fmt(r["trace_compile_vs_fp32"], ".2f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_targets(models: dict, backend: str) -> list[dict]:
    """Each DESIGN.md target against the numbers. GPU-only targets are reported as
    INFO (with the numbers) on other backends."""
    on_gpu = backend == "gpu"
    checks = []

    def add(model, variant, target, value, limit, ok, gpu_only, detail, same=False):
        if value is None:
            status = "n/a"
        elif gpu_only and not on_gpu:
            status = "INFO"
        elif same:
            status = "SAME"
            detail += "; the same compiled program"
        else:
            status = "PASS" if ok else "LAG"
        checks.append({"model": model, "variant": variant, "target": target,
                       "value": value, "limit": limit, "status": status,
                       "gpu_only": gpu_only, "detail": detail})  # fmt: skip

    for mname, model in models.items():
        vs = model["variants"]
        hand = vs.get("hand_bf16", {})
        for name in ("filter_amp_bf16", "autocast_bf16"):
            res = vs.get(name)
            if res is None or res["status"] != "ok":
                continue
            r = res["ratios"]
            v = r["step_vs_hand"]
            add(mname, name, "step time ≤ 1.02× hand-cast (GPU)", v, STEP_TOLERANCE,
                v is not None and v <= STEP_TOLERANCE, True,
                f"{_ms(res.get('step_s'))} vs {_ms(hand.get('step_s'))}")  # fmt: skip
            v = r["memory_vs_hand"]
            add(mname, name, "compiled memory ≤ hand-cast (GPU)", v, 1.0,
                v is not None and v <= 1.0, True,
                f"{_mib(res['memory'].get('total_bytes'))} vs "
                f"{_mib(hand.get('memory', {}).get('total_bytes'))}")  # fmt: skip
            v = r["saved_vs_hand"]
            add(mname, name, "saved activations ≤ hand-cast", v, 1.0,
                v is not None and v <= 1.0, False,
                f"{_mib(res['saved'].get('bytes'))} vs "
                f"{_mib(hand.get('saved', {}).get('bytes'))}")  # fmt: skip
            limit = COMPILE_LIMITS[name]
            v = r["trace_compile_vs_fp32"]
            detail = ""
            if vs.get("fp32", {}).get("status") == "ok":
                # Hand-cast's own ratio is the floor any correct half-precision
                # program meets on this backend (on a CPU, XLA wraps every half op
                # in converts, and compiles them).
                hand_ratio = hand.get("ratios", {}).get("trace_compile_vs_fp32")
                detail = (
                    f"{res['trace_compile_s']:.2f} s vs {vs['fp32']['trace_compile_s']:.2f} s;"
                    f" trace+lower alone {_x(r['trace_vs_fp32'])} fp32;"
                    f" t+c {_x(r['trace_compile_vs_hand'])} hand-cast,"
                    f" which itself is {_x(hand_ratio)} fp32"
                )
            add(mname, name, f"trace+compile ≤ {limit}× fp32", v, limit,
                v is not None and v <= limit, False, detail)  # fmt: skip
            for peer, pres in vs.items():
                if VARIANTS[peer].family != "peer" or pres["status"] != "ok":
                    continue
                # The same compiled program cannot be ahead of itself: its
                # compile and step times differ by noise only.
                same = (
                    res["hlo_compiled"]["signature"]
                    == pres["hlo_compiled"]["signature"]
                )
                v = _ratio(res.get("step_s"), pres.get("step_s"))
                add(mname, name, f"step time ahead of {peer} (GPU)", v, 1.0,
                    v is not None and v < 1.0, True,
                    f"{_ms(res.get('step_s'))} vs {_ms(pres.get('step_s'))}",
                    same)  # fmt: skip
                ours, theirs = res["trace_compile_s"], pres["trace_compile_s"]
                v = _ratio(ours, theirs)
                add(mname, name, f"trace+compile ahead of {peer}", v, 1.0,
                    v is not None and v < 1.0, False,
                    f"{ours:.2f} s vs {theirs:.2f} s; trace+lower "
                    f"{res['trace_lower_s']:.2f} s vs {pres['trace_lower_s']:.2f} s",
                    same)  # fmt: skip
    return checks


def _x(r):
    return "—" if r is None else f"{r:.2f}×"


def _ms(s):
    return "—" if s is None else f"{s * 1e3:.1f} ms"


def _mib(b):
    return "—" if b is None else f"{b / MiB:.2f} MiB"


def targets_text(checks: list[dict], backend: str) -> str:
    lines = [f"targets (DESIGN.md; backend {backend}; INFO = a GPU target, shown with "
             "the numbers measured here; SAME = both compiled the same program):"]  # fmt: skip
    for c in checks:
        value = "—" if c["value"] is None else f"{c['value']:.3f}"
        lines.append(
            f"  [{c['status']:>4}] {c['model']:<4} {c['variant']:<16} {c['target']:<40} "
            f"{value:>7} (limit {c['limit']})  {c['detail']}"
        )
    return "\n".join(lines)


def hardware() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10
        ).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu"] = value.strip()
    except (OSError, subprocess.SubprocessError):
        info["cpu"] = platform.processor() or "unknown"
    info["cores"] = os.cpu_count()
    info["devices"] = [str(d.device_kind) for d in jax.devices()]
    return info


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("jax", "jaxlib", "equinox", "optax", "eqx_amp", "jmp",
                "mixed-precision-for-JAX", "jaxamp"):  # fmt: skip
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def markdown_report(report: dict) -> str:
    meta = report["meta"]
    hw = meta["hardware"]
    devices = ", ".join(sorted(set(hw["devices"])))
    parts = [
        f"Run on {meta['date']}: backend `{meta['backend']}` ({devices}), "
        f"CPU {hw.get('cpu', '?')}, {hw['cores']} cores; jax {meta['versions']['jax']}, "
        f"equinox {meta['versions']['equinox']}; preset `{meta['preset']}`, "
        f"{meta['steps']} training steps, {meta['repeats']} timed trace+compile repeats.",
        f"Command: `{meta['command']}`",
    ]  # fmt: skip
    for model in report["models"].values():
        parts.append(f"**{model['description']}** ({model['params']:,} parameters; "
                     f"initial loss {model['initial_loss']:.4f})")  # fmt: skip
        parts.append(markdown_table(model))
    parts.append(
        "Targets:\n\n```\n" + targets_text(report["targets"], meta["backend"]) + "\n```"
    )
    parts.append("Compact (for the README):\n\n" + compact_table(report["models"]))
    return "\n\n".join(parts) + "\n"


def explain(
    model_names: list[str], preset: str, names: list[str], reference: str
) -> None:
    """Prints, per model, the saved residuals of each variant that differ from those
    of `reference`: dtype and shape, the op that produced them and its source line."""
    for mname in model_names:
        task = make_task(mname, PRESETS[preset][mname])
        ref = VARIANTS[reference].build(task)
        ref_table = _measure.residual_table(ref.loss_of, ref.diff_args)
        for name in names:
            built = VARIANTS[name].build(task)
            table = _measure.residual_table(built.loss_of, built.diff_args)
            total, ref_total = sum(table.values()), sum(ref_table.values())
            print(f"\n== {mname} {name}: saved {total / MiB:.3f} MiB vs {reference} "
                  f"{ref_total / MiB:.3f} MiB ({total / ref_total:.3f}x)")  # fmt: skip
            print(f"{'bytes':>10} {reference:>10}  residual, and what produced it")
            keys = sorted(
                set(table) | set(ref_table), key=lambda k: -abs(table[k] - ref_table[k])
            )
            for key in keys:
                if table[key] != ref_table[key]:
                    print(
                        f"{table[key]:>10} {ref_table[key]:>10}  {key[0]:<22} {key[1]}"
                    )


#
# Main.
#


def parse_variants(spec: str) -> list[str]:
    names = []
    for part in spec.split(","):
        part = part.strip()
        if part == "default":
            names.extend(DEFAULT_VARIANTS)
        elif part == "eqx_amp":
            names.extend(EQX_AMP_ONLY)
        elif part == "all":
            names.extend(VARIANTS)
        elif part in VARIANTS:
            names.append(part)
        elif part:
            raise SystemExit(
                f"unknown variant {part!r}; choose from default, eqx_amp, all, "
                + ", ".join(VARIANTS)
            )
    return list(dict.fromkeys(names))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    backend = jax.default_backend()
    parser.add_argument("--preset",
                        choices=sorted(PRESETS)
                        + ["sharded", "state", "h100-aot", "b200-aot"],
                        default="gpu" if backend == "gpu" else "cpu",
                        help="`sharded`: benchmarks/sharded.py (collectives on 8 "
                        "devices), `h100-aot`: benchmarks/h100_aot.py (compiled "
                        "for an H100 without one), each in its own process")  # fmt: skip
    parser.add_argument("--models", default="gpt,cnn",
                        help="comma-separated: gpt, cnn, llama")  # fmt: skip
    parser.add_argument("--config", default="",
                        help="comma-separated overrides of the preset's model sizes, "
                        "e.g. depth=4,batch=8 (one model per run)")  # fmt: skip
    parser.add_argument("--variants", default="default",
                        help="comma-separated names, or default / eqx_amp / all")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per variant (K; the first is not timed)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed trace+compile repeats per variant")  # fmt: skip
    parser.add_argument("--json", type=pathlib.Path, help="write all results here")
    parser.add_argument("--markdown", type=pathlib.Path,
                        help="write the tables and targets as markdown here")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failures")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="instead of benchmarking, print the saved residuals in which "
        "each variant differs from --reference (no compilation)",
    )
    parser.add_argument("--reference", default="hand_bf16", choices=sorted(VARIANTS))
    args = parser.parse_args(argv)
    if args.preset == "sharded":
        # It sets XLA's flags (8 CPU devices, the SPMD dump) before importing JAX,
        # which this process has already done.
        command = [sys.executable, str(_HERE / "sharded.py")]
        if args.json:
            command += ["--json", str(args.json)]
        sys.exit(subprocess.run(command).returncode)
    if args.preset in ("h100-aot", "b200-aot"):
        # The CUDA plugin must be told before JAX starts its backends that this
        # machine has no GPU, which this process has done.
        script = "h100_aot.py" if args.preset == "h100-aot" else "b200_aot.py"
        command = [sys.executable, str(_HERE / script), "--models", args.models]
        if args.variants != "default":
            command += ["--variants", args.variants]
        for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
            if path:
                command += [flag, str(path)]
        sys.exit(subprocess.run(command).returncode)
    if args.preset == "state":
        command = [sys.executable, str(_HERE / "training_state.py")]
        sys.exit(subprocess.run(command).returncode)
    args.steps = STEPS[args.preset] if args.steps is None else max(2, args.steps)
    args.repeats = (
        REPEATS[args.preset] if args.repeats is None else max(1, args.repeats)
    )
    variants = [VARIANTS[n] for n in parse_variants(args.variants)]
    model_names = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.explain:
        explain(model_names, args.preset, [v.name for v in variants], args.reference)
        return

    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "backend": backend,
        "hardware": hardware(),
        "versions": versions(),
        "preset": args.preset,
        "steps": args.steps,
        "repeats": args.repeats,
        "variants": [v.name for v in variants],
        "command": "python benchmarks/run.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(f"eqx_amp benchmarks: backend {backend}, preset {args.preset}, "
          f"{args.steps} steps, {args.repeats} repeats; {meta['hardware'].get('cpu')}, "
          f"{meta['hardware']['cores']} cores", flush=True)  # fmt: skip
    models = {}
    for name in model_names:
        config = with_overrides(PRESETS[args.preset][name], args.config)
        models[name] = run_model(name, config, variants, args)
        if args.json:  # after each model, so that a run cut short keeps what it did
            args.json.write_text(
                json.dumps({"meta": meta, "models": models}, indent=1, default=str)
            )
    checks = check_targets(models, backend)
    report = {"meta": meta, "models": models, "targets": checks}

    print()
    for model in models.values():
        print(f"{model['description']} ({model['params']:,} parameters; "
              f"initial loss {model['initial_loss']:.4f})")  # fmt: skip
        print(markdown_table(model))
        print()
    print("columns: t+c = trace+lower + compile (median of repeats); compiled MiB = "
          "memory_analysis() temp+argument+output; saved MiB = forward values saved "
          "for the backward pass (jax.vjp residuals); step ms = median step time; "
          "×fp32 / ×hand = ratio to fp32 / hand_bf16; "
          "converts / instrs = compiled HLO; half mm = dots+convs with a bf16/f16 "
          "operand, compiled (program) / all, and the program's fp8 ones "
          "(dots of values converted from fp8); loss@K = float32 loss of the final "
          "master weights on batch 0.")  # fmt: skip
    failed = [(n, r) for m in models.values() for n, r in m["variants"].items()
              if r["status"] != "ok"]  # fmt: skip
    if failed:
        print("\nnot run:")
        for n, r in dict(failed).items():
            print(f"  {n}: {r['status']}: {r.get('error', '')}")
    print()
    print(targets_text(checks, backend))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"\nresults written to {args.json}")
    if args.markdown:
        args.markdown.write_text(markdown_report(report))
        print(f"markdown written to {args.markdown}")


if __name__ == "__main__":
    main()

"""`benchmarks/run.py` runs end to end with the tiniest settings (tiny models, one
trace+compile repeat, two steps, and only the variants that need no optional
package), prints its table and targets, and writes JSON with the expected keys.
No timing is asserted: the targets are reported by the benchmark, not tested."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


# The slow tier: benchmark smoke runs in subprocesses.
pytestmark = pytest.mark.slow


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = ("fp32", "hand_bf16", "filter_amp_bf16", "autocast_bf16", "bimodel_f16")


def test_benchmark_runs(tmp_path):
    out_json = tmp_path / "results.json"
    # The pipeline is under test, not the numbers: a lower XLA backend optimisation
    # level halves the compile times.
    xla_flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags.strip()}
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "run.py"),
            "--preset",
            "tiny",
            "--models",
            "gpt,cnn",
            "--variants",
            ",".join(VARIANTS),
            "--steps",
            "2",
            "--repeats",
            "1",
            "--json",
            str(out_json),
        ],  # fmt: skip
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "| variant | dtype | scaling | trace+lower s | compile s |" in out
    assert "targets (DESIGN.md" in out
    for name in VARIANTS:
        assert f"| {name} |" in out

    report = json.loads(out_json.read_text())
    assert set(report) == {"meta", "models", "targets"}
    assert report["meta"]["preset"] == "tiny"
    assert set(report["models"]) == {"gpt", "cnn"}
    for model in report["models"].values():
        assert set(model["variants"]) == set(VARIANTS)
        for res in model["variants"].values():
            assert res["status"] == "ok", res
            for key in ("trace_lower_s", "compile_s", "memory", "saved", "hlo_program",
                        "hlo_compiled", "step_s", "final_loss", "ratios"):  # fmt: skip
                assert key in res, key
            assert res["memory"]["total_bytes"] > 0
            assert res["saved"]["bytes"] > 0
        # The half-precision variants ask XLA for every matmul in half precision.
        for name in ("hand_bf16", "filter_amp_bf16", "autocast_bf16", "bimodel_f16"):
            hlo = model["variants"][name]["hlo_program"]
            assert hlo["half_matmuls"] == hlo["matmuls"] > 0
        assert model["variants"]["fp32"]["hlo_program"]["half_matmuls"] == 0
        # filter_amp compiles exactly the program written by hand.
        signature = {
            n: r["hlo_compiled"]["signature"] for n, r in model["variants"].items()
        }
        assert (
            signature["filter_amp_bf16"] == signature["hand_bf16"] != signature["fp32"]
        )
    # On the CNN, so does autocast: its norms hand back bfloat16 as the hand-cast
    # model's do.
    cnn = report["models"]["cnn"]["variants"]
    assert (
        cnn["autocast_bf16"]["hlo_compiled"]["signature"]
        == (cnn["hand_bf16"]["hlo_compiled"]["signature"])
    )
    statuses = {c["status"] for c in report["targets"]}
    assert statuses <= {"PASS", "LAG", "INFO", "SAME", "n/a"}


def _run_benchmark(*args: str) -> subprocess.CompletedProcess:
    xla_flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags.strip()}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "run.py"), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_benchmark_llama_with_overridden_sizes(tmp_path):
    """The Llama-style model trains in bf16 and fp8, at the sizes `--config` sets."""
    out_json = tmp_path / "llama.json"
    result = _run_benchmark(
        "--preset", "tiny", "--models", "llama", "--config", "depth=2,batch=3",
        "--variants", "hand_bf16,filter_amp_fp8", "--steps", "2",
        "--json", str(out_json),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    model = json.loads(out_json.read_text())["models"]["llama"]
    assert model["description"].startswith("Llama-style: 2 blocks,")
    assert "batch 3" in model["description"]
    fp8 = model["variants"]["filter_amp_fp8"]
    assert fp8["status"] == "ok" and fp8["hlo_program"]["fp8_matmuls"] > 0


def test_benchmark_rejects_a_bad_config():
    result = _run_benchmark(
        "--preset", "tiny", "--models", "gpt", "--config", "depht=2"
    )
    assert result.returncode != 0
    assert "--config: expected NAME=VALUE (an integer but for" in result.stderr
    assert "'depht=2'" in result.stderr


def test_config_overrides_name_the_attention_by_word_and_sizes_by_number():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import _models

    llama = _models.PRESETS["tiny"]["llama"]
    flash = _models.with_overrides(llama, "attention=cudnn,depth=2")
    assert (flash.attention, flash.depth) == ("cudnn", 2)
    assert flash.describe().endswith(", cuDNN flash attention")
    assert llama.attention == "equinox"
    model = _models.make_task("llama", flash).model
    assert all(block.flash for block in model.blocks)
    with pytest.raises(SystemExit, match="attention is 'equinox' or 'cudnn'"):
        _models.make_task("llama", _models.with_overrides(llama, "attention=flash"))
    for bad in ("depth=two", "attention=", "heads"):
        with pytest.raises(SystemExit, match=r"--config: expected NAME=VALUE"):
            _models.with_overrides(llama, bad)


def test_training_state_benchmark_counts_the_bytes():
    xla_flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags.strip()}
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "training_state.py"),
            "--preset",
            "tiny",
            "--models",
            "gpt",
            "--steps",
            "1",
        ],  # fmt: skip
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    per_weight = {}
    for line in result.stdout.splitlines():
        if line.startswith("| ") and not line.startswith("| configuration"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            per_weight[cells[0]] = float(cells[1])
    assert per_weight["f32 Adam"] == 12.0
    assert 13.9 < per_weight["AMP, f32 master"] <= 14.0
    assert per_weight["master_weights"] == 14.0
    assert per_weight["bf16 + Kahan, bf16 moments"] <= 8.01
    assert per_weight["bf16 + SR, 8-bit moments"] <= 4.1


def test_telemetry_overhead_benchmark_runs():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [
            sys.executable,
            "telemetry_overhead.py",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--repeats",
            "1",
        ],  # fmt: skip
        cwd=REPO_ROOT / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "plain ms  measured ms   ratio" in result.stdout
    for line in ("gpt   filter_amp f16", "cnn   autocast fp8"):
        assert line in result.stdout

"""The examples run end to end (with tiny settings, so the suite stays fast)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest


# The slow tier: the example scripts, end to end.
pytestmark = pytest.mark.slow


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run_example(name: str, *args: str) -> str:
    # The checkout's `eqx_amp` comes first, installed or not.
    pythonpath = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in pythonpath if p),
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / name), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_quickstart():
    pytest.importorskip("sklearn")
    out = _run_example("quickstart.py", "--epochs", "1", "--batch-size", "64")
    assert "fp32 test accuracy:" in out
    assert "amp test accuracy:" in out
    assert "variant  | test accuracy | final train loss | compiled step memory" in out
    assert "amp/fp32:" in out


def test_data_parallel():
    pytest.importorskip("sklearn")
    out = _run_example(
        "data_parallel.py", "--steps", "12", "--period", "5", "--inject-nan", "4"
    )
    table = {
        cells[0].strip(): cells[1].strip()
        for line in out.splitlines()
        if line.startswith("| ") and len(cells := line[2:].split(" | ")) == 2
    }
    assert table["devices"] == "8 x cpu"
    assert table["skipped steps"].startswith("1 at [4]")
    assert table["params finite"] == "True"


def test_debug_overflow_finds_and_fixes_the_overflow():
    out = _run_example("debug_overflow.py")
    assert "float16 loss: inf" in out
    assert "first non-finite value: `exp` in scope 'GaussianHead'" in out
    assert "first non-finite value: `convert_element_type`" in out
    assert "Fix 1" in out and "find_nonfinite: None" in out
    assert "exp runs in ('float32',) under 'GaussianHead'" in out
    assert "variant                       |   loss | first non-finite op" in out
    assert "fix 2: autocast float16       | 5.9934 | none" in out


def test_bimodel_transformer():
    out = _run_example(
        "bimodel_transformer.py",
        *("--steps", "6", "--batch-size", "4", "--block-size", "16", "--dim", "16"),
        *("--heads", "2", "--layers", "1", "--val-batches", "1", "--redo-on-nan", "1"),
    )
    assert "alice29.txt: 148,481 characters" in out
    assert "fp32 final loss: train" in out
    assert "bimodel final loss: train" in out
    assert "compiled.memory_analysis() of the training step:" in out
    assert "variant  | train loss | val loss | step memory | saved activations" in out
    assert "gradient tree 0.5" in out  # the float16 gradient tree is about half
    assert "bimodel/fp32: val loss" in out


def test_fsdp_trains_on_a_two_dimensional_mesh():
    out = _run_example(
        "fsdp.py",
        *("--steps", "6", "--dim", "32", "--layers", "2", "--batch", "16"),
        *("--block", "16", "--dtype", "float16", "--reduce-dtype", "float32"),
    )
    assert "8 x cpu as 4 data x 2 model" in out
    assert "reduce=float32" in out
    rows = [line for line in out.splitlines() if line.startswith(("| fp32", "| amp"))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1] == "True"  # the weights kept their shardings
        assert np.isfinite(float(cells[1])) and np.isfinite(float(cells[2]))


def test_fsdp_trains_in_fp8():
    out = _run_example(
        "fsdp.py",
        *("--steps", "6", "--dim", "32", "--layers", "2", "--batch", "16"),
        *("--block", "16", "--fp8"),
    )
    rows = [line for line in out.splitlines() if line.startswith("| fp8")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[-1] == "True"  # the weights kept their shardings
    assert np.isfinite(float(cells[1])) and np.isfinite(float(cells[2]))
    assert "fp8/amp: val loss" in out


def test_fp8_training_tracks_bfloat16_and_the_ablation_does_not():
    pytest.importorskip("sklearn")
    out = _run_example("fp8_training.py", "--seeds", "1", "--steps", "30")
    rows = {}
    for line in out.splitlines():
        if line.startswith("| digits") or line.startswith("| char"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0], cells[1])] = float(cells[2].split()[0])
    for task in ("digits CNN", "char transformer"):
        bf16, fp8 = rows[(task, "bf16")], rows[(task, "fp8")]
        assert abs(fp8 - bf16) < 0.05 * bf16
        assert abs(rows[(task, "mxfp8")] - bf16) < 0.05 * bf16
        # 4-bit forward operands: within 5% after these 30 steps (the full run:
        # +1.7% on the text, the digits' small final loss +55%).
        assert abs(rows[(task, "nvfp4")] - bf16) < 0.05 * bf16
        assert rows[(task, "fp8, no scaling")] > 1.2 * bf16


def test_low_precision_state_halves_the_state_and_tracks_the_float32_master():
    pytest.importorskip("sklearn")
    out = _run_example("low_precision_state.py", "--seeds", "1", "--steps", "20")
    rows = {}
    for line in out.splitlines():
        if line.startswith("| digits") or line.startswith("| char"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0], cells[1])] = (float(cells[2]), float(cells[3].split()[0]))
    for task in ("digits CNN", "char transformer"):
        per_weight = {name: rows[(task, name)][0] for t, name in rows if t == task}
        assert per_weight["f32"] == 12.0
        assert 13.9 <= per_weight["AMP, f32 master"] <= 14.0
        assert per_weight["bf16 + Kahan, bf16 moments"] <= 8.01
        assert per_weight["bf16 + SR, 8-bit moments"] <= 4.1
        master = rows[(task, "AMP, f32 master")][1]
        for name in ("bf16 + Kahan, bf16 moments", "bf16 + SR, 8-bit moments"):
            assert abs(rows[(task, name)][1] - master) < 0.05 * master, (task, name)


def test_telemetry_underflow_shows_the_subnormal_gradients():
    out = _run_example(
        "telemetry_underflow.py", "--steps", "4", "--every", "2", "--width", "8"
    )
    assert "run              | step |      loss | worst output gradient" in out
    assert "no loss scale    |    4 |" in out and "DynamicLossScale |    4 |" in out


def test_telemetry_fp8_shows_what_unscaled_fp8_flushes():
    pytest.importorskip("sklearn")
    out = _run_example("telemetry_fp8.py", "--steps", "4", "--every", "2")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("fp8")]
    scaled = [r for r in rows if r[0].strip() == "fp8"]
    unscaled = [r for r in rows if r[0].strip() == "fp8, no scaling"]
    assert len(scaled) == len(unscaled) == 3
    # With scales nothing saturates or flushes; without, most of a gradient flushes.
    assert all(r[3].strip() == "0% / 0%" and r[4].strip() == "0%" for r in scaled)
    assert all(float(r[4].split("%")[0]) > 50 for r in unscaled)
    assert "step 4 (no fp8 cast overflowed), each fp8 cast of both runs:" in out
    assert "fp8, no scaling, step 4, `summary(top=6)`:" in out

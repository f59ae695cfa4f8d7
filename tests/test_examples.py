"""The examples run end to end (with tiny settings, so the suite stays fast)."""

import numpy as np
import pytest

from .helpers import run_example


# The slow tier: the example scripts, end to end.
pytestmark = pytest.mark.slow


def test_quickstart():
    pytest.importorskip("sklearn")
    out = run_example("quickstart.py", "--epochs", "1", "--batch-size", "64")
    assert "fp32 test accuracy:" in out
    assert "amp test accuracy:" in out
    assert "variant  | test accuracy | final train loss | compiled step memory" in out
    assert "amp/fp32:" in out


def test_data_parallel():
    pytest.importorskip("sklearn")
    out = run_example(
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
    out = run_example("debug_overflow.py")
    assert "float16 loss: inf" in out
    assert "first non-finite value: `exp` in scope 'GaussianHead'" in out
    assert "first non-finite value: `convert_element_type`" in out
    assert "Fix 1" in out and "find_nonfinite: None" in out
    assert "exp runs in ('float32',) under 'GaussianHead'" in out
    assert "variant                       |   loss | first non-finite op" in out
    assert "fix 2: autocast float16       | 5.9934 | none" in out


def test_bimodel_transformer():
    out = run_example(
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
    out = run_example(
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
    out = run_example(
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


def test_telemetry_underflow_shows_the_subnormal_gradients():
    out = run_example(
        "telemetry_underflow.py", "--steps", "4", "--every", "2", "--width", "8"
    )
    assert "run              | step |      loss | worst output gradient" in out
    assert "no loss scale    |    4 |" in out and "DynamicLossScale |    4 |" in out


def test_telemetry_fp8_shows_what_unscaled_fp8_flushes():
    pytest.importorskip("sklearn")
    out = run_example("telemetry_fp8.py", "--steps", "4", "--every", "2")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("fp8")]
    scaled = [r for r in rows if r[0].strip() == "fp8"]
    unscaled = [r for r in rows if r[0].strip() == "fp8, no scaling"]
    assert len(scaled) == len(unscaled) == 3
    # With scales nothing saturates or flushes; without, most of a gradient flushes.
    assert all(r[3].strip() == "0% / 0%" and r[4].strip() == "0%" for r in scaled)
    assert all(float(r[4].split("%")[0]) > 50 for r in unscaled)
    assert "step 4 (no fp8 cast overflowed), each fp8 cast of both runs:" in out
    assert "fp8, no scaling, step 4, `summary(top=6)`:" in out

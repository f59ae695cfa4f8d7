"""The notebook runs top to bottom (on tiny settings, so the suite stays fast)."""

import json
import os
import pathlib
import sys

import pytest


# The slow tier: executes the tour notebook.
pytestmark = pytest.mark.slow


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO_ROOT / "notebooks" / "mixed_precision_tour.ipynb"
VARIANTS = (
    "fp32",
    "filter_amp bf16",
    "autocast bf16",
    "BiModel f16 + loss scaling",
    "f16, no loss scaling",
)


def _kernel_env(tmp_path: pathlib.Path) -> dict[str, str]:
    """A `python3` kernelspec that runs this interpreter, found first on
    JUPYTER_PATH, so the kernel sees the packages (and `eqx_amp`) the tests see."""
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    jupyter_path = [str(tmp_path), os.environ.get("JUPYTER_PATH", "")]
    # The checkout's `eqx_amp` comes first, installed or not.
    pythonpath = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {
        "JUPYTER_PATH": os.pathsep.join(p for p in jupyter_path if p),
        "PYTHONPATH": os.pathsep.join(p for p in pythonpath if p),
        "EQX_AMP_NOTEBOOK_SMALL": "1",
        "JAX_PLATFORMS": "cpu",
    }


def _stream_text(cell) -> str:
    return "".join(
        out.get("text", "")
        for out in cell.get("outputs", [])
        if out["output_type"] == "stream"
    )


def test_notebook_runs_on_small_settings(tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    import nbformat

    for name, value in _kernel_env(tmp_path).items():
        monkeypatch.setenv(name, value)  # the kernel inherits this environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the traceback, on any error

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    errors = [
        out
        for c in code_cells
        for out in c.get("outputs", [])
        if out["output_type"] == "error"
    ]
    assert not errors
    assert all(c.get("execution_count") for c in code_cells)
    assert "small settings" in _stream_text(code_cells[0])

    (summary,) = [
        c for c in code_cells if "summary-table" in c.metadata.get("tags", [])
    ]
    table = _stream_text(summary)
    for variant in VARIANTS:
        assert variant in table, (variant, table)
    # Every figure came back as an image.
    images = [
        out
        for c in code_cells
        for out in c.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert len(images) == 5
    # The fp8 section: its matmuls are fp8, and each variant has a line per task.
    (fp8_cell,) = [c for c in code_cells if "FP8_VARIANTS = [" in "".join(c.source)]
    fp8_text = _stream_text(fp8_cell)
    assert "float8_e4m3fn x float8_e4m3fn" in fp8_text
    for name in ("autocast fp8", "fp8, no scaling"):
        assert f"digits       {name}" in fp8_text and f"transformer  {name}" in fp8_text
    # The training-state section: a line per task and variant, with its bytes.
    (state_cell,) = [c for c in code_cells if "STATE_NAMES = [" in "".join(c.source)]
    state_text = _stream_text(state_cell)
    for line in ("8.00 bytes/weight", "4.03 bytes/weight", "14.00 bytes/weight"):
        assert line in state_text, state_text
    assert state_text.count("final loss") == 8

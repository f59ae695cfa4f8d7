"""The optimizer update of each low-precision training state, compiled for an H100
without one (benchmarks/state_update_aot.py), moves no more bytes than float32
Adam's: its state is 4 to 8 bytes per weight against Adam's 12, and the 8-bit
moments' encoding (a block statistic, then the codes) must not cost that back by
writing float32 moments to memory and reading them again. Needs the CUDA plugin,
not a GPU."""

import json
import pathlib
import subprocess
import sys

import pytest

from .helpers import needs_cuda_plugin


pytestmark = [
    pytest.mark.slow,
    needs_cuda_plugin,
]

SCRIPT = (
    pathlib.Path(__file__).resolve().parent.parent
    / "benchmarks"
    / "state_update_aot.py"
)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("state_update") / "rows.json"
    # A one-block GPT at width 256: every matrix a multiple of the 8-bit block,
    # the bytes per weight those of GPT-2 small's (within 0.1 B), compiled in
    # minutes on two cores.
    run = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--config",
            "depth=1,width=256,heads=4,seq=256,vocab=1024", "--only",
            "f32_adam,bf16_kahan_bf16_moments,bf16_sr_8_bit_moments",
            "--json", str(out),
        ],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return {r["name"]: r for r in json.loads(out.read_text())}


def test_low_precision_states_move_no_more_bytes_than_float32_adam(rows):
    adam = rows["f32 Adam"]
    # float32 Adam's update is one pass over its state: what it weighs, read and
    # written, and the gradients read.
    assert adam["bytes"] == pytest.approx(adam["floor_bytes"], rel=0.01)
    for name in ("bf16 + Kahan, bf16 moments", "bf16 + SR, 8-bit moments"):
        assert rows[name]["bytes"] / adam["bytes"] <= 1.0, name


def test_eight_bit_moments_are_not_written_in_float32(rows):
    # Two passes over the state (the blocks' statistics, then the codes, the
    # weights and the updates), each reading the 1-byte codes: about 14 bytes a
    # weight at GPT-2 small's shapes. Writing the float32 moments to memory and
    # reading them back (as the update did before) cost 32.6. At this model's
    # 256 x 256 matrices XLA still writes some second moments' square roots
    # before reducing them (16.8 measured).
    eight_bit = rows["bf16 + SR, 8-bit moments"]
    assert eight_bit["bytes"] / eight_bit["weights"] < 20

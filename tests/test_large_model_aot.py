"""A Llama-shaped training step (blocks stacked and scanned under
`eqx.filter_checkpoint`) FSDP-sharded over 2 hosts x 4 H100s, compiled without them
(benchmarks/large_model_aot.py): what each device holds as arguments is exactly its
shard of the training state and of the batch, and the state weighs the bytes per
weight the docs give (12, 14, 8 and 4.03). Needs the CUDA plugin, not a GPU."""

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
    pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "large_model_aot.py"
)
# The bytes per weight of each state, as the training-state guide gives them. An
# AMP BiModel keeps its norms' weights in float32 in its compute copy (16 bytes
# each, a few thousand of 1.3M weights); 8-bit moments add two bfloat16 numbers
# per block of 256 values to each moment's byte.
NOMINAL = {
    "f32_adam": 12.0,
    "amp_f32_master": 14.0,
    "bf16_kahan_bf16_moments": 8.0,
    "bf16_sr_8bit_moments": 2 + 2 * (1 + 4 / 256),
}


def compiled_rows(tmp_path_factory, *options: str) -> list[dict]:
    out = tmp_path_factory.mktemp("large_model") / "rows.jsonl"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "test", *options, "--json", str(out)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return list(map(json.loads, out.read_text().splitlines()))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    rows = compiled_rows(tmp_path_factory, "--products", "bf16")
    return {r["state"]: r for r in rows}


@pytest.mark.parametrize("state", sorted(NOMINAL))
def test_arguments_are_the_state_shard_and_the_batch(rows, state):
    row = rows[state]
    assert row["devices"] == 8
    # Nothing replicated that should be split, nothing copied beside it.
    assert (
        row["argument_bytes"]
        == row["state_bytes_per_device"] + row["batch_bytes_per_device"]
    )
    assert row["state_bytes_per_weight"] == pytest.approx(NOMINAL[state], abs=0.01)
    per_device = row["weights"] * NOMINAL[state] / row["devices"]
    assert row["state_bytes_per_device"] == pytest.approx(per_device, rel=0.002)


def test_a_bimodel_gathers_the_weights_the_others_gather(rows):
    # The test model's 8 stacked layers divide by its 8 devices: a compute copy
    # split along its layer axis (each device holding whole layers) made XLA gather
    # the activations instead, 6x these bytes.
    gathered = {
        state: row["collectives"]["all-gather bf16"] for state, row in rows.items()
    }
    assert gathered["amp_f32_master"] == pytest.approx(gathered["f32_adam"], rel=0.01)


def test_weights_are_gathered_in_bfloat16(rows):
    # FSDP gathers each block's weights where the scan needs them, cast to the
    # compute dtype first: bfloat16 bytes, never float32 ones of a float32 master.
    for state, row in rows.items():
        c = row["collectives"]
        assert c.get("all-gather bf16", 0) > 0, state
        assert c.get("all-gather f32", 0) < 0.01 * c["all-gather bf16"], state


def test_flash_attention_keeps_the_state_split(tmp_path_factory, rows):
    # `--attention cudnn`: cuDNN's flash attention inside the scanned, checkpointed
    # blocks, the FSDP split unchanged, for bfloat16 and fp8 products.
    assert rows["f32_adam"]["attention"] == "xla"
    assert rows["f32_adam"]["fused_attention_calls"] == 0
    rows = compiled_rows(
        tmp_path_factory, "--attention", "cudnn", "--states", "f32_adam",
        "--products", "bf16,fp8",
    )  # fmt: skip
    assert [r["products"] for r in rows] == ["bf16", "fp8"]
    for row in rows:
        assert row["attention"] == "cudnn"
        # The forward call, and the backward's (with the forward recomputed for it).
        assert row["fused_attention_calls"] >= 2, row["products"]
        assert (
            row["argument_bytes"]
            == row["state_bytes_per_device"] + row["batch_bytes_per_device"]
        )
        assert row["state_bytes_per_weight"] == pytest.approx(12.0, abs=0.01)

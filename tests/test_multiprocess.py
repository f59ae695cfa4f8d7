"""eqx_amp on JAX's multi-process runtime: real processes (`eqx_amp.tools.launch_local`,
CPU devices, gloo collectives), every process running `tests/_multiprocess.py`, as
every host of a cluster runs the same script. Three process groups serve every test:
2 processes x 4 devices, the same 8 devices in 1 process (the reference), and
4 processes x 2 devices (restoring what the 2 processes saved, and the bad set-ups).

Everything compared here is bit-identical to one process holding all 8 devices: the
same mesh gives XLA the same partitioned program, and on this CPU backend its
collectives between processes (gloo) gave the same bits as those inside one. An
accelerator's collectives may sum in another order across hosts than within one; the
tests that compare to the one-process run would then need a tolerance.
"""

import json
import os
import pathlib
import sys

import pytest

from eqx_amp.tools.launch_local import format_results, launch


pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = [sys.executable, str(ROOT / "tests" / "_multiprocess.py")]
# Generous: the limit only stops a run that hangs (a collective waiting for a peer
# that is gone), it times nothing.
TIMEOUT = 1200


def run(processes: int, devices: int, checks: list[str], **env) -> dict:
    """{(check, road): [each process's report]} of one run of the worker."""
    results = launch(
        [*WORKER, *checks],
        processes,
        cpu_devices=devices,
        timeout=TIMEOUT,
        env={**os.environ, **env},
        cwd=ROOT,
        check=True,
    )
    reports: dict = {}
    for r in results:
        for line in r.output.splitlines():
            if line.startswith("REPORT "):
                entry = json.loads(line[len("REPORT ") :])
                key = (entry.pop("check"), entry.pop("road"))
                reports.setdefault(key, []).append(entry)
    for key, entries in reports.items():
        assert len(entries) == processes, (key, format_results(results))
    return reports


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("multiprocess_checkpoints")


@pytest.fixture(scope="module")
def two(checkpoint_dir):
    checks = ["fsdp", "scaling", "global", "checkpoint"]
    return run(2, 4, checks, CHECKPOINT_DIR=str(checkpoint_dir))


@pytest.fixture(scope="module")
def one():
    return run(1, 8, ["fsdp", "scaling", "global"])


@pytest.fixture(scope="module")
def four(two, checkpoint_dir):
    env = {"CHECKPOINT_DIR": str(checkpoint_dir), "CHECKPOINT_MODE": "restore"}
    return run(4, 2, ["checkpoint", "bad"], **env)


def agreed(entries: list[dict]) -> dict:
    """The one report every process gave."""
    assert all(e == entries[0] for e in entries[1:]), entries
    return entries[0]


FSDP_ROADS = [
    "filter_amp bf16",
    "autocast bf16",
    "BiModel bf16",
    "fp8 tensorwise",
    "filter_amp f16 + loss scaling",
]


@pytest.mark.parametrize("road", FSDP_ROADS)
def test_fsdp_step_on_two_processes_is_the_one_process_step(road, two, one):
    across = agreed(two["fsdp", road])
    assert across == agreed(one["fsdp", road])  # losses, params, optimizer state
    assert across["kept"] is True
    assert len(across["losses"]) == 3
    assert all(2.0 < loss < 5.0 for loss in across["losses"])


def test_fsdp_roads_differ_where_their_arithmetic_does(two):
    reports = {road: agreed(two["fsdp", road]) for road in FSDP_ROADS}
    # BiModel's bf16 compute copy is filter_amp's cast: the same losses and moments.
    assert reports["BiModel bf16"]["losses"] == reports["filter_amp bf16"]["losses"]
    assert (
        reports["BiModel bf16"]["opt_state"] == reports["filter_amp bf16"]["opt_state"]
    )
    others = {r["losses"][0] for n, r in reports.items() if n != "BiModel bf16"}
    assert len(others) == 4


def test_overflow_on_one_process_skips_the_step_everywhere(two, one):
    jit = agreed(two["scaling", "jit, loss_scaling"])
    assert jit == agreed(one["scaling", "jit, loss_scaling"])
    # Step 1's overflow is in the last process's rows only; every process skipped it,
    # and the loss scale halved once.
    assert jit["finite"] == [True, False, True, True]
    assert jit["scales"] == [2.0**15, 2.0**14, 2.0**14, 2.0**14]
    assert jit["skipped"] == 1

    skip = agreed(two["scaling", "shard_map, redo_on_nan=0"])
    assert skip == agreed(one["scaling", "shard_map, redo_on_nan=0"])
    assert skip["finite"] == [True, False, True, True]
    assert skip["scales"] == [2.0**15, 2.0**9, 2.0**9, 2.0**9]  # factor 2**6
    assert all(skip["devices_agree"])
    # Same data, same model: the losses of the steps taken are the jit road's.
    assert skip["losses"][0] == jit["losses"][0]


def test_redo_on_nan_recomputes_the_step_on_every_process(two, one):
    redo = agreed(two["scaling", "shard_map, redo_on_nan=3"])
    assert redo == agreed(one["scaling", "shard_map, redo_on_nan=3"])
    # Step 1 tried at 2**15 and 2**9, overflowed both times, and went through at 2**3.
    assert redo["finite"][:2] == [True, True]
    assert redo["scales"][:2] == [2.0**15, 2.0**3]
    assert all(redo["devices_agree"])
    skip = agreed(two["scaling", "shard_map, redo_on_nan=0"])
    assert redo["losses"][:2] == skip["losses"][:2]


@pytest.mark.parametrize(
    "road", ["gather_params bf16, reduce f32", "gather_params fp8"]
)
def test_gather_params_across_processes(road, two, one):
    across = agreed(two["global", road])
    assert across == agreed(one["global", road])
    # Global values: the loss and gradients of the whole model on the whole batch,
    # to bfloat16's (fp8's) precision.
    tol = 0.05 if "fp8" in road else 0.01
    assert abs(across["loss"] - across["ref_loss"]) < tol * across["ref_loss"]
    assert across["grad_error"] < tol


def test_reduce_dtype_across_processes(two, one):
    compute = agreed(two["global", "jit, reduce compute"])
    f32 = agreed(two["global", "jit, reduce float32"])
    assert compute == agreed(one["global", "jit, reduce compute"])
    assert f32 == agreed(one["global", "jit, reduce float32"])
    assert compute["dtypes"] == f32["dtypes"] == ["float32"]
    assert compute["loss"] == f32["loss"]
    assert compute["grads"] != f32["grads"]  # summed in bfloat16, then in float32
    assert compute["grad_error"] < 0.01 and f32["grad_error"] < 0.01


def test_eager_diagnostics_read_every_processs_rows(two, one):
    across = agreed(two["global", "eager diagnostics"])
    assert across == agreed(one["global", "eager diagnostics"])
    # The input that overflows float16 (100 x 1000) is in the last process's rows.
    assert across["primitive"] == "convert_element_type"
    assert across["output_dtype"] == "float16"
    assert across["input_ranges"][0][1] == 100_000.0
    assert across["low_precision_share"] == 1.0


def test_telemetry_amax_is_global(two, one):
    across = agreed(two["global", "telemetry"])
    assert across == agreed(one["global", "telemetry"])
    # The largest input is in the last process's rows, yet process 0 reports it.
    assert across["activation"] == across["true_activation"] == 100.0
    assert across["weight"] == across["true_weight"]


CHECKPOINT_ROADS = [
    "BiModel + loss scale",
    "kahan + bf16 moments",
    "sr + 8-bit moments",
]


@pytest.mark.parametrize("road", CHECKPOINT_ROADS)
def test_checkpoint_resumes_bit_identically_across_processes(road, two):
    saved = agreed(two["checkpoint", road])
    assert saved["restored"] == saved["saved"]
    assert saved["resumed"] == saved["uninterrupted"]
    assert saved["saved"] != saved["uninterrupted"]
    assert saved["shardings_kept"] is True


@pytest.mark.parametrize("road", CHECKPOINT_ROADS)
def test_checkpoint_of_two_processes_restores_on_four(road, two, four):
    saved = agreed(two["checkpoint", road])
    restored = agreed(four["checkpoint", road])
    assert restored["restored"] == saved["saved"]
    assert restored["resumed"] == saved["uninterrupted"]
    assert restored["shardings_kept"] is True


def test_mesh_of_one_processs_devices(four):
    reports = four["bad", "mesh of one process's devices"]
    assert reports[0]["put"] == {"value": [2, 3]}
    # JAX's error on a process with no device in the mesh says nothing useful: the
    # guide's check (`covers`) is what catches it, on every process.
    assert all(r["put"]["error"] == "StopIteration" for r in reports[1:])
    assert not any(r["covers"] for r in reports)


def test_mesh_of_each_processs_own_devices_is_silent(four):
    reports = four["bad", "mesh of each process's own devices"]
    # No error: each process sums only its own devices (2 devices x its index).
    assert [r["sum"] for r in reports] == [0.0, 2.0, 4.0, 6.0]
    assert not any(r["covers"] for r in reports)


def test_local_batches_of_different_sizes(four):
    reports = four["bad", "local batches of different sizes"]
    # Without `global_shape` each process infers its own global batch, silently.
    assert [r["inferred"] for r in reports] == [{"value": [8, 3]}] + [
        {"value": [16, 3]}
    ] * 3
    # With it, the process whose batch is wrong raises.
    assert reports[0]["with_global_shape"]["error"] == "ValueError"
    assert (
        "In dimension 0, the process data has 2 elements"
        in (reports[0]["with_global_shape"]["message"])
    )
    assert all(r["with_global_shape"] == {"value": [16, 3]} for r in reports[1:])


def test_different_policy_on_one_process(four):
    reports = four["bad", "a different policy on one process"]
    for r in reports:
        assert r["mismatch"]["error"] == "AssertionError"
        assert r["mismatch"]["message"].startswith("not every process runs")
        assert r["same"] == {"value": True}


def test_fsdp_example_runs_on_two_processes():
    results = launch(
        [
            *(sys.executable, str(ROOT / "examples" / "fsdp.py"), "--multi-host"),
            *("--steps", "3", "--dim", "16", "--heads", "2", "--layers", "1"),
            *("--batch", "8", "--block", "8"),
        ],
        2,
        cpu_devices=4,
        timeout=TIMEOUT,
        cwd=ROOT,
        check=True,
    )
    out = results[0].output
    assert "8 x cpu as 4 data x 2 model in 2 processes" in out
    rows = [line for line in out.splitlines() if line.startswith(("| fp32", "| amp"))]
    assert len(rows) == 2
    for row in rows:
        assert row.rstrip().endswith("| True |")  # the weights kept their shardings
    # Process 0 prints the table; the other process prints none.
    assert "| fp32" not in results[1].output

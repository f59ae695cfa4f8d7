"""The roofline of a GPT-2-small-sized training step compiled for an H100 without
one (benchmarks/h100_aot.py, `_gpu_hlo.roofline`): the bfloat16 roads cost what
hand-cast does, the fp8 roads do not regress, and `where_it_pays()` is faster
than bfloat16. Needs the CUDA plugin, not a GPU (`.ci/run` installs it in its own
environment). A module of its own, beside `test_h100_aot.py`: two test workers
compile the two in parallel."""

import textwrap

import pytest

from .helpers import needs_cuda_plugin, result_of_compile_script


pytestmark = [
    pytest.mark.slow,
    needs_cuda_plugin,
]

ROOFLINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]
    import h100_aot
    sharding = h100_aot.h100_sharding()
    out = {
        v: h100_aot.compile_variant(
            "gpt", v, "gpu", sharding, ("cublas",), config="depth=4,batch=8"
        )["cublas"]["roofline"]
        for v in sys.argv[2].split(",")
    }
    print("RESULT" + json.dumps(out))
    """
)
ROOFLINE_ROADS = (
    "filter_amp_bf16", "filter_amp_fp8", "autocast_fp8", "bimodel_fp8",
    "filter_amp_fp8_paying",
)  # fmt: skip


@pytest.fixture(scope="module")
def roofline():
    """The GPT-2-small-sized step (4 blocks x 768, seq 1024, batch 8, vocab 32768)
    compiled for an H100 with cuBLAS GEMMs: each road's roofline."""
    return result_of_compile_script(
        ROOFLINE_SCRIPT, ",".join(("hand_bf16", *ROOFLINE_ROADS))
    )


# The roofline ratios to hand-cast bfloat16 (launches counted) as compiled today,
# with 3% for XLA's changes: a step that moves more bytes or launches more kernels
# than this is a regression. The goal is below 0.97 for every fp8 road (measured
# on an H100: 1.21x, 1.51x and 1.23x before the roofline work; 1.16x by the roofline
# while the forward GEMMs wrote float32, 1.03x since they write bfloat16).
ROOFLINE_LIMITS = {"filter_amp_fp8": 1.06, "autocast_fp8": 1.06, "bimodel_fp8": 1.06}


def test_a_bfloat16_road_has_the_hand_cast_roofline(roofline):
    assert roofline["filter_amp_bf16"] == roofline["hand_bf16"]
    assert roofline["hand_bf16"]["non_gemm_bytes"]["quantise"] == 0
    assert roofline["hand_bf16"]["non_gemm_bytes"]["epilogue"] == 0


@pytest.mark.parametrize("road", ["filter_amp_fp8", "autocast_fp8", "bimodel_fp8"])
def test_fp8_roofline_does_not_regress(roofline, road):
    hand, ours = roofline["hand_bf16"], roofline[road]
    ratio = ours["time_s_with_launches"] / hand["time_s_with_launches"]
    assert ratio <= ROOFLINE_LIMITS[road]
    # Its GEMMs are fp8 and cost less than bfloat16's; what they cost around
    # them is quantisation, amaxes and rescaling epilogues.
    assert ours["gemm_flops"]["fp8"] > 0.8 * hand["gemm_flops"]["bf16"]
    for kind in ("quantise", "amax"):
        assert ours["non_gemm_bytes"][kind] > hand["non_gemm_bytes"][kind]
    # No GEMM writes float32 for another kernel to rescale.
    assert ours["non_gemm_bytes"]["epilogue"] == 0


def test_fp8_where_it_pays_is_faster_than_bfloat16(roofline):
    """`TENSORWISE.where_it_pays()` keeps GPT-2-small's vocabulary projection in
    fp8 and leaves its other products in bfloat16 (768 x 768: too few FLOPs; the
    MLP's: their six quantisation kernels cost more than they save at 7 us a
    kernel): 0.972x hand-cast's step with launches, 0.966x without, as compiled
    today, where every product in fp8 is 1.02x."""
    hand, ours = roofline["hand_bf16"], roofline["filter_amp_fp8_paying"]
    assert ours["time_s_with_launches"] <= 0.98 * hand["time_s_with_launches"]
    assert ours["time_s"] <= 0.97 * hand["time_s"]
    # The vocabulary projection's three products (forward and both backward).
    assert ours["gemm_flops"]["fp8"] == 3 * 2 * 8192 * 768 * 32768

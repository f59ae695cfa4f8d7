"""The roofline of a GPT-2-small-sized training step compiled for an H100 without
one (benchmarks/h100_aot.py, `_gpu_hlo.roofline`): the bfloat16 roads cost what
hand-cast does, the fp8 roads do not regress, and `where_it_pays()` is faster
than bfloat16; and of the Llama-style step with cuDNN's flash attention, where fp8
pays. Needs the CUDA plugin, not a GPU (`.ci/run` installs it in its own
environment). A module of its own, beside `test_h100_aot.py`: two test workers
compile the two in parallel."""

import pathlib
import sys
import textwrap

import pytest

from .helpers import needs_cuda_plugin, result_of_compile_script


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _gpu_hlo  # noqa: E402


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
    model, config, variants = sys.argv[2:5]
    out = {
        v: h100_aot.compile_variant(
            model, v, "gpu", sharding, ("cublas",), config=config
        )["cublas"]["roofline"]
        for v in variants.split(",")
    }
    print("RESULT" + json.dumps(out))
    """
)
ROOFLINE_ROADS = (
    "filter_amp_bf16", "filter_amp_fp8", "autocast_fp8", "bimodel_fp8",
    "filter_amp_fp8_paying", "filter_amp_fp8_delayed_weights",
    "autocast_fp8_rowwise_paying",
)  # fmt: skip


@pytest.fixture(scope="module")
def roofline():
    """The GPT-2-small-sized step (4 blocks x 768, seq 1024, batch 8, vocab 32768)
    compiled for an H100 with cuBLAS GEMMs: each road's roofline."""
    return result_of_compile_script(
        ROOFLINE_SCRIPT,
        "gpt",
        "depth=4,batch=8",
        ",".join(("hand_bf16", *ROOFLINE_ROADS)),
    )


# The roofline ratios to hand-cast bfloat16 (launches counted) as compiled today,
# with 3% for XLA's changes: a step that moves more bytes or launches more kernels
# than this is a regression. The goal is below 0.97 for every fp8 road (measured
# on an H100: 1.21x, 1.51x and 1.23x before the roofline work; 1.16x by the roofline
# while the forward GEMMs wrote float32, 1.03x since they write bfloat16, 1.007x
# since unscaling chooses between scalar factors; 0.95x without launches).
ROOFLINE_LIMITS = {"filter_amp_fp8": 1.04, "autocast_fp8": 1.04, "bimodel_fp8": 1.04}


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


def test_rowwise_where_it_pays_leaves_gpt2_small_in_bfloat16(roofline):
    """Rowwise quantises each tensor along both of its axes: by its estimate no
    product of this size pays (every product rowwise is 1.06x hand-cast's step,
    and the products tensorwise's estimate had picked for it 1.00x), so the step
    is hand-cast's program."""
    hand, ours = roofline["hand_bf16"], roofline["autocast_fp8_rowwise_paying"]
    assert "fp8" not in ours["gemm_flops"]
    assert ours == hand


def test_delayed_scaling_is_faster_than_bfloat16_at_gpt2_small_size(roofline):
    """Every product in fp8 with delayed scales (`eqx_amp.fp8.DelayedScaling`,
    weights' scales too) meets the goal of at most 0.97x hand-cast's step at this
    size, launches counted: 0.961x as compiled today (0.927x without), where
    current scaling is 1.007x (0.953x)."""
    hand = roofline["hand_bf16"]
    current = roofline["filter_amp_fp8"]
    delayed = roofline["filter_amp_fp8_delayed_weights"]
    assert delayed["gemm_flops"] == current["gemm_flops"]
    assert delayed["time_s_with_launches"] <= 0.97 * hand["time_s_with_launches"]
    assert delayed["time_s"] <= 0.94 * hand["time_s"]


@pytest.fixture(scope="module")
def flash_llama():
    """The Llama-style step (one block of 4096, SwiGLU 14336, seq 4096, batch 1) with
    cuDNN's flash attention, as such a model is trained on a GPU, compiled for an
    H100: hand-cast bfloat16's roofline, `autocast`'s, the fp8 step's and that step
    with delayed scaling (`eqx_amp.fp8.DelayedScaling`, weights' scales too)."""
    return result_of_compile_script(
        ROOFLINE_SCRIPT,
        "llama",
        "depth=1,attention=cudnn",
        "hand_bf16,autocast_bf16,filter_amp_fp8,filter_amp_fp8_delayed_weights,"
        "filter_amp_fp8_delayed_gemm,autocast_fp8_rowwise_paying",
    )


@pytest.fixture(scope="module")
def flash_llama_batch4():
    """The same block at batch 4: hand-cast bfloat16's roofline and the fp8 step
    with delayed scaling whose forward GEMMs apply the scales."""
    return result_of_compile_script(
        ROOFLINE_SCRIPT,
        "llama",
        "depth=1,attention=cudnn,batch=4",
        "hand_bf16,filter_amp_fp8_delayed_gemm",
    )


def test_flash_attention_is_timed_as_its_gemms_and_stays_bfloat16(flash_llama):
    hand, fp8 = flash_llama["hand_bf16"], flash_llama["filter_amp_fp8"]
    # `autocast` keeps the model's own cast of the attention's inputs to bfloat16,
    # and the attention one cuDNN call: hand-cast's program.
    assert flash_llama["autocast_bf16"] == hand
    # Causal: the forward's 2 GEMMs and the backward's 5, each 2 x 32 heads x 4096
    # x 4096 x 128, halved by the mask.
    attention = 7 * 2 * 32 * 4096 * 4096 * 128 * 0.5
    assert fp8["gemm_flops"]["bf16"] == attention
    assert hand["gemm_flops"]["bf16"] == attention + fp8["gemm_flops"]["fp8"]


def test_fp8_pays_at_llama_size_with_flash_attention(flash_llama):
    """As compiled today: 0.765x hand-cast's step (0.785x with launches; two blocks:
    0.761x and 0.780x); the ideal (quantising for free) 0.678x. Current scaling's
    floor lies above the goal of 0.72x (benchmarks/RESULTS.md); delayed scaling
    meets it (the next test)."""
    hand, fp8 = flash_llama["hand_bf16"], flash_llama["filter_amp_fp8"]
    assert fp8["time_s"] <= 0.78 * hand["time_s"]
    assert fp8["time_s_with_launches"] <= 0.80 * hand["time_s_with_launches"]
    ideal = _gpu_hlo.ideal_ratio(fp8, hand)
    assert ideal == pytest.approx(0.678, abs=0.005)


def test_rowwise_pays_at_llama_size(flash_llama):
    """At the Llama-style size every product pays for rowwise quantisation too, by
    its estimate: `ROWWISE.where_it_pays()` keeps all of `filter_amp`'s products in
    fp8 (attention's own stay with cuDNN)."""
    rowwise = flash_llama["autocast_fp8_rowwise_paying"]
    assert rowwise["gemm_flops"] == flash_llama["filter_amp_fp8"]["gemm_flops"]
    assert rowwise["time_s"] <= 0.81 * flash_llama["hand_bf16"]["time_s"]


def test_delayed_scaling_meets_the_llama_goals(flash_llama):
    """Issue 36's goals for the Llama-style step, met by delayed scaling: at most
    0.72x hand-cast's step and 1.15x its bytes outside the GEMMs. As compiled today
    0.719x (0.730x with launches) and 1.135x (two blocks: 0.717x, 0.726x, 1.148x),
    against current scaling's 0.765x (0.785x): each tensor's amax comes out of the
    pass that quantises it. Every product current scaling runs in fp8 still does."""
    hand = flash_llama["hand_bf16"]
    current = flash_llama["filter_amp_fp8"]
    delayed = flash_llama["filter_amp_fp8_delayed_weights"]
    assert delayed["gemm_flops"] == current["gemm_flops"]
    assert delayed["time_s"] <= 0.72 * hand["time_s"]
    assert delayed["time_s_with_launches"] <= 0.735 * hand["time_s_with_launches"]
    outside = sum(delayed["non_gemm_bytes"].values())
    assert outside <= 1.15 * sum(hand["non_gemm_bytes"].values())
    assert delayed["kernels"] < current["kernels"]
    # With `scales_in_gemm=True` the forward GEMMs take the scales and the residual
    # adds: 0.713x (0.724x with launches), 1.115x the bytes.
    gemm = flash_llama["filter_amp_fp8_delayed_gemm"]
    assert gemm["gemm_flops"] == current["gemm_flops"]
    assert gemm["time_s"] < delayed["time_s"]
    assert sum(gemm["non_gemm_bytes"].values()) < outside


def test_delayed_scaling_in_the_gemm_meets_the_batch_4_goal(flash_llama_batch4):
    """Issue 36's goal at batch 4, at most 0.65x hand-cast's step: 0.649x as
    compiled today (0.654x with launches; two blocks 0.647x, 0.652x), where delayed
    scaling with the scales applied after the GEMMs is 0.654x (two blocks 0.652x)."""
    hand = flash_llama_batch4["hand_bf16"]
    gemm = flash_llama_batch4["filter_amp_fp8_delayed_gemm"]
    assert gemm["time_s"] <= 0.65 * hand["time_s"]
    assert gemm["time_s_with_launches"] <= 0.66 * hand["time_s_with_launches"]

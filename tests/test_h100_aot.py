"""What XLA makes of each fp8 road and each bfloat16 road on an H100, compiled without
one (benchmarks/h100_aot.py). Needs the CUDA plugin, not a GPU:
`pip install "jax[cuda12]==<jax version>"` (`.ci/run` does, in its own environment).

- every fp8 product eqx_amp asks for (forward and both backward products,
  tensorwise and rowwise, matmuls and forward convolutions; `eqx_amp.fp8.dot_general`
  by hand, the autocast rules, `filter_amp(fp8=)`, `BiModel(fp8=)`) is cuBLASLt's
  fp8 GEMM or a cuDNN fp8 convolution with Triton GEMMs off;
- the bfloat16 roads (`filter_amp`, `autocast`, `BiModel`) compile to the GEMM and
  convolution kinds of the hand-cast step;
- FSDP over 8 H100s: the half-precision roads all-gather what hand-cast does, in
  their half dtype, and nothing in float32 (a float16 step's skipping once made XLA
  gather the whole float32 state every step); the fp8 roads all-gather their
  weights in fp8, at most 0.55x hand-cast's bytes, and reduce their weight
  gradients in bfloat16 as hand-cast does, and reduce all their weights' amaxes
  in one all-reduce.
"""

import textwrap

import pytest

from .helpers import needs_cuda_plugin, result_of_compile_script


pytestmark = [
    pytest.mark.slow,
    needs_cuda_plugin,
]

BF16_ROADS = ("filter_amp_bf16", "autocast_bf16", "bimodel_bf16")
FP8_ROADS = ("autocast_fp8", "autocast_fp8_rowwise", "filter_amp_fp8", "bimodel_fp8")
# FSDP over 8 H100s: the steps whose weights are all-gathered (a BiModel's compute
# copy is partitioned another way: no weight all-gather at all).
FSDP_HALF_ROADS = ("filter_amp_bf16", "autocast_bf16", "filter_amp_f16", "autocast_f16")
FSDP_FP8_ROADS = ("autocast_fp8", "filter_amp_fp8")

# Run in a fresh interpreter: the CUDA plugin must learn that there is no GPU before
# JAX starts its backends, which pytest's process has done.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]
    import h100_aot
    sharding = h100_aot.h100_sharding()
    import jax, jax.numpy as jnp
    import _gpu_hlo
    import eqx_amp

    def by_hand(scaling, conv):
        def step(x, w):
            if conv:
                f = lambda x, w: eqx_amp.autocast(
                    lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"),
                    rules={jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE},
                )(x, w)
            else:
                f = lambda x, w: eqx_amp.fp8.dot_general(
                    x, w, (((1,), (0,)), ((), ())), scaling=scaling
                )
            y, vjp = jax.vjp(f, x, w)
            return y, vjp(y)
        if conv:
            args = (jnp.zeros((8, 32, 16, 16), jnp.bfloat16),
                    jnp.zeros((32, 32, 3, 3), jnp.bfloat16))
        else:
            args = (jnp.zeros((256, 512), jnp.bfloat16),
                    jnp.zeros((512, 128), jnp.bfloat16))
        compiled = h100_aot.compile_for_h100(
            step, *args, sharding=sharding, triton_gemm=False
        )
        return h100_aot.analyse(compiled)

    import re

    def float16_arrays_of_odd_products(scaling):
        # Products no fp8 GEMM takes (sizes not multiples of 16), compiled with
        # XLA's defaults as a GPU would: once handed to XLA in fp8, they became
        # products of float16 operands, which overflow at fp8's scales.
        shapes = {
            "5x12x7": ((5, 12), (12, 7), (((1,), (0,)), ((), ()))),
            "batched": ((2, 3, 5), (2, 5, 4), (((2,), (1,)), ((0,), (0,)))),
        }
        out = {}
        for name, (lhs, rhs, dims) in shapes.items():
            def product(x, w, dims=dims):
                return eqx_amp.fp8.dot_general(
                    x, w, dims, scaling=scaling, out_dtype=jnp.float32
                )
            def step(x, w, g):
                y, vjp = jax.vjp(product, x, w)
                return y, vjp(g)
            x, w = jnp.zeros(lhs), jnp.zeros(rhs)
            g = jnp.zeros(jax.eval_shape(product, x, w).shape)
            text = h100_aot.compile_for_h100(
                step, x, w, g, sharding=sharding
            ).as_text()
            out[name] = len(re.findall(r"\\bf16\\[", text))
        return out

    out = {
        "odd_products_f16": {
            s: float16_arrays_of_odd_products(s) for s in ("tensorwise", "rowwise")
        },
        "by_hand": {
            "tensorwise": by_hand("tensorwise", False),
            "rowwise": by_hand("rowwise", False),
            "conv": by_hand(None, True),
        },
        "models": {
            model: {
                # The fp8 roads' checks read the cuBLAS compile only.
                v: h100_aot.compile_variant(
                    model, v, "cpu", sharding,
                    ("cublas",) if "fp8" in v else ("default", "cublas"),
                )
                for v in sys.argv[2].split(",")
            }
            for model in ("gpt", "cnn")
        },
    }
    # A float32 reduce dtype: the weight gradients' GEMMs read the compute dtype
    # and write float32 (the float32 operands are the CPU's form only).
    import equinox as eqx
    policy = eqx_amp.get_policy("mixed_bfloat16").with_reduce_dtype(jnp.float32)
    mlp = eqx.nn.MLP(256, 256, 512, 2, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    def reduce_loss(params, x):
        model = eqx_amp.filter_amp(eqx.combine(params, static), policy=policy)
        return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)
    reduce_step = h100_aot.compile_for_h100(
        jax.grad(reduce_loss), params, jnp.zeros((64, 256)), sharding=sharding,
        triton_gemm=False,
    )
    out["reduce_dtype_gemms"] = sorted(
        [list(p.reads), p.writes] for p in _gpu_hlo.products(reduce_step.as_text())
    )
    devices = h100_aot.h100_devices(8)
    fsdp = {
        v: h100_aot.compile_fsdp_variant("gpt", v, "cpu", devices)
        for v in sys.argv[3].split(",")
    }
    out["fsdp"] = {v: r["collectives"] for v, r in fsdp.items()}
    out["fsdp_all_reduces"] = {v: r["all_reduces"] for v, r in fsdp.items()}
    # The GPT's matrices an fp8 GEMM takes: its Linear layers' weights.
    from _models import PRESETS, make_task
    model = make_task("gpt", PRESETS["cpu"]["gpt"]).model
    linears = [
        m for m in jax.tree.leaves(
            model, is_leaf=lambda m: isinstance(m, eqx.nn.Linear)
        )
        if isinstance(m, eqx.nn.Linear)
    ]
    out["fp8_weights"] = sum(
        all(n % 16 == 0 for n in m.weight.shape) for m in linears
    )
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    variants = ",".join(("hand_bf16", *BF16_ROADS, *FP8_ROADS))
    fsdp = ",".join(("hand_bf16", *FSDP_HALF_ROADS, *FSDP_FP8_ROADS))
    return result_of_compile_script(SCRIPT, variants, fsdp)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_an_fp8_matmul_and_both_its_backward_products_are_fp8_gemms(compiled, scaling):
    result = compiled["by_hand"][scaling]
    # The forward GEMM accumulates fast; both backward GEMMs, which sum over the
    # tokens, precisely (`Precision.HIGHEST`).
    assert result["products"] == {"cublas-fp8": 1, "cublas-fp8 precise": 2}
    assert result["asked_for_fp8"] == 3 and result["not_fp8"] == []
    # Every GEMM writes its still-scaled sums in bfloat16 (power-of-two scales make
    # unscaling after rounding exact), not float32 for another kernel to rescale.
    assert result["fp8_gemms_writing_f32"] == 0
    assert result["roofline"]["non_gemm_bytes"]["epilogue"] == 0


def test_an_fp8_convolution_is_fp8_forward_and_bfloat16_backward(compiled):
    result = compiled["by_hand"]["conv"]
    assert result["products"] == {"cudnn-fp8": 1, "cudnn bf16": 2}
    assert result["asked_for_fp8"] == 1 and result["not_fp8"] == []


@pytest.mark.parametrize("road", FP8_ROADS)
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_every_fp8_product_of_a_training_step_is_an_fp8_kernel(compiled, model, road):
    result = compiled["models"][model][road]["cublas"]
    assert result["not_fp8"] == []
    products = result["products"]
    fp8 = sum(
        products.get(k, 0) for k in ("cublas-fp8", "cublas-fp8 precise", "cudnn-fp8")
    )
    assert fp8 == result["asked_for_fp8"]
    if products.get("cublas-fp8"):  # forward GEMMs: their backward ones are precise
        assert products["cublas-fp8 precise"] >= products["cublas-fp8"]
    assert result["fp8_gemms_writing_f32"] == 0  # bfloat16 sums, unscaled after
    if model == "cnn" and road == "autocast_fp8":
        assert fp8 == 0  # its rule names dot_general only; the CNN's head is too small
    else:
        assert fp8 > 0


@pytest.mark.parametrize("road", BF16_ROADS)
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_bfloat16_roads_compile_to_the_hand_cast_kernels(compiled, model, road):
    hand = compiled["models"][model]["hand_bf16"]
    ours = compiled["models"][model][road]
    for flags in ("cublas", "default"):
        assert ours[flags]["products"] == hand[flags]["products"]
    assert ours["default"]["temp_bytes"] <= 1.02 * hand["default"]["temp_bytes"]


def _collected(collectives: dict, kind: str) -> dict:
    """Bytes by dtype of one kind of collective."""
    return {
        k.split()[1]: v
        for k, v in collectives.items()
        if k.startswith(kind + " ") and not k.endswith("count")
    }


def _gathered(collectives: dict) -> dict:
    return _collected(collectives, "all-gather")


@pytest.mark.parametrize("road", FSDP_HALF_ROADS)
def test_fsdp_half_precision_roads_gather_what_hand_cast_gathers(compiled, road):
    hand = _gathered(compiled["fsdp"]["hand_bf16"])
    ours = _gathered(compiled["fsdp"][road])
    assert "f32" not in ours
    half = "bf16" if "bf16" in road else "f16"
    assert ours == {half: hand["bf16"]}


@pytest.mark.parametrize("road", FSDP_FP8_ROADS)
def test_fsdp_fp8_roads_gather_their_weights_in_fp8(compiled, road):
    hand = sum(_gathered(compiled["fsdp"]["hand_bf16"]).values())
    ours = _gathered(compiled["fsdp"][road])
    assert "f32" not in ours and ours["f8e4m3fn"] > 0
    assert sum(ours.values()) <= 0.55 * hand
    # The weight gradients are reduced as hand-cast reduces them, in bfloat16 (the
    # fp8 backward products emit the reduce dtype), never in float32.
    reduced = _collected(compiled["fsdp"][road], "reduce-scatter")
    assert reduced == _collected(compiled["fsdp"]["hand_bf16"], "reduce-scatter")


@pytest.mark.parametrize("road", FSDP_FP8_ROADS)
def test_fsdp_fp8_roads_reduce_every_weight_amax_in_one_all_reduce(compiled, road):
    """The fp8 roads quantise each weight once per step, with the amaxes of all of
    them taken together before any product: XLA's GPU pipeline reduces them across
    the 8 devices in one all-reduce."""
    weights = compiled["fp8_weights"]
    assert weights >= 8
    all_reduces = compiled["fsdp_all_reduces"][road]
    assert all_reduces.count([["f32", weights]]) == 1
    # Every other all-reduce holds a few values (activations' and gradients'
    # amaxes, which wait on the data) or is the loss's and the unsharded
    # gradients' (over a thousand values).
    for arrays in all_reduces:
        if arrays != [["f32", weights]]:
            assert sum(n for _, n in arrays) <= 3 or sum(n for _, n in arrays) > 1000


def test_products_no_fp8_gemm_takes_have_no_float16_in_the_h100_program(compiled):
    """On an H100 (jax 0.11.2), XLA turned fp8 products of sizes no fp8 GEMM takes
    into products of float16 operands: inf and NaN gradients from ordinary inputs
    (`benchmarks/gpu_fp8_fallback.py`). Their fp8 values are now multiplied in
    float32, and the compiled program holds no float16 array."""
    assert compiled["odd_products_f16"] == {
        s: {"5x12x7": 0, "batched": 0} for s in ("tensorwise", "rowwise")
    }


def test_a_float32_reduce_dtype_keeps_half_gemms_writing_float32(compiled):
    """Compiled for a GPU on a CPU host, a reduce dtype's weight-gradient GEMMs read
    bfloat16 and write float32: the float32 operands XLA's CPU runtime needs are
    chosen for CPU programs only."""
    gemms = compiled["reduce_dtype_gemms"]
    assert len(gemms) == 8  # 3 forward, 2 input gradients, 3 weight gradients
    assert all(reads == ["bf16", "bf16"] for reads, _ in gemms)
    assert sorted(writes for _, writes in gemms) == ["bf16"] * 5 + ["f32"] * 3

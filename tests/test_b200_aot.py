"""What XLA makes of eqx_amp's MXFP8 and NVFP4 products on a B200 (cuDNN 9.10), compiled without
one (benchmarks/b200_aot.py). Needs the CUDA plugin, not a GPU:
`pip install "jax[cuda12]==<jax version>"`.

- `eqx_amp.fp8.dot_general(..., scaling="mxfp8")` by hand, at sizes that are and
  are not multiples of 32: the forward product and both backward products are
  `__cudnn$blockScaledDot`;
- the GPT and Llama-style training steps on every MXFP8 road (`autocast`,
  `filter_amp(fp8=)`, `BiModel(fp8=)`): every product eqx_amp made an MXFP8 one is
  `__cudnn$blockScaledDot`, one forward and two backward per matmul, and the
  residuals saved for the backward pass are fewer bytes than hand-cast bfloat16's;
- the same for `eqx_amp.fp8.NVFP4` (by hand and on every road): each forward
  product is a `__cudnn$blockScaledDot` of e2m1 operands, its two backward
  products MXFP8 ones; with `NVFP4.with_nvfp4_backward()`, all three read e2m1
  operands;
- `MXFP8.where_it_pays()` on a model too small to gain: hand-cast's program;
- an MLP under `jax.shard_map` FSDP on 8 B200s, its weights gathered in MXFP8.
"""

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from .helpers import needs_cuda_plugin


pytestmark = [
    pytest.mark.slow,
    needs_cuda_plugin,
]

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
MXFP8_ROADS = ("autocast_mxfp8", "filter_amp_mxfp8", "bimodel_mxfp8")
NVFP4_ROADS = ("autocast_nvfp4", "filter_amp_nvfp4", "bimodel_nvfp4")
NVFP4_TRAINING_ROADS = tuple(f"{road}_training" for road in NVFP4_ROADS)

# A fresh interpreter: the CUDA plugin must learn that there is no GPU before JAX
# starts its backends, which pytest's process has done.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]
    import b200_aot
    sharding = b200_aot.b200_sharding()
    import jax, jax.numpy as jnp
    import eqx_amp
    from h100_aot import compile_for_h100

    def by_hand(m, k, n, scaling="mxfp8"):
        def step(x, w):
            def loss(x, w):
                y = eqx_amp.fp8.dot_general(
                    x, w, (((1,), (0,)), ((), ())), scaling=scaling
                )
                return jnp.sum(y.astype(jnp.float32) ** 2)
            return jax.grad(loss, (0, 1))(x, w)
        args = (jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16))
        compiled = compile_for_h100(step, *args, sharding=sharding, triton_gemm=False)
        return b200_aot.block_scaled_check(compiled.as_text())

    sizes = [(256, 512, 384), (10, 64, 10)]
    out = {
        "hand": [by_hand(*s) for s in sizes],
        "hand_nvfp4": [by_hand(*s, scaling="nvfp4") for s in sizes],
        "hand_nvfp4_training": [
            by_hand(*s, scaling="nvfp4_training") for s in sizes
        ],
    }
    for model in ("gpt", "llama"):
        out[model] = [
            b200_aot.compile_variant(model, v, "tiny", sharding)
            for v in ("hand_bf16", *sys.argv[2].split(","))
        ]
    out["paying"] = b200_aot.compile_variant(
        "gpt", "filter_amp_mxfp8_paying", "tiny", sharding
    )
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(BENCHMARKS),
            ",".join(MXFP8_ROADS + NVFP4_ROADS + NVFP4_TRAINING_ROADS),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_dot_general_by_hand_is_cudnn_block_scaled(compiled):
    for check in compiled["hand"]:
        assert check["block_scaled_forward"] == 1
        assert check["block_scaled_backward"] == 2
        assert check["mxfp8_not_cudnn"] == []
        assert check["fp4_products"] == 0
    # NVFP4: the forward product reads e2m1 operands, the backward ones MXFP8.
    for check in compiled["hand_nvfp4"]:
        assert check["block_scaled_forward"] == check["fp4_products"] == 1
        assert check["block_scaled_backward"] == 2
        assert check["mxfp8_not_cudnn"] == []
    # NVIDIA's recipe: all three read e2m1 operands.
    for check in compiled["hand_nvfp4_training"]:
        assert check["block_scaled_forward"] == 1
        assert check["block_scaled_backward"] == 2
        assert check["fp4_products"] == 3
        assert check["mxfp8_not_cudnn"] == []


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_every_road_is_cudnn_block_scaled(compiled, model):
    hand, *roads = compiled[model]
    assert hand["block_scaled_forward"] == 0
    for row in roads:
        forward = row["block_scaled_forward"]
        assert forward > 0, row["variant"]
        assert row["block_scaled_backward"] == 2 * forward, row["variant"]
        assert row["mxfp8_not_cudnn"] == [], row["variant"]
        assert row["saved"] < hand["saved"], row["variant"]
        fp4 = {"nvfp4": forward, "training": 3 * forward}
        expected = fp4.get(row["variant"].rsplit("_", 1)[-1], 0)
        assert row["fp4_products"] == expected, row["variant"]


def test_mxfp8_where_it_pays_leaves_a_small_model_in_bfloat16(compiled):
    """`MXFP8.where_it_pays()` on the tiny GPT, whose products are all too small to
    gain on a B200 (the estimate is `tests/test_fp8_cost.py`'s): hand-cast's
    program, no block-scaled product. (GPT-2-small's size too: RESULTS.md.)"""
    hand, paying = compiled["gpt"][0], compiled["paying"]
    assert paying["block_scaled_forward"] == paying["block_scaled_backward"] == 0
    assert paying["products"] == hand["products"]
    assert paying["roofline"] == hand["roofline"]


FSDP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]
    import b200_aot
    print("RESULT" + json.dumps(b200_aot.compile_mxfp8_fsdp()))
    """
)


def test_mxfp8_fsdp_gathers_e4m3_values_and_e8m0_scales_on_eight_b200s():
    """`gather_params(..., fp8=MXFP8)` under `jax.shard_map` FSDP, compiled for 8
    B200s: the weights all-gather as e4m3 values and e8m0 scales (0.52x the
    bfloat16 gather's bytes, biases in bfloat16), and every product is still a
    cuDNN block-scaled GEMM (two forward, three backward: the first layer's input
    gradient is not asked for)."""
    done = subprocess.run(
        [sys.executable, "-c", FSDP_SCRIPT, str(BENCHMARKS)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    found = json.loads(line[len("RESULT") :])
    bf16, mxfp8 = found["bf16"]["collectives"], found["mxfp8"]["collectives"]
    gathered = {
        k: v
        for k, v in mxfp8.items()
        if k.startswith("all-gather ") and "count" not in k
    }
    assert set(gathered) == {
        "all-gather f8e4m3fn",
        "all-gather f8e8m0fnu",
        "all-gather bf16",
    }
    ratio = sum(gathered.values()) / bf16["all-gather bf16"]
    assert ratio <= 0.55, ratio
    # Gradients are reduce-scattered in bfloat16 either way.
    assert mxfp8["reduce-scatter bf16"] == bf16["reduce-scatter bf16"]
    for row in found.values():
        assert (row["block_scaled_forward"], row["block_scaled_backward"]) == (2, 3)
        assert row["mxfp8_not_cudnn"] == []

"""benchmarks/_gpu_hlo.py on canned H100 HLO text (the forms XLA 0.10's GPU compiler
prints): cuBLAS and cuBLASLt fp8 calls, cuDNN convolutions, Triton GEMM fusions whose
dots read parameters bound to conversions from fp8, a merged GEMM that reads a float32
concatenation inside the fp8 scope (the defect `--preset h100-aot` found), the
skipped scope, fusions and converts. No GPU or CUDA plugin is needed."""

import pathlib
import sys

import pytest


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _gpu_hlo  # noqa: E402


HLO = """\
HloModule jit_step, entry_computation_layout={(f32[128,128]{1,0})->f32[64,128]{1,0}}

%fused_convert (param_0.1: f32[64,128]) -> f8e4m3fn[64,128] {
  %param_0.1 = f32[64,128]{1,0} parameter(0)
  ROOT %convert.1 = f8e4m3fn[64,128]{1,0} convert(%param_0.1), metadata={op_name="jit(step)/eqx_amp.fp8/convert_element_type"}
}

%gemm_fusion_dot.7_computation (parameter_0: f8e5m2[64,128], parameter_1: f8e4m3fn[128,128]) -> f32[64,128] {
  %parameter_0 = f8e5m2[64,128]{1,0} parameter(0)
  %convert.2 = f32[64,128]{1,0} convert(%parameter_0)
  %parameter_1 = f8e4m3fn[128,128]{1,0} parameter(1)
  %convert.3 = f32[128,128]{1,0} convert(%parameter_1)
  ROOT %dot.7 = f32[64,128]{1,0} dot(%convert.2, %convert.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_fusion_dot.8_computation (parameter_0.8: bf16[64,128], parameter_1.8: bf16[128,128]) -> bf16[64,128] {
  %parameter_0.8 = bf16[64,128]{1,0} parameter(0)
  %parameter_1.8 = bf16[128,128]{1,0} parameter(1)
  ROOT %dot.8 = bf16[64,128]{1,0} dot(%parameter_0.8, %parameter_1.8), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.1 (x.1: f32[64,128], w.1: f32[128,128], g.1: f8e5m2[64,128], h.1: bf16[64,128], k.1: bf16[128,128], c.1: f32[384,128]) -> f32[64,128] {
  %x.1 = f32[64,128]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f32[128,128]{1,0} parameter(1), metadata={op_name="w"}
  %g.1 = f8e5m2[64,128]{1,0} parameter(2)
  %h.1 = bf16[64,128]{1,0} parameter(3)
  %k.1 = bf16[128,128]{1,0} parameter(4)
  %c.1 = f32[384,128]{1,0} parameter(5)
  %loop_convert_fusion = f8e4m3fn[64,128]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_convert, metadata={op_name="jit(step)/eqx_amp.fp8/convert_element_type"}
  %wq = f8e4m3fn[128,128]{1,0} convert(%w.1), metadata={op_name="jit(step)/eqx_amp.fp8/convert_element_type"}
  %cublas-gemm.1 = (f32[64,128]{1,0}, s8[4194304]{0}) custom-call(%loop_convert_fusion, %wq, /*index=2*/%x.1, %x.1), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(step)/jvp(vmap(eqx_amp.fp8))/dot_general" scheduling_name="cublas-gemm.1"}, backend_config={"gemm_backend_config":{"scale_mode":1}}
  %custom-call.2 = (f32[64,384]{1,0}, s8[4194304]{0}) custom-call(%x.1, %c.1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/jvp(eqx.nn.MultiheadAttention)/vmap(eqx.nn.Linear)/vmap(eqx_amp.fp8)/dot_general"}
  %gemm_fusion_dot.7 = f32[64,128]{1,0} fusion(%g.1, %wq), kind=kCustom, calls=%gemm_fusion_dot.7_computation, metadata={op_name="jit(step)/transpose(jvp(eqx_amp.fp8))/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %gemm_fusion_dot.8 = bf16[64,128]{1,0} fusion(%h.1, %k.1), kind=kCustom, calls=%gemm_fusion_dot.8_computation, metadata={op_name="jit(step)/vmap(eqx.nn.Linear)/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %cudnn-conv.1 = (f32[8,16,16,16]{3,2,1,0}, u8[0]{0}) custom-call(%loop_convert_fusion, %wq), window={size=3x3}, custom_call_target="__cudnn$convForwardGraph", metadata={op_name="jit(step)/eqx_amp.fp8/conv_general_dilated"}
  %cudnn-conv.2 = (bf16[8,16,16,16]{3,2,1,0}, u8[0]{0}) custom-call(%h.1, %k.1), window={size=3x3}, custom_call_target="__cudnn$convBackwardInput", metadata={op_name="jit(step)/transpose(eqx_amp.fp8)/eqx_amp.fp8_skipped: backward convolution (cuDNN has fp8 forward convolutions only)/conv_general_dilated"}
  %cudnn-conv.3 = (f32[8,16,16,16]{3,2,1,0}, u8[0]{0}) custom-call(%x.1, %w.1), window={size=3x3}, custom_call_target="__cudnn$convBackwardFilter", metadata={op_name="jit(step)/conv_general_dilated"}
  %gte = f32[64,128]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  ROOT %add.1 = f32[64,128]{1,0} add(%gte, %gemm_fusion_dot.7)
}
"""


@pytest.fixture(scope="module")
def found():
    return _gpu_hlo.products(HLO)


def test_every_product_is_found_with_what_it_reads(found):
    by_call = {(p.call, p.reads) for p in found}
    assert by_call == {
        ("__cublas$lt$matmul$f8", ("f8e4m3fn", "f8e4m3fn")),
        ("__cublas$lt$matmul", ("f32", "f32")),
        # The Triton dot reads conversions up: what it multiplies is fp8.
        ("__triton_nested_gemm_fusion", ("f8e5m2", "f8e4m3fn")),
        ("__triton_gemm", ("bf16", "bf16")),
        ("__cudnn$convForwardGraph", ("f8e4m3fn", "f8e4m3fn")),
        ("__cudnn$convBackwardInput", ("bf16", "bf16")),
        ("__cudnn$convBackwardFilter", ("f32", "f32")),
    }


def test_fp8_products_and_the_fp8_scope(found):
    fp8 = {p.call for p in found if p.fp8}
    assert fp8 == {
        "__cublas$lt$matmul$f8",
        "__triton_nested_gemm_fusion",
        "__cudnn$convForwardGraph",
    }
    asked = {p.call for p in found if p.asked_for_fp8}
    # The skipped scope (`eqx_amp.fp8_skipped: ...`) and unscoped products are not.
    assert asked == fp8 | {"__cublas$lt$matmul"}
    (missing,) = _gpu_hlo.not_fp8(found)
    assert missing.call == "__cublas$lt$matmul"
    assert "MultiheadAttention" in missing.op_name


def test_summary_counts_by_kind_and_dtype(found):
    assert _gpu_hlo.summary(found) == {
        "cublas f32": 1,
        "cublas-fp8": 1,
        "cudnn bf16": 1,
        "cudnn f32": 1,
        "cudnn-fp8": 1,
        "triton bf16 x bf16": 1,
        "triton f8e5m2 x f8e4m3fn": 1,
    }


def test_kernels_count_launched_fusions_and_every_convert():
    # Three fusions in the entry computation; converts inside fusions count too.
    assert _gpu_hlo.kernels(HLO) == {"fusions": 3, "converts": 4}


def test_an_empty_or_foreign_text_has_no_products():
    assert _gpu_hlo.products("") == []
    assert _gpu_hlo.kernels("not hlo at all") == {"fusions": 0, "converts": 0}


@pytest.mark.parametrize(
    ("dtype", "bits"), [("f8e4m3fn", 8), ("f8e5m2", 8), ("bf16", 16), ("f32", 32)]
)
def test_bits(dtype, bits):
    assert _gpu_hlo._bits(dtype) == bits


COLLECTIVES = """\
ENTRY %main (p: f8e4m3fn[128,512], q: f32[1048576]) -> f32[] {
  %p = f8e4m3fn[128,512]{1,0} parameter(0)
  %q = f32[1048576]{0} parameter(1)
  %all-gather-start = ((f8e4m3fn[128,512]{1,0}, bf16[64,1024]{1,0}), (f8e4m3fn[1024,512]{1,0}, bf16[512,1024]{1,0})) all-gather-start(%p, %p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = (f8e4m3fn[1024,512]{1,0}, bf16[512,1024]{1,0}) all-gather-done(%all-gather-start)
  %all-reduce-start = f32[3]{0} all-reduce-start(%q), channel_id=2, to_apply=%add
  %all-reduce-done = f32[3]{0} all-reduce-done(%all-reduce-start)
  %all-reduce = (f32[], bf16[7]{0}) all-reduce(%q, %q), channel_id=4, to_apply=%add
  %reduce-scatter = bf16[131072]{0} reduce-scatter(%q), channel_id=3, dimensions={0}, to_apply=%add
  ROOT %r = f32[] constant(0)
}
"""


def test_collectives_count_what_each_device_receives_by_kind_and_dtype():
    assert _gpu_hlo.collectives(COLLECTIVES) == {
        # An async all-gather's results: the gathered arrays.
        "all-gather bf16": 512 * 1024 * 2,
        "all-gather count": 1,
        "all-gather f8e4m3fn": 1024 * 512,
        "all-reduce bf16": 7 * 2,
        "all-reduce count": 2,
        "all-reduce f32": 3 * 4 + 4,
        "reduce-scatter bf16": 131072 * 2,
        "reduce-scatter count": 1,
    }


def test_all_reduces_list_the_arrays_each_one_reduces():
    assert _gpu_hlo.all_reduces(COLLECTIVES) == [
        [("f32", 3)],
        [("f32", 1), ("bf16", 7)],
    ]
    assert _gpu_hlo.all_reduces("") == []


def test_fp8_gemms_that_ask_for_highest_precision_are_told_apart():
    """cuBLASLt accumulates an fp8 GEMM fast at DEFAULT precision and precisely at
    HIGHEST; the backward products of eqx_amp ask for HIGHEST."""
    gemm = (
        "  %{name} = (f32[64,128]{{1,0}}, s8[4194304]{{0}}) custom-call(%a, %b), "
        'custom_call_target="__cublas$lt$matmul$f8", metadata={{op_name="eqx_amp.fp8/'
        'dot_general"}}, backend_config={{"gemm_backend_config":{{"precision_config":'
        '{{"operand_precision":["{p}","{p}"],"algorithm":"ALG_UNSET"}}}}}}'
    )
    text = "\n".join(
        [
            "ENTRY %main (a: f8e4m3fn[64,128], b: f8e4m3fn[128,128]) -> f32[64,128] {",
            "  %a = f8e4m3fn[64,128]{1,0} parameter(0)",
            "  %b = f8e4m3fn[128,128]{1,0} parameter(1)",
            gemm.format(name="fast", p="DEFAULT"),
            gemm.format(name="precise", p="HIGHEST"),
            "}",
        ]
    )
    found = _gpu_hlo.products(text)
    assert [p.precise for p in found] == [False, True]
    assert _gpu_hlo.summary(found) == {"cublas-fp8": 1, "cublas-fp8 precise": 1}


ROOFLINE_HLO = """
%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %maximum = f32[] maximum(%a, %b)
}

%amax_computation (p0: bf16[64,128]) -> f32[] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %abs = bf16[64,128]{1,0} abs(%p0)
  %up = f32[64,128]{1,0} convert(%abs)
  %zero = f32[] constant(0)
  ROOT %reduce = f32[] reduce(%up, %zero), dimensions={0,1}, to_apply=%max
}

%quantise_computation (p0.1: bf16[64,128], s: f32[]) -> f8e4m3fn[64,128] {
  %p0.1 = bf16[64,128]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %up.1 = f32[64,128]{1,0} convert(%p0.1)
  %b = f32[64,128]{1,0} broadcast(%s), dimensions={}
  %m = f32[64,128]{1,0} multiply(%up.1, %b)
  ROOT %q = f8e4m3fn[64,128]{1,0} convert(%m)
}

%epilogue_computation (p0.2: f32[64,32]) -> bf16[64,32] {
  %p0.2 = f32[64,32]{1,0} parameter(0)
  ROOT %c = bf16[64,32]{1,0} convert(%p0.2)
}

%transpose_computation (p0.3: bf16[64,128]) -> bf16[128,64] {
  %p0.3 = bf16[64,128]{1,0} parameter(0)
  ROOT %t = bf16[128,64]{0,1} transpose(%p0.3), dimensions={1,0}
}

ENTRY %main (x: bf16[64,128], w: f8e4m3fn[128,32], v: bf16[128,32]) -> (bf16[64,32], bf16[64,32], bf16[128,64]) {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = f8e4m3fn[128,32]{1,0} parameter(1)
  %v = bf16[128,32]{1,0} parameter(2)
  %amax = f32[] fusion(%x), kind=kInput, calls=%amax_computation
  %xq = f8e4m3fn[64,128]{1,0} fusion(%x, %amax), kind=kLoop, calls=%quantise_computation
  %gemm = (f32[64,32]{1,0}, s8[1024]{0}) custom-call(%xq, %w, %amax, %amax), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %out = f32[64,32]{1,0} get-tuple-element(%gemm), index=0
  %y = bf16[64,32]{1,0} fusion(%out), kind=kLoop, calls=%epilogue_computation
  %gemm16 = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%x, %v), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %z = bf16[64,32]{1,0} get-tuple-element(%gemm16), index=0
  %xt = bf16[128,64]{0,1} fusion(%x), kind=kLoop, calls=%transpose_computation
  ROOT %tuple = (bf16[64,32]{1,0}, bf16[64,32]{1,0}, bf16[128,64]{0,1}) tuple(%y, %z, %xt)
}
"""


def test_roofline_times_each_kernel_by_what_bounds_it():
    device = _gpu_hlo.Device(
        "test", {"fp8": 2e12, "bf16": 1e12, "f32": 1e11}, bandwidth=1e9,
        gemm_efficiency=0.5, memory_efficiency=0.5, launch_s=1e-6,
    )  # fmt: skip
    roof = _gpu_hlo.roofline(ROOFLINE_HLO, device)
    x, xq, w, v, amax = 64 * 128 * 2, 64 * 128, 128 * 32, 128 * 32 * 2, 4
    out32, out16 = 64 * 32 * 4, 64 * 32 * 2
    # Every kernel once: the reducer and the fused computations launch nothing.
    assert roof["kernels"] == 6
    assert roof["gemm_flops"] == {"fp8": 2 * 64 * 32 * 128, "bf16": 2 * 64 * 32 * 128}
    # The GEMMs' workspaces (s8) are not data.
    fp8_gemm, bf16_gemm = xq + w + 2 * amax + out32, x + v + out16
    assert roof["gemm_bytes"] == fp8_gemm + bf16_gemm
    assert roof["non_gemm_bytes"] == {
        "quantise": x + amax + xq,
        "amax": x + amax,
        "epilogue": out32 + out16,
        "layout": 2 * x,
        "other": 0,
    }
    # At these rates every kernel is bound by its bytes but for none: each GEMM
    # takes max(FLOPs / (peak x 0.5), bytes / (bandwidth x 0.5)).
    rate = 1e9 * 0.5
    expected = sum(roof["non_gemm_bytes"].values()) / rate + sum(
        max(flops / (peak * 0.5), nbytes / rate)
        for flops, peak, nbytes in (
            (2 * 64 * 32 * 128, 2e12, fp8_gemm),
            (2 * 64 * 32 * 128, 1e12, bf16_gemm),
        )
    )
    assert roof["time_s"] == pytest.approx(expected)
    assert roof["time_s_with_launches"] == pytest.approx(expected + 6e-6)
    gemms = expected - sum(roof["non_gemm_bytes"].values()) / rate
    assert roof["gemm_time_s"] == pytest.approx(gemms)
    # The ideal: the base's kernels outside its GEMMs, with these GEMMs' time.
    base = {"time_s": 3 * expected, "gemm_time_s": 2 * expected}
    assert _gpu_hlo.ideal_ratio(roof, base) == pytest.approx(
        (expected + gemms) / (3 * expected)
    )


# cuDNN's flash attention as XLA 0.10's GPU compiler prints it (backend configs cut to
# the fields the roofline reads): a causal forward and its backward, and one unmasked.
ATTENTION_HLO = """\
HloModule jit_step

ENTRY %main (q: bf16[2,256,4,64], k: bf16[2,256,4,64], v: bf16[2,256,4,64], do: bf16[2,256,4,64]) -> bf16[2,4,256,64] {
  %q = bf16[2,256,4,64]{3,2,1,0} parameter(0)
  %k = bf16[2,256,4,64]{3,2,1,0} parameter(1)
  %v = bf16[2,256,4,64]{3,2,1,0} parameter(2)
  %do = bf16[2,256,4,64]{3,2,1,0} parameter(3)
  %fwd = (bf16[2,4,256,64]{3,1,2,0}, f32[2,4,256]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "256", "256"]}, "is_flash_attention": true, "mask_type": "CAUSAL"}}
  %o = bf16[2,4,256,64]{3,1,2,0} get-tuple-element(%fwd), index=0
  %stats = f32[2,4,256]{2,1,0} get-tuple-element(%fwd), index=1
  %bwd = (bf16[2,4,256,64]{3,1,2,0}, bf16[2,4,256,64]{3,1,2,0}, bf16[2,4,256,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %v, %stats, %do), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "256", "256"]}, "is_flash_attention": true, "mask_type": "CAUSAL"}}
  %full = (bf16[2,4,256,64]{3,1,2,0}, f32[2,4,256]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "256", "256"]}, "is_flash_attention": true, "mask_type": "NO_MASK"}}
  ROOT %tuple = (bf16[2,4,256,64]{3,1,2,0}, (bf16[2,4,256,64]{3,1,2,0}, bf16[2,4,256,64]{3,1,2,0}, bf16[2,4,256,64]{3,1,2,0}, u8[0]{0}), (bf16[2,4,256,64]{3,1,2,0}, f32[2,4,256]{2,1,0}, u8[0]{0})) tuple(%o, %bwd, %full)
}
"""


def test_flash_attention_is_timed_by_the_flops_of_its_gemms():
    device = _gpu_hlo.Device(
        "test", {"bf16": 1e12, "f32": 1e11}, bandwidth=1e15, gemm_efficiency=0.5
    )
    roof = _gpu_hlo.roofline(ATTENTION_HLO, device)
    one_gemm = 2 * (2 * 4 * 256 * 256) * 64
    # Forward: 2 GEMMs, backward: 5; a causal mask halves them.
    flops = one_gemm * (2 / 2 + 5 / 2 + 2)
    assert roof["gemm_flops"] == {"bf16": flops}
    assert roof["kernels"] == 3
    assert roof["gemm_time_s"] == pytest.approx(flops / 0.5e12)
    # Nothing but the three calls: no bytes outside them, no product to check.
    assert sum(roof["non_gemm_bytes"].values()) == 0
    assert _gpu_hlo.products(ATTENTION_HLO) == []

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

import eqx_amp

from .models import CNN, TransformerBlock


class _ExpHead(eqx.Module):
    """A layer with an exp that overflows float16 for large inputs."""

    linear: eqx.nn.Linear

    def __call__(self, x):
        with jax.named_scope("ExpHead"):
            return jnp.exp(self.linear(x))


def test_report_of_plain_filter_amp_and_autocast(getkey):
    model = TransformerBlock(16, 4, key=getkey())
    x = jr.normal(getkey(), (6, 16))

    plain = eqx_amp.precision_report(model, x)
    assert plain.low_precision_share == 0.0
    assert plain.casts == 0
    assert set(plain.ops["dot_general"]) == {("float32", "float32")}

    boundary = eqx_amp.precision_report(eqx_amp.filter_amp(model), x)
    assert boundary.low_precision_share == 1.0
    assert boundary.ops["dot_general"] == {("bfloat16", "bfloat16"): 8}
    assert boundary.casts > 0
    layer_norm_sites = [
        s for s in boundary.full_precision_ops if s.scope.endswith("LayerNorm")
    ]
    assert any(
        s.primitive == "rsqrt" and "_normalisation.py" in s.source
        for s in layer_norm_sites
    )

    op_level = eqx_amp.precision_report(eqx_amp.autocast(model), x)
    assert op_level.low_precision_share == 1.0
    assert op_level.matmul_flops == plain.matmul_flops > 0
    exps = [s for s in op_level.full_precision_ops if s.primitive == "exp"]
    assert exps and all("MultiheadAttention" in s.scope for s in exps)
    # Every site names a real source line (ops inside library jits borrow the line
    # that called the library).
    assert all(s.source != "<unknown>" for s in op_level.full_precision_ops)

    text = str(op_level)
    assert "matmul/conv FLOPs in low precision: 100.0%" in text
    assert "full-precision ops" in text and "dot_general" in text


def test_flops_scan_and_conv(getkey):
    w = jr.normal(getkey(), (4, 4))

    def rnn(h):
        return lax.scan(lambda h, _: (jnp.tanh(w @ h), None), h, None, length=5)[0]

    report = eqx_amp.precision_report(eqx_amp.autocast(rnn), jnp.ones(4))
    assert report.matmul_flops == 2 * 4 * 4 * 5
    assert report.low_precision_share == 1.0

    cnn = CNN(key=getkey())
    report = eqx_amp.precision_report(cnn, jnp.ones((1, 8, 8)))
    conv_flops = 2 * (8 * 8 * 8) * (1 * 3 * 3) + 2 * (8 * 8 * 8) * (8 * 3 * 3)
    assert report.matmul_flops == conv_flops + 2 * 10 * 8
    assert report.low_precision_share == 0.0


def test_report_accepts_shape_dtype_structs(getkey):
    model = eqx.nn.Linear(3, 2, key=getkey())
    report = eqx_amp.precision_report(
        eqx_amp.filter_amp(model), jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    assert report.low_precision_share == 1.0


def test_find_nonfinite_names_a_float16_overflow(getkey):
    head = _ExpHead(eqx.nn.Linear(4, 4, key=getkey()))
    x = jnp.full((4,), 40.0)
    assert eqx_amp.find_nonfinite(head, x) is None  # fine in float32
    bad = eqx_amp.find_nonfinite(eqx_amp.filter_amp(head, policy="mixed_float16"), x)
    assert bad is not None
    assert bad.primitive == "exp"
    assert bad.scope == "ExpHead"
    assert "test_report.py" in bad.source and "__call__" in bad.source
    assert bad.input_dtypes == ("float16",)
    low, high = bad.input_ranges[0]
    assert high > np.log(65504) and low < high
    assert bad.output_dtype == "float16" and bad.dtype_max == 65504.0
    assert "exp overflowed float16 (max 65504)" in bad.hint
    assert "full_precision" in bad.hint
    assert "first non-finite value: `exp` in scope 'ExpHead'" in str(bad)
    # The fix the hint suggests works.
    fixed = _ExpHead(head.linear)
    fixed_fn = eqx_amp.autocast(fixed, policy="mixed_float16")
    assert eqx_amp.find_nonfinite(fixed_fn, x) is None


def test_find_nonfinite_matmul_overflow_in_a_layer(getkey):
    model = eqx.nn.MLP(8, 2, 8, 1, key=getkey())
    model = eqx.tree_at(lambda m: m.layers[0].weight, model, jnp.full((8, 8), 0.5))
    x = jnp.full((8,), 30000.0)  # finite in float16; the weighted sum, 120000, is not
    bad = eqx_amp.find_nonfinite(eqx_amp.filter_amp(model, policy="mixed_float16"), x)
    assert bad.primitive == "dot_general"
    assert bad.scope == "eqx.nn.MLP/eqx.nn.Linear"


def test_find_nonfinite_domain_error_inside_scan_and_in_gradients():
    def fn(x):
        def step(c, _):
            return c - 1.0, jnp.log(c)

        return lax.scan(step, x, None, length=4)[1]

    bad = eqx_amp.find_nonfinite(fn, jnp.float32(2.0))  # log(0) on the third step
    assert bad.primitive == "log" and "outside its domain" in bad.hint
    assert bad.input_ranges == ((0.0, 0.0),)

    grad = jax.grad(lambda x: jnp.sum(jnp.sqrt(x)))
    bad = eqx_amp.find_nonfinite(grad, jnp.array([0.0, 1.0]))  # forward finite
    assert bad is not None
    assert bad.primitive in ("div", "rsqrt", "mul", "pow", "integer_pow")


def test_find_nonfinite_bad_inputs(getkey):
    with pytest.raises(
        ValueError, match=r"argument at \[0\]\[0\] already holds inf or nan"
    ):
        eqx_amp.find_nonfinite(jnp.exp, jnp.array([jnp.nan]))

    @jax.jit
    def inside(x):
        eqx_amp.find_nonfinite(jnp.exp, x)
        return x

    with pytest.raises(ValueError, match=r"needs concrete arrays"):
        inside(jnp.ones(2))
    with pytest.raises(TypeError, match=r"Expected a callable to inspect"):
        eqx_amp.find_nonfinite(3, jnp.ones(2))
    with pytest.raises(TypeError, match=r"Expected a callable to inspect"):
        eqx_amp.precision_report("model", jnp.ones(2))


def test_find_nonfinite_names_a_down_cast_at_a_kept_boundary(getkey):
    head = _ExpHead(eqx.nn.Linear(4, 4, key=getkey()))
    model = eqx.nn.Sequential([eqx.nn.Linear(4, 4, key=getkey()), eqx.nn.Lambda(head)])
    amp = eqx_amp.filter_amp(
        model, policy="mixed_float16", filter_spec=eqx_amp.keep(model, _ExpHead)
    )
    bad = eqx_amp.find_nonfinite(amp, jnp.full((4,), 40.0))
    assert bad.primitive == "convert_element_type"
    assert bad.input_dtypes == ("float32",) and bad.output_dtype == "float16"
    assert "was cast down to it, at a call boundary" in bad.hint
    # The line is the user's call, not eqx_amp's cast.
    assert "eqx_amp" not in bad.source


def test_find_nonfinite_ignores_what_the_program_discards():
    x = jnp.arange(8.0)
    # Both hold a NaN constant that a select keeps out of the output.
    assert eqx_amp.find_nonfinite(eqx.nn.LayerNorm(8), x) is None
    assert eqx_amp.find_nonfinite(jnp.var, x) is None

    def discards_then_overflows(x):
        discarded = jnp.where(x > 100, jnp.log(x - 100), 0.0)  # -inf/nan, selected away
        return jnp.exp(x * 20) + discarded

    bad = eqx_amp.find_nonfinite(discards_then_overflows, x)
    assert bad.primitive == "exp"


def test_find_nonfinite_hints_fit_the_dtypes():
    to_bf16 = eqx_amp.find_nonfinite(
        lambda x: (x * 3e38).astype(jnp.bfloat16) * 2, jnp.ones(2)
    )
    assert (to_bf16.primitive, to_bf16.output_dtype) == ("mul", "bfloat16")
    assert "bfloat16, which has float32's range" not in to_bf16.hint
    cast = eqx_amp.find_nonfinite(
        lambda x: jnp.full((2,), 3.4e38, jnp.float32).astype(jnp.bfloat16) + x,
        jnp.ones(2, jnp.bfloat16),
    )
    assert cast.primitive == "convert_element_type"
    assert "bfloat16, which has float32's range" not in cast.hint
    assert "a float32 value too large for bfloat16" in cast.hint
    f16 = eqx_amp.find_nonfinite(
        lambda x: x.astype(jnp.float16) * 2, jnp.full((2,), 7e4)
    )
    assert f16.primitive == "convert_element_type"
    assert "or use bfloat16, which has float32's range" in f16.hint


class _RNN(eqx.Module):
    cell: eqx.nn.GRUCell
    carry_in_input_dtype: bool = eqx.field(static=True, default=False)

    def __call__(self, xs):
        dtype = xs.dtype if self.carry_in_input_dtype else jnp.float32
        h0 = jnp.zeros(self.cell.hidden_size, dtype)
        return lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)[0]


def test_report_counts_mixed_matmuls_and_says_why_they_are_wide(getkey):
    model = _RNN(eqx.nn.GRUCell(8, 32, key=getkey()))
    xs = jnp.ones((10, 8))
    # As users run it: the float32 carry meets bfloat16 in the cell's adds.
    with jax.numpy_dtype_promotion("standard"):
        report = eqx_amp.precision_report(eqx_amp.filter_amp(model), xs)
    assert report.advice.startswith("Only 20% of the matmul")
    assert report.flops_by_dtypes[("bfloat16", "float32")] == 61_440  # h @ W_hh
    assert report.low_precision_share == pytest.approx(0.2)
    (wide,) = report.wide_matmuls
    assert wide.dtypes == ("bfloat16", "float32") and wide.flops == 61_440
    assert "loop carry of `scan`" in wide.reason
    assert (
        "made by `broadcast_in_dim`" in wide.reason and "test_report.py" in wide.reason
    )
    assert "matmuls with a wide operand" in str(report)


def test_find_nonfinite_names_a_constant_holding_inf_or_nan():
    """Arguments are checked before the run; a constant the function closes over,
    a literal, or a mask's fill value was not: the output was NaN and the answer
    `None`."""
    x = jnp.arange(4.0)
    bad = jnp.array([1.0, jnp.nan, 1.0, 1.0])
    for fn, primitive in [
        (lambda x: x * bad, "mul"),
        (lambda x: x + jnp.inf, "add"),
    ]:
        found = eqx_amp.find_nonfinite(fn, x)
        assert found is not None and found.primitive == primitive
        assert found.hint.startswith("a constant of the program already holds inf")

    def attention(scores, mask):  # a row with nothing unmasked
        return jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)

    mask = jnp.array([[True, True], [False, False]])
    found = eqx_amp.find_nonfinite(attention, jnp.ones((2, 2)), mask)
    assert found is not None and "a mask fill value" in found.hint
    # Finite throughout, or a NaN constant selected away: nothing to report.
    assert eqx_amp.find_nonfinite(attention, jnp.ones((2, 2)), mask | True) is None
    assert eqx_amp.find_nonfinite(jnp.var, x) is None

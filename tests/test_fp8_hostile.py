"""Hostile edge values for `eqx_amp.fp8.dot_general` and the fp8 rules (`TENSORWISE`, `ROWWISE`,
`filter_amp(..., fp8=)`, `BiModel(..., fp8=)`), and `precision_report` of fp8 steps.

The matrix, for both scalings, forward and first-order backward, against float64
references and the formats' error bounds (each factor off by a relative e4m3/e5m2
unit roundoff plus a subnormal spacing at its scale):

- values: zeros; tiny tensors whose scale would overflow float32 (amax 1e-37, output
  gradients of 1e-36); float32's smallest normal and a subnormal; bfloat16's
  smallest normal and a subnormal; small operands whose scales multiply past
  float32 (1e-18 x 1e-18); float32's largest values; a huge operand times a tiny
  one; one NaN or inf among finite values (in an operand, in the output gradient);
- shapes: odd sizes, empty (no rows, no contraction), a vector dot product, batch
  dimensions;
- dtypes: int, bool and complex operands and out_dtypes refused, dtype words taken;
- transformations: second-order derivatives refused (they would be rounded to fp8
  without scales), `vmap` with a NaN example, `jit` retracing on a new shape and
  dtype, every product (rowwise backward ones included) reading fp8 arrays;
- the report: only live products, under the dtypes they read;
- fp8 filters: identity predicates for `filter_amp` (module, closure, argument) and
  `BiModel`, and a warning where the filter selects nothing.
"""

import functools as ft
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp
from eqx_amp._jaxpr._evaluate import evaluate
from eqx_amp._jaxpr._hook import Hook

from .helpers import walk_eqns


MATMUL = (((1,), (0,)), ((), ()))  # (m, k) x (k, n)
SCALINGS = ("tensorwise", "rowwise")
F32 = jnp.finfo(jnp.float32)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# (unit roundoff, largest finite value, subnormal spacing) of each format.
FORMAT_E4M3 = (2.0**-4, 448.0, 2.0**-9)
FORMAT_E5M2 = (2.0**-3, 57344.0, 2.0**-16)
MAX_SCALE = 2.0**126
M, K, N = 5, 12, 7  # odd sizes: `eqx_amp.fp8.dot_general` itself takes any shape


@ft.partial(jax.jit, static_argnames="scaling")
def _product_and_grads(x, w, g, scaling):
    def product(x, w):
        return eqx_amp.fp8.dot_general(
            x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32
        )

    y, pullback = jax.vjp(product, x, w)
    return (y, *pullback(g))


def _step(x, w, g, scaling):
    return [np.asarray(v, np.float64) for v in _product_and_grads(x, w, g, scaling)]


def _spacing(a, fmt):
    """The fp8 subnormal spacing at the scale of `a` (its finite values), in `a`'s
    units: the most an element's rounding loses beyond the relative unit."""
    _, largest, spacing = fmt
    finite = np.abs(a[np.isfinite(a)])
    amax = float(finite.max()) if finite.size else 0.0
    return spacing / min(largest / max(amax, largest / MAX_SCALE), MAX_SCALE)


def _bound(a, b, fmt_a, fmt_b):
    """Bound on |fp8 product - exact product| of float64 `a @ b`, plus float32's
    accumulation and a flushed float32 subnormal."""
    a, b = np.nan_to_num(a), np.nan_to_num(b)
    ea = fmt_a[0] * np.abs(a) + _spacing(a, fmt_a)
    eb = fmt_b[0] * np.abs(b) + _spacing(b, fmt_b)
    exact = np.abs(a) @ np.abs(b)
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb + 1e-5 * exact + 4 * F32.tiny


def _check_within_bounds(x, w, g, y, dx, dw, rows=slice(None)):
    x, w, g = (np.asarray(v, np.float64) for v in (x, w, g))
    checks = [
        ("y", y, x @ w, _bound(x, w, FORMAT_E4M3, FORMAT_E4M3)),
        ("dx", dx, g @ w.T, _bound(g, w.T, FORMAT_E5M2, FORMAT_E4M3)),
        ("dw", dw, x.T @ g, _bound(x.T, g, FORMAT_E4M3, FORMAT_E5M2)),
    ]
    for name, got, exact, bound in checks:
        got, exact, bound = got[rows], exact[rows], bound[rows]
        assert np.isfinite(got).all(), name
        error = np.abs(got - exact)
        assert (error <= bound).all(), (name, float(np.max(error / bound)))


def _normal(key, shape, scale=1.0):
    return scale * jr.normal(key, shape)


def _case(name):
    k1, k2, k3 = jr.split(jr.key(0), 3)
    x, w, g = _normal(k1, (M, K)), _normal(k2, (K, N)), _normal(k3, (M, N))
    tiny32 = float(F32.tiny)
    cases = {
        "zeros": (jnp.zeros_like(x), w, g),
        # 448 / amax and 57344 / amax overflow float32: the scale once became inf.
        "tiny amax and output gradient": (1e-37 * x, w, 1e-36 * g),
        "float32 smallest normal": (tiny32 * jnp.sign(x), w, g),
        "float32 subnormal": (1e-40 * jnp.sign(x), w, g),
        # Each scale is finite, their product is not.
        "small operands": (1e-18 * x, 1e-18 * w, g),
        "largest values": (1e38 * jnp.tanh(x), 1e-3 * w, 1e-30 * g),
        "huge times tiny": (1e36 * x, 1e-36 * w, g),
    }
    return cases[name]


CASES = (
    "zeros",
    "tiny amax and output gradient",
    "float32 smallest normal",
    "float32 subnormal",
    "small operands",
    "largest values",
    "huge times tiny",
)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("case", CASES)
def test_edge_values_give_finite_products_within_the_formats_bounds(case, scaling):
    x, w, g = _case(case)
    y, dx, dw = _step(x, w, g, scaling)
    _check_within_bounds(x, w, g, y, dx, dw)
    if case == "zeros":
        assert not y.any() and not dw.any()
    if case in ("small operands", "tiny amax and output gradient"):
        # A representable product is not flushed to zero.
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert np.linalg.norm(y - exact) < 0.2 * np.linalg.norm(exact)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_bfloat16_smallest_normal_and_subnormal(scaling):
    x, w, g = _case("zeros")
    bf16 = jnp.finfo(jnp.bfloat16)
    for value in (float(bf16.tiny), float(bf16.smallest_subnormal) * 4):
        xb = (value * jnp.sign(_case("small operands")[1].T[:M])).astype(jnp.bfloat16)
        y, dx, dw = _step(xb, w.astype(jnp.bfloat16), g, scaling)
        xf, wf = xb.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
        _check_within_bounds(xf, wf, g, y, dx, dw)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_nonfinite_element_is_seen_and_leaves_the_other_rows_right(scaling, bad):
    """Rows 10x apart: with the NaN's row falling back to scale 1, the small rows
    flushed to zero while the output looked finite."""
    x, w, g = _case("zeros")
    x = (
        _normal(jr.key(1), (M, K))
        * (10.0 ** -jnp.arange(M, dtype=jnp.float32))[:, None]
    )
    x_bad = x.at[2, 3].set(bad)
    y, dx, dw = _step(x_bad, w, g, scaling)
    assert not np.isfinite(y[2]).any()
    clean = np.arange(M) != 2
    # The other rows are those of the clean product (dw mixes every row: skipped).
    y_clean, dx_clean, _ = _step(x, w, g, scaling)
    x_ref = np.asarray(x, np.float64)
    bound = _bound(x_ref, np.asarray(w, np.float64), FORMAT_E4M3, FORMAT_E4M3)
    error = np.abs(y[clean] - x_ref[clean] @ np.asarray(w, np.float64))
    assert (error <= bound[clean]).all()
    np.testing.assert_array_equal(dx, dx_clean)  # dx does not read x
    # A non-finite output gradient: its row of dx is non-finite, the rest right.
    g_bad = g.at[1, 4].set(bad)
    _, dx, dw = _step(x, w, g_bad, scaling)
    assert not np.isfinite(dx[1]).any() and not np.isfinite(dw[:, 4]).all()
    rows = np.arange(M) != 1
    _, dx_clean, _ = _step(x, w, g, scaling)
    g_ref, w_ref = np.asarray(g, np.float64), np.asarray(w, np.float64)
    bound = _bound(g_ref, w_ref.T, FORMAT_E5M2, FORMAT_E4M3)
    assert (np.abs(dx[rows] - (g_ref @ w_ref.T)[rows]) <= bound[rows]).all()


class _SaturatingFp8Conversion(Hook):
    """Converts to fp8 as a GPU does (PTX `cvt...satfinite`): inf becomes the
    largest finite value; NaN stays NaN."""

    def equation(self, eqn, invals, origins, frame, evaluate):
        new = eqn.params.get("new_dtype")
        if eqn.primitive.name == "convert_element_type" and new in (E4M3, E5M2):
            (x,) = invals
            largest = float(jnp.finfo(new).max)
            return [jnp.clip(x, -largest, largest).astype(new)]
        return evaluate(invals)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_an_inf_stays_non_finite_where_fp8_conversion_saturates(scaling):
    """On an H100 an inf in an operand gave a finite product: the conversion to fp8
    saturates inf to 448, so an overflow upstream vanished (and a loss scale would
    never see it). Non-finite values are made NaN before the conversion."""
    x, w, g = (
        _normal(jr.key(i), s) for i, s in enumerate([(16, 48), (48, 32), (16, 32)])
    )
    x = x.at[2, 3].set(jnp.inf)
    g = g.at[5, 4].set(-jnp.inf)
    closed = jax.make_jaxpr(ft.partial(_product_and_grads, scaling=scaling))(x, w, g)
    y, dx, dw = evaluate(closed, [x, w, g], _SaturatingFp8Conversion())[0]
    assert not np.isfinite(y[2]).any() and np.isfinite(np.delete(y, 2, 0)).all()
    assert not np.isfinite(dx[5]).any()
    assert not np.isfinite(dw[3]).any() and not np.isfinite(dw[:, 4]).any()


SHAPES = {
    "no rows": ((0, 8), (8, 4), MATMUL),
    "no contraction": ((4, 0), (0, 3), MATMUL),
    "vector dot": ((6,), (6,), (((0,), (0,)), ((), ()))),
    "batch": ((2, 3, 5), (2, 5, 4), (((2,), (1,)), ((0,), (0,)))),
    "rhs transposed, batch last": ((3, 5, 2), (4, 5, 2), (((1,), (1,)), ((2,), (2,)))),
}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(scaling, shape):
    lhs_shape, rhs_shape, dims = SHAPES[shape]
    k1, k2 = jr.split(jr.key(2))
    lhs, rhs = _normal(k1, lhs_shape), _normal(k2, rhs_shape)

    def product(lhs, rhs):
        return eqx_amp.fp8.dot_general(
            lhs, rhs, dims, scaling=scaling, out_dtype=jnp.float32
        )

    @jax.jit
    def both(lhs, rhs, g):
        exact = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
        y, pullback = jax.vjp(product, lhs, rhs)
        want, exact_pullback = jax.vjp(exact, lhs, rhs)
        return (y, *pullback(g)), (want, *exact_pullback(g))

    out_shape = jax.eval_shape(product, lhs, rhs).shape
    got, want = both(lhs, rhs, _normal(jr.key(3), out_shape))
    assert got[0].shape == want[0].shape and got[0].dtype == jnp.float32
    for got, want in zip(got, want):
        assert got.shape == want.shape
        assert float(jnp.max(jnp.abs(got - want), initial=0.0)) <= 0.25 * float(
            jnp.max(jnp.abs(want), initial=1.0)
        )


def test_dtypes_refused_and_dtype_words_taken():
    x = jnp.ones((4, 4))
    for bad in (
        jnp.ones((4, 4), jnp.int32),
        jnp.ones((4, 4), bool),
        x.astype(jnp.complex64),
    ):
        with pytest.raises(TypeError, match="multiplies floating arrays"):
            eqx_amp.fp8.dot_general(x, bad, MATMUL)
    for bad in (jnp.int32, jnp.complex64, "int8"):
        with pytest.raises(ValueError, match="`out_dtype` must be"):
            eqx_amp.fp8.dot_general(x, x, MATMUL, out_dtype=bad)
    for word, dtype in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        assert eqx_amp.fp8.dot_general(x, x, MATMUL, out_dtype=word).dtype == dtype


@pytest.mark.parametrize("scaling", SCALINGS)
def test_second_order_derivatives_are_refused(scaling):
    """A Hessian-vector product through the fp8 backward came out 50-70% off."""
    a, b = _normal(jr.key(4), (4, 8)), _normal(jr.key(5), (8, 4))

    def loss(a, b):
        y = eqx_amp.fp8.dot_general(a, b, MATMUL, scaling=scaling, out_dtype="f32")
        return jnp.sum(y**2)

    jax.eval_shape(jax.grad(loss), a, b)  # first order stays
    with pytest.raises(NotImplementedError, match="first-order derivatives only"):
        jax.eval_shape(jax.hessian(loss), a, b)
    with pytest.raises(NotImplementedError, match="first-order derivatives only"):
        jax.eval_shape(lambda a, b: jax.jvp(jax.grad(loss), (a, b), (a, b)), a, b)
    with pytest.raises(NotImplementedError, match="first-order derivatives only"):
        jax.eval_shape(jax.grad(lambda b: jnp.sum(jax.grad(loss)(a, b))), b)


def test_second_order_through_an_fp8_convolution_is_refused():
    conv = eqx.nn.Conv2d(16, 16, 3, padding=1, key=jr.key(6))
    x = _normal(jr.key(7), (16, 2, 2))
    forward = eqx_amp.autocast(
        conv, rules={jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE}
    )

    def loss(x):
        return jnp.sum(forward(x) ** 2)

    jax.eval_shape(jax.grad(loss), x)
    with pytest.raises(NotImplementedError, match="first-order derivatives only"):
        jax.eval_shape(lambda x: jax.jvp(jax.grad(loss), (x,), (x,)), x)


def _rel_error(got, exact):
    got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
    return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def test_tiny_inputs_through_the_fp8_rules_stay_finite():
    """autocast's and filter_amp's fp8 products share the scale: a tiny input (and a
    tiny convolution input) once gave NaN."""
    linear = eqx.nn.Linear(16, 16, use_bias=False, key=jr.key(8))
    x = 1e-37 * _normal(jr.key(9), (16, 16))
    exact = np.asarray(x, np.float64) @ np.asarray(linear.weight, np.float64).T
    rules = {jax.lax.dot_general_p: eqx_amp.fp8.ROWWISE}
    for forward in (
        eqx_amp.autocast(eqx.filter_vmap(linear), rules=rules),
        eqx_amp.filter_amp(eqx.filter_vmap(linear), fp8=eqx_amp.fp8.TENSORWISE),
    ):
        y = eqx.filter_jit(forward)(x)
        assert jnp.isfinite(y).all() and _rel_error(y, exact) < 0.1
    conv = eqx.nn.Conv2d(16, 16, 1, use_bias=False, key=jr.key(10))
    image = 1e-37 * _normal(jr.key(11), (16, 2, 2))
    conv_fp8 = eqx_amp.autocast(
        conv, rules={jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE}
    )
    y = eqx.filter_jit(conv_fp8)(image)
    exact = np.einsum(
        "oi,ihw->ohw",
        np.asarray(conv.weight[:, :, 0, 0], np.float64),
        np.asarray(image, np.float64),
    )
    assert jnp.isfinite(y).all() and _rel_error(y, exact) < 0.1


def test_vmap_with_a_nan_example_and_jit_retracing():
    w = _normal(jr.key(12), (K, N))
    x = _normal(jr.key(13), (4, K)).at[1, 0].set(jnp.nan)
    per_example = (((0,), (0,)), ((), ()))
    y = jax.jit(
        jax.vmap(
            lambda xi: eqx_amp.fp8.dot_general(xi, w, per_example, out_dtype="f32")
        )
    )(x)
    assert not jnp.isfinite(y[1]).any() and jnp.isfinite(y[jnp.array([0, 2, 3])]).all()
    traces = []

    @ft.partial(jax.jit, static_argnames="out_dtype")
    def product(x, w, out_dtype):
        traces.append(out_dtype)
        return eqx_amp.fp8.dot_general(x, w, MATMUL, out_dtype=out_dtype)

    cases = [((3, K), jnp.float32, "f32"), ((6, K), jnp.float32, "f32")]
    cases += [((3, K), jnp.bfloat16, "bf16"), ((3, K), jnp.float32, "f32")]
    for shape, dtype, word in cases:
        xi = _normal(jr.key(14), shape).astype(dtype)
        got = product(xi, w.astype(dtype), out_dtype=word)
        assert got.shape == (shape[0], N) and got.dtype == dtype
        exact = np.asarray(xi, np.float64) @ np.asarray(w.astype(dtype), np.float64)
        assert _rel_error(got, exact) < 0.1
    assert traces == ["f32", "f32", "bf16"]  # the last call reuses the first trace


def _operands_of_products(jaxpr):
    """The dtypes of each dot_general's operands."""
    return [
        tuple(v.aval.dtype for v in eqn.invars)
        for eqn, _ in walk_eqns(jaxpr)
        if eqn.primitive.name == "dot_general"
    ]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_every_product_of_a_step_reads_fp8_arrays(scaling):
    """Rowwise backward products once read `convert(fp8) / row_scale`, which is no
    fp8 GEMM, and conversions up in front of a dot can be dropped by XLA once it
    merges dots; every product reads fp8 arrays, each backward product quantised
    per row of its own."""
    x, w, g = (
        _normal(jr.key(i), s) for i, s in enumerate([(16, 48), (48, 32), (16, 32)])
    )
    jaxpr = jax.make_jaxpr(ft.partial(_product_and_grads, scaling=scaling))(x, w, g)
    products = _operands_of_products(jaxpr)
    assert len(products) == 3
    assert sorted(map(sorted, products)) == sorted(
        [sorted([E4M3, E4M3]), sorted([E5M2, E4M3]), sorted([E5M2, E4M3])]
    )


def _converted_from(jaxpr):
    """For each dot_general, the dtypes its operands were converted from (their own
    dtype where no `convert_element_type` made them)."""
    made_by = {}
    for eqn, _ in walk_eqns(jaxpr):
        if eqn.primitive.name == "convert_element_type":
            made_by[eqn.outvars[0]] = eqn.invars[0].aval.dtype
    return [
        tuple(made_by.get(v, v.aval.dtype) for v in eqn.invars)
        for eqn, _ in walk_eqns(jaxpr)
        if eqn.primitive.name == "dot_general"
    ]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_products_no_fp8_gemm_takes_multiply_fp8_values_in_float32(scaling):
    """On an H100, XLA turned an fp8 product of sizes no fp8 GEMM takes (5 x 12 x 7
    here) into one of float16 operands, whose products overflowed at fp8's scales:
    inf and NaN gradients from ordinary inputs. Such products read their fp8 values
    converted to float32 (exact) and accumulate at HIGHEST precision."""
    x, w, g = (_normal(jr.key(i), s) for i, s in enumerate([(M, K), (K, N), (M, N)]))
    jaxpr = jax.make_jaxpr(ft.partial(_product_and_grads, scaling=scaling))(x, w, g)
    dots = [e for e, _ in walk_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    for eqn in dots:
        assert all(v.aval.dtype == jnp.float32 for v in eqn.invars)
        assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2
    assert sorted(map(sorted, _converted_from(jaxpr))) == sorted(
        [sorted([E4M3, E4M3]), sorted([E5M2, E4M3]), sorted([E5M2, E4M3])]
    )
    # The numbers of the fp8 GEMM (on a CPU, an exact float32 sum of the products).
    y, dx, dw = _step(x, w, g, scaling)
    _check_within_bounds(x, w, g, y, dx, dw)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_report_of_an_fp8_step_counts_the_products_that_run(scaling):
    x, w = _normal(jr.key(16), (32, 64)), _normal(jr.key(17), (64, 48))

    def loss(x, w):
        y = eqx_amp.fp8.dot_general(x, w, MATMUL, scaling=scaling, out_dtype="f32")
        return jnp.sum(y**2)

    report = eqx_amp.precision_report(jax.value_and_grad(loss, (0, 1)), x, w)
    one = 2 * 32 * 64 * 48
    assert report.matmul_flops == 3 * one
    assert report.low_precision_flops == 3 * one
    by_pair = {}
    for dtypes, flops in report.flops_by_dtypes.items():
        key = tuple(sorted(dtypes))
        by_pair[key] = by_pair.get(key, 0) + flops
    assert by_pair == {
        (E4M3.name, E4M3.name): one,
        (E4M3.name, E5M2.name): 2 * one,
    }


def test_report_skips_a_product_nothing_uses():
    a, b = jnp.ones((8, 16)), jnp.ones((16, 4))

    def fn(a, b):
        unused = a @ b  # noqa: F841
        return jnp.sin(a)

    report = eqx_amp.precision_report(fn, a, b)
    assert report.matmul_flops == 0 and report.flops_by_dtypes == {}


#
# fp8 filters: identity predicates.
#


class TwoLayers(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _two_layers():
    k1, k2 = jr.split(jr.key(18))
    return TwoLayers(eqx.nn.Linear(32, 64, key=k1), eqx.nn.Linear(64, 32, key=k2))


L2_FLOPS = 2 * 16 * 64 * 32
FP8_PAIR = (E4M3.name, E4M3.name)


def _fp8_flops(fn, *args):
    return eqx_amp.precision_report(fn, *args).flops_by_dtypes.get(FP8_PAIR, 0)


def test_identity_fp8_filter_selects_that_module():
    model, x = _two_layers(), _normal(jr.key(19), (16, 32))
    is_l2 = lambda m: m is model.l2  # noqa: E731
    amp = eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=is_l2)
    assert _fp8_flops(jax.vmap(amp), x) == L2_FLOPS
    # Passed as an argument, the wrapper is traced as a pytree: a rebuilt copy.
    assert _fp8_flops(lambda amp, x: jax.vmap(amp)(x), amp, x) == L2_FLOPS
    bimodel = eqx_amp.BiModel(model, fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=is_l2)
    assert _fp8_flops(jax.vmap(bimodel), x) == L2_FLOPS

    def closing_over(model):
        return lambda x: jax.vmap(model)(x)

    # The arrays a function closes over were constants: nothing ran in fp8.
    closure = eqx_amp.filter_amp(closing_over(model), fp8=eqx_amp.fp8.TENSORWISE)
    assert _fp8_flops(closure, x) == 2 * L2_FLOPS
    closure = eqx_amp.filter_amp(
        closing_over(model), fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=is_l2
    )
    assert _fp8_flops(closure, x) == L2_FLOPS
    # A module passed to the call, as it is.
    amp_call = eqx_amp.filter_amp(
        lambda m, x: jax.vmap(m)(x), fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=is_l2
    )
    jaxpr = jax.make_jaxpr(lambda x: amp_call(model, x))(x)
    made = [
        e.params["new_dtype"]
        for e, _ in walk_eqns(jaxpr)
        if e.primitive.name == "convert_element_type"
    ]
    assert made.count(E4M3) == 2


def test_an_fp8_filter_that_selects_nothing_says_so():
    model, x = _two_layers(), _normal(jr.key(20), (16, 32))
    is_l2 = lambda m: m is model.l2  # noqa: E731
    # `eqx.filter_vmap` holds a rebuilt copy of the model: identity cannot hold.
    amp = eqx_amp.filter_amp(
        eqx.filter_vmap(model), fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=is_l2
    )
    with pytest.warns(UserWarning, match="`fp8_filter` selected no module"):
        amp(x)
    with pytest.warns(UserWarning, match="`fp8_filter` selects no module"):
        eqx_amp.BiModel(model, fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=lambda m: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=is_l2)(x[0])


def test_report_of_an_fp8_convolution_counts_its_backward_convolutions_as_bfloat16():
    """cuDNN has fp8 forward convolutions only (an H100 compile shows float32 backward
    convolutions when they read float32 conversions): they read bfloat16 copies of
    the fp8 values, are counted as bfloat16 and listed as left out of fp8."""
    x, w = _normal(jr.key(18), (2, 16, 8, 8)), _normal(jr.key(19), (16, 16, 3, 3))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")

    def loss(x, w):
        rules = {jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE}
        y = eqx_amp.autocast(conv, rules=rules)(x, w)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    report = eqx_amp.precision_report(jax.grad(loss, (0, 1)), x, w)
    one = report.matmul_flops // 3
    assert report.flops_by_dtypes[(E4M3.name, E4M3.name)] == one
    assert report.flops_by_dtypes[("bfloat16", "bfloat16")] == 2 * one
    assert [s.reason for s in report.fp8_skipped] == [
        "backward convolution (cuDNN has fp8 forward convolutions only; it reads "
        "bfloat16 copies of the fp8 values)"
    ] * 2
    # Still the fp8 numbers: the bfloat16 copies hold the fp8 values exactly.
    grads = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    reference = jax.jit(jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), (0, 1)))(x, w)
    for got, want in zip(grads, reference):
        assert jnp.all(jnp.isfinite(got))
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.15


@pytest.mark.parametrize("road", ["autocast", "filter_amp"])
def test_float16_policies_give_finite_fp8_gradients(road):
    """The backward products emit the reduce dtype before their scales are applied;
    float16 cannot hold those sums (448 * 57344 * K), so they emit float32 there,
    where bfloat16 policies emit bfloat16."""
    x = _normal(jr.key(20), (64, 256))
    linear = eqx.nn.Linear(256, 64, use_bias=False, key=jr.key(21))

    if road == "autocast":
        rules = {jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE}
        forward = eqx_amp.autocast(linear, policy="mixed_float16", rules=rules)
    else:
        forward = eqx_amp.filter_amp(
            linear, policy="mixed_float16", fp8=eqx_amp.fp8.TENSORWISE
        )

    def loss(x, model):
        return jnp.sum(jax.vmap(model)(x).astype(jnp.float32) ** 2)

    grad = eqx.filter_grad(lambda x: loss(x, forward))
    assert "float8_e5m2" in str(jax.make_jaxpr(grad)(x))  # the products are fp8
    got = eqx.filter_jit(grad)(x)
    want = eqx.filter_jit(eqx.filter_grad(lambda x: loss(x, linear)))(x)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.1


# Each fp8 road quantises a weight once per call, before its products (the weight
# read as it is by the program's top-level matmuls). The same layer called through
# `eqx.filter_checkpoint` has its matmul in a body of its own, quantised where it is
# read: the reference, with the same scale and fp8 values.
_WEIGHT_CASES = {
    "zeros": lambda w: jnp.zeros_like(w),
    "tiny": lambda w: 1e-30 * w,
    "bfloat16 subnormal": lambda w: 1e-39 * jnp.sign(w),
    # With inputs of 1e-10: outputs near 1e29, far from float32's overflow.
    "bfloat16 largest": lambda w: float(jnp.finfo(jnp.bfloat16).max) * jnp.tanh(w),
    "one nan": lambda w: w.at[3, 5].set(jnp.nan),
    "one inf": lambda w: w.at[3, 5].set(jnp.inf),
}


def _in_fp8(road: str, model):
    """`model` with its matmuls in fp8 (tensorwise), by one of the three roads."""
    fp8 = eqx_amp.fp8.TENSORWISE
    if road == "filter_amp":
        return eqx_amp.filter_amp(model, fp8=fp8)
    if road == "autocast":
        return eqx_amp.autocast(model, rules={jax.lax.dot_general_p: fp8})
    return eqx_amp.BiModel(model, fp8=fp8)


class _Checkpointed(eqx.Module):
    layer: eqx.nn.Linear

    def __call__(self, x):
        return eqx.filter_checkpoint(self.layer)(x)


@pytest.mark.parametrize("road", ["filter_amp", "autocast", "bimodel"])
@pytest.mark.parametrize("case", sorted(_WEIGHT_CASES))
def test_weights_quantised_once_match_quantising_at_each_product(road, case):
    linear = eqx.nn.Linear(48, 32, key=jr.key(30))
    linear = eqx.tree_at(lambda m: m.weight, linear, _WEIGHT_CASES[case](linear.weight))
    x = _normal(jr.key(31), (16, 48))

    def forward(model, x):
        return _in_fp8(road, eqx.filter_vmap(model))(x).astype(jnp.float32)

    def loss(model, x):
        return jnp.sum(forward(model, x) ** 2)

    if case == "bfloat16 largest":
        x = 1e-10 * x
    # The layer is an argument of the jitted step: traced, so quantised once.
    once = eqx.filter_jit(eqx.filter_value_and_grad(loss))(linear, x)
    at_each = eqx.filter_jit(eqx.filter_value_and_grad(loss))(_Checkpointed(linear), x)
    stacks = [
        sum(
            e.primitive.name == "stack"
            for e, _ in walk_eqns(eqx.filter_make_jaxpr(forward)(model, x)[0])
        )
        for model in (linear, _Checkpointed(linear))
    ]
    assert stacks == [1, 0]  # the weight's amax taken before the products, or not
    y_once = eqx.filter_jit(forward)(linear, x)
    y_each = eqx.filter_jit(forward)(_Checkpointed(linear), x)
    np.testing.assert_allclose(y_once, y_each, rtol=1e-6, atol=0)
    (value_once, grads_once), (value_each, grads_each) = once, at_each
    np.testing.assert_allclose(value_once, value_each, rtol=1e-6)
    np.testing.assert_allclose(
        grads_once.weight, grads_each.layer.weight, rtol=1e-6, atol=0
    )
    if "nan" in case or "inf" in case:
        assert not np.isfinite(np.asarray(y_once)).all()  # as in float32
    else:
        assert np.isfinite(np.asarray(y_once)).all()
        assert np.isfinite(np.asarray(grads_once.weight)).all()


@pytest.mark.parametrize("road", ["filter_amp", "autocast", "bimodel"])
def test_a_vmap_outside_a_checkpointed_fp8_layer_is_said(road):
    """Under a `jax.vmap` applied outside the wrapper, a checkpointed layer's matmul
    is traced one example at a time (a matrix times a vector), which no fp8 GEMM
    takes: it runs in bfloat16, and a warning says so and how to keep fp8."""
    layer = _Checkpointed(eqx.nn.Linear(48, 32, key=jr.key(32)))
    x = _normal(jr.key(33), (16, 48))
    eqx_amp._core._wrapper.warn_once.cache_clear()  # said once per process
    with pytest.warns(UserWarning, match=r"cannot run in fp8: a `jax.vmap` applied"):
        jax.jit(jax.vmap(_in_fp8(road, layer)))(x)
    # Applied outside the vmap, the matmul runs in fp8 and nothing is said.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(_in_fp8(road, eqx.filter_vmap(layer)))(x)
    assert any(
        "float8_e4m3fn" in str(e.outvars[0].aval.dtype) for e, _ in walk_eqns(jaxpr)
    )


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_by_hand_under_shard_map_and_pmap_a_replicated_operand_gets_its_gradient(
    getkey, scaling, check_vma
):
    """A data-parallel product by hand: `x` split over the mesh, `w` replicated.
    With `check_vma` its gradient must come back typed as replicated, summed over
    the mesh, as `lax.dot_general`'s does (it raised, the derivative rule's
    gradient typed as varying)."""
    x, w = jr.normal(getkey(), (8, 64)), jr.normal(getkey(), (64, 32))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec

    def product(x, w):
        return eqx_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), scaling=scaling)

    def loss(product):
        return lambda x, w: jnp.sum(product(x, w) ** 2)

    sharded = jax.shard_map(
        product,
        mesh=mesh,
        in_specs=(spec("data"), spec()),
        out_specs=spec("data"),
        check_vma=check_vma,
    )
    expected = jax.jit(jax.grad(loss(product), (0, 1)))(x, w)
    grads = jax.jit(jax.grad(loss(sharded), (0, 1)))(x, w)
    for a, b in zip(grads, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pmapped = jax.pmap(product, in_axes=(0, None))(x[None], w)
    np.testing.assert_array_equal(pmapped[0], jax.jit(product)(x, w))

"""`eqx_amp.fp8.MXFP8` and `eqx_amp.fp8.dot_general(..., scaling="mxfp8")`: block-scaled
fp8 matmuls (e4m3 values and gradients, an e8m0 scale per 32 values along each
product's contracting dimension, rounded up from the block's amax).

The hostile matrix, forward and first-order backward: the CPU computes the MXFP8
numbers exactly (against a NumPy quantiser and float64 products of its values),
scales are RCEIL powers of two, a block of zeros, one huge value in a block,
float32 subnormals, one NaN or inf (its block's outputs only, never another
block's), error against float32 within the format's bound; shapes and dimension
numbers (batch axes, several contracting axes, sizes that are not multiples of 32);
the residuals saved in MXFP8 form; second order refused; every road (`filter_amp`,
`BiModel`, `autocast`, `dot_general`) under `jax.vmap` and `eqx.filter_vmap`;
products whose contracting size is not a multiple of 32 left in the compute dtype
with the reason; the report's block-scaled FLOPs.
"""

import functools as ft
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import ml_dtypes
import numpy as np
import pytest

import eqx_amp

from .helpers import (
    ROAD_VMAPS,
    batched_on_road,
    check_first_order_and_retracing,
    fp8_roads,
    scanned_linears,
)


MATMUL = (((1,), (0,)), ((), ()))
E4M3_ULP, E4M3_SUBNORMAL = 2.0**-4, 2.0**-9  # unit roundoff; spacing below 2**-6


def _blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy MXFP8 of `x` along its last axis (padded to 32): the dequantised
    values and each block's scale, from the finite amax rounded up (RCEIL)."""
    x = np.asarray(x, np.float32)
    pad = -x.shape[-1] % 32
    x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    finite = np.where(np.isfinite(blocks), np.abs(blocks), 0.0)
    amax = finite.max(-1, keepdims=True).astype(np.float64)
    exponent = np.ceil(np.log2(np.maximum(amax / 448.0, 2.0**-127)))
    scale = 2.0**exponent
    with np.errstate(invalid="ignore", over="ignore"):
        q = (blocks / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    values = q.astype(np.float64) * scale
    return values.reshape(x.shape), scale[..., 0]


def _mxfp8_reference(x, w, g):
    """The MXFP8 product of `x (m, k) @ w (k, n)` and its two backward products,
    each operand quantised along that product's contracting axis, in float64."""
    x, w, g = (np.asarray(a, np.float32) for a in (x, w, g))
    k, n, m = x.shape[1], w.shape[1], x.shape[0]
    y = _blocks(x)[0][:, :k] @ _blocks(w.T)[0][:, :k].T
    dx = _blocks(g)[0][:, :n] @ _blocks(w)[0][:, :n].T
    dw = (_blocks(g.T)[0][:, :m] @ _blocks(x.T)[0][:, :m].T).T
    return y, dx, dw


@ft.partial(jax.jit, static_argnames="scaling")
def _product_and_grads(x, w, g, scaling="mxfp8"):
    def product(x, w):
        return eqx_amp.fp8.dot_general(
            x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32
        )

    y, pullback = jax.vjp(product, x, w)
    return (y, *pullback(g))


def _close(actual, expected, rtol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected)
    scale = np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale + 1e-30)


@pytest.mark.parametrize("shape", [(64, 96, 48), (40, 64, 24), (10, 32, 10)])
def test_cpu_computes_mxfp8_numbers(getkey, shape):
    """Forward and both backward products are those of the MXFP8 values, each
    operand quantised along its product's contracting axis (padded with zeros
    where the size is not a multiple of 32)."""
    m, k, n = shape
    x = jr.normal(getkey(), (m, k)) * jnp.exp(2 * jr.normal(getkey(), (m, k)))
    w = jr.normal(getkey(), (k, n))
    g = jr.normal(getkey(), (m, n)) * 1e-3
    for actual, expected in zip(_product_and_grads(x, w, g), _mxfp8_reference(x, w, g)):
        _close(actual, expected)


def test_scales_are_rceil_powers_of_two(getkey):
    from eqx_amp._fp8._block_scaled import mx_quantize

    x = jr.normal(getkey(), (2, 3, 128)) * jnp.exp(4 * jr.normal(getkey(), (2, 3, 4, 1))).reshape(2, 3, 4, 1).repeat(32, -1).reshape(2, 3, 128)  # fmt: skip
    q, scales = mx_quantize(x)
    assert q.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float8_e8m0fnu
    assert q.shape == x.shape and scales.shape == (2, 3, 4)
    scale = np.asarray(scales.astype(jnp.float32), np.float64)
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))
    amax = np.abs(np.asarray(x)).reshape(2, 3, 4, 32).max(-1)
    # Rounded up: the block's amax lands in (224, 448], so nothing saturates.
    assert np.all(amax / scale <= 448.0) and np.all(amax / scale > 224.0)
    np.testing.assert_array_equal(
        np.asarray(scale), _blocks(np.asarray(x))[1].reshape(2, 3, 4)
    )


def _bound(x, w):
    """The MXFP8 error bound of `x @ w` against the exact product: each factor off
    by e4m3's unit roundoff, or its subnormal spacing at its block's scale."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    sx = np.repeat(_blocks(x)[1], 32, -1)[:, : x.shape[1]]
    sw = np.repeat(_blocks(w.T)[1], 32, -1)[:, : w.shape[0]].T
    dx = np.maximum(E4M3_ULP * np.abs(x), E4M3_SUBNORMAL * sx)
    dw = np.maximum(E4M3_ULP * np.abs(w), E4M3_SUBNORMAL * sw)
    return np.abs(x) @ dw + dx @ np.abs(w) + dx @ dw


# One compile per shape and setting (eager products dispatch op by op); the
# eager path has its own test, `test_jit_matches_eager`.
_jitted = jax.jit(
    eqx_amp.fp8.dot_general, static_argnums=2, static_argnames=("scaling", "out_dtype")
)


def test_error_against_float32_within_the_mxfp8_bound(getkey):
    x = jr.normal(getkey(), (64, 256)) * jnp.exp(3 * jr.normal(getkey(), (64, 256)))
    w = jr.normal(getkey(), (256, 32))
    y = _jitted(x, w, MATMUL, scaling="mxfp8", out_dtype=jnp.float32)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    error = np.abs(np.asarray(y, np.float64) - exact)
    bound = _bound(x, w) * (1 + 1e-4) + 1e-6 * np.abs(exact)
    assert np.all(error <= bound)

    # Block scales keep a small row beside a huge one, which a single tensorwise
    # scale flushes.
    x = x.at[0].multiply(1e6).at[1].multiply(1e-6)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for scaling, worst in (("mxfp8", 0.1), ("tensorwise", None)):
        y = _jitted(x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32)
        relative = np.abs(np.asarray(y[1]) - exact[1]).max() / np.abs(exact[1]).max()
        assert relative < worst if worst else relative > 0.5


def test_block_of_zeros_and_one_huge_value(getkey):
    """A block of zeros stays zero (and finite); one huge value in a block flushes
    that block's small values but no other block's."""
    x = jr.normal(getkey(), (32, 128))
    x = x.at[:, 32:64].set(0.0).at[3, 70].set(1e30)
    w = jr.normal(getkey(), (128, 32))
    g = jr.normal(getkey(), (32, 32))
    y, dx, dw = _product_and_grads(x, w, g)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in (y, dx, dw))
    for actual, expected in zip((y, dx, dw), _mxfp8_reference(x, w, g)):
        _close(actual, expected)
    # Row 3's other blocks quantise as they would without the huge value.
    q_with = _blocks(np.asarray(x))[0]
    q_without = _blocks(np.asarray(x.at[3, 70].set(0.0)))[0]
    np.testing.assert_array_equal(q_with[3, :64], q_without[3, :64])
    np.testing.assert_array_equal(q_with[3, 96:], q_without[3, 96:])


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_the_ends_of_float32s_range(getkey, scaling):
    """Blocks whose e8m0 scales are float32 subnormals (2**-127: amaxes below about
    2.6e-36) or whose values round up to 2**128 (float32's largest) multiply as the
    GEMM would: a CPU reads a subnormal factor as zero, and a dequantised 2**128 is
    inf, where the products are normal numbers. (NVFP4's backward products are
    MXFP8's.)"""

    product_and_grads = ft.partial(_product_and_grads, scaling=scaling)

    def assert_close(got, want, rtol):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) <= rtol * np.linalg.norm(want)

    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 32)) * 1e3
    g = jr.normal(getkey(), (32, 32)) * 1e-37  # normal float32 numbers
    _, dx, _ = product_and_grads(x, w, g)
    assert_close(dx, np.asarray(g, np.float64) @ np.asarray(w, np.float64).T, 0.1)
    if scaling == "mxfp8":  # NVFP4's forward scales are not e8m0
        tiny = x * 1e-37
        y, _, _ = product_and_grads(tiny, w, g)
        assert_close(y, np.asarray(tiny, np.float64) @ np.asarray(w, np.float64), 0.1)
    largest = float(jnp.finfo(jnp.float32).max)
    huge = jnp.ones((32, 32)).at[0, 0].set(largest)
    w = jnp.full((32, 32), 1e-3)
    y, _, dw = product_and_grads(huge, w, jnp.full((32, 32), 1e-3))
    assert_close(y, np.asarray(huge, np.float64) @ np.asarray(w, np.float64), 0.05)
    assert_close(dw, np.asarray(huge, np.float64).T @ np.full((32, 32), 1e-3), 0.05)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("where", ["lhs", "rhs", "cotangent"])
def test_one_non_finite_value_stays_in_its_block(getkey, bad, where):
    """One NaN or inf makes non-finite only the outputs that read its block; every
    other output equals the product without it."""
    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 32))
    g = jr.normal(getkey(), (32, 32))
    clean = _product_and_grads(x, w, g)
    if where == "lhs":
        x = x.at[5, 40].set(bad)
    elif where == "rhs":
        w = w.at[40, 7].set(bad)
    else:
        g = g.at[5, 7].set(bad)
    dirty = _product_and_grads(x, w, g)
    # The outputs reading the block: row 5 / column 7 of y; in the gradients, the
    # products that contract the bad value's block.
    touched = {
        "lhs": (np.s_[5, :], np.s_[5, :], np.s_[32:64, :]),
        "rhs": (np.s_[:, 7], np.s_[:, 32:64], np.s_[40, 7]),
        "cotangent": ((), np.s_[5, :], np.s_[:, 0:32]),
    }[where]
    for clean_a, dirty_a, rows in zip(clean, dirty, touched):
        clean_a, dirty_a = np.asarray(clean_a), np.asarray(dirty_a)
        mask = np.zeros(clean_a.shape, bool)
        if rows != ():
            mask[rows] = True
        np.testing.assert_array_equal(dirty_a[~mask], clean_a[~mask])
    # The forward output that reads it is not finite.
    if where != "cotangent":
        assert not np.all(np.isfinite(np.asarray(dirty[0])[touched[0]]))


@pytest.mark.parametrize(
    "dims, lhs_shape, rhs_shape",
    [
        ((((2,), (1,)), ((0,), (0,))), (3, 40, 64), (3, 64, 24)),  # batched
        ((((0, 2), (1, 0)), ((), ())), (8, 5, 4), (4, 8, 6)),  # two contracting
        ((((1,), (2,)), ((0,), (1,))), (2, 64, 7), (5, 2, 64)),  # batch not leading
    ],
)
def test_dimension_numbers(getkey, dims, lhs_shape, rhs_shape):
    x, w = jr.normal(getkey(), lhs_shape), jr.normal(getkey(), rhs_shape)

    def product(x, w, fp8):
        if fp8:
            return eqx_amp.fp8.dot_general(x, w, dims, scaling="mxfp8")
        return jax.lax.dot_general(x, w, dims)

    @ft.partial(jax.jit, static_argnums=2)
    def values_and_grads(x, w, fp8):
        loss = lambda x, w: jnp.sum(product(x, w, fp8) ** 2)
        return product(x, w, fp8), jax.grad(loss, (0, 1))(x, w)

    (y, grads), (y_ref, ref) = (
        values_and_grads(x, w, True),
        values_and_grads(x, w, False),
    )
    assert y.shape == y_ref.shape and y.dtype == jnp.float32
    _close(y, y_ref, rtol=0.1)
    for a, b in zip(grads, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        _close(a, b, rtol=0.15)


def test_bfloat16_in_and_out(getkey):
    x = jr.normal(getkey(), (32, 64), jnp.bfloat16)
    w = jr.normal(getkey(), (64, 32), jnp.bfloat16)
    y = _jitted(x, w, MATMUL, scaling="mxfp8")
    assert y.dtype == jnp.bfloat16
    dx, dw = jax.jit(
        jax.grad(
            lambda x, w: jnp.sum(
                eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="mxfp8").astype(
                    jnp.float32
                )
            ),
            (0, 1),
        )
    )(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16


def _residual_bytes(f, *args) -> int:
    _, pullback = jax.vjp(f, *args)
    leaves = jax.tree.leaves(jax.eval_shape(lambda: pullback))
    return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in leaves)


def test_residuals_saved_in_mxfp8_form(getkey):
    x = jr.normal(getkey(), (256, 512), jnp.bfloat16)
    w = jr.normal(getkey(), (512, 256), jnp.bfloat16)
    mx = _residual_bytes(
        lambda x, w: eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="mxfp8"), x, w
    )
    bf16 = _residual_bytes(lambda x, w: x @ w, x, w)
    # 1 byte a value and one byte of scale per 32: (1 + 1/32) / 2 of bfloat16's.
    assert mx == pytest.approx(bf16 * 33 / 64, rel=0.01)


def test_second_order_refused_and_jit_retraces(getkey):
    def product(x, w):
        return eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="mxfp8")

    check_first_order_and_retracing(product, getkey())
    # A non-square product too.
    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 32))
    np.testing.assert_array_equal(product(x, w), jax.jit(product)(x, w))


def test_bad_scaling_named():
    with pytest.raises(ValueError, match="or 'mxfp8' for block scales"):
        eqx_amp.fp8.dot_general(
            jnp.ones((2, 2)), jnp.ones((2, 2)), MATMUL, scaling="mx"
        )


#
# The rule on every road.
#


def _model(getkey, in_size=64):
    return eqx.nn.MLP(in_size, 32, 64, 2, key=getkey())


ROADS = fp8_roads(eqx_amp.fp8.MXFP8)


@pytest.mark.parametrize("road, vmap", ROAD_VMAPS)
def test_every_road_runs_block_scaled(getkey, road, vmap):
    model = _model(getkey)
    x = jr.normal(getkey(), (32, 64))

    forward = batched_on_road(ROADS, road, vmap)

    def loss(model, x):
        return jnp.mean(forward(model, x).astype(jnp.float32) ** 2)

    report = eqx_amp.precision_report(forward, model, x)
    total = 2 * 32 * (64 * 64 + 64 * 64 + 64 * 32)
    assert report.block_scaled_flops == report.matmul_flops == total
    assert report.flops_by_dtypes == {("float8_e4m3fn", "float8_e4m3fn"): total}
    assert "block-scaled (MXFP8, NVFP4)" in str(report)
    # The float32 product a CPU runs instead (`with_cpu_form`) is not the program's:
    # it once showed as a matmul with a wide operand.
    assert report.wide_matmuls == () and "wide operand" not in str(report)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    reference = eqx.filter_jit(
        eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))
    )(model, x)
    out, ref_out = eqx.filter_jit(forward)(model, x), jax.vmap(model)(x)
    assert out.dtype == jnp.float32
    _close(out, ref_out, rtol=0.1)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        assert a.dtype == b.dtype == jnp.float32
        # fp8 cotangents through two fp8 backward products: the first layer's
        # weight gradient is ~16% off float32's, as tensorwise scaling's is.
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.25


def test_contracting_size_not_a_multiple_of_32_stays_in_compute_dtype(getkey):
    model = _model(getkey, in_size=48)  # the first layer contracts 48
    x = jr.normal(getkey(), (32, 48))
    report = eqx_amp.precision_report(jax.vmap(ROADS["filter_amp"](model)), x)
    (skip,) = report.fp8_skipped
    assert (
        "contracting size 48 not a multiple of the MXFP8 block size 32" in skip.reason
    )
    assert report.block_scaled_flops == 2 * 32 * (64 * 64 + 64 * 32)


def test_rule_values():
    rule = eqx_amp.fp8.MXFP8
    assert repr(rule) == "eqx_amp.fp8.MXFP8" and rule.multiple == 32
    assert pickle.loads(pickle.dumps(rule)) is rule
    with_activations = rule.with_activation_products()
    assert pickle.loads(pickle.dumps(with_activations)) == with_activations
    assert rule != eqx_amp.fp8.TENSORWISE and hash(rule) != hash(with_activations)


def test_gather_params_takes_mxfp8_and_refuses_rowwise():
    """(The gathers themselves: `test_sharding_fp8.py`.)"""
    eqx_amp.fp8.MXFP8.check_gather(jnp.dtype(jnp.bfloat16))
    with pytest.raises(TypeError, match="rowwise products quantise each weight"):
        eqx_amp.fp8.ROWWISE.check_gather(jnp.dtype(jnp.bfloat16))
    with pytest.raises(ValueError, match="must be bfloat16, float16 or wider"):
        eqx_amp.fp8.MXFP8.check_gather(jnp.dtype(jnp.float8_e4m3fn))


def test_the_jaxpr_holds_cudnn_and_portable_products(getkey):
    """The product is chosen per platform as the program is lowered: JAX's cuDNN
    block-scaled GEMM for CUDA, a float32 dot of the dequantised operands for a
    CPU, `lax.scaled_dot` elsewhere."""
    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 32))
    text = str(
        jax.make_jaxpr(
            lambda x, w: eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="mxfp8")
        )(x, w)
    )
    assert "scaled_matmul_wrapper" in text and "scaled_dot[" in text
    assert "branches_platforms=(('cpu',), ('cuda',), None)" in text


def test_autocast_around_a_block_scaled_product(getkey):
    """`autocast` around code that calls an MXFP8 product keeps the product's
    per-platform choice (only the CPU's form is compiled here) and its dtypes."""
    dims = (((1,), (2,)), ((0,), (1,)))
    x, w = jr.normal(getkey(), (2, 64, 7)), jr.normal(getkey(), (5, 2, 64))

    def product(x, w):
        return eqx_amp.fp8.dot_general(x, w, dims, scaling="mxfp8")

    wrapped = eqx_amp.autocast(product, policy="mixed_bfloat16")
    y = jax.jit(wrapped)(x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(product)(x, w)))
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(wrapped(x, w) ** 2), (0, 1)))(x, w)
    assert [g.dtype for g in grads] == [jnp.float32, jnp.float32]
    report = eqx_amp.precision_report(wrapped, x, w)
    assert report.flops_by_dtypes == {
        ("float8_e4m3fn", "float8_e4m3fn"): 2 * 2 * 7 * 5 * 64
    }


@pytest.mark.parametrize("road", sorted(ROADS))
def test_a_vmap_outside_the_wrapper_keeps_scanned_products_in_the_compute_dtype(
    getkey, road
):
    # The wrapper traces the scan body one example at a time and the outer vmap
    # batches it afterwards: JAX cannot batch a block-scaled product whose weight
    # was not traced with the batch (it raised an AssertionError from
    # `scaled_matmul`'s batching rule). The products run in the compute dtype,
    # which the warning says, and `precision_report` gives the reason.
    model = scanned_linears(3, 32)
    x = jr.normal(getkey(), (16, 32))
    wrapped = ROADS[road](model)

    def loss(model, x):
        return jnp.mean(jax.vmap(ROADS[road](model))(x).astype(jnp.float32) ** 2)

    eqx_amp._core._wrapper.warn_once.cache_clear()  # said once per process
    with pytest.warns(UserWarning, match="nor can JAX batch a block-scaled"):
        grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    reference = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(model, x)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        assert a.shape == b.shape and bool(jnp.all(jnp.isfinite(a)))
        # bfloat16 products: within bfloat16's rounding of float32's gradients.
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.02
    report = eqx_amp.precision_report(lambda x: jax.vmap(wrapped)(x), x)
    assert report.block_scaled_flops == 0
    assert report.fp8_skipped and all(
        "traced one example at a time" in skip.reason for skip in report.fp8_skipped
    )

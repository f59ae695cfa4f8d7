"""`eqx_amp.fp8.NVFP4` and `eqx_amp.fp8.dot_general(..., scaling="nvfp4")`: NVFP4
forward products (e2m1 values, an e4m3 scale per 16 values along the contracting
dimension rounded up from the block's amax, a power-of-two float32 scale per
tensor), MXFP8 backward products.

The hostile matrix: the CPU computes the NVFP4 numbers exactly (against a NumPy
quantiser and float64 products of its values); the scales' forms; the backward
products are MXFP8's, bit for bit; error against float32 within NVFP4's bound; a
block of zeros, a 1000x outlier (other blocks keep their accuracy) and a 1e30 one
(blocks out of e4m3's scale range flush to zero, finite), float32 subnormals, one
NaN or inf (its block's outputs only); empty, scalar-sized and odd-sized products
and integer operands; dimension numbers; bfloat16 in and out; residuals; second
order refused; `jit` retracing; every road under `jax.vmap` and
`eqx.filter_vmap`, `shard_map` (with and without `check_vma`), `pmap`, an optax
chain; sizes no NVFP4 GEMM takes; the rule's values and its refusals;
`telemetry` rows.
"""

import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqx_amp

from .helpers import (
    ROAD_VMAPS,
    batched_on_road,
    check_first_order_and_retracing,
    fp8_roads,
    halves_its_loss_with_an_optax_chain,
    scanned_linears,
)


MATMUL = (((1,), (0,)), ((), ()))
NVFP4 = eqx_amp.fp8.NVFP4


def _nvfp4(x: np.ndarray) -> np.ndarray:
    """NumPy NVFP4 of `x (rows, k)` along its last axis, dequantised in float64:
    a power-of-two tensor scale `s` (the largest finite block amax times `s` in
    (896, 1792]),
    each block of 16's scale its amax times `s` over 6 (in float32) rounded up to
    an e4m3 value, values (times `s` over the scale, in float32) rounded to
    nearest e2m1."""
    x = np.asarray(x, np.float32)
    block_amax = np.abs(x.reshape(x.shape[0], -1, 16)).max(-1)
    amax = float(np.where(np.isfinite(block_amax), block_amax, 0.0).max(initial=0.0))
    s = 2.0 ** np.floor(np.log2(448.0 / max(amax, 448.0 / 2.0**126)))
    s = np.float32(min(s, 2.0**124) * 4)
    blocks = x.reshape(x.shape[0], -1, 16)
    e4m3 = ml_dtypes.float8_e4m3fn
    wanted = np.abs(blocks).max(-1, keepdims=True) * s / np.float32(6)
    nearest = wanted.astype(e4m3)
    up = nearest.view(np.uint8) + (nearest.astype(np.float32) < wanted)
    scale = up.astype(np.uint8).view(e4m3).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        factor = np.where(scale > 0, s / scale, s).astype(np.float32)
        q = np.clip(blocks * factor, -6, 6)
    values = q.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (values * scale / np.float64(s)).reshape(x.shape)


@jax.jit
def _nvfp4_product(x, w):
    return eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4", out_dtype=jnp.float32)


def _product_and_grads(scaling):
    @jax.jit
    def run(x, w, g):
        def product(x, w):
            return eqx_amp.fp8.dot_general(
                x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32
            )

        y, pullback = jax.vjp(product, x, w)
        return (y, *pullback(g))

    return run


_NVFP4_AND_GRADS = _product_and_grads("nvfp4")
_MXFP8_AND_GRADS = _product_and_grads("mxfp8")


def _close(actual, expected, rtol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected)
    scale = np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale + 1e-30)


@pytest.mark.parametrize("shape", [(64, 96, 48), (40, 64, 24), (10, 32, 10)])
def test_cpu_computes_nvfp4_numbers(getkey, shape):
    m, k, n = shape
    x, w = jr.normal(getkey(), (m, k)), jr.normal(getkey(), (k, n))
    expected = _nvfp4(np.asarray(x)) @ _nvfp4(np.asarray(w).T).T
    _close(_nvfp4_product(x, w), expected)


def test_scales(getkey):
    from eqx_amp._fp8._nvfp4 import nv_quantize

    spread = jnp.exp(jr.normal(getkey(), (2, 3, 4, 1)))
    x = (jr.normal(getkey(), (2, 3, 4, 16)) * spread).reshape(2, 3, 64)
    values, block_scales, tensor_scale = nv_quantize(x)
    assert values.dtype == jnp.float4_e2m1fn and block_scales.dtype == jnp.float8_e4m3fn
    assert block_scales.shape == (2, 3, 4) and tensor_scale.shape == ()
    s = float(tensor_scale)
    assert np.log2(s) == np.round(np.log2(s))
    amax = float(jnp.max(jnp.abs(x)))
    assert 896 < amax * s <= 1792
    # Rounded up: every block's amax over its scale is at most 6 (none saturates).
    decoded = np.asarray(block_scales.astype(jnp.float32), np.float64)
    block_amax = np.abs(np.asarray(x)).reshape(2, 3, 4, 16).max(-1) * s
    assert np.all(block_amax / decoded <= 6.0) and np.all(block_amax / decoded > 5.0)


def test_backward_products_are_mxfp8s(getkey):
    """The same residuals and gradients as `scaling="mxfp8"`, bit for bit."""
    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 48))
    g = jr.normal(getkey(), (32, 48))
    _, *nv_grads = _NVFP4_AND_GRADS(x, w, g)
    _, *mx_grads = _MXFP8_AND_GRADS(x, w, g)
    for a, b in zip(nv_grads, mx_grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_error_against_float32_within_the_nvfp4_bound(getkey):
    x = jr.normal(getkey(), (64, 256)) * jnp.exp(jr.normal(getkey(), (64, 256)))
    w = jr.normal(getkey(), (256, 32))
    y = np.asarray(_nvfp4_product(x, w), np.float64)
    xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact = xd @ wd
    # Each value is off by at most half an e2m1 step at its block's scale: a
    # quarter of the value, or a small part of the block's amax below half a step.
    dx, dw = np.abs(_nvfp4(xd) - xd), np.abs(_nvfp4(wd.T).T - wd)
    block_amax = np.repeat(np.abs(xd).reshape(64, -1, 16).max(-1), 16, -1)
    assert np.all(dx <= np.maximum(0.25 * np.abs(xd), block_amax / 20) + 1e-12)
    bound = np.abs(xd) @ dw + dx @ np.abs(wd) + dx @ dw
    assert np.all(np.abs(y - exact) <= bound * (1 + 1e-4) + 1e-5 * np.abs(exact))
    relative = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert 0.01 < relative < 0.2  # 4 bits: about 10% for each operand


def test_block_of_zeros_and_outliers(getkey):
    x = jr.normal(getkey(), (32, 128)).at[:, 32:48].set(0.0)
    w = jr.normal(getkey(), (128, 32))
    y = _nvfp4_product(x, w)
    assert bool(jnp.all(jnp.isfinite(y)))
    _close(y, _nvfp4(np.asarray(x)) @ _nvfp4(np.asarray(w).T).T)
    exact = np.asarray(x @ w)
    # A 1000x outlier: the other blocks' scales stay within e4m3's range, so the
    # other rows, and row 3's other blocks, keep NVFP4's accuracy.
    outlier = x.at[3, 70].set(1000.0)
    y = np.delete(np.asarray(_nvfp4_product(outlier, w)), 3, 0)
    other_rows = np.delete(exact, 3, 0)
    assert np.linalg.norm(y - other_rows) / np.linalg.norm(other_rows) < 0.2
    row = _nvfp4(np.asarray(outlier))[3]
    kept = np.r_[0:64, 80:128]
    original = np.asarray(x)[3, kept]
    assert np.linalg.norm(row[kept] - original) / np.linalg.norm(original) < 0.2
    # A 1e30 one: blocks more than e4m3's 17 binades of scales below it flush to
    # zero (the format's range: one tensor scale), and everything stays finite.
    y = np.asarray(_nvfp4_product(x.at[3, 70].set(1e30), w))
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(np.delete(y, 3, 0), 0.0)


def test_float32_subnormals(getkey):
    x = jr.normal(getkey(), (32, 64)) * 1e-40  # float32 subnormals
    w = jr.normal(getkey(), (64, 32))
    y = _nvfp4_product(x, w)
    # The tensor scale is at most 2**126: such a tensor's blocks flush to zero,
    # finite.
    assert bool(jnp.all(jnp.isfinite(y)))
    assert np.max(np.abs(np.asarray(y))) <= 1e-38


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("where", ["lhs", "rhs"])
def test_one_non_finite_value_stays_in_its_block(getkey, bad, where):
    """The forward outputs reading the bad value's block are NaN, every other one
    is the product without it; the gradients are MXFP8's."""
    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 32))
    g = jr.normal(getkey(), (32, 32))
    clean = _NVFP4_AND_GRADS(x, w, g)[0]
    if where == "lhs":
        x = x.at[5, 40].set(bad)
    else:
        w = w.at[40, 7].set(bad)
    dirty, *grads = _NVFP4_AND_GRADS(x, w, g)
    touched = np.s_[5, :] if where == "lhs" else np.s_[:, 7]
    mask = np.zeros(clean.shape, bool)
    mask[touched] = True
    np.testing.assert_array_equal(np.asarray(dirty)[~mask], np.asarray(clean)[~mask])
    assert np.all(np.isnan(np.asarray(dirty)[touched]))
    for a, b in zip(grads, _MXFP8_AND_GRADS(x, w, g)[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "dims, lhs_shape, rhs_shape",
    [
        ((((2,), (1,)), ((0,), (0,))), (3, 40, 64), (3, 64, 24)),  # batched
        ((((0, 2), (1, 0)), ((), ())), (8, 5, 4), (4, 8, 6)),  # two contracting
        ((((1,), (2,)), ((0,), (1,))), (2, 64, 7), (5, 2, 64)),  # batch not leading
        ((((1,), (0,)), ((), ())), (1, 16), (16, 1)),  # one output
        ((((1,), (0,)), ((), ())), (0, 32), (32, 8)),  # empty
    ],
)
@pytest.mark.parametrize(
    "scaling", ["nvfp4", pytest.param("nvfp4_training", marks=pytest.mark.slow)]
)
def test_dimension_numbers(getkey, dims, lhs_shape, rhs_shape, scaling):
    """Forward products in NVFP4, backward ones in MXFP8 or (NVIDIA's recipe,
    `"nvfp4_training"`) in NVFP4 too, whose 4-bit gradients get a wider margin."""
    x, w = jr.normal(getkey(), lhs_shape), jr.normal(getkey(), rhs_shape)

    def values_and_grads(x, w, fp8):
        def product(x, w):
            if fp8:
                return eqx_amp.fp8.dot_general(x, w, dims, scaling=scaling)
            return jax.lax.dot_general(x, w, dims)

        loss = lambda x, w: jnp.sum(product(x, w) ** 2)  # noqa: E731
        return product(x, w), jax.grad(loss, (0, 1))(x, w)

    (y, grads) = jax.jit(values_and_grads, static_argnums=2)(x, w, True)
    (y_ref, ref) = jax.jit(values_and_grads, static_argnums=2)(x, w, False)
    assert y.shape == y_ref.shape and y.dtype == jnp.float32
    _close(y, y_ref, rtol=0.3)
    for a, b in zip(grads, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        _close(a, b, rtol=0.4 if scaling == "nvfp4" else 0.5)


def test_bfloat16_in_and_out_and_bad_operands(getkey):
    x = jr.normal(getkey(), (32, 64), jnp.bfloat16)
    w = jr.normal(getkey(), (64, 32), jnp.bfloat16)
    y = eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4")
    assert y.dtype == jnp.bfloat16
    # The GEMM writes its still-scaled sums in bfloat16 (the tensor scales are
    # powers of two): the numbers of rounding the float32 product after.
    wide = eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4", out_dtype="f32")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(wide.astype(jnp.bfloat16)))
    dx, dw = jax.jit(
        jax.grad(
            lambda x, w: jnp.sum(
                eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4").astype(
                    jnp.float32
                )
            ),
            (0, 1),
        )
    )(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    with pytest.raises(
        TypeError, match="multiplies floating arrays, but `lhs` is int32"
    ):
        eqx_amp.fp8.dot_general(jnp.ones((4, 16), int), w[:16], MATMUL, scaling="nvfp4")
    with pytest.raises(ValueError, match=r"\('nvfp4' for a 4-bit forward product,"):
        eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="fp4")


def test_residuals_saved_in_mxfp8_form(getkey):
    x = jr.normal(getkey(), (256, 512), jnp.bfloat16)
    w = jr.normal(getkey(), (512, 256), jnp.bfloat16)

    def residual_bytes(f):
        _, pullback = jax.vjp(f, x, w)
        leaves = jax.tree.leaves(jax.eval_shape(lambda: pullback))
        return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in leaves)

    nv = residual_bytes(
        lambda x, w: eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4")
    )
    assert nv == pytest.approx(residual_bytes(lambda x, w: x @ w) * 33 / 64, rel=0.01)


def test_second_order_refused_and_jit_retraces(getkey):
    def product(x, w):
        return eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4")

    check_first_order_and_retracing(product, getkey())


#
# The rule on every road.
#


ROADS = fp8_roads(NVFP4)


def _model(getkey, in_size=64):
    return eqx.nn.MLP(in_size, 32, 64, 2, key=getkey())


@pytest.mark.parametrize("road, vmap", ROAD_VMAPS)
def test_every_road_runs_nvfp4_forward(getkey, road, vmap):
    model = _model(getkey)
    x = jr.normal(getkey(), (32, 64))

    forward = batched_on_road(ROADS, road, vmap)

    report = eqx_amp.precision_report(forward, model, x)
    total = 2 * 32 * (64 * 64 + 64 * 64 + 64 * 32)
    assert report.block_scaled_flops == report.matmul_flops == total
    assert report.flops_by_dtypes == {("float4_e2m1fn", "float4_e2m1fn"): total}
    assert report.wide_matmuls == ()
    grads = eqx.filter_jit(
        eqx.filter_grad(lambda m, x: jnp.mean(forward(m, x).astype(jnp.float32) ** 2))
    )(model, x)
    reference = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(model, x)
    out = eqx.filter_jit(forward)(model, x)
    assert out.dtype == jnp.float32
    _close(out, jax.vmap(model)(x), rtol=0.3)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        assert a.dtype == b.dtype == jnp.float32
        # 4-bit forward operands in three layers (the output gradient is made
        # from the forward output): the gradients point float32's way.
        cosine = jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))
        assert float(cosine) > 0.85


def test_trains_with_an_optax_chain(getkey):
    def forward(model, x):
        return jax.vmap(eqx_amp.filter_amp(model, fp8=NVFP4))(x)

    assert halves_its_loss_with_an_optax_chain(_model(getkey), forward, getkey())


@pytest.mark.parametrize("check_vma", [True, False])
def test_under_shard_map_and_pmap(getkey, check_vma):
    x, w = jr.normal(getkey(), (8, 64)), jr.normal(getkey(), (64, 32))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    f = lambda x, w: eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4")  # noqa: E731
    sharded = jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(P("data"), P()),
        out_specs=P("data"),
        check_vma=check_vma,
    )
    expected = f(x, w)
    np.testing.assert_array_equal(jax.jit(sharded)(x, w), expected)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(sharded(x, w) ** 2), (0, 1)))(x, w)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    pmapped = jax.pmap(f, in_axes=(0, None))(x[None], w)
    np.testing.assert_array_equal(pmapped[0], expected)


def test_contracting_size_not_a_multiple_of_16_stays_in_compute_dtype(getkey):
    model = _model(getkey, in_size=40)  # the first layer contracts 40
    x = jr.normal(getkey(), (32, 40))
    report = eqx_amp.precision_report(jax.vmap(ROADS["filter_amp"](model)), x)
    (skip,) = report.fp8_skipped
    assert (
        "contracting size 40 not a multiple of the NVFP4 block size 16" in skip.reason
    )
    assert report.block_scaled_flops == 2 * 32 * (64 * 64 + 64 * 32)
    # 48 is a multiple of 16 (not of MXFP8's 32): NVFP4 takes it.
    model = _model(getkey, in_size=48)
    x = jr.normal(getkey(), (32, 48))
    report = eqx_amp.precision_report(jax.vmap(ROADS["filter_amp"](model)), x)
    assert report.fp8_skipped == () and report.block_scaled_flops == report.matmul_flops


def test_rule_values_and_refusals():
    assert repr(NVFP4) == "eqx_amp.fp8.NVFP4" and NVFP4.multiple == 16
    assert pickle.loads(pickle.dumps(NVFP4)) is NVFP4
    variant = NVFP4.with_activation_products()
    assert pickle.loads(pickle.dumps(variant)) == variant
    assert NVFP4 != eqx_amp.fp8.MXFP8
    with pytest.raises(TypeError, match="NVFP4's forward products quantise each"):
        NVFP4.check_gather(jnp.dtype(jnp.bfloat16))
    with pytest.raises(
        TypeError, match="NVFP4's 4-bit forward products are not modelled"
    ):
        NVFP4.where_it_pays()


@pytest.mark.parametrize("road", sorted(ROADS))
def test_a_vmap_outside_the_wrapper_keeps_scanned_products_in_the_compute_dtype(
    getkey, road
):
    model = scanned_linears(3, 32)
    x = jr.normal(getkey(), (16, 32))
    eqx_amp._core._wrapper.warn_once.cache_clear()  # said once per process
    with pytest.warns(UserWarning, match="nor can JAX batch a block-scaled"):
        report = eqx_amp.precision_report(lambda x: jax.vmap(ROADS[road](model))(x), x)
    assert report.block_scaled_flops == 0 and report.fp8_skipped


def test_telemetry_rows_say_nvfp4(getkey):
    model = _model(getkey)
    x = jr.normal(getkey(), (32, 64))

    def step(model, x):
        def loss(model):
            out = jax.vmap(eqx_amp.filter_amp(model, fp8=NVFP4))(x)
            return jnp.mean(out.astype(jnp.float32) ** 2)

        return eqx.filter_grad(loss)(model)

    _, telemetry = eqx.filter_jit(eqx_amp.diagnostics.telemetry(step))(model, x)
    rows = telemetry.rows()
    fp4 = [r for r in rows if r.dtype == "float4_e2m1fn"]
    # Each layer's weight and input, forward; no row for the e4m3 block scales.
    assert len(fp4) == 6 and {r.scaling for r in fp4} == {"nvfp4"}
    assert not [r for r in rows if r.scaling == "nvfp4" and r.dtype != "float4_e2m1fn"]
    assert {r.scaling for r in rows if r.role == "output gradient" and r.scaling} == {
        "mxfp8"
    }
    # The amax is the tensor's (no value saturates), as the bfloat16 cast's.
    first = {r.role: r.amax for r in fp4 if r.layer == "model.layers[0]"}
    assert first["weight"] == pytest.approx(
        float(jnp.max(jnp.abs(model.layers[0].weight))), rel=1e-2
    )
    assert "float4_e2m1fn (nvfp4)" in telemetry.summary()

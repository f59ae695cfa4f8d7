"""`eqx_amp.fp8.NVFP4.with_nvfp4_backward()` and `eqx_amp.fp8.dot_general(...,
scaling="nvfp4_training")`: every product in NVFP4 by NVIDIA's training recipe (the
weight in 16 x 16 tiles, output gradients rounded stochastically, both inputs of a
weight gradient rotated by a random 16 x 16 Hadamard matrix).

The hostile matrix: the CPU computes the recipe's numbers (the forward product
against a NumPy quantiser with 16 x 16 weight tiles; the input gradient reads the
forward's weight numbers exactly; the rotation is orthogonal and spreads an outlier;
stochastic rounding is unbiased and leaves grid values alone); error against
float32; zeros, float32 subnormals, the largest finite values, a 1e30 outlier; one
NaN or inf in an input, the weight or the output gradient (non-finite where float32
is, widened to the weight's tile); empty, odd-sized and batched products and
dimension numbers (`test_nvfp4.py`'s, for both NVFP4 scalings); bfloat16 in and out; residuals saved in NVFP4; second order
refused; `jit` retracing; the weight as either operand; every road under `jax.vmap`
and `eqx.filter_vmap`, `shard_map` (with and without `check_vma`), `pmap`, an optax
chain; the rule's values and refusals; `telemetry` rows.
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
from eqx_amp._fp8._nvfp4 import (
    _to_e2m1_stochastically,
    _uniform,
    hadamard_16,
    nv_quantize_along,
)

from .helpers import (
    ROAD_VMAPS,
    batched_on_road,
    check_first_order_and_retracing,
    eqns_named,
    fp8_roads,
    halves_its_loss_with_an_optax_chain,
    in_dtypes,
    traced,
)


MATMUL = (((1,), (0,)), ((), ()))
RULE = eqx_amp.fp8.NVFP4.with_nvfp4_backward()
GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def _nvfp4(x: np.ndarray, tile_rows: int = 1) -> np.ndarray:
    """NumPy NVFP4 of `x (rows, k)` along its last axis, dequantised in float64, one
    block scale per `tile_rows` x 16 values (rows padded with zeros): a
    power-of-two tensor scale `s` (the largest block amax times `s` in (896,
    1792]); each block's scale its amax times `s` over 6 rounded up to an e4m3
    value; values (times `s` over the scale) rounded to nearest e2m1."""
    x = np.asarray(x, np.float32)
    rows = x.shape[0]
    x = np.pad(x, ((0, -rows % tile_rows), (0, 0)))
    tiles = x.reshape(x.shape[0] // tile_rows, tile_rows, -1, 16)
    block_amax = np.abs(tiles).max((1, 3), keepdims=True)
    amax = float(np.where(np.isfinite(block_amax), block_amax, 0.0).max(initial=0.0))
    s = 2.0 ** np.floor(np.log2(448.0 / max(amax, 448.0 / 2.0**126)))
    s = np.float32(min(s, 2.0**124) * 4)
    e4m3 = ml_dtypes.float8_e4m3fn
    wanted = block_amax * s / np.float32(6)
    nearest = wanted.astype(e4m3)
    up = nearest.view(np.uint8) + (nearest.astype(np.float32) < wanted)
    scale = up.astype(np.uint8).view(e4m3).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        factor = np.where(scale > 0, s / scale, s).astype(np.float32)
        q = np.clip(tiles * factor, -6, 6)
    values = q.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (values * scale / np.float64(s)).reshape(x.shape)[:rows]


def _product(scaling="nvfp4_training", out_dtype=jnp.float32, dims=MATMUL):
    return lambda x, w: eqx_amp.fp8.dot_general(
        x, w, dims, scaling=scaling, out_dtype=out_dtype
    )


@jax.jit
def _value_and_grads(x, w, g):
    y, pullback = jax.vjp(_product(), x, w)
    return (y, *pullback(g))


def _on_grid(key, shape, scale=0.125):
    """Values of the e2m1 grid times a power of two, each block of 16 along the
    last axis holding a 6: NVFP4 holds them exactly, so no rounding (stochastic or
    not) changes them."""
    values = jr.choice(key, jnp.asarray(np.r_[-GRID, GRID]), shape)
    return values.at[..., ::16].set(6.0) * scale


def _close(actual, expected, rtol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected)
    scale = np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale + 1e-30)


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


#
# The numbers.
#


@pytest.mark.parametrize(
    "shape", [(40, 64, 24), pytest.param((10, 32, 10), marks=pytest.mark.slow)]
)
def test_forward_reads_the_weight_in_16x16_tiles(getkey, shape):
    m, k, n = shape
    x, w = jr.normal(getkey(), (m, k)), jr.normal(getkey(), (k, n))
    expected = _nvfp4(np.asarray(x)) @ _nvfp4(np.asarray(w).T, tile_rows=16).T
    out = jax.jit(_product())(x, w)
    _close(out, expected)
    # Not the forward-only rule's weight (one scale per 16 values of a row).
    plain = _nvfp4(np.asarray(x)) @ _nvfp4(np.asarray(w).T).T
    assert not np.allclose(np.asarray(out), plain)


@pytest.mark.parametrize("n", [48, 24])
def test_input_gradient_reads_the_forward_weight(getkey, n):
    """With an output gradient NVFP4 holds exactly, the input gradient is the
    gradient times the forward product's weight numbers (its tiles), to float32's
    rounding: the backward product multiplies by the weight the forward one did."""
    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, n))
    g = _on_grid(getkey(), (32, n))
    _, dx, _ = _value_and_grads(x, w, g)
    weight = _nvfp4(np.asarray(w).T, tile_rows=16)  # (n, 64), as the forward read it
    _close(dx, np.asarray(g, np.float64) @ weight)


def test_weight_gradient_within_the_nvfp4_bound(getkey):
    x = jr.normal(getkey(), (256, 64)) * jnp.exp(jr.normal(getkey(), (256, 1)))
    w, g = jr.normal(getkey(), (64, 48)), jr.normal(getkey(), (256, 48))
    y, dx, dw = _value_and_grads(x, w, g)
    xd, wd, gd = (np.asarray(a, np.float64) for a in (x, w, g))
    # 4 bits for each operand of each product: about 10% for each.
    assert 0.01 < _relative(y, xd @ wd) < 0.25
    assert 0.01 < _relative(dx, gd @ wd.T) < 0.25
    assert 0.01 < _relative(dw, xd.T @ gd) < 0.25


@pytest.mark.slow  # beside the fast tier's forward-only NVFP4 module
def test_the_rotation_is_orthogonal_and_spreads_an_outlier(getkey):
    a, b = jr.normal(getkey(), (5, 48)), jr.normal(getkey(), (7, 48))
    _close(hadamard_16(a) @ hadamard_16(b).T, np.asarray(a) @ np.asarray(b).T)
    # A lone value spreads over its block of 16 at a quarter of its magnitude.
    spread = np.asarray(hadamard_16(jnp.zeros((1, 32)).at[0, 3].set(8.0)))
    np.testing.assert_array_equal(np.abs(spread[0, :16]), 2.0)
    np.testing.assert_array_equal(spread[0, 16:], 0.0)
    # The weight gradient's operands rotated alike: their product is the
    # unrotated one, within 4 bits' error of it.
    x = jr.normal(getkey(), (1, 64, 250)) * jnp.exp(jr.normal(getkey(), (1, 64, 250)))
    g = jr.normal(getkey(), (1, 32, 250))
    (qx, sx, tx), (qg, sg, tg) = (nv_quantize_along(a, 2, rotated=True) for a in (x, g))
    assert qx.shape == (1, 64, 256)  # padded to 16 values a block

    def dequantised(q, s, t):
        blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, 16)
        return (blocks * s.astype(jnp.float32)[..., None]).reshape(q.shape) / t

    product = dequantised(qx, sx, tx)[0] @ dequantised(qg, sg, tg)[0].T
    assert 0.01 < _relative(product, np.asarray(x[0]) @ np.asarray(g[0]).T) < 0.25


def test_stochastic_rounding_is_unbiased_and_keeps_grid_values():
    # Compiled once a shape, rather than op by op.
    round_ = jax.jit(_to_e2m1_stochastically)
    uniform_ = jax.jit(_uniform, static_argnums=0)
    seed = jnp.uint32(12345)
    x = jnp.full((200_000,), 1.3)
    rounded = np.asarray(round_(x, uniform_(x.shape, seed)))
    assert set(np.unique(rounded)) == {1.0, 1.5}
    assert abs(rounded.mean() - 1.3) < 0.005
    # A value that stays the same across steps is rounded up as often as its
    # distance to the grid says: the seed (its tensor's amax) changes.
    one = jnp.full((2_000, 1), 1.3)
    seeds = jnp.arange(2_000, dtype=jnp.uint32)
    draws = jax.vmap(lambda seed: uniform_((1,), seed))(seeds)
    ups = np.asarray(round_(one, draws)) == 1.5
    assert abs(ups.mean() - 0.6) < 0.05
    on_grid = jnp.asarray(np.r_[-GRID, GRID])
    np.testing.assert_array_equal(
        round_(on_grid, uniform_(on_grid.shape, seed)), on_grid
    )
    # Near the top of the grid: 5.9 goes to 4 or 6, never past 6.
    top = jnp.full((10_000,), -5.9)
    rounded = np.asarray(round_(top, uniform_(top.shape, seed)))
    assert set(np.unique(rounded)) == {-6.0, -4.0}
    uniform = np.asarray(uniform_((200, 1000), seed))
    assert uniform.min() >= 0.0 and uniform.max() < 1.0
    counts, _ = np.histogram(uniform, bins=10, range=(0, 1))
    assert np.all(np.abs(counts - 20_000) < 1_000)
    # Another seed: another draw at every position.
    other = np.asarray(uniform_((200, 1000), jnp.uint32(12346)))
    assert np.mean(other == uniform) < 1e-3


#
# Edge values.
#


def test_zeros_subnormals_and_the_largest_values(getkey):
    w, g = jr.normal(getkey(), (64, 32)), jr.normal(getkey(), (32, 32))
    for x in (jnp.zeros((32, 64)), jr.normal(getkey(), (32, 64)) * 1e-40):
        outs = _value_and_grads(x, w, g)
        assert all(bool(jnp.all(jnp.isfinite(o))) for o in outs)
        # Subnormal tensors are flushed (the tensor scale is at most 2**126).
        assert np.max(np.abs(np.asarray(outs[0]))) <= 1e-38
        assert np.max(np.abs(np.asarray(outs[2]))) <= 1e-36
    # The largest finite float32 values: finite wherever float32's products are.
    x = jr.normal(getkey(), (32, 64)).at[3].set(jnp.finfo(jnp.float32).max)
    small = w / 1e4
    y, dx, dw = _value_and_grads(x, small, g)
    reference = jax.jit(lambda x, w: x @ w)(x, small)
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(reference))
    assert bool(jnp.all(jnp.isfinite(dx)))
    # A 1e30 outlier: blocks 17 binades of scales below it flush, all finite.
    y, dx, dw = _value_and_grads(jr.normal(getkey(), (32, 64)).at[3, 7].set(1e30), w, g)
    assert all(bool(jnp.all(jnp.isfinite(o))) for o in (y, dx, dw))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
@pytest.mark.parametrize("where", ["input", "weight", "output gradient"])
def test_one_non_finite_value(getkey, bad, where):
    """Non-finite where float32's products are, and nowhere else; for the weight,
    every output that reads its 16 x 16 tile (the tile has one NaN scale)."""
    x, w = jr.normal(getkey(), (32, 64)), jr.normal(getkey(), (64, 48))
    g = jr.normal(getkey(), (32, 48))
    if where == "input":
        x = x.at[5, 40].set(bad)
    elif where == "weight":
        w = w.at[40, 7].set(bad)
    else:
        g = g.at[5, 7].set(bad)
    outs = _value_and_grads(x, w, g)
    reference = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g))(x, w, g)
    for name, out, ref in zip(("y", "dx", "dw"), outs, reference):
        expected = ~np.isfinite(np.asarray(ref))
        if where == "weight" and name == "y":
            expected[:, 0:16] = True  # the tile of rows 32-47, columns 0-15
        if where == "weight" and name == "dx":
            expected[:, 32:48] = True
        np.testing.assert_array_equal(~np.isfinite(np.asarray(out)), expected, name)


def test_under_vmap_the_batch_is_one_product(getkey):
    x, w = jr.normal(getkey(), (4, 32, 64)), jr.normal(getkey(), (64, 32))
    g = jr.normal(getkey(), (4, 32, 32))
    batched = jax.vmap(_product(), in_axes=(0, None))

    @jax.jit
    def value_and_grads(x, w, g):
        y, pullback = jax.vjp(batched, x, w)
        return (y, *pullback(g))

    y, dx, dw = value_and_grads(x, w, g)
    assert y.shape == (4, 32, 32) and dx.shape == x.shape and dw.shape == w.shape
    # One product over the batch: the batch's rows as one lhs, one scale.
    rows = x.reshape(128, 64)
    _close(y.reshape(128, 32), _value_and_grads(rows, w, g.reshape(128, 32))[0])
    xd, wd, gd = (np.asarray(a, np.float64) for a in (rows, w, g.reshape(128, 32)))
    assert 0.01 < _relative(dx.reshape(128, 64), gd @ wd.T) < 0.25
    assert 0.01 < _relative(dw, xd.T @ gd) < 0.25


def test_bfloat16_in_and_out_and_bad_operands(getkey):
    x = jr.normal(getkey(), (32, 64), jnp.bfloat16)
    w = jr.normal(getkey(), (64, 32), jnp.bfloat16)
    f = _product(out_dtype=None)
    assert f(x, w).dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(f(x, w)), np.asarray(_product()(x, w).astype(jnp.bfloat16))
    )
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32))  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    with pytest.raises(
        TypeError, match="multiplies floating arrays, but `rhs` is int32"
    ):
        eqx_amp.fp8.dot_general(
            x, jnp.ones((64, 16), int), MATMUL, scaling="nvfp4_training"
        )
    with pytest.raises(
        ValueError, match="'nvfp4_training' for 4-bit backward products"
    ):
        eqx_amp.fp8.dot_general(x, w, MATMUL, scaling="nvfp4-training")


@pytest.mark.slow  # beside the fast tier's forward-only NVFP4 module
def test_residuals_saved_in_nvfp4_form(getkey):
    """Each operand saved as e2m1 values and e4m3 scales along what its backward
    product contracts: half a byte and one scale per 16 values on a GPU (XLA holds
    e2m1 in a byte on a CPU, as JAX's arrays do)."""
    x = jr.normal(getkey(), (256, 512), jnp.bfloat16)
    w = jr.normal(getkey(), (512, 256), jnp.bfloat16)
    _, pullback = jax.vjp(_product(out_dtype=jnp.bfloat16), x, w)
    leaves = jax.tree.leaves(jax.eval_shape(lambda: pullback))
    sizes = {}
    for leaf in leaves:
        sizes[jnp.dtype(leaf.dtype)] = sizes.get(jnp.dtype(leaf.dtype), 0) + leaf.size
    assert sizes.pop(jnp.dtype(jnp.float4_e2m1fn)) == x.size + w.size
    assert sizes.pop(jnp.dtype(jnp.float8_e4m3fn)) == (x.size + w.size) // 16
    assert sum(sizes.values()) <= 2  # the two tensor scales


@pytest.mark.slow  # beside the fast tier's forward-only NVFP4 module
def test_second_order_refused_and_jit_retraces(getkey):
    check_first_order_and_retracing(_product(), getkey())
    # Stochastic rounding draws from the values, not a key: a program run twice
    # gives the same gradient.
    x, w = jr.normal(getkey(), (32, 32)), jr.normal(getkey(), (32, 32))
    grad = jax.jit(jax.grad(lambda w: jnp.sum(_product()(x, w) ** 2)))
    np.testing.assert_array_equal(grad(w), grad(w))


#
# The rule on every road.
#


ROADS = fp8_roads(RULE)


def _model(getkey, in_size=64):
    return eqx.nn.MLP(in_size, 32, 64, 2, key=getkey())


@pytest.mark.parametrize(
    "road",
    [
        "filter_amp",
        *(pytest.param(r, marks=pytest.mark.slow) for r in ("autocast", "bimodel")),
    ],
)
def test_an_equinox_linear_is_quantised_in_tiles(getkey, road):
    """`eqx.nn.Linear` multiplies `weight @ x`: the weight is the left operand,
    and every road finds it there."""
    linear = eqx.nn.Linear(64, 48, use_bias=False, key=getkey())
    x = jr.normal(getkey(), (32, 64))
    forward = batched_on_road(ROADS, road, "eqx.filter_vmap inside")
    y = eqx.filter_jit(forward)(linear, x).astype(jnp.float32)
    # Both in bfloat16 first, as every road casts them; the output in bfloat16.
    in_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # noqa: E731
    weight = _nvfp4(in_bf16(linear.weight), tile_rows=16)
    expected = _nvfp4(in_bf16(x)) @ weight.T
    _close(y, expected, rtol=1e-2)
    untiled = _nvfp4(in_bf16(x)) @ _nvfp4(in_bf16(linear.weight)).T
    assert _relative(y, untiled) > 10 * _relative(y, expected)


@pytest.mark.slow  # beside the fast tier's forward-only NVFP4 module
@pytest.mark.parametrize("road, vmap", ROAD_VMAPS)
def test_every_road_runs_every_product_in_nvfp4(getkey, road, vmap):
    model = _model(getkey)
    x = jr.normal(getkey(), (32, 64))
    forward = batched_on_road(ROADS, road, vmap)
    report = eqx_amp.precision_report(forward, model, x)
    total = 2 * 32 * (64 * 64 + 64 * 64 + 64 * 32)
    assert report.block_scaled_flops == report.matmul_flops == total
    assert report.flops_by_dtypes == {("float4_e2m1fn", "float4_e2m1fn"): total}
    loss = lambda m, x: jnp.mean(forward(m, x).astype(jnp.float32) ** 2)  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    reference = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(model, x)
    # Every backward product in 4 bits as well: the gradients still point
    # float32's way.
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        assert a.dtype == b.dtype == jnp.float32
        cosine = jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))
        assert float(cosine) > 0.8
    # The gradient's program: three products per layer, each reading e2m1
    # operands.
    products = eqns_named(
        traced(eqx.filter_grad(loss), model, x), "scaled_matmul_wrapper"
    )
    assert len(products) == 9
    assert all(in_dtypes(e)[:2] == [jnp.float4_e2m1fn] * 2 for e, _ in products)


@pytest.mark.slow  # beside the fast tier's forward-only NVFP4 module
def test_trains_with_an_optax_chain(getkey):
    def forward(model, x):
        return eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=RULE)(x)

    assert halves_its_loss_with_an_optax_chain(_model(getkey), forward, getkey())


@pytest.mark.slow  # beside the fast tier's forward-only NVFP4 module
@pytest.mark.parametrize("check_vma", [True, False])
def test_under_shard_map_and_pmap(getkey, check_vma):
    x, w = jr.normal(getkey(), (8, 64)), jr.normal(getkey(), (64, 32))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    f = _product()
    sharded = jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(P("data"), P()),
        out_specs=P("data"),
        check_vma=check_vma,
    )
    np.testing.assert_array_equal(jax.jit(sharded)(x, w), f(x, w))
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(sharded(x, w) ** 2), (0, 1)))(x, w)
    plain = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1)))(x, w)
    for a, b in zip(grads, plain):
        np.testing.assert_array_equal(a, b)
    pmapped = jax.pmap(f, in_axes=(0, None))(x[None], w)
    np.testing.assert_array_equal(pmapped[0], f(x, w))


def test_rule_values_and_refusals():
    assert repr(RULE) == "eqx_amp.fp8.NVFP4.with_nvfp4_backward()"
    assert RULE.multiple == 16 and RULE != eqx_amp.fp8.NVFP4
    assert RULE == eqx_amp.fp8.NVFP4.with_nvfp4_backward()
    assert pickle.loads(pickle.dumps(RULE)) == RULE
    both = RULE.with_activation_products()
    assert repr(both) == (
        "eqx_amp.fp8.NVFP4.with_nvfp4_backward().with_activation_products()"
    )
    assert pickle.loads(pickle.dumps(both)) == both
    assert eqx_amp.fp8.NVFP4.with_activation_products().with_nvfp4_backward() == both
    for rule in (eqx_amp.fp8.TENSORWISE, eqx_amp.fp8.MXFP8):
        with pytest.raises(TypeError, match="is a form of `eqx_amp.fp8.NVFP4`"):
            rule.with_nvfp4_backward()
    with pytest.raises(TypeError, match="NVFP4's 4-bit forward products are not"):
        RULE.where_it_pays()
    with pytest.raises(TypeError, match="NVFP4's products quantise each weight"):
        RULE.check_gather(jnp.dtype(jnp.bfloat16))


@pytest.mark.slow  # beside the fast tier's forward-only NVFP4 module
def test_telemetry_rows_say_nvfp4_for_every_product(getkey):
    model = _model(getkey)
    x = jr.normal(getkey(), (32, 64))

    def step(model, x):
        def loss(model):
            out = eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=RULE)(x)
            return jnp.mean(out.astype(jnp.float32) ** 2)

        return eqx.filter_grad(loss)(model)

    _, telemetry = eqx.filter_jit(eqx_amp.diagnostics.telemetry(step))(model, x)
    rows = telemetry.rows()
    scalings = {r.scaling for r in rows if r.scaling}
    assert scalings == {"nvfp4"}
    gradients = [r for r in rows if r.role == "output gradient" and r.scaling]
    assert gradients and {r.dtype for r in gradients} == {"float4_e2m1fn"}
    # The amaxes are the tensors' (the weight's read from its tiles' pass, the
    # output gradient's from the one its stochastic rounding follows).
    first = {r.role: r.amax for r in rows if r.layer == "model.layers[0]"}
    assert first["weight"] == pytest.approx(
        float(jnp.max(jnp.abs(model.layers[0].weight))), rel=1e-2
    )


@pytest.mark.parametrize("case", ["x near float32's largest", "x tiny", "g tiny"])
def test_the_rotated_weight_gradient_at_the_ends_of_float32s_range(case):
    """The weight gradient's rotated inputs: a block's rotated values reach 4 times
    its largest, so a tensor near float32's largest is rotated scaled down by a
    power of two (its tensor scale carries it), and the rotation's quarters are
    taken after its sums, which a CPU would read as zero for values near float32's
    smallest normal. The product stays finite and within NVFP4's error where
    float32's is a normal number (before: NaN, and all zeros)."""
    keys = jr.split(jr.key(0), 3)
    x = jr.uniform(keys[0], (64, 64), minval=-1.0, maxval=1.0)
    w, g = jr.normal(keys[1], (64, 32)), jr.normal(keys[2], (64, 32))
    if case == "x near float32's largest":
        x, g = x * 3e38, g * 1e-3
    elif case == "x tiny":
        x = jnp.sign(x) * 2e-38
    else:
        g = jnp.sign(g) * 2e-38

    def product(x, w):
        return eqx_amp.fp8.dot_general(
            x, w, MATMUL, scaling="nvfp4_training", out_dtype=jnp.float32
        )

    _, dw = jax.vjp(product, x, w)[1](g)
    exact = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
    assert bool(jnp.all(jnp.isfinite(dw)))
    error = np.linalg.norm(np.asarray(dw, np.float64) - exact)
    # Four-bit operands, one of them rounded stochastically: about 0.18 at
    # ordinary magnitudes, 0.34 for these +-2e-38 tensors.
    assert error <= 0.5 * np.linalg.norm(exact)

"""`eqx_amp.fp8.DelayedScaling` and `eqx_amp.fp8.delayed`: tensorwise fp8 products
quantised with scales from earlier steps' amaxes, the amaxes handed out as the
gradient of the state, hostile inputs included."""

import json
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_amp
from eqx_amp._fp8._products import dequantized_product
from eqx_amp._fp8._scaling import E4M3, E5M2, scale_from_amax

from .helpers import in_dtypes, rel_error, run_script_on_eight_devices, walk_eqns


TENSORWISE = eqx_amp.fp8.TENSORWISE


def _mlp(key, width=64, out=32):
    return eqx.nn.MLP(width, out, 128, 2, key=key)


ROADS = {
    "filter_amp": lambda m: eqx_amp.filter_amp(eqx.filter_vmap(m), fp8=TENSORWISE),
    "autocast": lambda m: eqx_amp.autocast(
        eqx.filter_vmap(m), rules={jax.lax.dot_general_p: TENSORWISE}
    ),
}


def _loss_on(road):
    def loss_fn(model, x, y):
        out = ROADS[road](model)(x).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    return loss_fn


def _delayed_value_and_grad(loss_fn):
    """`(loss, grads, observed)` of `loss_fn(model, *args)` under `scaling`."""

    @eqx.filter_jit
    def run(model, scaling, *args):
        def scaled(diff, *args):
            model, scaling = diff
            with eqx_amp.fp8.delayed(scaling):
                return loss_fn(model, *args)

        loss, (grads, observed) = eqx.filter_value_and_grad(scaled)(
            (model, scaling), *args
        )
        return loss, grads, observed

    return run


def _data(key, n=32, width=64, out=32, magnitude=1.0):
    kx, ky = jr.split(key)
    return magnitude * jr.normal(kx, (n, width)), jr.normal(ky, (n, out))


def _same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


# (weights, scales_in_gemm): the option needs delayed weights.
RECIPES = [(True, False), (False, False), (True, True)]


@pytest.mark.parametrize("road", sorted(ROADS))
@pytest.mark.parametrize("weights, scales_in_gemm", RECIPES)
def test_a_step_on_the_batch_init_saw_is_current_scaling_bit_for_bit(
    road, weights, scales_in_gemm, getkey
):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on(road)
    scaling = eqx_amp.fp8.DelayedScaling.init(
        loss_fn, model, x, y, weights=weights, scales_in_gemm=scales_in_gemm
    )
    kinds = {"weight": 3 * weights, "activation": 3, "gradient": 3}
    assert {k: scaling.kinds.count(k) for k in kinds} == kinds
    assert scaling.history.shape == (len(scaling.kinds), 16)
    loss, grads, observed = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    current = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    _same((loss, grads), current)
    # Each slot saw one tensor: one bin hit once.
    counts = np.stack(observed.received)
    np.testing.assert_array_equal(counts.sum(axis=1), 1.0)
    newer = scaling.update(observed)
    np.testing.assert_array_equal(newer.history[:, 0], newer.history[:, 1])


@pytest.mark.parametrize("scales_in_gemm", [False, True])
def test_every_product_forward_and_backward_reads_fp8(scales_in_gemm, getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(
        loss_fn, model, x, y, scales_in_gemm=scales_in_gemm
    )

    def scaled(diff):
        model, scaling = diff
        with eqx_amp.fp8.delayed(scaling):
            return loss_fn(model, x, y)

    grad_fn = eqx.filter_grad(scaled)
    jaxpr = eqx.filter_make_jaxpr(grad_fn)((model, scaling))[0]
    eqns = [eqn for eqn, _ in walk_eqns(jaxpr.jaxpr)]
    made = {var: eqn for eqn in eqns for var in eqn.outvars}
    fp8 = {"float8_e4m3fn", "float8_e5m2"}

    def dequantized(atom):
        # fp8 values converted up and times their one inverse scale: the pattern
        # XLA makes cuBLASLt's fp8 GEMM of, which applies the scales itself.
        mul = made.get(atom)
        if mul is None or mul.primitive is not jax.lax.mul_p:
            return False
        values, scale = mul.invars
        convert = made.get(values)
        return (
            convert is not None
            and convert.primitive is jax.lax.convert_element_type_p
            and convert.invars[0].aval.dtype.name in fp8
            and scale.aval.shape == ()
        )

    dots = [eqn for eqn in eqns if eqn.primitive is jax.lax.dot_general_p]
    # Three forward products and two backward ones each.
    assert len(dots) == 9
    forward = [eqn for eqn in dots if all(map(dequantized, eqn.invars))]
    assert len(forward) == (3 if scales_in_gemm else 0)
    for eqn in dots:
        if eqn not in forward:
            assert {d.name for d in in_dtypes(eqn)} <= fp8
    # And so `precision_report` counts every product in fp8.
    report = eqx_amp.precision_report(grad_fn, (model, scaling))
    assert set(report.flops_by_dtypes) <= {
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
    }
    assert report.matmul_flops > 0


def test_the_scale_follows_the_largest_amax_of_the_history(getkey):
    model = _mlp(getkey())
    loss_fn = _loss_on("filter_amp")
    x, y = _data(getkey())
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y, history=2)
    run = _delayed_value_and_grad(loss_fn)
    first = scaling.kinds.index("activation")  # the input's slot
    seen = [float(scale_from_amax(jnp.max(jnp.abs(x)), E4M3))]
    assert float(scaling.scales()[first]) == seen[0]
    for magnitude in (16.0, 1.0, 1.0):
        xs = magnitude * x
        scaling = scaling.update(run(model, scaling, xs, y)[2])
        seen.append(float(scale_from_amax(jnp.max(jnp.abs(xs)), E4M3)))
        # The smallest scale (largest amax) of the last two steps.
        assert float(scaling.scales()[first]) == min(seen[-2:])


def test_without_calibration_every_scale_starts_at_one(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y, calibrate=False)
    np.testing.assert_array_equal(scaling.scales(), 1.0)
    _, _, observed = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    calibrated = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    np.testing.assert_array_equal(
        scaling.update(observed).scales(), calibrated.scales()
    )


def test_margin_halves_each_scale(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    plain = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    wide = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y, margin=2)
    np.testing.assert_array_equal(wide.scales() * 4, plain.scales())


def test_a_stale_scale_saturates_finite_values_and_catches_up(getkey):
    model = _mlp(getkey())
    loss_fn = _loss_on("filter_amp")
    x, y = _data(getkey())
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    run = _delayed_value_and_grad(loss_fn)
    big = 1000.0 * x
    loss, grads, observed = run(model, scaling, big, y)
    assert np.isfinite(loss) and all(
        np.isfinite(g).all() for g in jax.tree.leaves(grads)
    )
    # Saturated: the input's values beyond 448 / scale were clipped, so the loss
    # differs from current scaling's on the same batch.
    current = eqx.filter_jit(loss_fn)(model, big, y)
    assert loss != current
    # Each step, the first saturated layer's input is observed as it is; those
    # after it saw inputs computed from clipped values: one layer a step.
    for _ in range(3):
        scaling = scaling.update(observed)
        loss, grads, observed = run(model, scaling, big, y)
    np.testing.assert_allclose(loss, current, rtol=2e-2)


# The hostile matrix: each input's delayed step after an init on it is current
# scaling's step (NaN where that has NaN).
_F32 = np.finfo(np.float32)
EDGES = {
    "zeros": lambda x: jnp.zeros_like(x),
    "smallest normals": lambda x: jnp.sign(x) * _F32.tiny,
    "subnormals": lambda x: jnp.sign(x) * _F32.smallest_subnormal * 8,
    "largest finite": lambda x: jnp.sign(x) * _F32.max / 4,
    "one inf": lambda x: x.at[3, 5].set(jnp.inf),
    "one nan": lambda x: x.at[3, 5].set(jnp.nan),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "exponents", [(0, 0), (-40, -20), (63, 0), (-63, 63), (20, -7)]
)
def test_a_gemm_applying_the_scales_computes_the_unscaled_product(
    exponents, dtype, getkey
):
    """What a GPU runs for a forward product under delayed scaling (the dot of the
    dequantised fp8 values, which XLA makes an fp8 GEMM taking the inverse scales)
    run here, against what a CPU runs (the fp8 product, unscaled after)."""
    ql = (jr.normal(getkey(), (32, 64)) * 100).astype(E4M3)
    qr = (jr.normal(getkey(), (48, 64)) * 100).astype(E4M3)
    sl, sr = (jnp.float32(2.0**e) for e in exponents)
    dims = (((1,), (1,)), ((), ()))
    gpu = jax.jit(dequantized_product, static_argnames=("dims", "dtype"))(
        ql, qr, sl, sr, dims=dims, dtype=dtype
    )
    wide = (ql.astype(jnp.float32), qr.astype(jnp.float32))
    exact = jax.jit(jax.lax.dot_general, static_argnums=2)(*wide, dims) / sl / sr
    assert gpu.dtype == dtype
    if dtype == jnp.float32:  # the sums of the same values scaled by powers of two
        np.testing.assert_array_equal(gpu, exact)
    else:
        error = np.abs(np.float64(gpu.astype(jnp.float32)) - np.float64(exact))
        assert np.max(error / np.abs(np.float64(exact)).max()) < 2**-7


def _edge_problem(edge, getkey):
    """One fp8 linear layer on an input of `EDGES[edge]`, and its loss."""
    model = eqx.nn.Linear(64, 32, use_bias=False, key=getkey())
    x = EDGES[edge](jr.normal(getkey(), (32, 64)))
    y = jr.normal(getkey(), (32, 32))

    def loss_fn(model, x, y):
        out = eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=TENSORWISE)(x)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    return model, x, y, loss_fn


@pytest.mark.parametrize("edge", sorted(EDGES))
def test_scales_in_gemm_keep_the_operand_scales_within_2_to_the_63(edge, getkey):
    """With `scales_in_gemm`, a GEMM multiplies two inverse scales in float32: the
    activations' and weights' scales stay within 2**±63. Inside them a step is
    current scaling's; an input of amax 8.5e37 saturates at 448 * 2**63, and its
    loss overflows as current scaling's does (not hidden); values below 2**-72 of
    one of amax 1.2e-38 are lost (none reaches this loss)."""
    model, x, y, loss_fn = _edge_problem(edge, getkey)
    init = eqx_amp.fp8.DelayedScaling.init
    scaling = init(loss_fn, model, x, y, scales_in_gemm=True)
    scales = scaling.scales()
    operand = np.array([k != "gradient" for k in scaling.kinds])
    assert np.all((scales[operand] >= 2.0**-63) & (scales[operand] <= 2.0**63))
    loss, grads, observed = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    current = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    activation = float(scales[scaling.kinds.index("activation")])
    if edge == "largest finite":
        assert activation == 2.0**-63
        assert not np.isfinite(loss) and not np.isfinite(current[0])
    else:
        _same((loss, grads), current)
    if edge == "smallest normals":
        assert activation == 2.0**63
    assert np.all(np.isfinite(scaling.update(observed).scales()))


def test_scales_in_gemm_takes_a_bool_and_delayed_weights(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    init = eqx_amp.fp8.DelayedScaling.init
    with pytest.raises(TypeError, match="`scales_in_gemm` must be a bool, got 1"):
        init(loss_fn, model, x, y, scales_in_gemm=1)
    with pytest.raises(ValueError, match="`scales_in_gemm=True` needs `weights=True`"):
        init(loss_fn, model, x, y, weights=False, scales_in_gemm=True)


@pytest.mark.parametrize("edge", sorted(EDGES))
def test_edge_values_give_current_scalings_step(edge, getkey):
    model, x, y, loss_fn = _edge_problem(edge, getkey)
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    loss, grads, observed = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    current = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    _same((loss, grads), current)
    newer = scaling.update(observed)
    assert np.all(np.isfinite(newer.scales()))
    if edge == "zeros":  # no amax: the input keeps a scale of 1
        assert float(newer.scales()[newer.kinds.index("activation")]) == 1.0


def test_ineligible_and_empty_products_take_no_slot(getkey):
    class Mixed(eqx.Module):
        odd: eqx.nn.Linear  # 13 features: no fp8 GEMM takes it
        even: eqx.nn.Linear
        step: int = 3
        key: jax.Array = eqx.field(default_factory=lambda: jr.key(0))
        nothing: None = None
        flag: bool = True

        def __call__(self, x):
            return self.even(jnp.pad(self.odd(x), (0, 3)))

    model = Mixed(
        eqx.nn.Linear(32, 13, key=getkey()), eqx.nn.Linear(16, 16, key=getkey())
    )
    x, y = jr.normal(getkey(), (16, 32)), jr.normal(getkey(), (16, 16))
    scaling = eqx_amp.fp8.DelayedScaling.init(
        lambda m, x, y: jnp.sum(
            eqx_amp.filter_amp(eqx.filter_vmap(m), fp8=TENSORWISE)(x) * y
        ),
        model,
        x,
        y,
    )
    assert scaling.kinds == ("weight", "activation", "gradient")

    def total(model, x):
        return jnp.sum(eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=TENSORWISE)(x))

    with pytest.raises(ValueError, match="runs no tensorwise fp8 matmul"):
        eqx_amp.fp8.DelayedScaling.init(total, model.odd, x)
    # An empty batch: the weight is quantised, but no product hands anything out.
    with pytest.raises(ValueError, match="Either no product ran in fp8"):
        eqx_amp.fp8.DelayedScaling.init(total, model.even, jnp.ones((0, 16)))


def test_a_scanned_product_hands_out_the_largest_amax_of_its_iterations(getkey):
    w = jr.normal(getkey(), (64, 32))
    x = jr.normal(getkey(), (16, 64))
    # The iterations' amaxes are a, a/2, a/4 and a: their sum (2.75a) would ask for
    # a smaller scale than their largest.
    xs = jnp.stack([x * c for c in (1.0, 0.5, 0.25, 1.0)])

    def loss_fn(w, xs):
        def body(total, xi):
            return total + jnp.sum(xi @ w), None

        product = eqx_amp.autocast(
            lambda w, xs: jax.lax.scan(body, 0.0, xs)[0],
            rules={jax.lax.dot_general_p: TENSORWISE},
        )
        return product(w, xs)

    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, w, xs)
    assert scaling.kinds == ("activation", "activation", "gradient")
    largest = scale_from_amax(jnp.max(jnp.abs(x)), E4M3)
    assert float(scaling.scales()[0]) == float(largest)
    assert float(scale_from_amax(2.75 * jnp.max(jnp.abs(x)), E4M3)) < float(largest)
    _, _, observed = _delayed_value_and_grad(loss_fn)(w, scaling, xs)
    assert np.asarray(observed.received[0]).sum() == 4  # once per iteration


def test_the_bimodel_road_with_loss_scaling(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    bimodel = eqx_amp.BiModel(eqx.filter_vmap(model), fp8=TENSORWISE)

    def loss_fn(bm, x, y):
        return jnp.mean((bm(x).astype(jnp.float32) - y) ** 2)

    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, bimodel, x, y)
    assert scaling.kinds.count("gradient") == 3

    def scaled(diff, x, y):
        bm, scaling = diff
        with eqx_amp.fp8.delayed(scaling):
            return loss_fn(bm, x, y)

    grad_fn = eqx.filter_jit(eqx_amp.filter_value_and_grad(scaled))
    loss_scale = eqx_amp.DynamicLossScale(jnp.float32(2.0**10))
    (loss, (grads, observed)), loss_scale, finite = grad_fn(
        (bimodel, scaling), x, y, loss_scale=loss_scale
    )
    current = eqx.filter_jit(eqx_amp.filter_value_and_grad(loss_fn))(
        bimodel, x, y, loss_scale=eqx_amp.DynamicLossScale(jnp.float32(2.0**10))
    )
    _same((loss, grads), current[0])
    assert bool(finite)
    # Each hit counts the loss scale, which unscaling divided out.
    np.testing.assert_array_equal(np.stack(observed.received).sum(axis=1), 1.0)
    newer = scaling.update(observed)
    np.testing.assert_array_equal(newer.history[:, 0], scaling.history[:, 0])
    # A skipped step (NaN gradients) observes nothing: the scales stay, even with
    # a history of one step.
    nan = jax.tree.map(lambda r: jnp.full_like(r, jnp.nan), observed)
    np.testing.assert_array_equal(scaling.update(nan).scales(), scaling.scales())
    short = eqx_amp.fp8.DelayedScaling.init(loss_fn, bimodel, x, y, history=1)
    np.testing.assert_array_equal(short.update(nan).scales(), short.scales())


@pytest.mark.parametrize(
    "loss_scale",
    [
        eqx_amp.StaticLossScale(jnp.float32(1000.0)),
        eqx_amp.DynamicLossScale(jnp.float32(3.0**20), factor=3),
        eqx_amp.DynamicLossScale(jnp.float32(2.0**127)),
    ],
    ids=["static 1000", "powers of 3", "2**127"],
)
def test_any_loss_scale_gives_current_scalings_step_and_counts(loss_scale, getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)

    def scaled(diff, x, y):
        with eqx_amp.fp8.delayed(diff[1]):
            return loss_fn(diff[0], x, y)

    (loss, (grads, observed)), _, _ = eqx.filter_jit(
        eqx_amp.filter_value_and_grad(scaled)
    )((model, scaling), x, y, loss_scale=loss_scale)
    current = eqx.filter_jit(eqx_amp.filter_value_and_grad(loss_fn))(
        model, x, y, loss_scale=loss_scale
    )
    _same((loss, grads), current[0])
    # Scales stay powers of two under a loss scale that is not one, and no count
    # is flushed by unscaling at the largest.
    np.testing.assert_array_equal(np.stack(observed.received).sum(axis=1), 1.0)


def test_a_bimodel_in_any_container_is_differentiated_through_its_compute_copy(
    getkey,
):
    import collections

    model, (x, y) = _mlp(getkey()), _data(getkey())
    bimodel = eqx_amp.BiModel(eqx.filter_vmap(model), fp8=TENSORWISE)
    other = jnp.ones(3)
    Pair = collections.namedtuple("Pair", "model other")

    def loss_of(get):
        def loss_fn(arg, x, y):
            return jnp.mean((get(arg)(x).astype(jnp.float32) - y) ** 2) + jnp.sum(
                arg_other(arg)
            )

        return loss_fn

    grad = eqx_amp.filter_value_and_grad
    ls = eqx_amp.NoOpLossScale()
    alone = grad(lambda bm, x, y: jnp.mean((bm(x).astype(jnp.float32) - y) ** 2))(
        bimodel, x, y, loss_scale=ls
    )[0][1]
    for arg, get, arg_other, pick in (
        ([bimodel, other], lambda a: a[0], lambda a: a[1], lambda g: g[0]),
        (
            {"m": bimodel, "o": other},
            lambda a: a["m"],
            lambda a: a["o"],
            lambda g: g["m"],
        ),
        (Pair(bimodel, other), lambda a: a.model, lambda a: a.other, lambda g: g.model),
        (((bimodel,), other), lambda a: a[0][0], lambda a: a[1], lambda g: g[0][0]),
    ):
        grads = grad(loss_of(get))(arg, x, y, loss_scale=ls)[0][1]
        _same(pick(grads), alone)


def test_a_jit_inside_the_model_is_inlined(getkey):
    class Jitted(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, x):
            return eqx.filter_jit(lambda m, x: m(x))(self.mlp, x)

    model, (x, y) = Jitted(_mlp(getkey())), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    loss, grads, _ = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    current = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    # Current scaling keeps the `jit` a program of its own, which XLA compiles
    # apart: the loss's float32 sums in another order (an ulp apart), whose
    # gradient then rounds to e5m2 a step away here and there.
    np.testing.assert_allclose(loss, current[0], rtol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(current[1])):
        assert rel_error(ours, theirs) < 0.02


def test_a_batch_size_that_changes_the_fp8_products_is_refused(getkey):
    class Reshaping(eqx.Module):
        first: eqx.nn.Linear
        second: eqx.nn.Linear

        def __call__(self, x):  # the second product's rows: 4 per example
            h = jax.nn.relu(self.first(x)).reshape(4, 16)
            return jax.vmap(self.second)(h).reshape(-1)

    model = Reshaping(
        eqx.nn.Linear(64, 64, key=getkey()), eqx.nn.Linear(16, 16, key=getkey())
    )
    loss_fn = _loss_on("filter_amp")
    x, y = _data(getkey(), n=32, out=64)
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    run = _delayed_value_and_grad(loss_fn)
    # 20 examples: the first product (20 rows) leaves fp8, the second (80) stays.
    with pytest.raises(ValueError, match="slot 2 holds activation of sizes \\(64,\\)"):
        run(model, scaling, x[:20], y[:20])
    # A program with fewer products than the state is refused too.
    two = eqx.nn.Sequential([_mlp(getkey(), 64, 64), _mlp(getkey(), 64, 32)])
    x, y = _data(getkey())
    state = eqx_amp.fp8.DelayedScaling.init(loss_fn, two, x, y, weights=False)
    short = eqx.nn.Sequential([two.layers[0], eqx.nn.Lambda(lambda h: h[:32])])
    with pytest.raises(ValueError, match="it holds 12 slots; the program quantised 6"):
        run(short, state, x, y)


@pytest.mark.parametrize("scales_in_gemm", [False, True])
def test_training_with_an_optax_chain_and_multisteps(scales_in_gemm, getkey):
    model = _mlp(getkey(), width=32, out=16)
    kx, kw = jr.split(getkey())
    x = jr.normal(kx, (64, 32))
    y = jnp.tanh(x @ jr.normal(kw, (32, 16)))
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(
        loss_fn, model, x, y, history=4, scales_in_gemm=scales_in_gemm
    )
    optimizer = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3)), 2
    )
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    run = _delayed_value_and_grad(loss_fn)
    first = None
    for _ in range(50):
        loss, grads, observed = run(model, scaling, x, y)
        with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic
            params = eqx.filter(model, eqx.is_array)
            updates, state = optimizer.update(grads, state, params)
        model = eqx.apply_updates(model, updates)
        scaling = scaling.update(observed)
        first = loss if first is None else first
    assert loss < first / 2
    assert np.all(np.isfinite(scaling.scales()))


def test_retracing_reuses_the_slots_and_a_different_program_is_refused(getkey):
    model = _mlp(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, *_data(getkey()))
    run = _delayed_value_and_grad(loss_fn)
    for n in (32, 48):  # two batch sizes: two traces, the same slots
        loss, _, observed = run(model, scaling, *_data(getkey(), n=n))
        assert np.isfinite(loss)
        assert len(observed.received) == len(scaling.kinds)
    deeper = eqx.nn.MLP(64, 32, 128, 3, key=getkey())
    with pytest.raises(ValueError, match="differ from the ones its `DelayedScaling`"):
        run(deeper, scaling, *_data(getkey()))


@pytest.mark.parametrize("scales_in_gemm", [False, True])
# Differentiated with respect to the model alone: the observations are lost, and
# `delayed` says so; what is tested is the refusal.
@pytest.mark.filterwarnings("ignore:`eqx_amp.fp8.delayed`. a product is differentiated")
def test_second_order_derivatives_and_an_inner_vmap_are_refused(scales_in_gemm, getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(
        loss_fn, model, x, y, scales_in_gemm=scales_in_gemm
    )

    def scaled(model, x):
        with eqx_amp.fp8.delayed(scaling):
            return loss_fn(model, x, y)

    @eqx.filter_jit  # the model traced, as in a step
    def hessian(model, x):
        return jax.jacfwd(jax.grad(lambda x: scaled(model, x)))(x)

    with pytest.raises(NotImplementedError, match="first-order derivatives only"):
        hessian(model, x)

    amp = eqx_amp.filter_amp(model, fp8=TENSORWISE)
    with pytest.raises(NotImplementedError, match="outside `jax.vmap` only"):
        with eqx_amp.fp8.delayed(scaling):
            eqx.filter_eval_shape(jax.vmap(amp), x)


def test_bad_inputs_are_refused(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    init = eqx_amp.fp8.DelayedScaling.init
    with pytest.raises(TypeError, match="takes a function"):
        init(model.layers[0].weight, x)
    with pytest.raises(ValueError, match="`history` must be at least 1, got 0"):
        init(loss_fn, model, x, y, history=0)
    with pytest.raises(TypeError, match="`history` must be an integer"):
        init(loss_fn, model, x, y, history=2.5)
    with pytest.raises(ValueError, match="`margin` must be at least 0"):
        init(loss_fn, model, x, y, margin=-1)
    with pytest.raises(ValueError, match="`margin` must be at most 16, got 17"):
        init(loss_fn, model, x, y, margin=17)
    with pytest.raises(TypeError, match="`weights` must be a bool"):
        init(loss_fn, model, x, y, weights="yes")
    with pytest.raises(TypeError, match="`calibrate` must be a bool"):
        init(loss_fn, model, x, y, calibrate=1)
    with pytest.raises(ValueError, match="runs no tensorwise fp8 matmul"):
        init(lambda m, x, y: jnp.sum(jax.vmap(m)(x)), model, x, y)
    scaling = init(loss_fn, model, x, y, history=np.int64(3))
    assert scaling.history.shape[1] == 3
    with pytest.raises(TypeError, match="takes the gradient of the loss"):
        scaling.update(model)
    with pytest.raises(TypeError, match="takes a `DelayedScaling`"):
        with eqx_amp.fp8.delayed(model):
            pass


# Each device's batch is the same but scaled by 2**device: the observations,
# combined by `update(..., axis_name=)`, follow device 7's.
_ON_EIGHT = r"""
import functools as ft
import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, numpy as np
from jax.sharding import PartitionSpec as P
import eqx_amp
from eqx_amp._fp8._scaling import E4M3, scale_from_amax

TENSORWISE = eqx_amp.fp8.TENSORWISE
model = eqx.nn.MLP(64, 32, 64, 1, key=jr.key(0))
x = jr.normal(jr.key(1), (16, 64))
xs = jnp.stack([x * 2.0**d for d in range(8)])
y = jr.normal(jr.key(2), (8, 16, 32))

def loss_fn(model, x, y):
    out = eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=TENSORWISE)(x)
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)

scaling = eqx_amp.fp8.DelayedScaling.init(
    loss_fn, model, x, y[0], scales_in_gemm=SCALES_IN_GEMM
)

params, static = eqx.partition(model, eqx.is_array)

def step(params, scaling, x, y):
    def scaled(diff):
        params, scaling = diff
        with eqx_amp.fp8.delayed(scaling):
            return loss_fn(eqx.combine(params, static), x, y)
    grads, observed = eqx.filter_grad(scaled)((params, scaling))
    return scaling.update(observed, axis_name="d").history

report = {"expected": int(np.log2(float(scale_from_amax(jnp.max(jnp.abs(xs[7])), E4M3))))}
pmapped = jax.pmap(step, axis_name="d", in_axes=(None, None, 0, 0))
first = scaling.kinds.index("activation")  # the input's slot
report["pmap"] = np.asarray(pmapped(params, scaling, xs, y)[:, first, 0]).tolist()
mesh = jax.make_mesh((8,), ("d",))
split = jax.sharding.NamedSharding(mesh, P("d"))
xs, y = jax.device_put(xs, split), jax.device_put(y, split)
for check in (True, False):
    # Under `shard_map` a weight is made device-varying before each product reads
    # it, so the body quantises it there: the state is initialised from the mapped
    # loss (its observations summed over the devices by JAX).
    def mapped(fn, out_specs):
        return jax.jit(jax.shard_map(
            fn, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=out_specs,
            check_vma=check,
        ))
    def mean_loss(p, x, y):
        return jax.lax.pmean(loss_fn(eqx.combine(p, static), x[0], y[0]), "d")
    # Unjitted: a `jit` around it would reuse the trace `init` counts slots with.
    unjitted = jax.shard_map(
        mean_loss, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P(),
        check_vma=check,
    )
    on_all = eqx_amp.fp8.DelayedScaling.init(
        unjitted, params, xs, y, scales_in_gemm=SCALES_IN_GEMM
    )
    try:
        eqx_amp.fp8.DelayedScaling.init(jax.jit(unjitted), params, xs, y)
    except ValueError as error:
        report[f"jitted, check_vma={check}"] = str(error)
    # The input's slot: with `check_vma`, each weight is cast to device-varying and
    # quantised by its product, which reads it first (`weight @ x`).
    first = 1 if check else on_all.kinds.index("activation")
    assert on_all.kinds[first] == "activation"
    report[f"init, shard_map check_vma={check}"] = [int(on_all.history[first, 0])] * 8
    steps = mapped(lambda p, s, x, y: step(p, s, x[0], y[0])[None], P("d"))
    report[f"shard_map check_vma={check}"] = np.asarray(
        steps(params, on_all, xs, y)[:, first, 0]
    ).tolist()
"""


@pytest.mark.slow  # 8 devices: another interpreter
@pytest.mark.parametrize("scales_in_gemm", [False, True])
def test_devices_combine_their_observations_under_pmap_and_shard_map(scales_in_gemm):
    report = run_script_on_eight_devices(
        _ON_EIGHT.replace("SCALES_IN_GEMM", str(scales_in_gemm))
    )
    expected = report.pop("expected")
    for check in (True, False):
        assert "observed none of its fp8 tensors" in report.pop(
            f"jitted, check_vma={check}"
        )
    # The input's slot: its newest entry is the same on every device and follows
    # the largest batch.
    for how, newest in report.items():
        assert newest == [expected] * 8, (how, json.dumps(newest))


def test_the_gradient_slot_uses_e5m2s_range(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y, weights=False)
    # The last product's output gradient: d(mean of squares)/d(out).
    out = eqx.filter_jit(lambda m, x: ROADS["filter_amp"](m)(x))(model, x)
    g = (2 * (out.astype(jnp.float32) - y) / y.size).astype(out.dtype)
    expected = scale_from_amax(jnp.max(jnp.abs(g.astype(jnp.float32))), E5M2)
    assert float(scaling.scales()[-1]) == float(expected)


def test_slots_a_run_does_not_reach_are_named_and_keep_a_scale_of_one(getkey):
    w1, w2 = jr.normal(getkey(), (64, 32)), jr.normal(getkey(), (64, 32))
    x = jr.normal(getkey(), (16, 64))

    def loss_fn(ws, x):
        def pick(x, ws):
            return jax.lax.cond(jnp.sum(x) > 1e9, lambda: x @ ws[0], lambda: x @ ws[1])

        # Every product (`autocast` leaves those reading no parameter in bf16).
        rule = {jax.lax.dot_general_p: TENSORWISE.with_activation_products()}
        return jnp.sum(eqx_amp.autocast(pick, rules=rule)(x, ws))

    # `lax.cond`'s branches in index order: the false one (taken) first.
    with pytest.warns(UserWarning, match=r"the slots \[3, 4, 5\] observed no tensor"):
        scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, (w1, w2), x)
    assert scaling.kinds == ("activation", "activation", "gradient") * 2
    assert np.all(scaling.scales()[:3] != 1.0)
    np.testing.assert_array_equal(scaling.scales()[3:], 1.0)


def test_a_convolutions_kernel_keeps_current_scaling(getkey):
    class ConvThenDense(eqx.Module):
        conv: eqx.nn.Conv2d
        dense: eqx.nn.Linear

        def __call__(self, x):
            return self.dense(jnp.ravel(self.conv(x)))

    model = ConvThenDense(
        eqx.nn.Conv2d(16, 16, 3, padding=1, key=getkey()),
        eqx.nn.Linear(16 * 4 * 4, 32, key=getkey()),
    )
    x, y = jr.normal(getkey(), (16, 16, 4, 4)), jr.normal(getkey(), (16, 32))
    rules = {
        jax.lax.dot_general_p: TENSORWISE,
        jax.lax.conv_general_dilated_p: TENSORWISE,
    }

    def loss_fn(model, x, y):
        out = eqx_amp.autocast(eqx.filter_vmap(model), rules=rules)(x)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every slot observed
        scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    # The dense layer's weight, input and output gradient; not the kernel's.
    assert scaling.kinds == ("weight", "activation", "gradient")
    loss, grads, _ = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    _same(
        (loss, grads), eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    )


def test_products_reading_one_array_share_its_slot(getkey):
    class Two(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __call__(self, x):
            return self.a(x) + self.b(x)

    model = Two(
        eqx.nn.Linear(64, 32, use_bias=False, key=getkey()),
        eqx.nn.Linear(64, 32, use_bias=False, key=getkey()),
    )
    x, y = jr.normal(getkey(), (16, 64)), jr.normal(getkey(), (16, 32))

    def loss_fn(model, x, y):
        out = eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=TENSORWISE)(x)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    # One fp8 form of `x` for both products (as q, k and v read one).
    assert scaling.kinds == ("weight", "weight", "activation", "gradient", "gradient")
    loss, grads, observed = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    _same(
        (loss, grads), eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    )
    np.testing.assert_array_equal(np.stack(observed.received).sum(axis=1), 1.0)


def test_the_state_round_trips_through_a_checkpoint(getkey, tmp_path):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y, history=3)
    scaling = scaling.update(
        _delayed_value_and_grad(loss_fn)(model, scaling, 4 * x, y)[2]
    )
    path = tmp_path / "scaling.eqx"
    eqx.tree_serialise_leaves(path, scaling)
    like = eqx_amp.fp8.DelayedScaling.init(
        loss_fn, model, x, y, history=3, calibrate=False
    )
    restored = eqx.tree_deserialise_leaves(path, like)
    _same(restored, scaling)
    np.testing.assert_array_equal(restored.scales(), scaling.scales())


@pytest.mark.parametrize("scales_in_gemm", [False, True])
def test_an_ensemble_vmapped_over_the_whole_step(scales_in_gemm, getkey):
    models = eqx.filter_vmap(lambda k: _mlp(k))(jr.split(getkey(), 2))
    x, y = _data(getkey())
    loss_fn = _loss_on("filter_amp")
    first = jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, models)
    scaling = eqx_amp.fp8.DelayedScaling.init(
        loss_fn, first, x, y, scales_in_gemm=scales_in_gemm
    )

    def member(model):
        def scaled(diff):
            with eqx_amp.fp8.delayed(diff[1]):
                return loss_fn(diff[0], x, y)

        loss, (_, observed) = eqx.filter_value_and_grad(scaled)((model, scaling))
        return loss, scaling.update(observed).exponents()

    losses, exponents = eqx.filter_jit(eqx.filter_vmap(member))(models)
    expected = eqx.filter_jit(eqx.filter_vmap(lambda m: loss_fn(m, x, y)))(models)
    np.testing.assert_array_equal(losses[0], expected[0])
    assert exponents.shape == (2, len(scaling.kinds))


@pytest.mark.parametrize("scales_in_gemm", [False, True])
@pytest.mark.parametrize("road", ["filter_amp", "autocast", "bimodel"])
def test_no_tracer_outlives_a_delayed_step(road, scales_in_gemm, getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    wrap = {
        **ROADS,
        "bimodel": lambda m: eqx_amp.BiModel(eqx.filter_vmap(m), fp8=TENSORWISE),
    }[road]

    def loss_fn(model, x, y):
        return jnp.mean((wrap(model)(x).astype(jnp.float32) - y) ** 2)

    scaling = eqx_amp.fp8.DelayedScaling.init(
        loss_fn, model, x, y, scales_in_gemm=scales_in_gemm
    )
    run = _delayed_value_and_grad(loss_fn)
    # One step traces every function a step traces: a tracer kept past it fails here.
    with jax.checking_leaks():
        _, _, observed = run(model, scaling, x, y)
        scaling = scaling.update(observed)
    assert np.all(np.isfinite(scaling.scales()))


def _initialised_mlp(getkey):
    """An MLP, a batch, its `filter_amp` fp8 loss and a `DelayedScaling` from it."""
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    return model, x, y, loss_fn, eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)


class _ReadInAndAfterALoop(eqx.Module):
    """An activation read by a product in a loop body (closed over, as an encoder's
    memory is by scanned layers) and by another after the loop."""

    inner: eqx.nn.Linear
    outer: eqx.nn.Linear
    loop: str = eqx.field(static=True)

    def __call__(self, x):
        def add(c):
            return c + jax.vmap(self.inner)(x)

        zero = jnp.zeros(x.shape, x.dtype)
        if self.loop == "scan":
            h, _ = jax.lax.scan(lambda c, _: (add(c), None), zero, None, length=2)
        elif self.loop == "fori_loop":
            h = jax.lax.fori_loop(0, 2, lambda i, c: add(c), zero)
        else:
            h = jax.checkpoint(add)(zero)
        return jax.vmap(self.outer)(x) + h[:, :32]


@pytest.mark.parametrize("loop", ["scan", "fori_loop", "checkpoint"])
def test_an_activation_read_in_a_loop_body_and_after_it(loop, getkey):
    """Its fp8 form made inside the body is the body's: the read after the loop
    quantises it again (it crashed with an escaped tracer)."""
    model = _ReadInAndAfterALoop(
        eqx.nn.Linear(64, 64, key=getkey()), eqx.nn.Linear(64, 32, key=getkey()), loop
    )
    x, y = _data(getkey())

    def loss_fn(model, x, y):
        out = eqx_amp.filter_amp(model, fp8=TENSORWISE)(x).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    loss, grads, observed = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    current = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    _same((loss, grads), current)
    assert np.all(np.stack(observed.received).sum(axis=1) >= 1)


def test_a_step_that_observes_nothing_keeps_every_entry_of_the_history(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())
    loss_fn = _loss_on("filter_amp")
    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y, history=2)
    _, _, big = _delayed_value_and_grad(loss_fn)(model, scaling, 64 * x, y)
    _, _, small = _delayed_value_and_grad(loss_fn)(model, scaling, x / 64, y)
    # A large amax, then a small one: the scale is the large amax's.
    seen = scaling.update(big).update(small)
    assert np.any(seen.history[:, 0] != seen.history[:, 1])
    nothing = jax.tree.map(jnp.zeros_like, small)
    skipped = jax.tree.map(lambda r: jnp.full_like(r, jnp.nan), small)
    for observed in (nothing, skipped):
        kept = seen.update(observed)
        np.testing.assert_array_equal(kept.history, seen.history)
        np.testing.assert_array_equal(kept.scales(), seen.scales())


def test_a_scaling_that_is_not_differentiated_is_warned_of(getkey):
    """`delayed` around the gradient's call, with the scaling not among what is
    differentiated: its observations cannot leave, so the scales would never
    move."""
    model, x, y, loss_fn, scaling = _initialised_mlp(getkey)
    with pytest.warns(
        UserWarning, match=r"the `DelayedScaling` given to `delayed` is not"
    ):
        with eqx_amp.fp8.delayed(scaling):
            eqx.filter_value_and_grad(loss_fn)(model, x, y)
    # Differentiated with the model, or not differentiated at all: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
        with eqx_amp.fp8.delayed(scaling):
            eqx.filter_jit(loss_fn)(model, x, y)


def test_delayed_entered_twice_is_refused(getkey):
    model, x, y, loss_fn, scaling = _initialised_mlp(getkey)
    with pytest.raises(ValueError, match=r"`eqx_amp.fp8.delayed` is in effect"):
        with eqx_amp.fp8.delayed(scaling):
            with eqx_amp.fp8.delayed(scaling):
                pass


def test_a_product_under_stop_gradient_is_named_among_the_unseen(getkey):
    model, (x, y) = _mlp(getkey()), _data(getkey())

    def loss_fn(model, x, y):
        forward = ROADS["filter_amp"](model)
        target = jax.lax.stop_gradient(forward(2 * x)).astype(jnp.float32)
        return jnp.mean((forward(x).astype(jnp.float32) - target) ** 2)

    with pytest.warns(
        UserWarning, match=r"observed no tensor.*`jax.lax.stop_gradient`"
    ):
        eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)


def test_update_under_x64_with_strict_promotion(getkey):
    model, x, y, loss_fn, scaling = _initialised_mlp(getkey)
    _, _, observed = _delayed_value_and_grad(loss_fn)(model, scaling, x, y)
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        newer = scaling.update(observed)
    assert newer.history.dtype == jnp.int32
    np.testing.assert_array_equal(newer.history, scaling.update(observed).history)


def test_a_concrete_forward_under_delayed_weights_is_refused(getkey):
    model, x, y, loss_fn, scaling = _initialised_mlp(getkey)
    with pytest.raises(ValueError, match=r"a product ran on concrete arrays"):
        with eqx_amp.fp8.delayed(scaling):
            loss_fn(model, x, y)
    with eqx_amp.fp8.delayed(scaling):  # traced: as a step runs it
        assert np.isfinite(eqx.filter_jit(loss_fn)(model, x, y))

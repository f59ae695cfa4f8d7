import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqx_amp

from .helpers import (
    assert_matmuls_in,
    assert_scope_in_float32,
    eqns_named,
    float_dtypes,
    rel_error,
    run_on_eight_devices,
    traced,
)
from .models import BatchNormNet, TransformerBlock


F32 = jnp.dtype(jnp.float32)
F16 = jnp.dtype(jnp.float16)
BF16 = jnp.dtype(jnp.bfloat16)
POLICY = eqx_amp.Policy(jnp.float32, jnp.float16, jnp.float32)
DIM, SEQ, BATCH = 16, 8, 4


#
# Helpers.
#


def _model(key=None):
    return TransformerBlock(DIM, 2, key=jr.key(0) if key is None else key)


def _data(key, poison=1.0):
    kx, ky = jr.split(key)
    x = jr.normal(kx, (BATCH, SEQ, DIM))
    y = jr.normal(ky, (BATCH, SEQ, DIM))
    return x, y, jnp.float32(poison)


def _loss_fn(model, x, y, poison):
    pred = jax.vmap(model)(x)
    # `poison` is 1 on a normal step and NaN on a step whose gradients we want to
    # be non-finite (fault injection, as in optax's `apply_if_finite` tests).
    return jnp.mean((pred - y) ** 2) * poison


def _params(bimodel):
    return eqx.filter(bimodel.master, eqx.is_inexact_array)


def _make_step(optimizer, redo_on_nan=0):
    @eqx.filter_jit
    def step(bimodel, opt_state, loss_scale, x, y, poison):
        (loss, grads), loss_scale, grads_finite = eqx_amp.filter_value_and_grad(
            _loss_fn, redo_on_nan=redo_on_nan
        )(bimodel, x, y, poison, loss_scale=loss_scale)
        # optax.adam's bias correction computes `decay**count` (a float32 to the
        # power of an int32 count), which strict promotion rejects; the update
        # itself is float32 throughout.
        with jax.numpy_dtype_promotion("standard"):
            updates, new_opt_state = optimizer.update(
                grads, opt_state, _params(bimodel)
            )
        new_bimodel = bimodel.apply_updates(updates)
        bimodel, opt_state = eqx_amp.select_tree(
            grads_finite, (new_bimodel, new_opt_state), (bimodel, opt_state)
        )
        return bimodel, opt_state, loss_scale, loss, grads_finite

    return step


OPTIMIZER = optax.adam(1e-2)
# Module-level, so that the tests which use the same shapes share one compilation.
STEP = _make_step(OPTIMIZER)


def _init_opt(bimodel):
    with jax.numpy_dtype_promotion("standard"):
        return OPTIMIZER.init(_params(bimodel))


def _bits(x):
    """An array's bit pattern: compares -0.0 and 0.0 (and NaNs) exactly."""
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating) or x.dtype in (F16, BF16):
        return x.view(f"u{x.dtype.itemsize}")
    return x


def assert_bitwise_equal(a, b):
    a_leaves, a_def = jtu.tree_flatten(a)
    b_leaves, b_def = jtu.tree_flatten(b)
    assert a_def == b_def
    for x, y in zip(a_leaves, b_leaves):
        if eqx.is_array(x) or isinstance(x, np.ndarray):
            assert eqx.is_array(y) or isinstance(y, np.ndarray)
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(_bits(x), _bits(y))
        else:
            assert x == y


def assert_invariant(bimodel):
    """The compute copy is the master cast to the compute dtype, bit for bit."""
    expected = eqx_amp.cast_tree(
        bimodel.master, bimodel.policy.compute_dtype, bimodel.filter_spec
    )
    assert_bitwise_equal(bimodel.compute, expected)


def _array_bytes(tree):
    """Bytes of the arrays (or `jax.ShapeDtypeStruct`s) of `tree`."""
    return sum(
        x.size * x.dtype.itemsize
        for x in jtu.tree_leaves(tree)
        if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    )


#
# Structure.
#


def test_structure_and_dtypes():
    model = _model()
    bimodel = eqx_amp.BiModel(model, policy=POLICY)
    assert bimodel.policy == POLICY
    assert jtu.tree_structure(bimodel.compute) == jtu.tree_structure(bimodel.master)
    assert jtu.tree_structure(bimodel.master) == jtu.tree_structure(model)
    assert float_dtypes(bimodel.master) == {F32}
    compute = bimodel.compute
    assert compute.attention.query_proj.weight.dtype == F16
    assert compute.mlp.layers[0].bias.dtype == F16
    # Normalisation layers are kept by the default spec.
    assert compute.norm1.weight.dtype == F32
    assert compute.norm2.bias.dtype == F32
    assert_bitwise_equal(bimodel.master, model)
    assert_invariant(bimodel)


def test_default_policy_and_master_in_param_dtype():
    # A bfloat16 model gets float32 master weights.
    model = eqx_amp.cast_tree(_model(), jnp.bfloat16)
    bimodel = eqx_amp.BiModel(model)
    assert bimodel.policy == eqx_amp.default_policy()
    assert float_dtypes(bimodel.master) == {F32}
    assert bimodel.compute.mlp.layers[0].weight.dtype == bimodel.policy.compute_dtype
    assert_invariant(bimodel)


def test_kept_leaves_are_not_duplicated():
    model = _model()
    bimodel = eqx_amp.BiModel(model, policy=POLICY)
    spec = eqx_amp.default_filter_spec(model)
    n_cast = sum(
        bool(s) and eqx.is_inexact_array(x)
        for s, x in zip(
            jtu.tree_leaves(eqx_amp._core._filters.selection_mask(model, spec)),
            jtu.tree_leaves(model),
        )
    )
    assert n_cast == 8  # 4 attention projections, 2 MLP weights and 2 MLP biases.
    assert len(jtu.tree_leaves(bimodel)) == len(jtu.tree_leaves(model)) + n_cast
    # The pytree holds the master once, plus a half-size copy of the cast leaves.
    kept_bytes = _array_bytes((model.norm1, model.norm2))
    master_bytes = _array_bytes(model)
    assert _array_bytes(bimodel) == master_bytes + (master_bytes - kept_bytes) // 2
    # The compute copy shares the master's kept arrays.
    assert bimodel.compute.norm1.weight is bimodel.master.norm1.weight


def test_nothing_is_copied_when_compute_equals_param_dtype():
    model = _model()
    bimodel = eqx_amp.BiModel(model, policy="float32")
    assert len(jtu.tree_leaves(bimodel)) == len(jtu.tree_leaves(model))
    x = jr.normal(jr.key(1), (SEQ, DIM))
    assert_bitwise_equal(bimodel(x), model(x))


def test_user_spec_keeps_attention_in_float32():
    model = _model()
    spec = eqx_amp.keep(model, eqx.nn.MultiheadAttention)
    bimodel = eqx_amp.BiModel(model, policy=POLICY, filter_spec=spec)
    assert bimodel.compute.attention.query_proj.weight.dtype == F32
    assert bimodel.compute.mlp.layers[0].weight.dtype == F16
    jaxpr = traced(bimodel.compute.attention, *(jnp.ones((SEQ, DIM)),) * 3)
    assert_matmuls_in(jaxpr, F32)
    x = jr.normal(jr.key(1), (SEQ, DIM))
    expected = eqx_amp.filter_amp(model, policy=POLICY, filter_spec=spec)(x)
    assert_bitwise_equal(bimodel(x), expected)


#
# Calling.
#


def test_call_matches_filter_amp_bit_for_bit():
    model = _model()
    bimodel = eqx_amp.BiModel(model, policy=POLICY)
    x = jr.normal(jr.key(1), (SEQ, DIM))
    out = bimodel(x)
    assert out.dtype == F32
    assert_bitwise_equal(out, eqx_amp.filter_amp(model, policy=POLICY)(x))
    jaxpr = traced(bimodel, x)
    assert_matmuls_in(jaxpr, F16, at_least=6)
    assert_scope_in_float32(jaxpr, "LayerNorm")
    # The compute copy is already cast: calling casts no weights, only activations.
    weight_shapes = {(DIM, DIM), (4 * DIM, DIM), (DIM, 4 * DIM)}
    for eqn, _ in eqns_named(jaxpr, "convert_element_type"):
        assert all(v.aval.shape not in weight_shapes for v in eqn.invars)


def test_batch_norm_state_is_never_cast(getkey):
    model, state = eqx.nn.make_with_state(BatchNormNet)(key=getkey())
    bimodel = eqx_amp.BiModel(model, policy=POLICY)
    x = jr.normal(getkey(), (8, 6))

    @eqx.filter_jit
    def forward(bimodel, x, state):
        return jax.vmap(
            bimodel, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)

    out, new_state = forward(bimodel, x, state)
    assert out.dtype == F32
    assert float_dtypes(new_state) == {F32}
    assert bimodel.compute.layers[0].weight.dtype == F16
    assert bimodel.compute.layers[1].weight.dtype == F32


#
# Gradients.
#


def test_gradients_with_respect_to_compute_copy_are_half():
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    x, y, poison = _data(jr.key(2))

    def loss(compute):
        return _loss_fn(bimodel.with_compute(compute), x, y, poison)

    raw = eqx.filter_jit(eqx.filter_grad(loss))(bimodel.compute)
    assert jtu.tree_structure(raw) == jtu.tree_structure(_params(bimodel))
    assert raw.attention.query_proj.weight.dtype == F16
    assert raw.mlp.layers[1].weight.dtype == F16
    assert raw.norm1.weight.dtype == F32
    # Half the bytes of the float32 gradient tree, except for the kept norm layers.
    full = eqx.filter_eval_shape(
        eqx.filter_grad(lambda m: _loss_fn(m, x, y, poison)), bimodel.master
    )
    norms = _array_bytes((full.norm1, full.norm2))
    assert _array_bytes(raw) == (_array_bytes(full) - norms) // 2 + norms

    # Through the loss-scaling transform: unscaled into float32, in master structure.
    scale = eqx_amp.StaticLossScale(2.0**8)
    (value, grads), _, grads_finite = eqx.filter_jit(
        lambda b: eqx_amp.filter_value_and_grad(_loss_fn)(
            b, x, y, poison, loss_scale=scale
        )
    )(bimodel)
    assert bool(grads_finite)
    assert value.dtype == F32
    assert jtu.tree_structure(grads) == jtu.tree_structure(raw)
    assert float_dtypes(grads) == {F32}
    # The same gradients up to float16 rounding (the scaled backward pass rounds
    # differently from the unscaled one).
    for g, r in zip(jtu.tree_leaves(grads), jtu.tree_leaves(raw)):
        np.testing.assert_allclose(g, r.astype(jnp.float32), rtol=2e-2, atol=1e-4)

    grads2, _, _ = eqx.filter_jit(
        lambda b: eqx_amp.filter_grad(_loss_fn)(b, x, y, poison, loss_scale=scale)
    )(bimodel)
    assert_bitwise_equal(grads2, grads)


def test_has_aux():
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    x, y, _ = _data(jr.key(2))

    def loss_with_aux(model, x, y):
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2), pred

    no_scale = eqx_amp.NoOpLossScale()
    ((_, pred), grads), _, _ = eqx.filter_jit(
        lambda b: eqx_amp.filter_value_and_grad(loss_with_aux, has_aux=True)(
            b, x, y, loss_scale=no_scale
        )
    )(bimodel)
    assert pred.shape == (BATCH, SEQ, DIM) and pred.dtype == F32
    (grads2, pred2), _, _ = eqx.filter_jit(
        lambda b: eqx_amp.filter_grad(loss_with_aux, has_aux=True)(
            b, x, y, loss_scale=no_scale
        )
    )(bimodel)
    assert_bitwise_equal((grads2, pred2), (grads, pred))


#
# Training.
#


def _run(bimodel, opt_state, loss_scale, poisons, start=0, step=STEP):
    history = []
    for i, poison in enumerate(poisons, start=start):
        x, y, poison = _data(jr.key(100 + i), poison)
        bimodel, opt_state, loss_scale, loss, finite = step(
            bimodel, opt_state, loss_scale, x, y, poison
        )
        history.append((bimodel, opt_state, loss_scale, loss, finite))
    return history


def test_invariant_holds_after_every_step():
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    history = _run(bimodel, _init_opt(bimodel), eqx_amp.DynamicLossScale(), [1.0] * 4)
    losses = [float(h[3]) for h in history]
    assert losses[-1] < losses[0]
    for new, *_ in history:
        assert_invariant(new)
        assert float_dtypes(new.master) == {F32}
    assert not eqx.tree_equal(history[-1][0].master, bimodel.master)


def test_skipped_step_leaves_master_and_optimizer_state_unchanged():
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    loss_scale = eqx_amp.DynamicLossScale(2.0**10, period=2)
    opt_state = _init_opt(bimodel)
    nan = float("nan")
    poisons = [1.0, nan, 1.0, 1.0, nan, nan]
    history = _run(bimodel, opt_state, loss_scale, poisons)

    expected_scales = [2.0**10, 2.0**9, 2.0**9, 2.0**10, 2.0**9, 2.0**8]
    expected_counters = [1, 0, 1, 0, 0, 0]
    previous = (bimodel, opt_state)
    for i, (b, s, ls, loss, finite) in enumerate(history):
        assert bool(finite) == (poisons[i] == 1.0), i
        assert float(ls.loss_scale) == expected_scales[i], i
        assert int(ls.counter) == expected_counters[i], i
        if poisons[i] == 1.0:
            assert not eqx.tree_equal(b.master, previous[0].master)
        else:
            assert_bitwise_equal((b, s), previous)
        assert_invariant(b)
        previous = (b, s)


def test_apply_if_finite_skips_too():
    # The other way to skip: optax.apply_if_finite gives zero updates.
    optimizer = optax.apply_if_finite(optax.sgd(1e-2), max_consecutive_errors=5)
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    x, y, _ = _data(jr.key(3))
    (_, grads), _, finite = eqx.filter_jit(
        lambda b: eqx_amp.filter_value_and_grad(_loss_fn)(
            b, x, y, jnp.float32(jnp.nan), loss_scale=eqx_amp.NoOpLossScale()
        )
    )(bimodel)
    assert not bool(finite)
    opt_state = optimizer.init(_params(bimodel))
    updates, opt_state = optimizer.update(grads, opt_state, _params(bimodel))
    assert int(opt_state.notfinite_count) == 1
    new = bimodel.apply_updates(updates)
    assert_bitwise_equal(new, bimodel)


def test_redo_on_nan():
    # 2**40 overflows every float16 gradient: redoing halves the scale until the
    # gradients are finite, inside one call, and the step is taken.
    step = _make_step(OPTIMIZER, redo_on_nan=30)
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    loss_scale = eqx_amp.DynamicLossScale(2.0**40)
    ((new, _, new_scale, _, finite),) = _run(
        bimodel, _init_opt(bimodel), loss_scale, [1.0], step=step
    )
    assert bool(finite)
    assert float(new_scale.loss_scale) < 2.0**40
    assert not eqx.tree_equal(new.master, bimodel.master)
    assert_invariant(new)

    # The gradients are those of the scale that worked, computed directly.
    x, y, poison = _data(jr.key(100))
    (_, redone), _, _ = eqx.filter_jit(
        lambda b, s: eqx_amp.filter_value_and_grad(_loss_fn, redo_on_nan=30)(
            b, x, y, poison, loss_scale=s
        )
    )(bimodel, loss_scale)
    (_, direct), _, direct_finite = eqx.filter_jit(
        lambda b, s: eqx_amp.filter_value_and_grad(_loss_fn)(
            b, x, y, poison, loss_scale=s
        )
    )(bimodel, eqx_amp.StaticLossScale(new_scale.loss_scale))
    assert bool(direct_finite)
    for a, b in zip(jtu.tree_leaves(redone), jtu.tree_leaves(direct)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)

    # Without redoing, the same scale overflows and the step is skipped.
    ((skipped, *_, finite),) = _run(bimodel, _init_opt(bimodel), loss_scale, [1.0])
    assert not bool(finite)
    assert_bitwise_equal(skipped, bimodel)


def test_step_compiles_once():
    traces = []

    @eqx.filter_jit
    def step(bimodel, opt_state, loss_scale, x, y):
        traces.append(None)
        (_, grads), loss_scale, _ = eqx_amp.filter_value_and_grad(_loss_fn)(
            bimodel, x, y, jnp.float32(1), loss_scale=loss_scale
        )
        with jax.numpy_dtype_promotion("standard"):  # optax.adam: see `_make_step`.
            updates, opt_state = OPTIMIZER.update(grads, opt_state, _params(bimodel))
        return bimodel.apply_updates(updates), opt_state, loss_scale

    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    state = (bimodel, _init_opt(bimodel), eqx_amp.DynamicLossScale())
    for i in range(3):
        x, y, _ = _data(jr.key(i))
        state = step(*state, x, y)
    assert len(traces) == 1
    assert isinstance(state[0], eqx_amp.BiModel)
    assert_invariant(state[0])


def test_serialisation_round_trip_continues_bit_for_bit(tmp_path):
    nan = float("nan")
    poisons = [1.0, 1.0, nan, 1.0, 1.0, nan, 1.0, 1.0]
    cut = 4

    def fresh():
        bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
        return bimodel, _init_opt(bimodel), eqx_amp.DynamicLossScale(2.0**12, period=2)

    uninterrupted = _run(*fresh(), poisons)[-1][:3]

    first = _run(*fresh(), poisons[:cut])[-1][:3]
    path = tmp_path / "checkpoint.eqx"
    eqx.tree_serialise_leaves(path, first)
    # A like-shaped skeleton from other weights, so nothing leaks from memory.
    skeleton = eqx_amp.BiModel(_model(jr.key(99)), policy=POLICY)
    like = (skeleton, _init_opt(skeleton), eqx_amp.DynamicLossScale(1.0, period=2))
    restored = eqx.tree_deserialise_leaves(path, like)
    assert_bitwise_equal(restored, first)
    assert_invariant(restored[0])

    continued = _run(*restored, poisons[cut:], start=cut)[-1][:3]
    assert_bitwise_equal(continued, uninterrupted)


@pytest.mark.slow
def test_sharded_over_a_mesh_of_eight_devices():
    """Runs tests/_multidevice_bimodel.py on 8 fake CPU devices (the flag must be
    set before JAX is imported, so it runs in a fresh interpreter)."""
    report = run_on_eight_devices("_multidevice_bimodel.py")
    assert report["devices"] == 8
    for layout in ("replicated", "tensor_parallel"):
        run = report[layout]
        assert run["grads_finite"] is True
        assert run["invariant"] is True
        assert run["master_changed"] is True
        assert run["max_abs_diff_to_one_device"] < 1e-4
        assert run["output_devices"] == 8
    assert report["tensor_parallel"]["weight_sharding"] == ["model", None]


#
# Bad input.
#


def test_bad_policy_and_spec():
    model = _model()
    with pytest.raises(ValueError, match="Unknown policy 'float12'"):
        eqx_amp.BiModel(model, policy="float12")
    with pytest.raises(ValueError, match="`filter_spec` does not match the structure"):
        eqx_amp.BiModel(model, filter_spec=(True, False))
    with pytest.raises(ValueError, match="`filter_spec` must be a bool, a callable"):
        eqx_amp.BiModel(model, filter_spec=jtu.tree_map(lambda _: "yes", model))
    bimodel = eqx_amp.BiModel(model, policy=POLICY)
    with pytest.raises(TypeError, match=r"`model` is already a `BiModel`\. Pass"):
        eqx_amp.BiModel(bimodel)
    with pytest.raises(TypeError, match="which is not callable"):
        eqx_amp.BiModel((jnp.ones(3),))(jnp.ones(3))


def test_bad_updates_raise_and_change_nothing():
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    before = jtu.tree_map(lambda x: np.array(x) if eqx.is_array(x) else x, bimodel)
    params = _params(bimodel)
    zeros = jtu.tree_map(jnp.zeros_like, params)

    with pytest.raises(ValueError) as error:
        bimodel.apply_updates((zeros,))
    assert str(error.value) == (
        "`updates` must have the structure of `bimodel.master` (the same containers, "
        "module types and static fields), with `None` allowed in place of any "
        "subtree, as `optimizer.update(grads, opt_state, eqx.filter(bimodel.master, "
        "eqx.is_inexact_array))` returns it. The structure of `updates` does not "
        "match. JAX reported: Expected tuple, got TransformerBlock"
    )
    with pytest.raises(ValueError, match=r"^`updates` must have the structure"):
        bimodel.apply_updates(bimodel)

    wrong_shape = eqx.tree_at(lambda m: m.mlp.layers[0].bias, zeros, jnp.zeros(3))
    with pytest.raises(
        ValueError,
        match=r"^`updates` must hold floating arrays \(or `None`\), one per floating "
        r"array of `bimodel\.master`, with the same shape; it has an array of dtype "
        r"float32 and shape \(3,\) where `bimodel\.master` has an array of dtype float32 "
        r"and shape \(64,\)\.$",
    ):
        bimodel.apply_updates(wrong_shape)

    integer = eqx.tree_at(
        lambda m: m.mlp.layers[0].bias, zeros, jnp.zeros(64, jnp.int32)
    )
    with pytest.raises(ValueError, match=r"it has an array of dtype int32"):
        bimodel.apply_updates(integer)

    dropout_p = eqx.tree_at(
        lambda m: m.attention.dropout.p,
        zeros,
        jnp.float32(0.5),
        is_leaf=lambda x: x is None,
    )
    with pytest.raises(
        ValueError,
        match=r"^`updates` has an array of dtype float32 and shape \(\) where "
        r"`bimodel\.master` has float 0\.0, which is not a floating array and is "
        r"never updated\.",
    ):
        bimodel.apply_updates(dropout_p)

    with pytest.raises(ValueError, match=r"^`compute` must have the structure"):
        bimodel.with_compute((bimodel.compute,))

    assert_bitwise_equal(bimodel, before)


def test_updates_with_none_subtrees_and_half_updates():
    bimodel = eqx_amp.BiModel(_model(), policy=POLICY)
    params = _params(bimodel)
    ones = jtu.tree_map(lambda x: jnp.ones_like(x, jnp.float16), params)
    # `None` for a whole subtree: nothing there is updated.
    partial = eqx.tree_at(
        lambda m: m.attention, ones, None, is_leaf=lambda x: x is None
    )
    new = bimodel.apply_updates(partial)
    assert_bitwise_equal(new.master.attention, bimodel.master.attention)
    np.testing.assert_array_equal(
        new.master.mlp.layers[0].weight, bimodel.master.mlp.layers[0].weight + 1
    )
    assert float_dtypes(new.master) == {F32}
    assert_invariant(new)
    assert_bitwise_equal(bimodel.apply_updates(None), bimodel)


def _with_large_weight(getkey, value=1e5):
    model = eqx.nn.MLP(3, 2, 4, 1, key=getkey())
    return eqx.tree_at(
        lambda m: m.layers[0].weight, model, model.layers[0].weight.at[0, 0].set(value)
    )


def test_a_master_dtype_too_small_for_a_weight_raises(getkey):
    model = _with_large_weight(getkey)
    with pytest.raises(
        ValueError,
        match=r"master weights are stored in float16.*cannot hold the value of "
        r"\.layers\[0\]\.weight: storing it would give inf",
    ):
        eqx_amp.BiModel(model, policy="float16")
    with pytest.warns(UserWarning, match=r"2\^-12 of its weight .* float32 master"):
        bimodel = eqx_amp.BiModel(_with_large_weight(getkey, 6e4), policy="float16")
    params = eqx.filter(bimodel.master, eqx.is_inexact_array)
    updates = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 1e4), params)
    with pytest.raises(ValueError, match=r"after this update"):
        bimodel.apply_updates(updates)
    # Under `jit` the sums are not known: one float32 holds is held at float16's
    # largest, not stored as inf.
    new = eqx.filter_jit(lambda b, u: b.apply_updates(u))(bimodel, updates)
    largest = float(jnp.finfo(jnp.float16).max)
    assert float(new.master.layers[0].weight[0, 0]) == largest


def test_a_compute_dtype_too_small_for_a_weight_warns(getkey):
    model = _with_large_weight(getkey)
    match = r"compute copy is float16, which cannot hold the value of \.layers\[0\]"
    with pytest.warns(UserWarning, match=match):
        bimodel = eqx_amp.BiModel(model, policy="mixed_float16")
    assert float(bimodel.master.layers[0].weight[0, 0]) == 1e5  # the master is kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_amp.BiModel(model, policy="mixed_bfloat16")  # bfloat16 holds it


def test_inference_mode_turns_dropout_off(getkey):
    class WithDropout(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __call__(self, x, key=None):
            return self.dropout(self.linear(x), key=key)

    model = WithDropout(eqx.nn.Linear(3, 3, key=getkey()), eqx.nn.Dropout(0.5))
    bimodel = eqx.nn.inference_mode(eqx_amp.BiModel(model))
    assert bimodel.master.dropout.inference and bimodel.compute.dropout.inference
    x = jnp.ones(3)
    assert jnp.array_equal(bimodel(x), bimodel(x))  # no key needed: dropout is off
    assert eqx.nn.inference_mode(bimodel, False).compute.dropout.inference is False


def test_gradient_functions_take_a_bimodel_as_their_differentiated_argument(getkey):
    """There is one road to scaled gradients: a `BiModel` is the first argument of
    the gradient functions (no methods of its own)."""
    bimodel = eqx_amp.BiModel(eqx.nn.Linear(2, 2, key=getkey()))
    assert not hasattr(bimodel, "value_and_grad") and not hasattr(bimodel, "grad")
    with pytest.raises(TypeError, match=r"`fun` must be callable, but got int"):
        eqx_amp.filter_value_and_grad(3)


def test_complex_parameters_train(getkey):
    """A complex parameter is differentiated, unscaled and updated like a real one."""

    class Diagonal(eqx.Module):
        diag: jax.Array
        proj: eqx.nn.Linear

        def __call__(self, x):
            z = self.diag * x.astype(jnp.complex64)
            return self.proj(jnp.abs(z).astype(x.dtype))

    model = Diagonal(
        jax.lax.complex(jnp.ones(3), jnp.ones(3)), eqx.nn.Linear(3, 1, key=getkey())
    )
    bimodel = eqx_amp.BiModel(model, policy="mixed_float16")

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    (_, grads), _, finite = eqx_amp.filter_value_and_grad(loss)(
        bimodel, jnp.ones(3), loss_scale=eqx_amp.DynamicLossScale()
    )
    assert bool(finite) and grads.diag.dtype == jnp.complex64
    expected = eqx.filter_grad(loss)(model, jnp.ones(3))
    assert rel_error(jnp.abs(grads.diag), jnp.abs(expected.diag)) < 2e-2
    updated = bimodel.apply_updates(jax.tree_util.tree_map(lambda g: -0.1 * g, grads))
    assert updated.master.diag.dtype == jnp.complex64


def test_low_coverage_is_advised_for_a_bimodel_too(getkey):
    class CarryRNN(eqx.Module):
        cell: eqx.nn.GRUCell

        def __call__(self, xs):
            h0 = jnp.zeros(self.cell.hidden_size)  # float32, made inside the model
            return jax.lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)[0]

    bimodel = eqx_amp.BiModel(CarryRNN(eqx.nn.GRUCell(8, 32, key=getkey())))
    with jax.numpy_dtype_promotion("standard"):  # as users run it
        advice = eqx_amp.precision_report(bimodel, jnp.ones((10, 8))).advice
    assert advice.startswith("Only 20% ")
    assert "FLOPs of CarryRNN run in bfloat16" in advice

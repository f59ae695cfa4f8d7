"""Hostile inputs for the low-precision training state: `master_weights`,
`kahan_summation`, `stochastic_rounding`, `apply_updates`, `low_precision_moments`
and `loss_scaling`.

The matrix, each against float32 optax (or the float32 sum rounded once to
bfloat16) and the storage formats' error bounds:

- values: zeros of both signs, the smallest normals and subnormals of bfloat16,
    float16 and float32, the largest finite values, one inf or NaN among finite
    values (it stays in its element), a finite but huge gradient (its second moment
    overflows to inf, as float32 Adam's does);
- leaves: empty (`(0,)`, `(0, 256)`, `(3, 0)`), scalars, sizes that are not a
    multiple of the 8-bit block, blocks along the last axis, and integer, boolean,
    PRNG-key and `None` leaves next to the weights;
- optax's combinators around the wrappers (`chain`, `masked` with a full and a
    prefix mask, `multi_transform`, `inject_hyperparams`, `MultiSteps`,
    `apply_if_finite`) and around `loss_scaling` (refused where it would freeze the
    loss scale);
- keys: a batch of keys where one is required, for every key argument;
- `jax.jit`: the update traces once, however many steps it runs.
"""

import functools
import re
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
from eqx_amp._optim._codec import encode

from .helpers import rel_error


BF16 = jnp.bfloat16
F32_MAX = float(jnp.finfo(jnp.float32).max)
BF16_MAX = float(jnp.finfo(BF16).max)


def _is_moment(node):
    return isinstance(node, eqx_amp.optim.QuantizedMoment)


def _moments(state):
    return [m for m in jtu.tree_leaves(state, is_leaf=_is_moment) if _is_moment(m)]


def _run(optimizer, params, grads, steps=3, jit_init=False):
    """`steps` jitted updates (the same gradients each step unless `grads` is a
    list), and how many times the update was traced."""
    traces = []

    @jax.jit
    def update(grads, state, params):
        traces.append(None)
        return optimizer.update(grads, state, params)

    grads = grads if isinstance(grads, list) else [grads] * steps
    # An eager init encodes each moment primitive by primitive, each compiled for
    # its own shape: worth it where the shapes recur (the combinators' tests),
    # not for `_SHAPES`'s seven.
    state = jax.jit(optimizer.init)(params) if jit_init else optimizer.init(params)
    out = []
    # optax's Adam computes `b1**count` (a float to an int32 power), which strict
    # promotion refuses; the update itself is float32.
    with jax.numpy_dtype_promotion("standard"):
        for g in grads:
            updates, state = update(g, state, params)
            out.append(updates)
    return out, state, len(traces)


#
# Compensated bfloat16 weights: edge values against the float32 sum rounded once.
#

_TINY = [
    float(jnp.finfo(BF16).tiny),  # the smallest normals
    float(jnp.finfo(jnp.float16).tiny),
    float(jnp.finfo(jnp.float32).tiny),
    float(jnp.finfo(BF16).smallest_subnormal),  # the smallest subnormals
    float(jnp.finfo(jnp.float16).smallest_subnormal),
]
# The last pair's float32 sum is finite but rounds past bfloat16's largest: it is
# held at the largest (as nearest rounding within range would), not stored as inf.
_WEIGHTS = [0.0, -0.0, 1.0, -3.0, BF16_MAX, -BF16_MAX, *_TINY, 1e-3, 7.0, BF16_MAX]
_UPDATES = [1e-3, 0.0, 2**-10, -(2**-12), 1.0, -1e38, *_TINY, 0.0, 1e37, 1e36]


def _compensated_update(name):
    """`params + updates` as each of the compensated paths computes it."""
    if name == "apply_updates":
        return lambda p, u: eqx_amp.optim.apply_updates(p, u)

    def through(optimizer):
        def add(p, u):
            state = optimizer.init(p)
            updates, _ = optimizer.update(u, state, p)
            return eqx_amp.optim.apply_updates(p, updates)

        return add

    if name == "master_weights":
        return through(eqx_amp.optim.master_weights(optax.sgd(-1.0)))
    compensation = (
        eqx_amp.optim.kahan_summation()
        if name == "kahan_summation"
        else eqx_amp.optim.stochastic_rounding(jr.key(0))
    )
    return through(compensation)


def _bf16_ulp(x):
    x = np.abs(np.asarray(x, np.float32))
    exponent = np.floor(np.log2(np.maximum(x, float(jnp.finfo(BF16).tiny))))
    return 2.0 ** (exponent - 7)


@pytest.mark.parametrize(
    "name",
    ["apply_updates", "kahan_summation", "stochastic_rounding", "master_weights"],
)
def test_compensated_updates_of_edge_values(name):
    weights = jnp.asarray(_WEIGHTS, BF16)
    add = jax.jit(_compensated_update(name))
    for poison in (None, jnp.inf, -jnp.inf, jnp.nan):
        updates = jnp.asarray(_UPDATES, jnp.float32)
        if poison is not None:
            updates = updates.at[2].set(poison)
        new = add({"w": weights, "s": weights[2]}, {"w": updates, "s": updates[3]})
        assert new["w"].dtype == BF16 and new["s"].dtype == BF16
        # The float32 sum (CPUs flush float32 subnormals, as XLA does), rounded
        # once: within one bfloat16 ulp of it (stochastic rounding goes either way).
        with np.errstate(over="ignore", invalid="ignore"):
            exact = np.asarray(weights, np.float32) + np.asarray(updates)
            error = np.abs(np.asarray(new["w"], np.float32) - exact)
        exact = np.where(np.abs(exact) < float(jnp.finfo(jnp.float32).tiny), 0, exact)
        got = np.asarray(new["w"], np.float32)
        finite = np.isfinite(exact)
        assert np.array_equal(np.isfinite(got), finite), (poison, got)
        flushed = error <= float(jnp.finfo(jnp.float32).tiny)
        close = error <= _bf16_ulp(exact)
        assert np.all((close | flushed)[finite]), (poison, got, exact)
        if poison is not None:
            assert not np.isfinite(got[2]) and np.sum(~np.isfinite(got)) == 2
        np.testing.assert_allclose(
            float(new["s"]), float(weights[2]) + float(updates[3]), rtol=2**-8
        )


def test_compensated_paths_keep_non_floating_leaves():
    model = {
        "w": jnp.linspace(-1, 1, 300).astype(BF16),
        "empty": jnp.zeros((0, 256), BF16),
        "scalar": jnp.asarray(0.5, BF16),
        "count": jnp.arange(3),
        "mask": jnp.ones(2, bool),
        "key": jr.key(1),
        "none": None,
        "name": "linear",
    }
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jtu.tree_map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), params)
    for optimizer in (
        optax.chain(optax.sgd(1.0), eqx_amp.optim.kahan_summation()),
        optax.chain(optax.sgd(1.0), eqx_amp.optim.stochastic_rounding(jr.key(0))),
    ):
        # The update jitted; `apply_updates` eagerly, where the leaves it passes
        # through keep their identity.
        update = jax.jit(lambda g, p: optimizer.update(g, optimizer.init(p), p))
        updates, _ = update(grads, params)
        new = eqx_amp.optim.apply_updates(model, updates)
        assert new["name"] == "linear" and new["none"] is None
        assert new["key"] is model["key"] and new["count"] is model["count"]
        assert new["empty"].shape == (0, 256) and new["scalar"].dtype == BF16
    master = eqx_amp.optim.master_weights(optax.sgd(1.0))
    update = eqx.filter_jit(lambda g, m: master.update(g, master.init(m), m))
    updates, state = update(grads, model)
    new = eqx_amp.optim.apply_updates(model, updates)
    assert new["count"] is model["count"] and new["key"] is model["key"]
    assert state.master["empty"].shape == (0, 256)
    np.testing.assert_allclose(float(new["scalar"]), 0.499, rtol=2**-8)


#
# Low-precision moments: shapes, edge values, combinators.
#


def _grads_like(params, key):
    leaves, treedef = jtu.tree_flatten(params)
    keys = jr.split(key, len(leaves))
    return treedef.unflatten(
        [jr.normal(k, p.shape, jnp.float32) for k, p in zip(keys, leaves)]
    )


_SHAPES = {
    "empty": (0,),
    "empty rows": (0, 256),
    "empty columns": (3, 0),
    "scalar": (),
    "odd": (300,),
    "last axis": (2, 512),
    "kernel": (3, 3, 5),
}


def _every_shape_params_and_grads():
    params = {name: jnp.zeros(shape) for name, shape in _SHAPES.items()}
    params["none"] = None
    return params, [_grads_like(params, jr.key(i)) for i in range(3)]


@functools.cache
def _every_shape_reference():
    """float32 Adam's updates for `_SHAPES` (run once for both storages)."""
    reference, _, _ = _run(
        optax.adam(1e-3), *_every_shape_params_and_grads(), jit_init=True
    )
    return reference


@pytest.mark.parametrize("storage", ["bfloat16", "8bit"])
def test_low_precision_moments_take_every_shape_adam_takes(storage):
    params, grads = _every_shape_params_and_grads()
    reference = _every_shape_reference()
    compressed = eqx_amp.optim.low_precision_moments(optax.adam(1e-3), storage)
    updates, state, traces = _run(compressed, params, grads, jit_init=True)
    assert traces == 1
    # Every non-scalar leaf's two moments are compressed (empty ones too).
    assert len(_moments(state)) == 2 * (len(_SHAPES) - 1)
    for name in _SHAPES:
        assert updates[-1][name].shape == _SHAPES[name]
        np.testing.assert_allclose(
            updates[-1][name], reference[-1][name], atol=0.1 * 1e-3
        )
    assert updates[-1]["none"] is None


@pytest.mark.parametrize("overflowing", [[3], [3, 200]])
def test_eight_bit_block_with_a_huge_gradient_keeps_the_others(overflowing):
    # Elements (0, i): gradients of 1e20, whose second moments overflow to inf in
    # float32 Adam too (their steps are then 0); two in one block leave its scale
    # finite. Element (1, 5): -1e19, whose moments are 20 decades above the rest of
    # its block.
    columns = np.asarray(overflowing)
    params = {"w": jnp.zeros((2, 256))}
    grads = [{"w": 0.1 * jr.normal(jr.key(i), (2, 256))} for i in range(5)]
    grads[0]["w"] = grads[0]["w"].at[0, columns].set(1e20).at[1, 5].set(-1e19)
    reference, _, _ = _run(optax.adam(1e-3), params, grads)
    updates, state, _ = _run(
        eqx_amp.optim.low_precision_moments(optax.adam(1e-3), "8bit"), params, grads
    )
    nu = state.inner_state[0].nu["w"].decode()
    assert bool(jnp.all(nu[0, columns] == np.inf))
    assert bool(jnp.all(jnp.isfinite(nu.at[0, columns].set(0))))
    for got, want in zip(updates, reference):
        assert bool(jnp.all(jnp.isfinite(got["w"])))
        # Within a tenth of the learning rate of float32 Adam, as for a block
        # without the outliers. Two huge first moments in one block (1e19 each)
        # are its two largest values, 21 decades above the others', which round to
        # zero while they last: those steps are small, not wrong in sign or size.
        close = slice(None) if len(overflowing) == 1 else slice(1, 2)
        np.testing.assert_allclose(got["w"][close], want["w"][close], atol=1e-4)
        assert bool(jnp.all(jnp.abs(got["w"]) <= 1.1e-3))  # about the learning rate


def test_a_field_name_two_optimizers_use_is_read_by_its_state():
    # `v`: Adafactor's second moment of the weights it does not factor (never
    # negative: stored as a square root, kept off zero), Adan's signed first moment
    # of gradient differences.
    params = {"w": jnp.ones((8, 256)), "b": jnp.ones(256)}
    adafactor = eqx_amp.optim.low_precision_moments(optax.adafactor(1e-2), "8bit")
    factored = jax.eval_shape(adafactor.init, params).inner_state[0]
    assert isinstance(factored, optax.FactoredState)
    assert factored.v["b"].square_root and factored.v_row["w"].square_root
    adan = eqx_amp.optim.low_precision_moments(optax.adan(1e-2), "8bit")
    adan_state = jax.eval_shape(adan.init, params).inner_state[0]
    assert not adan_state.v["w"].square_root and adan_state.n["w"].square_root
    # Gradients four decades apart in one block: the small weights' second moments
    # stay above zero, so their Adafactor steps stay near float32's.
    grads = {"w": jnp.ones((8, 256)), "b": jnp.ones(256).at[::2].set(1e-4)}
    reference, _, _ = _run(optax.adafactor(1e-2), params, [grads] * 5)
    updates, _, _ = _run(adafactor, params, [grads] * 5)
    small = np.asarray(updates[-1]["b"][::2]) / np.asarray(reference[-1]["b"][::2])
    assert np.median(np.abs(small - 1)) < 0.2


@pytest.mark.parametrize("name", ["sophia", "sm3"])
def test_a_signed_nu_is_stored_signed(name):
    # Sophia's `nu` averages Hutchinson's estimates of the Hessian's diagonal,
    # negative where the loss curves down, and SM3's `nu` is its momentum; stored
    # as a square root (as Adam's `nu`), each negative value became zero.
    params = {"w": jnp.linspace(-3.0, 3.0, 512)}

    def loss(p):
        return jnp.sum(jnp.sin(3.0 * p["w"]) * p["w"])

    make = {"sophia": optax.contrib.sophia, "sm3": optax.sm3}[name]
    extra = {"obj_fn": loss} if name == "sophia" else {}
    stored = eqx_amp.optim.low_precision_moments(make(1e-2), "8bit", key=jr.key(0))
    state = stored.init(params)
    assert not state.inner_state[0].nu["w"].square_root
    reference = make(1e-2).init(params)
    with jax.numpy_dtype_promotion("standard"):
        grads = jax.grad(loss)(params)
        _, state = jax.jit(functools.partial(stored.update, **extra))(
            grads, state, params
        )
        _, reference = make(1e-2).update(grads, reference, params, **extra)
    nu, want = state.inner_state[0].nu["w"].decode(), reference[0].nu["w"]
    assert float(jnp.min(want)) < 0
    assert np.array_equal(np.sign(nu), np.sign(want))
    assert rel_error(nu, want) < 0.05


@functools.cache
@jax.jit
def _edge_blocks():
    # Built in one compiled program, once, when first needed (not op by op at
    # import, in every worker).
    return {
        "largest": jnp.full(256, F32_MAX),
        "largest of both signs": jnp.full(256, F32_MAX).at[::2].set(-F32_MAX),
        "largest and small": jnp.linspace(1, 2, 256).at[7].set(F32_MAX),
        "smallest normals": jnp.full(256, float(jnp.finfo(jnp.float32).tiny)),
        "zeros": jnp.zeros(256).at[3].set(-0.0),
        "one tiny": jnp.zeros(256).at[9].set(float(jnp.finfo(BF16).tiny)),
        "ramp": jnp.linspace(-1, 1, 256),
    }


@pytest.mark.parametrize("square_root", [False, True])
def test_eight_bit_finite_blocks_decode_finite(square_root):
    def round_trip(x, key):
        return encode(x, "8bit", square_root, 256, key).decode()

    round_trip = jax.jit(round_trip)

    @jax.jit
    def errors(block, decoded):
        # Each value within a map step (0.9 / 64) of its block's second largest
        # (the largest is kept aside, in bfloat16).
        stored = jnp.sqrt(block) if square_root else block
        back = jnp.sqrt(decoded) if square_root else decoded
        second = jnp.sort(jnp.abs(stored))[-2]
        error = jnp.abs(back - stored)
        # A second moment at float32's smallest normal may come back a hair
        # below it, which float32 (as XLA runs it) flushes to zero.
        flushed = (decoded == 0) & (block <= 1.02 * float(jnp.finfo(jnp.float32).tiny))
        error = jnp.where(flushed, 0.0, error)
        largest = jnp.argmax(jnp.abs(stored))
        return (
            jnp.all(jnp.isfinite(decoded)),
            error[largest],
            jnp.abs(stored[largest]),
            jnp.max(error.at[largest].set(0)),
            second,
        )

    for name, block in _edge_blocks().items():
        block = jnp.abs(block) if square_root else block
        decoded = round_trip(block, jr.key(0))
        finite, largest_error, largest, rest_error, second = errors(block, decoded)
        assert bool(finite), name
        assert float(largest_error) <= 2**-8 * float(largest), name
        assert float(rest_error) <= 0.9 / 64 * float(second), name


@pytest.mark.parametrize("square_root", [False, True])
def test_eight_bit_non_finite_element_stays_in_its_element(square_root):
    round_trip = jax.jit(
        lambda x: encode(x, "8bit", square_root, 256, jr.key(1)).decode()
    )
    block = jnp.linspace(0.5, 1.0, 512).reshape(2, 256)
    for poison in (jnp.inf, jnp.nan) + (() if square_root else (-jnp.inf,)):
        x = block.at[0, 11].set(poison)
        decoded = round_trip(x)
        np.testing.assert_array_equal(decoded[0, 11], poison)
        rest = jnp.isfinite(decoded).at[0, 11].set(True)
        assert bool(jnp.all(rest))
        np.testing.assert_allclose(
            decoded.at[0, 11].set(0), x.at[0, 11].set(0), rtol=0.02
        )


def _combinators():
    adam = optax.adam(1e-3)
    mask = {"a": True, "b": {"c": False, "d": True}}
    return {
        "chain": (optax.chain(optax.clip(1.0), adam), 6),
        "masked": (optax.masked(adam, mask), 4),
        "masked by a prefix": (optax.masked(adam, {"a": False, "b": True}), 4),
        "multi_transform": (
            optax.multi_transform(
                {"adam": adam, "momentum": optax.sgd(1e-3, momentum=0.9)},
                {"a": "adam", "b": {"c": "momentum", "d": "adam"}},
            ),
            5,
        ),
        "inject_hyperparams": (optax.inject_hyperparams(optax.adam)(1e-3), 6),
        "MultiSteps": (optax.MultiSteps(adam, 2), 6),
        "apply_if_finite": (optax.apply_if_finite(adam, 3), 6),
    }


# Three of them in the fast tier (each takes 3-4 s); all of them in the slow one.
_FAST_COMBINATORS = ("chain", "masked", "MultiSteps")


@pytest.mark.parametrize(
    "name",
    [
        n if n in _FAST_COMBINATORS else pytest.param(n, marks=pytest.mark.slow)
        for n in _combinators()
    ],
)
def test_low_precision_moments_through_optax_combinators(name):
    optimizer, expected = _combinators()[name]
    params = {"a": jnp.zeros(300), "b": {"c": jnp.zeros((2, 256)), "d": jnp.zeros(5)}}
    grads = [_grads_like(params, jr.key(i)) for i in range(4)]
    reference, _, _ = _run(optimizer, params, grads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compressed = eqx_amp.optim.low_precision_moments(optimizer, "8bit")
        updates, state, traces = _run(compressed, params, grads)
    assert len(_moments(state)) == expected and traces == 1
    for got, want in zip(jtu.tree_leaves(updates), jtu.tree_leaves(reference)):
        np.testing.assert_allclose(got, want, atol=0.1 * 1e-3)


def test_low_precision_moments_that_find_no_moment_say_so():
    params = {"w": jnp.zeros((4, 8))}
    for optimizer in (
        optax.sgd(1e-2),
        optax.masked(optax.adam(1e-3), {"w": False}),
    ):
        wrapped = eqx_amp.optim.low_precision_moments(optimizer, "8bit")
        with pytest.warns(UserWarning, match=r"found no moment to compress"):
            wrapped.init(params)
    # Scalars only: nothing to compress, nothing to say.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_amp.optim.low_precision_moments(optax.adam(1e-3)).init({"s": jnp.zeros(())})


#
# Keys.
#


_KEY_ARGUMENTS = {
    "stochastic_rounding": lambda key: eqx_amp.optim.stochastic_rounding(key),
    "low_precision_moments": lambda key: eqx_amp.optim.low_precision_moments(
        optax.adam(1e-3), key=key
    ),
}


@pytest.mark.parametrize("where", list(_KEY_ARGUMENTS))
def test_a_batch_of_keys_is_refused_where_one_is_needed(where):
    make = _KEY_ARGUMENTS[where]
    for keys, shape in (
        (jr.split(jr.key(0), 2), (2,)),
        (jr.split(jr.PRNGKey(0), 2), (2,)),
        (jr.split(jr.key(0), (2, 3)), (2, 3)),
    ):
        expected = (
            f"`{where}` needs one PRNG key as `key`, but got a batch of keys of "
            f"shape {shape}"
        )
        with pytest.raises(ValueError, match=re.escape(expected)):
            make(keys)
    make(jr.key(0))
    make(jr.PRNGKey(0))


#
# Loss scaling under optax's combinators.
#


def _loss(weights, x):
    return jnp.sum((weights["w"] * x) ** 2)


_SKIPPING = {
    "apply_if_finite": lambda inner: optax.apply_if_finite(inner, 5),
    "MultiSteps(skip_not_finite)": lambda inner: optax.MultiSteps(
        inner, 2, should_skip_update_fn=optax.skip_not_finite
    ),
}


@pytest.mark.parametrize("name", list(_SKIPPING))
def test_loss_scaling_under_a_skipping_wrapper_is_refused(name):
    optimizer = _SKIPPING[name](eqx_amp.loss_scaling(optax.sgd(1e-2)))
    state = optimizer.init({"w": jnp.ones(3)})
    with pytest.raises(
        ValueError,
        match=r"inside an `optax\.(apply_if_finite|MultiSteps)`.*could not back off"
        r".*`eqx_amp\.loss_scaling\(optax\.apply_if_finite\(optimizer, 5\)\)`",
    ):
        eqx_amp.scaled_value_and_grad(_loss)(
            {"w": jnp.ones(3)}, jnp.ones(3), opt_state=state
        )


@pytest.mark.parametrize(
    "name", ["apply_if_finite", "MultiSteps", "inject_hyperparams"]
)
def test_loss_scaling_around_combinators_backs_off_at_once(name):
    inner = {
        "apply_if_finite": optax.apply_if_finite(optax.sgd(1e-2), 5),
        "MultiSteps": optax.MultiSteps(optax.sgd(1e-2), 2),
        "inject_hyperparams": optax.inject_hyperparams(optax.sgd)(1e-2),
    }[name]
    optimizer = eqx_amp.loss_scaling(inner)
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, x):
        (loss, grads), state = eqx_amp.scaled_value_and_grad(_loss)(
            params, x, opt_state=state
        )
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    # One element overflows the scaled loss (1e34 * 2**15 > float32's largest).
    x = jnp.asarray([1.0, 1e17, 1.0])
    with jax.numpy_dtype_promotion("standard"):  # optax's MultiSteps mixes dtypes
        new, state = step(params, state, x)
        assert float(state.loss_scale.loss_scale) == 2.0**14
        assert not bool(state.last_finite) and int(state.total_notfinite) == 1
        np.testing.assert_array_equal(new["w"], params["w"])
        for _ in range(2 if name == "MultiSteps" else 1):  # MultiSteps: 2 steps
            new, state = step(new, state, jnp.ones(3))
    assert bool(state.last_finite) and float(new["w"][0]) < 1.0


def test_master_weights_passes_weights_without_a_master_through_unchanged():
    """Complex and float32 weights are their own master: their updates are the wrapped
    optimizer's, bit for bit (not a float32 difference dropping the imaginary part);
    float64 ones too, with no step rounded to float32."""
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        params = {
            "complex": jnp.asarray([1 + 1j, 2 - 1j], jnp.complex64),
            "f32": jnp.asarray([1.0, 3.0], jnp.float32),
            "f64": jnp.asarray([1.0], jnp.float64),
            "half": jnp.asarray([1.0], BF16),
            "count": jnp.arange(2),
        }
        grads = {
            "complex": jnp.asarray([0.5 + 0.5j, 1j], jnp.complex64),
            "f32": jnp.asarray([1e-3, -2.0], jnp.float32),
            "f64": jnp.asarray([1e-10], jnp.float64),
            "half": jnp.asarray([2**-4], jnp.float32),
            "count": None,
        }
        optimizer = eqx_amp.optim.master_weights(optax.sgd(1.0))
        updates, state = optimizer.update(grads, optimizer.init(params), params)
        plain, _ = optax.sgd(1.0).update(grads, optax.sgd(1.0).init(params))
        for name in ("complex", "f32", "f64"):
            assert updates[name].dtype == params[name].dtype
            np.testing.assert_array_equal(updates[name], plain[name])
        new = eqx_amp.optim.apply_updates(params, updates)
        assert float(new["f64"][0]) == 1.0 - 1e-10
        assert new["half"].dtype == BF16 and float(new["half"][0]) == 1.0 - 2**-4
        assert state.master["complex"] is None
        assert state.master["half"].dtype == jnp.float32

"""The whole training state: every form (master weights, compensated bfloat16,
low-precision moments) serialises and resumes bit for bit, and keeps its
shardings."""

import equinox as eqx
import jax
import jax.random as jr
import optax
import pytest

import eqx_amp

from .helpers import run_script_on_eight_devices
from .optim_helpers import (
    BF16,
    assert_bitwise_equal,
    float_params,
    mse_loss,
    regression_data,
    small_mlp,  # noqa: F401 (the sharded script imports it from here)
)


#
# Resuming and sharding.
#


def _recipes():
    """(name, start(model) -> (held, opt_state), step) for every form of state."""
    key = jr.key(7)

    def plain(wrap):
        def start(model):
            model = eqx_amp.cast_tree(model, BF16)
            return model, wrap.init(float_params(model))

        def step(model, opt_state, grads):
            updates, opt_state = wrap.update(grads, opt_state, float_params(model))
            return eqx_amp.optim.apply_updates(model, updates), opt_state

        return start, step

    def master():
        optimizer = eqx_amp.optim.master_weights(optax.adam(1e-2))

        def start(model):
            model = eqx_amp.cast_tree(model, BF16)
            return model, optimizer.init(model)

        def step(model, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, model)
            return eqx_amp.optim.apply_updates(model, updates), opt_state

        return start, step

    def bimodel(storage):
        optimizer = eqx_amp.optim.low_precision_moments(
            optax.adam(1e-2), storage, key=key
        )

        def start(model):
            bm = eqx_amp.BiModel(model, policy="mixed_bfloat16")
            return bm, optimizer.init(float_params(bm.master))

        def step(bm, opt_state, grads):
            updates, opt_state = optimizer.update(
                grads, opt_state, float_params(bm.master)
            )
            return bm.apply_updates(updates), opt_state

        return start, step

    return {
        "master_weights": master(),
        "kahan + bf16 moments": plain(
            optax.chain(
                eqx_amp.optim.low_precision_moments(optax.adam(1e-2)),
                eqx_amp.optim.kahan_summation(),
            )
        ),
        "sr + 8-bit moments": plain(
            optax.chain(
                eqx_amp.optim.low_precision_moments(optax.adam(1e-2), "8bit", key=key),
                eqx_amp.optim.stochastic_rounding(key),
            )
        ),
        "bimodel + bf16 moments": bimodel("bfloat16"),
        "bimodel + 8-bit moments": bimodel("8bit"),
    }


def _runnable(held):
    return held.compute if isinstance(held, eqx_amp.BiModel) else held


def _save_eqx(path, state):
    eqx.tree_serialise_leaves(path / "state.eqx", state)


def _restore_eqx(path, like):
    return eqx.tree_deserialise_leaves(path / "state.eqx", like)


def _one_layer_mlp(key):
    # One hidden layer (each weight's moments one 8-bit block): every leaf adds
    # its own encodings to the step's compile.
    return eqx.nn.MLP(8, 4, 32, 1, key=key)


# Every recipe through orbax in the slow tier: `tests/test_orbax.py` keeps orbax in
# the fast one. `BiModel` with 8-bit moments too: the fast tier has each of them
# (`BiModel` with bfloat16 moments, 8-bit moments with stochastic rounding).
@pytest.mark.parametrize(
    "serialiser",
    ["tree_serialise_leaves", pytest.param("orbax", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n == "bimodel + 8-bit moments" else n
        for n in _recipes()
    ],
)
def test_state_serialises_and_resumes_bit_exactly(name, serialiser, tmp_path):
    from .test_orbax import restore_with_orbax, save_with_orbax

    save, restore = {
        "tree_serialise_leaves": (_save_eqx, _restore_eqx),
        "orbax": (
            lambda path, state: save_with_orbax(path / "ckpt", state),
            lambda path, like: restore_with_orbax(path / "ckpt", like),
        ),
    }[serialiser]
    start, update = _recipes()[name]
    x, y = regression_data(jr.key(1))

    @eqx.filter_jit
    def step(held, opt_state):
        grads = eqx.filter_grad(mse_loss)(_runnable(held), x, y)
        return update(held, opt_state, grads)

    with jax.numpy_dtype_promotion("standard"):
        state = start(_one_layer_mlp(jr.key(0)))
        for _ in range(3):
            state = step(*state)
        save(tmp_path, state)
        uninterrupted = state
        for _ in range(3):
            uninterrupted = step(*uninterrupted)

        # A state built from other weights: everything must come from the file.
        # (For Equinox's deserialiser, only its shapes and dtypes: nothing run.)
        other = _one_layer_mlp(jr.key(99))
        if serialiser == "orbax":
            like = start(other)
        else:
            like = eqx.filter_eval_shape(start, other)
        resumed = restore(tmp_path, like)
        assert_bitwise_equal(resumed, state)
        for _ in range(3):
            resumed = step(*resumed)
    assert_bitwise_equal(resumed, uninterrupted)


_SHARDED = """
import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import eqx_amp
from tests.test_training_state import _recipes, mse_loss, _runnable, small_mlp

mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
def shard(tree):
    def place(x):
        if not eqx.is_array(x):
            return x
        spec = P("data") if x.ndim and x.shape[0] % 8 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.tree.map(place, tree)

x = jax.device_put(jr.normal(jr.key(1), (64, 8)), NamedSharding(mesh, P("data")))
y = jax.device_put(jr.normal(jr.key(2), (64, 8)), NamedSharding(mesh, P("data")))
report = {}
for name, (start, update) in _recipes().items():
    @eqx.filter_jit
    def step(held, opt_state):
        grads = eqx.filter_grad(mse_loss)(_runnable(held), x, y)
        return update(held, opt_state, grads)
    # Every weight split along its first axis (GSPMD may re-lay-out a replicated
    # one as it likes; what is checked is that eqx_amp's state follows its weight).
    held, opt_state = shard(start(small_mlp(jr.key(0), out=8)))
    before = [l.sharding for l in jax.tree.leaves((held, opt_state)) if eqx.is_array(l)]
    for _ in range(2):
        held, opt_state = step(held, opt_state)
    after = [l.sharding for l in jax.tree.leaves((held, opt_state)) if eqx.is_array(l)]
    leaves = [l for l in jax.tree.leaves((held, opt_state)) if eqx.is_array(l)]
    report[name] = {
        "same": [a.is_equivalent_to(b, l.ndim) for a, b, l in zip(before, after, leaves)],
        "split": sum(not s.is_fully_replicated for s in after),
    }
"""


_LAST_AXIS = """
# A weight split along its last axis: 8-bit blocks run along that axis, so the
# moments are encoded where they live, with no gather.
w = jax.device_put(jnp.ones((16, 4096)), NamedSharding(mesh, P(None, "data")))
optimizer = eqx_amp.optim.low_precision_moments(optax.adam(1e-3), "8bit")
state = optimizer.init({"w": w})
initial = state.inner_state[0].mu["w"]
update = jax.jit(optimizer.update)
hlo = update.lower({"w": w}, state).compile().as_text()
_, new = update({"w": w}, state)
mu = new.inner_state[0].mu["w"]
report["last axis"] = {
    "gathers": hlo.count("all-gather"),
    "values": list(mu.values.sharding.spec),
    "scales": list(mu.scales.sharding.spec),
    # Initialised (all zero: `encode_zeros`) where the weight lives too.
    "initial": [list(initial.values.sharding.spec), list(initial.scales.sharding.spec)],
}
"""


@pytest.mark.slow
def test_sharded_states_keep_their_shardings():
    report = run_script_on_eight_devices(_SHARDED + _LAST_AXIS, promotion="standard")
    last_axis = report.pop("last axis")
    assert last_axis == {
        "gathers": 0,
        "values": [None, "data"],
        "scales": [None, "data"],
        "initial": [[None, "data"], [None, "data"]],
    }
    for name, result in report.items():
        assert all(result["same"]), name
        assert result["split"] >= 4, name

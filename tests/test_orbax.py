"""Checkpoints of a whole mixed-precision training state (a `BiModel`, its optax
state and a dynamic loss scale) with orbax and with `eqx.tree_serialise_leaves`:
the dtypes and shardings come back, and a resumed run is bit for bit the run that
was never interrupted. `docs/guides/checkpoints.md` copies its code from here."""

import functools as ft
import pathlib
import re
import textwrap
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqx_amp

from .helpers import run_script_on_eight_devices


ocp = pytest.importorskip(
    "orbax.checkpoint", reason='needs the orbax extra: pip install -e ".[orbax]"'
)


WIDTH, FEATURES, BATCH = 32, 8, 64
INITIAL_SCALE = 2.0**14
STEPS, CUT = 6, 3
# Step 1's loss times the scale overflows float32, so its gradients are not finite:
# the step is skipped and the scale backs off before the checkpoint. With period=2
# the scale grows again after the cut, and step 4 overflows once more, so the
# resumed run has to carry the scale's counter as well as its value.
MULTIPLIERS = (1.0, 1e38, 1.0, 1.0, 1e38, 1.0)


class Net(eqx.Module):
    """Every weight's first dimension divides by 8, so that all of them can be
    sharded over a mesh of 8 devices; the LayerNorm is kept in float32 by the
    default filter spec, so the `BiModel` holds it once."""

    inp: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.inp = eqx.nn.Linear(FEATURES, WIDTH, key=k1)
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.out = eqx.nn.Linear(WIDTH, FEATURES, key=k2)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.inp(x))))


def loss_fn(model, x, y, multiplier):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2) * multiplier


def batch(i):
    kx, ky = jr.split(jr.key(1000 + i))
    x = jr.normal(kx, (BATCH, FEATURES))
    return x, jnp.sin(x) + 0.1 * jr.normal(ky, (BATCH, FEATURES))


def params(bimodel):
    return eqx.filter(bimodel.master, eqx.is_inexact_array)


#
# (a) The loss scale in the optimizer state: `eqx_amp.loss_scaling`, float16.
#

scaled_adam = eqx_amp.loss_scaling(
    optax.adam(1e-2), eqx_amp.DynamicLossScale(INITIAL_SCALE, period=2)
)


def init_in_optimizer(key):
    bimodel = eqx_amp.BiModel(Net(key), policy="mixed_float16")
    # optax.adam's bias correction raises a float32 to an int32 count, which the
    # suite's strict promotion rejects; users run it with standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        opt_state = scaled_adam.init(params(bimodel))
    return bimodel, opt_state


def step_in_optimizer(state, x, y, multiplier):
    bimodel, opt_state = state

    # Differentiated at the compute copy, so the backward pass runs in float16.
    grad_fn = eqx_amp.scaled_value_and_grad(loss_fn)
    (loss, grads), opt_state = grad_fn(bimodel, x, y, multiplier, opt_state=opt_state)
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = scaled_adam.update(grads, opt_state, params(bimodel))
    # A skipped step has zero updates: the master (and so the compute copy) stays.
    return (bimodel.apply_updates(updates), opt_state), opt_state.last_finite


def scale_in_optimizer(state):
    return state[1].loss_scale


#
# (b) An explicit `DynamicLossScale`, `BiModel.value_and_grad` and `select_tree`,
# bfloat16.
#

adam = optax.adam(1e-2)


def init_explicit(key):
    bimodel = eqx_amp.BiModel(Net(key), policy="mixed_bfloat16")
    with jax.numpy_dtype_promotion("standard"):
        opt_state = adam.init(params(bimodel))
    return bimodel, opt_state, eqx_amp.DynamicLossScale(INITIAL_SCALE, period=2)


def step_explicit(state, x, y, multiplier):
    bimodel, opt_state, loss_scale = state
    (loss, grads), loss_scale, grads_finite = eqx_amp.filter_value_and_grad(loss_fn)(
        bimodel, x, y, multiplier, loss_scale=loss_scale
    )
    with jax.numpy_dtype_promotion("standard"):
        updates, new_opt_state = adam.update(grads, opt_state, params(bimodel))
    new_bimodel = bimodel.apply_updates(updates)
    bimodel, opt_state = eqx_amp.select_tree(
        grads_finite, (new_bimodel, new_opt_state), (bimodel, opt_state)
    )
    return (bimodel, opt_state, loss_scale), grads_finite


def scale_explicit(state):
    return state[2]


class Recipe(NamedTuple):
    init: Any
    step: Any  # not jitted: the sharded run adds its sharding constraints
    loss_scale: Any
    compute_dtype: Any


RECIPES = {
    "loss_scaling": Recipe(
        init_in_optimizer, step_in_optimizer, scale_in_optimizer, jnp.float16
    ),
    "explicit": Recipe(init_explicit, step_explicit, scale_explicit, jnp.bfloat16),
}


@ft.cache
def jitted(name):
    # One compilation per recipe, shared by every test that runs it.
    return eqx.filter_jit(RECIPES[name].step)


def train(recipe, step, state, start, stop, put=lambda batch: batch):
    """Steps `start` to `stop`; returns the state and, per step, whether the
    gradients were finite and the loss scale after it."""
    history = []
    for i in range(start, stop):
        x, y = put(batch(i))
        state, grads_finite = step(state, x, y, jnp.float32(MULTIPLIERS[i]))
        history.append((bool(grads_finite), float(recipe.loss_scale(state).loss_scale)))
    return state, history


# Halved at each overflow, doubled after two finite steps in a row (period=2).
HISTORY = [
    (True, INITIAL_SCALE),
    (False, INITIAL_SCALE / 2),
    (True, INITIAL_SCALE / 2),
    (True, INITIAL_SCALE),
    (False, INITIAL_SCALE / 2),
    (True, INITIAL_SCALE / 2),
]


@ft.cache
def uninterrupted(name):
    recipe = RECIPES[name]
    state, history = train(recipe, jitted(name), recipe.init(jr.key(0)), 0, STEPS)
    assert history == HISTORY
    return state


#
# Saving and restoring.
#


def save_with_orbax(path, state):
    arrays, _ = eqx.partition(state, eqx.is_array)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, arrays)
        checkpointer.wait_until_finished()


def restore_with_orbax(path, like):
    """`like` is a freshly initialised state: the dtypes, shapes and shardings of
    the restored arrays, and every non-array part of the state, come from it."""
    arrays, static = eqx.partition(like, eqx.is_array)
    abstract = jtu.tree_map(ocp.utils.to_shape_dtype_struct, arrays)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, abstract)
    return eqx.combine(restored, static)


def _bits(x):
    """The bit pattern: tells -0.0 from 0.0, and compares NaNs."""
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating) or x.dtype in (jnp.bfloat16, jnp.float16):
        return x.view(f"u{x.dtype.itemsize}")
    return x


def assert_bitwise_equal(a, b):
    """Same structure (static fields included), and every array leaf the same dtype,
    shape and bits."""
    a_leaves, a_def = jtu.tree_flatten_with_path(a)
    b_leaves, b_def = jtu.tree_flatten_with_path(b)
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    assert len(a_leaves) == len(b_leaves)
    for (path, x), (_, y) in zip(a_leaves, b_leaves):
        name = jtu.keystr(path)
        if eqx.is_array(x):
            assert eqx.is_array(y), name
            assert (x.dtype, x.shape) == (y.dtype, y.shape), name
            np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=name)
        else:
            assert x == y, name


def assert_mixed_precision_dtypes(state, compute_dtype):
    """The master is float32, the compute copy is in the compute dtype (the kept
    LayerNorm in float32), and the counters are still integers."""
    bimodel = state[0]
    f32 = jnp.dtype(jnp.float32)
    assert {x.dtype for x in jtu.tree_leaves(params(bimodel))} == {f32}
    compute = bimodel.compute
    assert compute.inp.weight.dtype == compute.out.weight.dtype == compute_dtype
    assert compute.inp.bias.dtype == compute.out.bias.dtype == compute_dtype
    assert compute.norm.weight.dtype == f32
    if isinstance(state[1], eqx_amp.optim.LossScalingState):
        assert state[1].notfinite_count.dtype == jnp.int32
        assert state[1].total_notfinite.dtype == jnp.int32
        assert state[1].last_finite.dtype == jnp.bool_
    inner = adam_state(state)
    assert inner.count.dtype == jnp.int32
    assert {x.dtype for x in jtu.tree_leaves((inner.mu, inner.nu))} == {f32}


def adam_state(state):
    opt_state = state[1]
    if isinstance(opt_state, eqx_amp.optim.LossScalingState):
        opt_state = opt_state.inner_state
    return opt_state[0]


def check_checkpointed_scale(scale):
    # Backed off at the overflow and not grown back yet: not the scale a fresh
    # state starts with, so a restore that lost it would show.
    assert float(scale.loss_scale) == INITIAL_SCALE / 2
    assert int(scale.counter) == 1
    assert scale.loss_scale.dtype == jnp.float32
    assert scale.counter.dtype == jnp.int32


#
# One device.
#


@pytest.mark.parametrize("name", list(RECIPES))
def test_orbax_resume_is_bit_identical(name, tmp_path):
    recipe, step = RECIPES[name], jitted(name)
    first, history = train(recipe, step, recipe.init(jr.key(0)), 0, CUT)
    assert history == HISTORY[:CUT]
    check_checkpointed_scale(recipe.loss_scale(first))
    # The skipped step did not advance Adam (so neither would a schedule).
    assert int(adam_state(first).count) == CUT - 1
    if name == "loss_scaling":
        assert int(first[1].total_notfinite) == 1

    path = tmp_path / "checkpoint"
    save_with_orbax(path, first)
    # Other weights and the initial scale, so that nothing can leak from memory
    # into what is restored.
    like = recipe.init(jr.key(99))
    assert float(recipe.loss_scale(like).loss_scale) == INITIAL_SCALE
    restored = restore_with_orbax(path, like)
    assert_bitwise_equal(restored, first)
    assert_mixed_precision_dtypes(restored, recipe.compute_dtype)
    check_checkpointed_scale(recipe.loss_scale(restored))

    resumed, history = train(recipe, step, restored, CUT, STEPS)
    assert history == HISTORY[CUT:]
    assert_bitwise_equal(resumed, uninterrupted(name))
    assert_mixed_precision_dtypes(resumed, recipe.compute_dtype)


@pytest.mark.parametrize("name", list(RECIPES))
def test_tree_serialise_leaves_resume_is_bit_identical(name, tmp_path):
    recipe, step = RECIPES[name], jitted(name)
    first, _ = train(recipe, step, recipe.init(jr.key(0)), 0, CUT)
    path = tmp_path / "checkpoint.eqx"
    eqx.tree_serialise_leaves(path, first)
    restored = eqx.tree_deserialise_leaves(path, recipe.init(jr.key(99)))
    assert_bitwise_equal(restored, first)
    assert_mixed_precision_dtypes(restored, recipe.compute_dtype)
    check_checkpointed_scale(recipe.loss_scale(restored))
    resumed, history = train(recipe, step, restored, CUT, STEPS)
    assert history == HISTORY[CUT:]
    assert_bitwise_equal(resumed, uninterrupted(name))


#
# A mesh of 8 devices. The device count must be set before JAX is imported, so
# this runs in a fresh interpreter, with this module's recipes and checks.
#

SHARDED = textwrap.dedent(
    """
    import pathlib

    import equinox as eqx
    import jax
    import jax.random as jr
    import jax.tree_util as jtu
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tests.test_orbax import (
        CUT, HISTORY, RECIPES, STEPS, assert_bitwise_equal,
        assert_mixed_precision_dtypes, train,
    )

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    data = NamedSharding(mesh, P("data"))


    def sharding_of(x):
        split = x.ndim > 0 and x.shape[0] % 8 == 0
        return NamedSharding(mesh, P("data") if split else P())


    def shard(state):
        arrays, static = eqx.partition(state, eqx.is_array)
        shardings = jtu.tree_map(sharding_of, arrays)
        return eqx.combine(jax.device_put(arrays, shardings), static), shardings


    def put(batch):
        return jax.device_put(batch, data)


    report = {"devices": jax.device_count()}
    for name, recipe in RECIPES.items():
        state, shardings = shard(recipe.init(jr.key(0)))

        @eqx.filter_jit
        def step(state, x, y, multiplier):
            state, grads_finite = recipe.step(state, x, y, multiplier)
            return eqx.filter_shard(state, shardings), grads_finite

        uninterrupted, full_history = train(recipe, step, state, 0, STEPS, put)
        first, history = train(recipe, step, state, 0, CUT, put)
        assert full_history == HISTORY and history == HISTORY[:CUT]

        directory = pathlib.Path(TMP_PATH) / name
        with ocp.CheckpointManager(directory) as manager:
            arrays, _ = eqx.partition(first, eqx.is_array)
            manager.save(CUT, args=ocp.args.StandardSave(arrays))
            manager.wait_until_finished()

        like, _ = shard(recipe.init(jr.key(99)))
        arrays, static = eqx.partition(like, eqx.is_array)
        abstract = jtu.tree_map(ocp.utils.to_shape_dtype_struct, arrays)
        with ocp.CheckpointManager(directory) as manager:
            restored = manager.restore(
                manager.latest_step(), args=ocp.args.StandardRestore(abstract)
            )
        restored = eqx.combine(restored, static)

        assert_bitwise_equal(restored, first)
        assert_mixed_precision_dtypes(restored, recipe.compute_dtype)
        pairs = list(zip(jtu.tree_leaves(restored), jtu.tree_leaves(first)))
        kept = [a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in pairs]
        same_spec = [a.sharding.spec == b.sharding.spec for a, b in pairs]
        resumed, resumed_history = train(recipe, step, restored, CUT, STEPS, put)
        assert resumed_history == HISTORY[CUT:]
        assert_bitwise_equal(resumed, uninterrupted)
        report[name] = {
            "leaves": len(pairs),
            "shardings_kept": all(kept) and all(same_spec),
            "split_leaves": sum(a.sharding.spec == P("data") for a, _ in pairs),
            "spread_over": sorted({len(a.sharding.device_set) for a, _ in pairs}),
            "resumed_shardings_kept": all(
                a.sharding.is_equivalent_to(b.sharding, a.ndim)
                for a, b in zip(jtu.tree_leaves(resumed), jtu.tree_leaves(first))
            ),
        }
    """
)


@pytest.mark.slow
def test_orbax_on_a_mesh_of_eight_devices(tmp_path):
    source = f"TMP_PATH = {str(tmp_path)!r}\n" + SHARDED
    report = run_script_on_eight_devices(source, promotion="standard")
    assert report["devices"] == 8
    for name in RECIPES:
        run = report[name]
        assert run["shardings_kept"] is True
        assert run["resumed_shardings_kept"] is True
        assert run["spread_over"] == [8]
        # The master, its float16/bfloat16 copy and Adam's moments of all six
        # weights and biases are split over the mesh; only scalars are replicated.
        assert run["split_leaves"] == 6 + 4 + 12
        assert run["leaves"] > run["split_leaves"]


GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs/guides/checkpoints.md"


@pytest.mark.slow
def test_the_checkpoints_guide_runs(tmp_path):
    """Every Python block of the guide, in order, as one program on 8 devices (its
    sharded section needs a mesh). The guide's own asserts check the restored
    dtypes and shardings; the report adds what the page leaves unchecked."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert len(blocks) >= 5
    report = textwrap.dedent(
        """
        report = {
            "devices": n,
            "split": sum(a.sharding.spec == P("data") for a in after),
            "saved": sorted(str(p) for p in pathlib.Path(".").rglob("*.eqx")),
            "checkpoints": sorted(p.name for p in pathlib.Path("checkpoints").iterdir()),
        }
        """
    )
    chdir = f"import os\nos.chdir({str(tmp_path)!r})\n"
    source = chdir + "\n".join(blocks) + report
    report = run_script_on_eight_devices(source, promotion="standard")
    assert report["devices"] == 8
    # The master, its float16 copy and Adam's two moments of the MLP's six arrays.
    assert report["split"] == 4 * 6
    assert report["saved"] == ["state.eqx"]
    assert report["checkpoints"] == ["sharded", "step_10"]

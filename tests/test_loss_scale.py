import importlib.util
import io
import pathlib

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp

from .helpers import eqns_named, traced


F16 = jnp.dtype(jnp.float16)
BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
I32 = jnp.dtype(jnp.int32)
ROOT = pathlib.Path(__file__).parent.parent


def _fields(scale):
    """Every field of a DynamicLossScale, as Python values."""
    return (
        float(scale.loss_scale),
        int(scale.counter),
        scale.period,
        scale.factor,
        float(scale.min_loss_scale),
    )


#
# Construction.
#


def test_dynamic_defaults():
    scale = eqx_amp.DynamicLossScale()
    assert _fields(scale) == (2.0**15, 0, 2000, 2, 1.0)
    for leaf, dtype in [
        (scale.loss_scale, F32),
        (scale.counter, I32),
        (scale.min_loss_scale, F32),
    ]:
        assert isinstance(leaf, jax.Array)
        assert leaf.shape == ()
        assert leaf.dtype == dtype
        assert not leaf.weak_type


def test_static_and_noop():
    static = eqx_amp.StaticLossScale(1024)
    assert static.loss_scale.dtype == F32 and static.loss_scale.shape == ()
    assert float(static.loss_scale) == 1024.0
    noop = eqx_amp.NoOpLossScale()
    assert noop.loss_scale.dtype == F32 and float(noop.loss_scale) == 1.0
    assert jax.tree_util.tree_leaves(noop) == []


def test_abstract_base():
    for cls in (
        eqx_amp.NoOpLossScale,
        eqx_amp.StaticLossScale,
        eqx_amp.DynamicLossScale,
    ):
        assert issubclass(cls, eqx_amp.AbstractLossScale)
    with pytest.raises(
        TypeError, match=r"Can't instantiate abstract class AbstractLossScale"
    ):
        eqx_amp.AbstractLossScale()
    assert eqx_amp.NoOpLossScale().is_fixed and eqx_amp.StaticLossScale(2.0).is_fixed
    assert not eqx_amp.DynamicLossScale().is_fixed


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"period": 0}, ValueError, "`period`"),
        ({"period": -3}, ValueError, "`period`"),
        ({"period": 2.5}, TypeError, "`period`"),
        ({"period": True}, TypeError, "`period`"),
        ({"factor": 1}, ValueError, "`factor`"),
        ({"factor": 0.5}, ValueError, "`factor`"),
        ({"factor": float("inf")}, ValueError, "`factor`"),
        ({"factor": "2"}, TypeError, "`factor`"),
        ({"factor": jnp.asarray(2.0)}, TypeError, "`factor`"),
        ({"min_loss_scale": 0.0}, ValueError, "`min_loss_scale`"),
        ({"min_loss_scale": -1.0}, ValueError, "`min_loss_scale`"),
        ({"loss_scale": 0.0}, ValueError, "`loss_scale`"),
        ({"loss_scale": -2.0}, ValueError, "`loss_scale`"),
        ({"loss_scale": float("inf")}, ValueError, "`loss_scale`"),
        ({"loss_scale": float("nan")}, ValueError, "`loss_scale`"),
        ({"loss_scale": jnp.ones(2)}, ValueError, "`loss_scale`"),
        ({"loss_scale": "big"}, TypeError, "`loss_scale`"),
        ({"loss_scale": True}, TypeError, "`loss_scale`"),
        ({"loss_scale": 0.5, "min_loss_scale": 1.0}, ValueError, "`min_loss_scale`"),
        (
            {"min_loss_scale": 1e-45},
            ValueError,
            r"`min_loss_scale` must be a positive, normal float32.*1e-45",
        ),
        (
            {"loss_scale": 1e-50},
            ValueError,
            r"`loss_scale` must be a positive, normal float32.*got 1e-50",
        ),
        (
            {"loss_scale": 1e39},
            ValueError,
            r"`loss_scale` must be a positive, normal float32.*got 1e\+39",
        ),
        (
            {"counter": 1.5},
            ValueError,
            r"`counter` must be a whole number, but got 1.5",
        ),
        (
            {"factor": 2**200},
            ValueError,
            r"`factor` must be greater than 1 and at most the largest float32",
        ),
        # float32 rounds it to 1: the scale would never move.
        (
            {"factor": 1 + 1e-10},
            ValueError,
            r"`factor` must be greater than 1 .*must not round to 1\), but got "
            r"1.0000000001",
        ),
        # Checked as given, before an int32 conversion wraps or truncates it.
        (
            {"counter": np.int64(2**32 + 5), "period": 2**31 - 1},
            ValueError,
            r"`counter` must fit an int32 .*but got 4294967301",
        ),
        (
            {"counter": np.array(2**40), "period": 2**31 - 1},
            ValueError,
            r"`counter` must fit an int32",
        ),
        ({"counter": 2**40}, ValueError, r"`counter` must fit an int32"),
        (
            {"counter": jnp.float32(1.5), "period": 4},
            ValueError,
            r"`counter` must be a whole number, but got 1.5",
        ),
        ({"counter": float("inf")}, ValueError, r"`counter` must be a whole number"),
        (
            {"loss_scale": 10**400},
            ValueError,
            r"`loss_scale` must be a positive, normal float32.*got 1000000",
        ),
        ({"period": 2**40}, ValueError, r"`period` must be from 1 to 2147483647"),
        ({"counter": -1}, ValueError, "`counter`"),
        ({"counter": 5, "period": 5}, ValueError, "`counter`"),
        ({"counter": np.ones(3)}, ValueError, "`counter`"),
    ],
)
def test_dynamic_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        eqx_amp.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("factor", [2**31, 2**40, 2.0**100])
def test_a_factor_past_int32_grows_and_backs_off_in_float32(factor):
    scale = eqx_amp.DynamicLossScale(2.0**100, period=1, factor=factor)
    grown, backed_off = scale.adjust(jnp.array(True)), scale.adjust(jnp.array(False))
    assert float(backed_off.loss_scale) == max(2.0**100 / factor, 1.0)
    expected = 2.0**100 * factor
    assert float(grown.loss_scale) == (expected if expected < 2.0**128 else 2.0**100)
    # The counter of a jax array counter is kept as given.
    kept = eqx_amp.DynamicLossScale(counter=jnp.float32(1.0), period=4)
    assert kept.counter.dtype == jnp.int32 and int(kept.counter) == 1


@pytest.mark.parametrize(
    "value, error",
    [
        (0.0, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (jnp.ones(3), ValueError),
        (None, TypeError),
    ],
)
def test_static_bad_arguments(value, error):
    with pytest.raises(error, match="`loss_scale`"):
        eqx_amp.StaticLossScale(value)


def test_constructed_from_tracers_under_jit():
    # Values cannot be checked under tracing; construction must still work.
    @jax.jit
    def make(loss_scale, counter):
        return eqx_amp.DynamicLossScale(loss_scale, counter, period=4)

    scale = make(jnp.float16(8.0), 2)
    assert _fields(scale) == (8.0, 2, 4, 2, 1.0)
    assert scale.loss_scale.dtype == F32 and scale.counter.dtype == I32
    static = jax.jit(eqx_amp.StaticLossScale)(3.0)
    assert float(static.loss_scale) == 3.0


#
# Pytree behaviour: jit, scan, serialisation.
#


def test_every_field_survives_jit():
    scale = eqx_amp.DynamicLossScale(
        8.0, counter=3, period=5, factor=3, min_loss_scale=2.0
    )
    out = jax.jit(lambda s: s)(scale)
    assert _fields(out) == (8.0, 3, 5, 3, 2.0)
    # jmp's hand-written flatten drops `min_loss_scale` under jit, so a non-finite
    # step takes the scale below the minimum. Here the minimum holds.
    at_minimum = eqx_amp.DynamicLossScale(2.0, min_loss_scale=2.0)
    out = jax.jit(lambda s: s.adjust(jnp.asarray(False)))(at_minimum)
    assert float(out.loss_scale) == 2.0
    assert float(out.min_loss_scale) == 2.0


def test_scan_carry():
    flags = jnp.array([True, True, False, True, True, True, True])
    scale = eqx_amp.DynamicLossScale(4.0, period=2)

    def body(scale, finite):
        new = scale.adjust(finite)
        return new, new.loss_scale

    final, history = jax.lax.scan(body, scale, flags)
    assert history.dtype == F32
    assert history.tolist() == [4.0, 8.0, 4.0, 4.0, 8.0, 8.0, 16.0]
    assert _fields(final) == (16.0, 0, 2, 2, 1.0)


def test_while_loop_carry():
    scale = eqx_amp.DynamicLossScale(2.0**10, period=3)
    out = jax.lax.while_loop(
        lambda s: s.loss_scale > 100.0, lambda s: s.adjust(jnp.asarray(False)), scale
    )
    assert float(out.loss_scale) == 64.0


@pytest.mark.parametrize(
    "scale",
    [
        eqx_amp.DynamicLossScale(
            3.0 * 2.0**20, counter=7, period=11, min_loss_scale=0.25
        ),
        eqx_amp.StaticLossScale(12345.678),
        eqx_amp.NoOpLossScale(),
    ],
    ids=["dynamic", "static", "noop"],
)
def test_serialise_round_trip(scale, tmp_path):
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, scale)
    buffer.seek(0)
    like = jax.tree_util.tree_map(jnp.zeros_like, scale)
    loaded = eqx.tree_deserialise_leaves(buffer, like)
    assert bool(eqx.tree_equal(loaded, scale))
    for a, b in zip(
        jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(scale)
    ):
        assert a.dtype == b.dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

    path = tmp_path / "scale.eqx"
    eqx.tree_serialise_leaves(path, scale)
    assert bool(eqx.tree_equal(eqx.tree_deserialise_leaves(path, like), scale))


def test_adjust_does_not_mutate():
    scale = eqx_amp.DynamicLossScale(4.0, counter=1, period=2)
    new = scale.adjust(True)
    assert _fields(scale) == (4.0, 1, 2, 2, 1.0)
    assert _fields(new) == (8.0, 0, 2, 2, 1.0)
    assert type(new) is eqx_amp.DynamicLossScale


#
# scale / unscale.
#


class _Holder(eqx.Module):
    weight: jax.Array
    steps: jax.Array
    mask: jax.Array
    key: jax.Array
    activation: object
    rate: float


def _mixed_tree():
    return _Holder(
        weight=jnp.array([1.0, -2.0], F16),
        steps=jnp.array([3, 4], I32),
        mask=jnp.array([True, False]),
        key=jr.key(0),
        activation=jax.nn.relu,
        rate=0.5,
    )


@pytest.mark.parametrize(
    "scale",
    [eqx_amp.StaticLossScale(8.0), eqx_amp.DynamicLossScale(8.0)],
    ids=["static", "dynamic"],
)
def test_scale_only_touches_floating_arrays(scale):
    tree = _mixed_tree()
    out = scale.scale(tree)
    assert out.weight.dtype == F16
    assert out.weight.tolist() == [8.0, -16.0]
    assert out.steps is tree.steps and out.mask is tree.mask and out.key is tree.key
    assert out.activation is jax.nn.relu and out.rate == 0.5
    assert scale.scale(None) is None
    loss = scale.scale(jnp.float32(1.5))
    assert loss.dtype == F32 and float(loss) == 12.0


def test_scale_half_beyond_its_range():
    # float16 cannot hold 2**16; a zero must not become 0 * inf = nan.
    scale = eqx_amp.DynamicLossScale(2.0**16)
    out = scale.scale(jnp.array([0.0, 2.0**-10, 1.0], F16))
    assert out.dtype == F16
    assert out.tolist() == [0.0, 64.0, float("inf")]
    assert scale.scale(jnp.array([3.0], BF16)).tolist() == [3.0 * 2.0**16]


@pytest.mark.parametrize("half", [F16, BF16], ids=["f16", "bf16"])
def test_unscale_half_in_float32(half):
    scale = eqx_amp.DynamicLossScale(2.0**15)
    # A 1e-8 gradient of a float16 parameter: it underflows to 0 in float16, but
    # scaled it is representable, and unscaled in float32 it survives.
    scaled = (jnp.float32(1e-8) * 2.0**15).astype(half)
    assert float(scaled) > 0
    assert float(scaled / jnp.asarray(2.0**15, half)) == 0.0 or half == BF16
    out = scale.unscale({"w": scaled, "n": jnp.int32(3), "none": None})
    assert out["w"].dtype == F32
    assert float(out["w"]) == pytest.approx(1e-8, rel=1e-2)
    assert float(out["w"]) == float(scaled.astype(F32)) / 2.0**15
    assert out["n"].dtype == I32 and int(out["n"]) == 3
    assert out["none"] is None


def test_unscale_keeps_float32_and_non_arrays():
    scale = eqx_amp.StaticLossScale(4.0)
    tree = _mixed_tree()
    out = scale.unscale(eqx.tree_at(lambda t: t.weight, tree, jnp.array([8.0], F32)))
    assert out.weight.dtype == F32 and out.weight.tolist() == [2.0]
    assert out.key is tree.key and out.activation is jax.nn.relu and out.rate == 0.5


def test_unscale_is_exact_division():
    # A non-power-of-two scale: unscaling divides (one rounding), it does not
    # multiply by a rounded reciprocal.
    scale = eqx_amp.StaticLossScale(3.0)
    x = jnp.array([3.0, 9.0, 0.3], F32)
    assert bool(eqx.tree_equal(scale.unscale(x), x / jnp.float32(3.0)))


def test_noop_scale():
    noop = eqx_amp.NoOpLossScale()
    tree = _mixed_tree()
    assert noop.scale(tree) is tree
    out = noop.unscale(tree)
    assert out.weight.dtype == F32 and out.weight.tolist() == [1.0, -2.0]
    assert out.steps is tree.steps
    assert noop.adjust(jnp.asarray(False)) is noop


def test_static_adjust_is_identity():
    static = eqx_amp.StaticLossScale(4.0)
    assert static.adjust(False) is static
    assert static.adjust(jnp.asarray(True)) is static


#
# adjust.
#


def test_adjust_growth_period():
    scale = eqx_amp.DynamicLossScale(2.0, period=3)
    seen = []
    for _ in range(7):
        scale = scale.adjust(jnp.asarray(True))
        seen.append((float(scale.loss_scale), int(scale.counter)))
    assert seen == [(2, 1), (2, 2), (4, 0), (4, 1), (4, 2), (8, 0), (8, 1)]


def test_adjust_back_off_resets_counter_and_respects_minimum():
    scale = eqx_amp.DynamicLossScale(
        8.0, counter=2, period=3, factor=4, min_loss_scale=1.0
    )
    scale = scale.adjust(False)
    assert (float(scale.loss_scale), int(scale.counter)) == (2.0, 0)
    scale = scale.adjust(False)
    assert (float(scale.loss_scale), int(scale.counter)) == (1.0, 0)
    scale = scale.adjust(False)
    assert (float(scale.loss_scale), int(scale.counter)) == (1.0, 0)


def test_adjust_refuses_infinite_growth():
    biggest = float(np.finfo(np.float32).max)
    scale = eqx_amp.DynamicLossScale(biggest, counter=0, period=1)
    grown = scale.adjust(True)
    assert float(grown.loss_scale) == biggest
    assert int(grown.counter) == 0


def test_adjust_non_integer_factor():
    scale = eqx_amp.DynamicLossScale(4.0, period=1, factor=1.5)
    assert float(scale.adjust(True).loss_scale) == 6.0
    assert float(scale.adjust(False).loss_scale) == pytest.approx(4.0 / 1.5)


@pytest.mark.parametrize(
    "scale",
    [eqx_amp.DynamicLossScale(), eqx_amp.StaticLossScale(2.0), eqx_amp.NoOpLossScale()],
    ids=["dynamic", "static", "noop"],
)
@pytest.mark.parametrize(
    "flag, error",
    [
        (jnp.ones(3, bool), ValueError),
        (jnp.float32(1.0), TypeError),
        (1, TypeError),
        ("yes", TypeError),
    ],
)
def test_adjust_bad_flag(scale, flag, error):
    with pytest.raises(error, match="`grads_finite`"):
        scale.adjust(flag)


#
# Property test: the state machine against a plain-Python reference.
#


def _reference(loss_scale, counter, period, factor, min_loss_scale, flags):
    """jmp's `DynamicLossScale.adjust`, step by step in float32 NumPy."""
    scale = np.float32(loss_scale)
    history = []
    for finite in flags:
        if finite:
            if counter == period - 1:
                with np.errstate(over="ignore"):
                    grown = np.float32(scale * np.float32(factor))
                if np.isfinite(grown):
                    scale = grown
            counter = (counter + 1) % period
        else:
            scale = max(
                np.float32(min_loss_scale), np.float32(scale / np.float32(factor))
            )
            counter = 0
        history.append((float(scale), counter))
    return history


_jitted_adjust = jax.jit(lambda scale, finite: scale.adjust(finite))


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(
    exponent=st.integers(-4, 127),
    period=st.integers(1, 4),
    # Powers of two, so that the reference is exact: XLA turns a division by a
    # constant into a multiplication by its rounded reciprocal.
    factor=st.sampled_from([2, 4, 8]),
    min_exponent=st.integers(-6, 0),
    flags=st.lists(st.booleans(), min_size=1, max_size=25),
)
def test_dynamic_scale_matches_reference(exponent, period, factor, min_exponent, flags):
    min_loss_scale = 2.0**min_exponent
    loss_scale = max(2.0**exponent, min_loss_scale)
    scale = eqx_amp.DynamicLossScale(
        loss_scale, period=period, factor=factor, min_loss_scale=min_loss_scale
    )
    expected = _reference(loss_scale, 0, period, factor, min_loss_scale, flags)
    for finite, (want_scale, want_counter) in zip(flags, expected):
        scale = _jitted_adjust(scale, jnp.asarray(finite))
        assert float(scale.loss_scale) == want_scale
        assert int(scale.counter) == want_counter
        assert np.isfinite(float(scale.loss_scale))
        assert float(scale.loss_scale) >= min_loss_scale
        assert scale.loss_scale.dtype == F32 and scale.counter.dtype == I32


#
# all_finite.
#


def test_all_finite_on_a_module(getkey):
    model = eqx.nn.MLP(3, 2, 4, 1, key=getkey())  # holds activation functions
    tree = (model, jnp.arange(3), jr.key(0), None, "label", 1.5)
    flag = eqx_amp.all_finite(tree)
    assert flag.dtype == jnp.bool_ and flag.shape == ()
    assert bool(flag)
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        weight = model.layers[0].weight.at[1, 2].set(bad).astype(F16)
        broken = eqx.tree_at(lambda m: m.layers[0].weight, model, weight)
        assert not bool(eqx_amp.all_finite((broken, jnp.arange(3))))
        assert not bool(jax.jit(eqx_amp.all_finite)(eqx.filter(broken, eqx.is_array)))


def test_all_finite_empty_and_complex():
    assert bool(eqx_amp.all_finite({})) and bool(eqx_amp.all_finite([None, 3, "x"]))
    assert not bool(eqx_amp.all_finite(jnp.array([1 + 1j, complex("nan+0j")])))


def test_all_finite_axis_name_agrees():
    x = jnp.ones((4, 3)).at[2, 1].set(jnp.nan)
    local = jax.vmap(eqx_amp.all_finite)(x)
    assert local.tolist() == [True, True, False, True]
    agreed = jax.vmap(lambda r: eqx_amp.all_finite(r, axis_name="i"), axis_name="i")(x)
    assert agreed.tolist() == [False] * 4
    finite = jax.vmap(lambda r: eqx_amp.all_finite(r, axis_name="i"), axis_name="i")
    assert finite(jnp.ones((4, 3))).tolist() == [True] * 4


def test_all_finite_unbound_axis():
    with pytest.raises(NameError, match="`axis_name='nope'`"):
        eqx_amp.all_finite(jnp.ones(3), axis_name="nope")


#
# select_tree.
#


def test_select_tree_on_modules(getkey):
    a = eqx.nn.MLP(3, 2, 4, 1, key=getkey())
    b = jax.tree_util.tree_map(lambda x: x + 1 if eqx.is_array(x) else x, a)
    assert eqx_amp.select_tree(True, a, b) is a
    assert eqx_amp.select_tree(jnp.asarray(False), a, b) is b

    select = eqx.filter_jit(eqx_amp.select_tree)
    assert bool(eqx.tree_equal(select(jnp.asarray(True), a, b), a))
    assert bool(eqx.tree_equal(select(jnp.asarray(False), a, b), b))


def test_select_tree_keys_ints_and_static_leaves():
    a = {"k": jr.key(0), "n": jnp.int32(1), "f": jax.nn.relu, "s": 0.5, "none": None}
    b = {"k": jr.key(1), "n": jnp.int32(2), "f": jax.nn.relu, "s": 0.5, "none": None}
    out = eqx.filter_jit(eqx_amp.select_tree)(jnp.asarray(False), a, b)
    assert int(out["n"]) == 2 and out["f"] is jax.nn.relu and out["s"] == 0.5
    assert jr.key_data(out["k"]).tolist() == jr.key_data(b["k"]).tolist()


def _lowered_for(platform: str, fn, *args) -> str:
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


def test_select_tree_is_one_cond_on_a_cpu_and_a_select_per_leaf_elsewhere():
    """One cond compiles smaller on a CPU; a select per leaf keeps each leaf's
    sharding where XLA's GPU partitioner replicates a cond's outputs (an FSDP
    state all-gathered every step: `benchmarks/h100_aot.py --fsdp 8`)."""
    a = {"w": jnp.ones((3, 4)), "b": jnp.ones(4), "rest": [jnp.ones(2, F16)]}
    b = jax.tree_util.tree_map(lambda x: x * 2, a)
    jaxpr = traced(eqx_amp.select_tree, jnp.asarray(True), a, b)
    assert len(eqns_named(jaxpr, "platform_index")) == 1
    cpu = _lowered_for("cpu", eqx_amp.select_tree, jnp.asarray(True), a, b)
    assert "stablehlo.select" not in cpu
    for platform in ("cuda", "tpu"):
        text = _lowered_for(platform, eqx_amp.select_tree, jnp.asarray(True), a, b)
        assert text.count("stablehlo.select ") == 3, platform
    out = jax.jit(eqx_amp.select_tree)(jnp.asarray(False), a, b)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(jnp.array_equal, out, b))


@pytest.mark.parametrize(
    "pred",
    [jnp.ones(2, bool), jnp.float32(1.0), 1, "yes", None],
    ids=["vector", "float", "int", "str", "none"],
)
def test_select_tree_bad_pred(pred):
    with pytest.raises(TypeError, match="`pred`"):
        eqx_amp.select_tree(pred, jnp.ones(2), jnp.zeros(2))


@pytest.mark.parametrize(
    "a, b, match",
    [
        ((jnp.ones(2),), [jnp.ones(2)], "same pytree structure"),
        ({"x": jnp.ones(2)}, {"y": jnp.ones(2)}, "same pytree structure"),
        (jnp.ones(2), jnp.ones(3), "same shape and dtype"),
        (jnp.ones(2), jnp.ones(2, F16), "same shape and dtype"),
        (jax.nn.relu, jax.nn.gelu, "passed through"),
        (0.5, 0.25, "passed through"),
        (jnp.ones(()), 1.0, "both are arrays"),
    ],
)
def test_select_tree_mismatch(a, b, match):
    with pytest.raises(ValueError, match=match):
        eqx_amp.select_tree(jnp.asarray(True), a, b)


def _load_benchmark():
    path = ROOT / "benchmarks" / "skip_overhead.py"
    spec = importlib.util.spec_from_file_location("skip_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_skipping_keeps_the_compiled_step_small(getkey):
    """Deterministic instruction counts (no timing): a step that skips non-finite
    updates with `select_tree` compiles to nearly the same program as one that never
    skips, unlike a `lax.select` per leaf."""
    benchmark = _load_benchmark()
    model = eqx.nn.MLP(8, "scalar", 32, 3, key=getkey())
    x, y = jnp.ones((4, 8)), jnp.ones((4,))
    counts = benchmark.instruction_counts(
        model, x, y, names=("no skip", "select_tree", "per-leaf select")
    )
    assert counts["select_tree"] < 1.5 * counts["no skip"]
    assert counts["select_tree"] < counts["per-leaf select"]


def test_all_finite_names_an_unhashable_axis_name():
    with pytest.raises(TypeError, match=r"`axis_name` must be the \(hashable\) name"):
        eqx_amp.all_finite(jnp.ones(2), axis_name=["data"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32])
def test_numpy_scalars_of_every_real_dtype_are_numbers(dtype):
    # bfloat16's NumPy scalar (ml_dtypes) is no `np.floating`: it was refused as a
    # factor while float16's was taken.
    two = np.array(2, dtype).item() if dtype is jnp.int32 else np.asarray(2, dtype)[()]
    scale = eqx_amp.DynamicLossScale(two, factor=two)
    assert scale.factor == 2 and float(scale.loss_scale) == 2.0
    assert float(eqx_amp.StaticLossScale(two).loss_scale) == 2.0
    with pytest.raises(TypeError, match="`factor` must be a Python int or float"):
        eqx_amp.DynamicLossScale(two, factor=np.bool_(True))

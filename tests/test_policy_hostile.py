"""Hostile tests of the scoped default policy (`using_policy`, `default_policy`).

The matrix: a step traced before, inside and after a `using_policy` block, nested
blocks and an exception leaving a block, under `jax.jit` and `eqx.filter_jit`, for
`filter_amp` and `autocast` wrappers built outside the block (the policy is read
where the call is traced, so it must be part of the jit cache key); `using_policy`
opened inside a jitted function; two threads, one inside a block and one outside,
running one jitted step at once; a `BiModel` (which reads the policy where it is
built); bad arguments (None, a dtype object, unknown words). The float16 weight
overflow warning where the policy comes from a block around the call rather than
from `filter_amp(..., policy=)`: eager and traced weights, `filter_amp`, `autocast`
and `BiModel`, pointing at the user's line. Values are read against the exact
products each compute dtype gives.
"""

import threading
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_amp


# One weight that bfloat16 rounds away (2^-9 below its 8-bit mantissa) and float16
# keeps, one that both round away and float32 keeps: each compute dtype gives
# another product, so the output says which one the traced program used.
_WEIGHTS = np.array([[1 + 2**-9], [1 + 2**-12]], np.float32)
_EXPECTED = {
    "bfloat16": np.array([1.0, 1.0], np.float32),
    "float16": np.array([1 + 2**-9, 1.0], np.float32),
    "float32": _WEIGHTS[:, 0],
}
_X = jnp.ones(1)


def _model() -> eqx.nn.Linear:
    linear = eqx.nn.Linear(1, 2, use_bias=False, key=jax.random.key(0))
    return eqx.tree_at(lambda m: m.weight, linear, jnp.asarray(_WEIGHTS))


_WRAPPERS = {"filter_amp": eqx_amp.filter_amp, "autocast": eqx_amp.autocast}
_JITS = {"jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit}


def _counting_step(jit):
    traces = []

    def step(model, x):
        traces.append(None)
        return model(x)

    return jit(step), traces


def _computed_in(y) -> str:
    matches = [name for name, ref in _EXPECTED.items() if np.array_equal(y, ref)]
    assert len(matches) == 1, (y, matches)
    return matches[0]


@pytest.mark.parametrize("wrap", _WRAPPERS.values(), ids=_WRAPPERS.keys())
@pytest.mark.parametrize("jit", _JITS.values(), ids=_JITS.keys())
def test_a_step_jitted_before_a_block_is_traced_again_inside_and_after(wrap, jit):
    model = wrap(_model())
    step, traces = _counting_step(jit)
    assert eqx_amp.default_policy() == eqx_amp.get_policy("mixed_bfloat16")
    assert _computed_in(step(model, _X)) == "bfloat16"
    with eqx_amp.using_policy("mixed_float16"):
        assert _computed_in(step(model, _X)) == "float16"
        assert _computed_in(step(model, _X)) == "float16"  # cached under this policy
        with eqx_amp.using_policy("float32"):
            assert _computed_in(step(model, _X)) == "float32"
        assert _computed_in(step(model, _X)) == "float16"
    assert _computed_in(step(model, _X)) == "bfloat16"
    # One trace per policy: leaving a block finds the earlier program again.
    assert len(traces) == 3
    with pytest.raises(RuntimeError, match="inside the block"):
        with eqx_amp.using_policy("mixed_float16"):
            raise RuntimeError("inside the block")
    assert eqx_amp.default_policy() == eqx_amp.get_policy("mixed_bfloat16")
    assert _computed_in(step(model, _X)) == "bfloat16"
    assert len(traces) == 3


def test_an_explicit_policy_and_a_bimodel_ignore_a_later_block():
    explicit = eqx_amp.filter_amp(_model(), policy="mixed_bfloat16")
    bimodel = eqx_amp.BiModel(_model())  # the policy is read here
    step, traces = _counting_step(eqx.filter_jit)
    with eqx_amp.using_policy("mixed_float16"):
        assert _computed_in(step(explicit, _X)) == "bfloat16"
        assert _computed_in(step(bimodel, _X)) == "bfloat16"
        assert eqx_amp.BiModel(_model()).policy == eqx_amp.get_policy("mixed_float16")


def test_using_policy_inside_a_jitted_function_and_as_a_decorator():
    model = eqx_amp.filter_amp(_model())

    @jax.jit
    def scoped(x):
        with eqx_amp.using_policy("mixed_float16"):
            return model(x)

    assert _computed_in(scoped(_X)) == "float16"
    assert _computed_in(model(_X)) == "bfloat16"  # the block ended with the trace

    @eqx_amp.using_policy("float32")
    def decorated(x):
        return model(x)

    assert _computed_in(decorated(_X)) == "float32"
    assert _computed_in(model(_X)) == "bfloat16"


def test_the_scoped_policy_is_per_thread_under_one_jitted_step():
    model = eqx_amp.filter_amp(_model())
    step, _ = _counting_step(eqx.filter_jit)
    both_ready = threading.Barrier(2, timeout=60)
    seen = {}

    def inside():
        with eqx_amp.using_policy("mixed_float16"):
            both_ready.wait()  # the other thread runs while this block is open
            seen["inside"] = _computed_in(step(model, _X))
            both_ready.wait()

    def outside():
        both_ready.wait()
        seen["outside"] = _computed_in(step(model, _X))
        both_ready.wait()

    threads = [threading.Thread(target=f) for f in (inside, outside)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"inside": "float16", "outside": "bfloat16"}


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (None, TypeError, r"`policy` must be a string or an `eqx_amp.Policy`, not "),
        (
            jnp.float16,
            TypeError,
            r"not the dtype float16 \(the policy string .float16.",
        ),
        ("f17", ValueError, r"Unknown policy 'f17'"),
        ("c=int8", ValueError, r"'int8' in policy 'c=int8' is int8, not a real"),
        ("p=f32,p=f16", ValueError, r"Key 'p' is given twice"),
    ],
)
def test_using_policy_refuses_what_is_not_a_policy(bad, error, match):
    with pytest.raises(error, match=match):
        with eqx_amp.using_policy(bad):
            pass
    assert eqx_amp.default_policy() == eqx_amp.get_policy("mixed_bfloat16")


#
# The float16 weight-overflow warning, with the policy from a block.
#


def _huge_weight_model() -> eqx.nn.Linear:
    model = _model()
    return eqx.tree_at(lambda m: m.weight, model, model.weight.at[0, 0].set(1e5))


_OVERFLOW = r"float16, which cannot hold the value of \.weight: it will be inf"


@pytest.mark.parametrize("wrap", _WRAPPERS.values(), ids=_WRAPPERS.keys())
def test_weights_too_large_for_a_scoped_float16_are_warned_about_at_the_call(wrap):
    model = wrap(_huge_weight_model())  # built where bfloat16 holds them
    step, _ = _counting_step(eqx.filter_jit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, _X)  # bfloat16 holds 1e5
    with eqx_amp.using_policy("mixed_float16"):
        with pytest.warns(UserWarning, match=_OVERFLOW) as eager:
            model(_X)
        with pytest.warns(UserWarning, match=_OVERFLOW) as traced:
            step(model, _X)  # the weights are tracers here
    # At the user's line, not inside JAX or eqx_amp.
    assert {w.filename for w in eager} == {__file__}
    assert {w.filename for w in traced} == {__file__}


def test_weights_too_large_warned_once_where_built_inside_the_block():
    with eqx_amp.using_policy("mixed_float16"):
        with pytest.warns(UserWarning, match=_OVERFLOW) as built:
            amp = eqx_amp.filter_amp(_huge_weight_model())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            amp(_X)  # said where it was built
        with pytest.warns(UserWarning, match=r"The compute copy is float16") as bi:
            eqx_amp.BiModel(_huge_weight_model())
    assert {w.filename for w in built} == {__file__}
    assert {w.filename for w in bi} == {__file__}

"""Hostile tests of the warning `filter_amp` gives when less than half of a call's
matmul FLOPs run in the compute dtype.

The matrix: models wrapped by `eqx.filter_vmap` and `eqx.nn.Sequential` (two of each,
checked one after the other, the second one with another coverage; two instances of
one class, the well-cast one first); a model with `eqx.nn.SpectralNorm` and
`eqx.nn.BatchNorm` (the cause is SpectralNorm's float32 state, BatchNorm only passes
on what it is given) and the fix the warning gives, applied; calls traced by
`jax.make_jaxpr`, `eqx.filter_jit` and `jax.vmap`; a call on concrete arrays (not
checked); a function that reads a concrete value (an eager `jax.grad`), which an
abstract trace cannot. Each warning must name the model, point at the user's line
(this file), give the cause and the fix, and give the share that `precision_report`
gives for the same call.
"""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_amp


class _RNN(eqx.Module):
    """Its carry starts as `jnp.zeros(hidden)`, float32 whatever the input."""

    cell: eqx.nn.GRUCell
    carry_in_input_dtype: bool = eqx.field(static=True, default=False)

    def __call__(self, xs, *, key=None):
        del key  # a layer of `eqx.nn.Sequential`
        dtype = xs.dtype if self.carry_in_input_dtype else jnp.float32
        h0 = jnp.zeros(self.cell.hidden_size, dtype)
        return jax.lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)[0]


def _rnn(hidden, carry_in_input_dtype=False):
    cell = eqx.nn.GRUCell(4, hidden, key=jax.random.key(hidden))
    return _RNN(cell, carry_in_input_dtype)


_XS = jnp.ones((3, 5, 4))  # batch, time, features


def _share(message: str) -> float:
    return int(re.search(r"runs only (\d+)%", message).group(1)) / 100


def _trace_warnings(fn, *args) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax.numpy_dtype_promotion("standard"):  # as users run these models
            jax.make_jaxpr(fn)(*args)
    return [w for w in caught if "runs only" in str(w.message)]


def _report(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its own trace warns again
        with jax.numpy_dtype_promotion("standard"):
            return eqx_amp.precision_report(fn, *args)


@pytest.mark.parametrize("wrap", ["filter_vmap", "Sequential"])
def test_every_wrapped_model_is_checked_and_named(wrap):
    if wrap == "filter_vmap":
        name = r"_RNN under `eqx\.filter_vmap`"
        models = [eqx_amp.filter_amp(eqx.filter_vmap(_rnn(h))) for h in (16, 8)]
    else:
        name = r"Sequential\(Lambda, _RNN\)"
        models = [
            jax.vmap(
                eqx_amp.filter_amp(
                    eqx.nn.Sequential([eqx.nn.Lambda(jnp.tanh), _rnn(h)])
                )
            )
            for h in (16, 8)
        ]
    shares = []
    for amp in models:  # the second is checked too, whatever the first did
        (warning,) = _trace_warnings(amp, _XS)
        message = str(warning.message)
        assert re.search(rf"FLOPs of {name} in bfloat16", message), message
        assert warning.filename == __file__
        shares.append(_share(message))
        assert shares[-1] == pytest.approx(
            _report(amp, _XS).low_precision_share, abs=0.01
        )
        # The cause (the carry made by `jnp.zeros` in this file) and its fix.
        assert re.search(
            r"made by `broadcast_in_dim` at .*test_coverage_warning", message
        )
        assert "Cast that array to the compute dtype where it is made" in message
        assert "keep fewer leaves" not in message
    assert shares == [0.2, 0.33]


def test_an_instance_is_checked_after_a_well_cast_one_of_its_class():
    fixed, wide = _rnn(8, carry_in_input_dtype=True), _rnn(8)
    assert _trace_warnings(eqx_amp.filter_amp(fixed), _XS[0]) == []
    (warning,) = _trace_warnings(eqx_amp.filter_amp(wide), _XS[0])
    assert "runs only 33% of the matmul/convolution FLOPs of _RNN" in str(
        warning.message
    )
    # Again in another trace: nothing is remembered between checks.
    assert len(_trace_warnings(eqx_amp.filter_amp(wide), _XS[0])) == 1


def test_the_share_is_the_reports_under_jax_vmap():
    amp = eqx_amp.filter_amp(_rnn(8))
    batched = jax.vmap(amp)
    (warning,) = _trace_warnings(batched, _XS)
    message = str(warning.message)
    assert "(per call, which under `jax.vmap` is one example;" in message
    report = _report(batched, _XS)
    assert _share(message) == pytest.approx(report.low_precision_share, abs=0.01)
    assert warning.filename == __file__  # below jax.vmap's frames: the user's line


class _SpectralBatchNormNet(eqx.Module):
    spectral: eqx.nn.SpectralNorm
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __call__(self, x, state):
        x, state = self.spectral(x, state)
        x, state = self.norm(x, state)
        return self.head(x), state


def _spectral_net():
    key1, key2, key3 = jax.random.split(jax.random.key(0), 3)
    linear = eqx.nn.Linear(8, 8, key=key1)
    return eqx.nn.make_with_state(_SpectralBatchNormNet)(
        eqx.nn.SpectralNorm(linear, "weight", key=key2),
        eqx.nn.BatchNorm(8, "batch", mode="batch"),
        eqx.nn.Linear(8, 32, key=key3),
    )


def test_spectral_norm_is_named_as_the_cause_and_keeping_it_fixes_it():
    model, state = _spectral_net()
    x = jnp.ones((4, 8))

    def batched(amp):
        return jax.vmap(amp, in_axes=(0, None), out_axes=(0, None), axis_name="batch")

    (warning,) = _trace_warnings(batched(eqx_amp.filter_amp(model)), x, state)
    message = str(warning.message)
    assert "of _SpectralBatchNormNet in bfloat16" in message
    assert (
        "`eqx.nn.SpectralNorm` makes its result float32 from its own float32 state"
        in message
    )
    assert "eqx_amp.keep(model, eqx.nn.SpectralNorm)" in message
    assert (
        "keep fewer leaves" not in message and "keep(model, eqx.nn.Batch" not in message
    )
    assert warning.filename == __file__
    # The fix it gives works: no warning, and most FLOPs in bfloat16.
    spec = eqx_amp.keep(model, eqx.nn.SpectralNorm)
    fixed = batched(eqx_amp.filter_amp(model, filter_spec=spec))
    assert _trace_warnings(fixed, x, state) == []
    assert _report(fixed, x, state).low_precision_share > 0.5


def test_concrete_calls_are_not_checked_and_concrete_reads_are_not_an_error():
    amp = eqx_amp.filter_amp(_rnn(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.numpy_dtype_promotion("standard"):
            amp(_XS[0])  # concrete arrays: no second trace, no warning

    class ReadsItsScale(eqx.Module):
        linear: eqx.nn.Linear
        scale: jax.Array

        def __call__(self, x):
            # A Python branch on a weight: fine on concrete weights (an eager
            # `jax.grad` differentiates with respect to `x` only).
            factor = 2.0 if float(self.scale) > 0 else 1.0
            return jnp.sum(self.linear(x)) * factor

    model = ReadsItsScale(eqx.nn.Linear(4, 4, key=jax.random.key(1)), jnp.array(1.0))
    grad = jax.grad(eqx_amp.filter_amp(model, filter_spec=lambda leaf: leaf.ndim > 0))
    assert grad(jnp.ones(4)).dtype == jnp.float32

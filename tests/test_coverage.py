"""Hostile tests of the advice `precision_report` gives when less than half of a
mixed-precision model's matmul FLOPs run in the compute dtype (`report.advice`,
printed at the top of `str(report)`), and of the warning `filter_amp` gives with
it on a model's first traced call, which traces the user's function once.

The matrix: models wrapped by `eqx.filter_vmap` and `eqx.nn.Sequential` (two of each,
the second one with another coverage; two instances of one class, the well-cast one
first); a model with `eqx.nn.SpectralNorm` and `eqx.nn.BatchNorm` (the cause is
SpectralNorm's float32 state, BatchNorm only passes on what it is given) and the
fix the advice gives, applied; reports through `jax.vmap`, `filter_amp`'s decorator
form and `BiModel`; a program that is not mixed precision, and one under `autocast`
(its wide matmuls are its rules' choice). Each advice must name the model, give the
cause and the fix, and give the share the report itself gives.
"""

import functools as ft
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_amp
from eqx_amp.diagnostics import CoverageWarning


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


def _share(advice: str) -> float:
    return int(re.search(r"Only (\d+)%", advice).group(1)) / 100


def _report(fn, *args):
    with jax.numpy_dtype_promotion("standard"):  # as users run these models
        return eqx_amp.precision_report(fn, *args)


@pytest.mark.parametrize("wrap", ["filter_vmap", "Sequential"])
def test_every_wrapped_model_is_named_with_the_cause_and_the_fix(wrap):
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
    for amp in models:  # the second is advised too, whatever the first was
        report = _report(amp, _XS)
        advice = report.advice
        assert re.search(rf"FLOPs of {name} run in bfloat16", advice), advice
        shares.append(_share(advice))
        assert shares[-1] == pytest.approx(report.low_precision_share, abs=0.01)
        # The cause (the carry made by `jnp.zeros` in this file) and its fix.
        assert re.search(r"made by `broadcast_in_dim` at .*test_coverage", advice)
        assert "Cast that array to the compute dtype where it is made" in advice
        assert "keep fewer leaves" not in advice
        # Printed at the top of the table, after the share it explains.
        lines = str(report).splitlines()
        assert lines[0].startswith("matmul/conv FLOPs in low precision: ")
        assert lines[2] == "" and lines[3].startswith("advice: Only ")
        paragraph = lines[3 : lines.index("", 3)]
        assert " ".join(paragraph) == f"advice: {advice}"
    assert shares == [0.2, 0.33]


def test_an_instance_is_advised_after_a_well_cast_one_of_its_class():
    fixed, wide = _rnn(8, carry_in_input_dtype=True), _rnn(8)
    assert _report(eqx_amp.filter_amp(fixed), _XS[0]).advice == ""
    advice = _report(eqx_amp.filter_amp(wide), _XS[0]).advice
    assert "Only 33% of the matmul/convolution FLOPs of _RNN run in bfloat16" in advice
    # The decorator form and `jax.vmap` name the model too; nothing is remembered.
    decorated = eqx_amp.filter_amp(policy="mixed_bfloat16")(wide)
    assert "FLOPs of _RNN run in" in _report(decorated, _XS[0]).advice
    batched = jax.vmap(eqx_amp.filter_amp(wide))
    report = _report(batched, _XS)
    assert _share(report.advice) == pytest.approx(report.low_precision_share, abs=0.01)


def test_a_bimodel_is_advised_by_its_model_name():
    bimodel = eqx_amp.BiModel(_rnn(8))
    advice = _report(bimodel, _XS[0]).advice
    assert "Only 33% of the matmul/convolution FLOPs of _RNN run in bfloat16" in advice


def test_no_advice_where_there_is_nothing_to_fix():
    # Not mixed precision: no half-precision value anywhere.
    assert _report(_rnn(8), _XS[0]).advice == ""
    # Under `autocast` every matmul reads the compute dtype but those its rules keep.
    assert _report(eqx_amp.autocast(_rnn(8)), _XS[0]).advice == ""
    kept = eqx_amp.autocast(_rnn(8), rules={jax.lax.dot_general_p: eqx_amp.FULL})
    report = _report(kept, _XS[0])
    assert report.low_precision_share == 0.0 and report.advice == ""


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

    advice = _report(batched(eqx_amp.filter_amp(model)), x, state).advice
    assert "FLOPs of _SpectralBatchNormNet run in bfloat16" in advice
    assert (
        "`eqx.nn.SpectralNorm` makes its result float32 from its own float32 state"
        in advice
    )
    assert "eqx_amp.keep(model, eqx.nn.SpectralNorm)" in advice
    assert (
        "keep fewer leaves" not in advice and "keep(model, eqx.nn.Batch" not in advice
    )
    # The fix it gives works: no advice, and most FLOPs in bfloat16.
    spec = eqx_amp.keep(model, eqx.nn.SpectralNorm)
    report = _report(batched(eqx_amp.filter_amp(model, filter_spec=spec)), x, state)
    assert report.advice == "" and report.low_precision_share > 0.5


def test_a_call_traces_the_function_once():
    """The check runs on the first traced call of a model class under a policy and
    traces the user's function once there too (to a jaxpr it evaluates): under
    `jit`, concretely, and through `BiModel`."""
    traces = []

    class CountsTraces(eqx.Module):
        rnn: _RNN

        def __call__(self, xs):
            traces.append(None)
            return self.rnn(xs)

    amp = eqx_amp.filter_amp(CountsTraces(_rnn(8)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax.numpy_dtype_promotion("standard"):
            jax.make_jaxpr(amp)(_XS[0])  # checked here
            assert len(traces) == 1
            eqx.filter_jit(amp)(_XS[0])
            assert len(traces) == 2
            amp(_XS[0])  # concrete arrays
            assert len(traces) == 3
            bimodel = eqx_amp.BiModel(CountsTraces(_rnn(8)), policy="mixed_float16")
            eqx.filter_jit(bimodel)(_XS[0])  # checked here
            assert len(traces) == 4
    coverage = [w for w in caught if w.category is CoverageWarning]
    assert [str(w.message)[:40] for w in coverage] == 2 * [
        "Only 33% of the matmul/convolution FLOPs"
    ]


def _generator_loss(generator, key):
    z = jax.random.normal(key, (8,))  # the noise, made in float32 here
    return jnp.mean(generator(z))


def test_a_layer_given_wide_data_is_not_named_as_its_cause():
    """An `eqx.nn.MLP` given float32 noise makes float32 hidden values from it:
    the cause is the noise, made in the loss, not the MLP (whose keeping changes
    nothing), while SpectralNorm, reading its own float32 state, still is."""
    generator = eqx.nn.MLP(8, 16, 64, 2, key=jax.random.key(0))
    amp = eqx_amp.filter_amp(_generator_loss)
    advice = _report(amp, generator, jax.random.key(1)).advice
    assert "Only 0% of the matmul/convolution FLOPs of _generator_loss" in advice
    assert re.search(
        r"first made float32 by `\w+` at \S*test_coverage\.py:\d+ "
        r"\(_generator_loss\)\. Cast that array to the compute dtype where it is made",
        advice,
    ), advice
    assert "keep(model" not in advice and "`eqx.nn.MLP` makes" not in advice


def test_a_model_is_named_through_jit_and_a_lambda():
    """`jax.jit(lambda x: amp(x))` is advised by the model the lambda calls, not
    as `<lambda>`; the compute dtype is that wrapper's policy."""
    amp = eqx_amp.filter_amp(_rnn(8), policy="mixed_float16")
    for jitted in (jax.jit(lambda x: amp(x)), eqx.filter_jit(lambda x: amp(x))):
        advice = _report(jitted, _XS[0]).advice
        assert re.search(
            r"FLOPs of _RNN( under `eqx\.filter_jit`)? run in float16", advice
        ), advice
        assert "<lambda>" not in advice


def test_a_float16_rnn_under_vmap_and_grad_is_advised_on_its_carry():
    """Under `eqx.filter_vmap` and `eqx.filter_grad`, the cause is the carry made
    in float32, not a layer of the RNN (the backward pass is wide where the
    forward pass was; a cast JAX inserts for promotion is not a cause)."""
    model = _rnn(16)

    def loss(model, xs):
        return jnp.mean(eqx.filter_vmap(model)(xs))

    for fn, name in [
        (eqx_amp.filter_amp(eqx.filter_vmap(model), policy="mixed_float16"),
         r"_RNN under `eqx\.filter_vmap`"),
        (eqx.filter_grad(eqx_amp.filter_amp(loss, policy="mixed_float16")),
         r"\S*\.loss under `eqx\.filter_grad`"),
    ]:  # fmt: skip
        args = (_XS,) if name.startswith("_RNN") else (model, _XS)
        advice = _report(fn, *args).advice
        assert re.search(rf"FLOPs of {name} run in float16", advice), advice
        assert "an input or loop carry of `scan` at" in advice
        assert "Cast that array to the compute dtype where it is made" in advice
        assert "custom_vjp_call" not in advice and "keep(model" not in advice


#
# The warning `filter_amp` gives on a model's first traced call.
#


@pytest.fixture(autouse=True)
def _check_every_model_afresh():
    """Each test sees every model class unchecked (the check remembers per process)."""
    eqx_amp.diagnostics.check_coverage(True)
    yield
    eqx_amp.diagnostics.check_coverage(True)


def _coverage_warnings(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax.numpy_dtype_promotion("standard"):
            out = fn(*args)
    return out, [w for w in caught if w.category is CoverageWarning]


def _train_rnn_step(amp_model_of):
    """equinox's `train_rnn` example, small: a jitted value-and-grad of a loss that
    vmaps the model over the batch."""

    def loss(model, xs):
        out = jax.vmap(amp_model_of(model))(xs)  # the user's line
        return jnp.mean(out.astype(jnp.float32))

    line = loss.__code__.co_firstlineno + 1
    return eqx.filter_jit(eqx.filter_value_and_grad(loss)), line


def test_an_rnn_with_a_float32_carry_warns_once_at_the_users_line():
    step, line = _train_rnn_step(eqx_amp.filter_amp)
    model = _rnn(16)
    (loss, grads), caught = _coverage_warnings(step, model, _XS)
    [warning] = caught
    assert (warning.filename, warning.lineno) == (__file__, line)
    # The text `precision_report(...).advice` gives: cause and fix.
    assert str(warning.message) == _report(eqx_amp.filter_amp(model), _XS[0]).advice
    with pytest.warns(
        CoverageWarning,
        match=(
            r"^Only 20% of the matmul/convolution FLOPs of _RNN run in bfloat16 "
            r"\(matmuls on parameters the filter spec keeps are not counted\): the "
            r"rest read a wider operand\. The largest, 80% of them, is `dot_general` "
            r"at \S+_rnn\.py:\d+ \(GRUCell\.__call__\), whose wide operand is float32 "
            r"data .*, an input or loop carry of `scan` at \S+test_coverage\.py:\d+ "
            r"\(_RNN\.__call__\), which enters it as float32 made by "
            r"`broadcast_in_dim` at \S+test_coverage\.py:\d+ \(_RNN\.__call__\)\. "
            r"Cast that array to the compute dtype where it is made or enters "
            r"\(`jnp\.zeros\(n, x\.dtype\)`, `h\.astype\(x\.dtype\)`\), or use "
            r"`eqx_amp\.autocast`, which casts every matmul's operands\. "
            r"`wide_matmuls` lists every such matmul\.$"
        ),
    ):
        eqx_amp.diagnostics.check_coverage(True)  # forgets what it checked
        with jax.numpy_dtype_promotion("standard"):
            _train_rnn_step(eqx_amp.filter_amp)[0](model, _XS)
    # Once per class and policy: another instance, another shape, another step.
    step2, _ = _train_rnn_step(eqx_amp.filter_amp)
    assert _coverage_warnings(step2, _rnn(8), _XS[:, :2])[1] == []
    # Another policy is another check.
    step16, _ = _train_rnn_step(ft.partial(eqx_amp.filter_amp, policy="mixed_float16"))
    [warning] = _coverage_warnings(step16, model, _XS)[1]
    assert "FLOPs of _RNN run in float16" in str(warning.message)
    # The checked call computes what the plain call does, gradients included.
    eqx_amp.diagnostics.check_coverage(False)
    step_plain, _ = _train_rnn_step(eqx_amp.filter_amp)
    (loss_plain, grads_plain), caught = _coverage_warnings(step_plain, model, _XS)
    assert caught == [] and loss == loss_plain
    assert eqx.tree_equal(grads, grads_plain)


class _Stateful(eqx.Module):
    """equinox's `stateful` example, small: SpectralNorm's power iteration runs on
    its float32 state."""

    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    spectral: eqx.nn.SpectralNorm
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.linear1 = eqx.nn.Linear(3, 32, key=k1)
        self.norm = eqx.nn.BatchNorm(32, axis_name="batch", mode="batch")
        self.spectral = eqx.nn.SpectralNorm(
            eqx.nn.Linear(32, 32, key=k2), "weight", key=k3
        )
        self.linear2 = eqx.nn.Linear(32, 3, key=k4)

    def __call__(self, x, state):
        x = self.linear1(x)
        x, state = self.norm(x, state)
        x = jax.nn.relu(x)
        x, state = self.spectral(x, state)
        return self.linear2(jax.nn.relu(x)), state


def test_spectral_norm_warns_with_the_layer_to_keep():
    model, state = eqx.nn.make_with_state(_Stateful)(jax.random.key(0))
    xs = jnp.ones((4, 3))

    @eqx.filter_jit
    def step(model, state, xs):
        amp = eqx_amp.filter_amp(model)
        batched = jax.vmap(amp, (0, None), (0, None), axis_name="batch")
        out, state = batched(xs, state)  # the user's line
        return jnp.mean(out), state

    line = step.__wrapped__.__code__.co_firstlineno + 4
    _, caught = _coverage_warnings(step, model, state, xs)
    [warning] = caught
    assert (warning.filename, warning.lineno) == (__file__, line)
    message = str(warning.message)
    # The first layer reads the cast input; what BatchNorm hands on is float32.
    assert message.startswith("Only 2% of the matmul/convolution FLOPs of _Stateful")
    assert (
        "`eqx.nn.SpectralNorm` makes its result float32 from its own float32 state "
        "or parameters: keep it in the parameter dtype, where it then runs by choice "
        "(`filter_spec=eqx_amp.keep(model, eqx.nn.SpectralNorm)`)"
    ) in message


def test_no_warning_for_a_model_that_runs_in_half_precision():
    mlp = eqx.nn.MLP(4, 4, 32, 2, key=jax.random.key(0))
    fixed = _rnn(8, carry_in_input_dtype=True)
    for model, xs in [(mlp, _XS[:, 0]), (fixed, _XS)]:
        out, caught = _coverage_warnings(
            eqx.filter_jit(jax.vmap(eqx_amp.filter_amp(model))), xs
        )
        assert caught == [] and out.dtype == jnp.float32
    # Under `precision_report`, which gives the advice itself: no warning either.
    assert _coverage_warnings(_report, eqx_amp.filter_amp(_rnn(8)), _XS[0])[1] == []


def test_the_warning_is_silenced_by_its_category_or_the_switch():
    step, _ = _train_rnn_step(eqx_amp.filter_amp)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # what is not ignored
        warnings.filterwarnings("ignore", category=CoverageWarning)
        with jax.numpy_dtype_promotion("standard"):
            step(_rnn(16), _XS)
    eqx_amp.diagnostics.check_coverage(False)
    step, _ = _train_rnn_step(eqx_amp.filter_amp)
    assert _coverage_warnings(step, _rnn(16), _XS)[1] == []

"""`eqx_amp.diagnostics.telemetry`: per-layer statistics inside the training step,
checked against float32 references on injected values, by role and layer name, in
scan-stacked blocks and on 8 devices, and leaving the step's own program alone."""

import pathlib
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp
from eqx_amp.diagnostics import telemetry

from .helpers import run_script_on_eight_devices, scanned_linears


F16 = eqx_amp.get_policy("p=f32,c=f16,o=f32")
BF16 = eqx_amp.get_policy("mixed_bfloat16")


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _step(model, x):
    (loss, grads), _, _ = eqx_amp.filter_value_and_grad(_loss)(
        model, x, loss_scale=eqx_amp.StaticLossScale(jnp.float32(1024.0))
    )
    return loss, grads


def _row(tel, layer, role, dtype="float16", at_cast=None):
    found = [
        t
        for t in tel.tensors
        if t.layer == layer
        and t.role == role
        and t.dtype == dtype
        and (at_cast is None or t.at_cast == at_cast)
    ]
    assert found, f"no {role} of {layer} in {[(t.layer, t.role) for t in tel.tensors]}"
    return found[0]


@pytest.mark.filterwarnings("ignore:`filter_amp` casts the weights")
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_cast_statistics_match_a_float32_reference():
    # Zeros, float16 subnormals, values that flush, values past float16's largest
    # finite value, NaN and inf, in a weight cast to float16.
    special = np.array(
        [0.0, 1e-6, -3e-7, 1e-9, 7e4, -1e5, np.nan, np.inf, 0.5, 2.0], np.float32
    )
    weight = np.tile(special, 16 * 16 // len(special) + 1)[: 16 * 16].reshape(16, 16)
    model = eqx.tree_at(
        lambda m: m.weight,
        eqx.nn.Linear(16, 16, use_bias=False, key=jr.key(0)),
        jnp.asarray(weight),
    )
    amp = eqx_amp.filter_amp(model, policy=F16)
    _, tel = jax.jit(telemetry(lambda m, x: jax.vmap(m)(x)))(amp, jnp.ones((4, 16)))
    stats = _row(tel, "m", "weight", at_cast=True)

    half = weight.astype(np.float16).astype(np.float32)
    finite = np.isfinite(weight)
    tiny = np.finfo(np.float16).smallest_normal
    n = weight.size
    np.testing.assert_allclose(stats.size, n)
    # Smaller than the sample: every fraction is exact. amax is NaN: it holds a NaN.
    np.testing.assert_allclose(stats.sample, n)
    assert np.isnan(stats.amax)
    np.testing.assert_allclose(
        stats.underflow, np.sum(finite & (weight != 0) & (half == 0)) / n
    )
    np.testing.assert_allclose(
        stats.subnormal, np.sum((np.abs(half) > 0) & (np.abs(half) < tiny)) / n
    )
    np.testing.assert_allclose(
        stats.overflow, np.sum(finite & (np.abs(weight) > 65504)) / n
    )
    np.testing.assert_allclose(stats.nonfinite, np.sum(~np.isfinite(half)) / n)
    assert stats.scale is None


@pytest.mark.filterwarnings("ignore:`filter_amp` casts the weights")
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def _large_weight():
    # 256 x 512 values. Columns 0-63 (1/8) hold float16 subnormals, column 100
    # values that flush; one value in the whole tensor is past float16's range and
    # one is inf.
    rows, cols = 256, 512
    weight = np.full((rows, cols), 0.5, np.float32)
    weight[:, :64] = 1e-6
    weight[:, 100] = 1e-9
    weight[7, 3] = 1e5
    weight[9, 5] = np.inf
    return weight


def test_accelerators_count_every_value_in_one_pass():
    """The form a GPU or TPU runs: every value counted, exactly, in one variadic
    reduction (a CPU counts a sample; the choice is made as the program is lowered,
    so this calls the accelerators' form directly)."""
    from eqx_amp._diagnostics._statistics import _counted_whole, _magnitude_bits

    weight = _large_weight()
    magnitude = _magnitude_bits(jnp.asarray(weight))
    largest, counted, counts = jax.jit(
        lambda m: _counted_whole(m, jnp.float16, at_cast=True, fp8_scaled=False)
    )(magnitude)
    subnormal, nonfinite, flushed, saturated = (float(c) for c in counts)
    rows = weight.shape[0]
    assert counted == weight.size and largest == np.float32(np.inf).view(np.int32)
    assert (subnormal, flushed) == (64 * rows - 2, rows)
    assert (nonfinite, saturated) == (2, 1)  # inf, and 1e5 past float16's range


def test_large_tensors_sampled_fractions_exact_flags():
    # On a CPU: 256 x 512 values, 32 times the sample: the sample has 4096 values at a
    # stride coprime with the row length (33), so it visits every column 8 times
    # (+-1).
    weight = _large_weight()
    rows, cols = weight.shape
    model = eqx.tree_at(
        lambda m: m.weight,
        eqx.nn.Linear(cols, rows, use_bias=False, key=jr.key(0)),
        jnp.asarray(weight),
    )
    amp = eqx_amp.filter_amp(model, policy=F16)
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(amp, jnp.ones(cols))
    stats = _row(tel, "m", "weight", at_cast=True)
    n = weight.size
    assert float(stats.size) == n and 3000 <= float(stats.sample) <= 4096
    # Each column's share of the sample is off by at most one value: 1/8 of the
    # columns is off by at most 64 values, one column by at most one.
    np.testing.assert_allclose(stats.subnormal, 1 / 8, atol=64 / float(stats.sample))
    np.testing.assert_allclose(stats.underflow, 1 / cols, atol=1 / float(stats.sample))
    # The flags are exact: one overflow and one inf, missed or not by the sample.
    assert float(stats.overflow) >= 1 / n and float(stats.nonfinite) >= 1 / n
    assert float(stats.amax) == np.inf


def test_values_without_specials_have_exact_flags():
    model = eqx.nn.Linear(64, 64, key=jr.key(0))
    amp = eqx_amp.filter_amp(model, policy=F16)
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(amp, jnp.ones(64))
    stats = _row(tel, "m", "weight", at_cast=True)
    assert float(stats.overflow) == 0.0 and float(stats.nonfinite) == 0.0
    np.testing.assert_allclose(stats.amax, jnp.max(jnp.abs(model.weight)))


@pytest.mark.parametrize("wrap", ["filter_amp", "autocast", "bimodel"])
def test_roles_and_layer_names(wrap):
    model = eqx.nn.MLP(16, 4, 32, 2, key=jr.key(0))
    amp = {
        "filter_amp": lambda: eqx_amp.filter_amp(model, policy=F16),
        "autocast": lambda: eqx_amp.autocast(model, policy=F16),
        "bimodel": lambda: eqx_amp.BiModel(model, policy=F16),
    }[wrap]()
    x = jr.normal(jr.key(1), (8, 16))
    (loss, _), tel = eqx.filter_jit(telemetry(_step))(amp, x)
    assert loss == eqx.filter_jit(_step)(amp, x)[0]
    found = {(t.layer, t.role) for t in tel.tensors}
    for i in range(3):
        for role in ("weight", "activation", "output gradient", "parameter gradient"):
            assert (f"model.layers[{i}]", role) in found, (i, role, found)
    # The largest magnitude of layer 0's weight (a BiModel holds it in float16).
    weight = _row(tel, "model.layers[0]", "weight")
    reference = jnp.max(jnp.abs(model.layers[0].weight))
    np.testing.assert_allclose(weight.amax, reference, rtol=1e-3)


def test_fp8_records_the_scale_and_the_unscaled_amax():
    model = eqx.nn.Linear(32, 32, key=jr.key(0))
    amp = eqx_amp.filter_amp(model, policy=F16, fp8=eqx_amp.fp8.TENSORWISE)
    _, tel = eqx.filter_jit(telemetry(_step))(amp, jr.normal(jr.key(1), (16, 32)))
    weight = _row(tel, "model", "weight", "float8_e4m3fn")
    amax = jnp.max(jnp.abs(model.weight.astype(jnp.float16).astype(jnp.float32)))
    np.testing.assert_allclose(weight.amax, amax, rtol=1e-6)
    # The largest power of two that maps the amax into e4m3's range.
    np.testing.assert_allclose(weight.scale, 2.0 ** np.floor(np.log2(448.0 / amax)))
    grad = _row(tel, "model", "output gradient", "float8_e5m2")
    assert grad.scale is not None and float(grad.overflow) == 0.0


@pytest.mark.filterwarnings("ignore:`filter_amp` casts the weights")
def test_a_tensor_of_nans_has_a_nan_amax_and_no_overflow():
    model = eqx.nn.Linear(8, 8, use_bias=False, key=jr.key(0))
    model = eqx.tree_at(lambda m: m.weight, model, jnp.full((8, 8), jnp.nan))
    amp = eqx_amp.filter_amp(model, policy=F16)
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(amp, jnp.ones(8))
    stats = _row(tel, "m", "weight", at_cast=True)
    # Not the max reduction's initial value (-inf), and NaN is not an overflow.
    assert np.isnan(stats.amax)
    assert float(stats.nonfinite) == 1.0 and float(stats.overflow) == 0.0


def _unscaled_fp8(compute_dtype, original_dtypes, *invals, **params):
    return [v.astype(jnp.float8_e4m3fn).astype(compute_dtype) for v in invals], params


def test_a_gradient_cast_twice_is_measured_at_both_casts():
    # Without scales, the backward pass casts the gradient of each fp8 cast to fp8,
    # and then to bfloat16: both casts are the same layer's output gradient.
    model = eqx.nn.MLP(16, 16, 16, 2, key=jr.key(0))
    rules = {jax.lax.dot_general_p: _unscaled_fp8}
    amp = eqx_amp.autocast(model, policy="mixed_bfloat16", rules=rules)
    _, tel = eqx.filter_jit(telemetry(_step))(amp, jr.normal(jr.key(1), (8, 16)))
    dtypes = {
        t.dtype
        for t in tel.tensors
        if t.layer == "model.layers[0]" and t.role == "output gradient" and t.at_cast
    }
    assert dtypes == {"float8_e4m3fn", "bfloat16"}


def test_fp8_convolution_gradients_are_measured_unscaled():
    # The backward fp8 convolutions multiply bfloat16 copies of the scaled fp8
    # values: their outputs are still scaled, and measured only once unscaled.
    conv = eqx.nn.Conv2d(16, 16, 3, padding=1, key=jr.key(0))
    rules = {jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE}
    amp = eqx_amp.autocast(conv, policy="mixed_bfloat16", rules=rules)
    x = jr.normal(jr.key(1), (2, 16, 8, 8))
    (_, grads), tel = eqx.filter_jit(telemetry(_step))(amp, x)
    grad = [t for t in tel.tensors if t.role == "parameter gradient"]
    assert grad and all(t.at_cast for t in grad)
    reference = 1024.0 * jnp.max(jnp.abs(grads.fn.weight))  # `_step`'s loss scale
    np.testing.assert_allclose(grad[0].amax, reference, rtol=1e-2)


def test_scan_stacked_blocks_have_one_entry_per_iteration():
    model = scanned_linears(3, 16)
    amp = eqx_amp.autocast(model, policy=F16)
    _, tel = eqx.filter_jit(telemetry(_step))(amp, jr.normal(jr.key(1), (8, 16)))
    weight = _row(tel, "model.blocks[{0}]", "weight", at_cast=True)
    assert weight.amax.shape == (3,)
    reference = jnp.max(jnp.abs(model.blocks.weight), axis=(1, 2))
    np.testing.assert_allclose(weight.amax, reference)
    names = {r.layer for r in tel.rows()}
    assert {"model.blocks[0]", "model.blocks[1]", "model.blocks[2]"} <= names
    assert "model.blocks[2]" in tel.summary(top=50)


def test_turning_it_off_compiles_todays_program():
    amp = eqx_amp.filter_amp(eqx.nn.MLP(16, 4, 32, 2, key=jr.key(0)), policy=F16)
    x = jnp.ones((8, 16))
    step = eqx.filter_jit(_step)
    before = step.lower(amp, x).as_text()
    eqx.filter_jit(telemetry(_step))(amp, x)
    assert step.lower(amp, x).as_text() == before


def test_bad_inputs():
    with pytest.raises(TypeError, match="`telemetry` takes a callable"):
        telemetry(3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="reads the parameters from `step`'s first"):
        telemetry(lambda: 1.0)()
    model = eqx.nn.Linear(4, 4, key=jr.key(0))
    amp = eqx_amp.filter_amp(model, policy=F16)
    _, tel = telemetry(lambda m, x: m(x))(amp, jnp.ones(4))
    with pytest.raises(ValueError, match="`top` must be a positive int"):
        tel.summary(top=0)

    @jax.jit
    def read_inside(x):
        _, t = telemetry(lambda m, x: m(x))(amp, x)
        return t.rows()

    with pytest.raises(TypeError, match="read concrete values"):
        read_inside(jnp.ones(4))


_EIGHT_DEVICES = """
import warnings

import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import eqx_amp
warnings.simplefilter("ignore")
policy = eqx_amp.get_policy("p=f32,c=f16,o=f32")
x = jr.normal(jr.key(1), (64, 512)) * jnp.arange(64.0)[:, None]
mesh = Mesh(np.array(jax.devices()), ("data",))
# One value past float16's range, which the sample (stride 33) misses.
linear = eqx.nn.Linear(512, 256, key=jr.key(0))
linear = eqx.tree_at(lambda m: m.weight, linear, linear.weight.at[7, 3].set(1e5))

def forward(m, x):
    return jax.shard_map(
        lambda x: jax.vmap(m)(x), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )(x)

report = {"reference": float(jnp.max(jnp.abs(x)))}
for wrap in (eqx_amp.filter_amp, eqx_amp.autocast):
    model = wrap(linear, policy=policy)
    _, tel = jax.jit(eqx_amp.diagnostics.telemetry(forward))(model, x)
    stats = {t.role: t for t in tel.tensors if t.at_cast}
    report[wrap.__name__] = {
        role: {k: float(getattr(t, k)) for k in ("amax", "size", "overflow")}
        for role, t in stats.items()
    }
# MXFP8 products under `shard_map` (its quantiser's constants are `pvary`'d
# literals, which once crashed the pass), typed and not.
for check_vma in (True, False):
    def forward(m, x, check_vma=check_vma):
        return jax.shard_map(
            lambda x: jax.vmap(m)(x), mesh=mesh, in_specs=P("data"),
            out_specs=P("data"), check_vma=check_vma,
        )(x)
    model = eqx_amp.filter_amp(linear, fp8=eqx_amp.fp8.MXFP8)
    _, tel = jax.jit(eqx_amp.diagnostics.telemetry(forward))(model, x)
    report[f"mxfp8 check_vma={check_vma}"] = {
        t.role: {"scaling": t.scaling, "size": float(t.size), "amax": float(t.amax),
                 "overflow": float(t.overflow)}
        for t in tel.tensors if t.scaling is not None
    }
"""


@pytest.mark.slow
def test_eight_devices_give_global_values():
    # The weight is replicated: every device casts the same 256 x 512 + 256 values,
    # one tensor, counted once (its one overflowing value is 1/size of it); the
    # activations are 64 x 512 values, an eighth on each device.
    report = run_script_on_eight_devices(_EIGHT_DEVICES)
    weight_size = 256 * 512 + 256
    for wrap in ("filter_amp", "autocast"):
        weight, activation = report[wrap]["weight"], report[wrap]["activation"]
        assert weight["size"] == weight_size, wrap
        assert weight["overflow"] == np.float32(1 / np.float32(weight_size)), wrap
        assert weight["amax"] == 1e5
        assert activation["size"] == 64 * 512
        np.testing.assert_allclose(activation["amax"], report["reference"])
    # MXFP8: the replicated weight is counted once where `shard_map` types it (every
    # device's copy without the types), its outlier saturates nothing (its block's
    # scale holds it), and the activations' amax is the global one (of bfloat16
    # values).
    for check_vma, copies in ((True, 1), (False, 8)):
        mx = report[f"mxfp8 check_vma={check_vma}"]
        assert {t["scaling"] for t in mx.values()} == {"mxfp8"}
        assert mx["weight"]["size"] == copies * 256 * 512
        assert mx["weight"]["overflow"] == 0 and mx["weight"]["amax"] > 9.9e4
        assert mx["activation"]["size"] == 64 * 512
        np.testing.assert_allclose(mx["activation"]["amax"], report["reference"], 1e-2)


def test_products_inside_a_while_loop_are_said_to_be_unmeasured():
    """`redo_on_nan > 0` runs the whole gradient inside one `lax.while_loop`, which
    telemetry does not measure: a warning says so, rather than an empty table."""
    model = eqx.nn.Linear(32, 32, key=jr.key(0))
    amp = eqx_amp.filter_amp(model, policy=F16)

    def retrying_step(model, x):
        (loss, grads), _, _ = eqx_amp.filter_value_and_grad(_loss, redo_on_nan=2)(
            model, x, loss_scale=eqx_amp.DynamicLossScale(jnp.float32(1024.0))
        )
        return loss, grads

    eqx_amp._core._wrapper.warn_once.cache_clear()  # said once per process
    with pytest.warns(UserWarning, match=r"does not measure inside `lax.while_loop`"):
        _, tel = eqx.filter_jit(telemetry(retrying_step))(amp, jnp.ones((16, 32)))
    assert not [t for t in tel.tensors if t.layer == "model"]
    # Without retries the same step is measured, and nothing is said.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, tel = eqx.filter_jit(telemetry(_step))(amp, jnp.ones((16, 32)))
    assert _row(tel, "model", "weight")


def _linear(weight):
    """A float16 `filter_amp` linear layer without bias, holding `weight`."""
    weight = np.asarray(weight, np.float32)
    linear = eqx.nn.Linear(
        weight.shape[1], weight.shape[0], use_bias=False, key=jr.key(0)
    )
    linear = eqx.tree_at(lambda m: m.weight, linear, jnp.asarray(weight))
    return eqx_amp.filter_amp(linear, policy=F16)


def test_steps_stacked_by_a_scan_are_read_per_step():
    # Eight steps (as many as the fields of a packed row), the activation of step t
    # all t + 1.
    amp = _linear(np.full((4, 4), 0.5))
    xs = jnp.arange(1.0, 9.0)[:, None] * jnp.ones((8, 4))

    def run(model, xs):
        def one(carry, x):
            return carry, telemetry(lambda m, x: m(x))(model, x)[1]

        return jax.lax.scan(one, 0.0, xs)[1]

    tel = jax.jit(run)(amp, xs)
    assert tel.leading_shape == (8,)
    activation = _row(tel, "m", "activation")
    np.testing.assert_array_equal(activation.amax, np.arange(1.0, 9.0))
    np.testing.assert_array_equal(activation.size, np.full(8, 4.0))
    np.testing.assert_array_equal(_row(tel, "m", "weight").amax, np.full(8, 0.5))
    third = tel[2]
    assert third.leading_shape == ()
    assert _row(third, "m", "activation").amax == 3.0
    assert {(r.role, r.amax) for r in tel[-1].rows()} == {
        ("weight", 0.5),
        ("activation", 8.0),
    }
    with pytest.raises(ValueError, match=r"leading axes of shape \(8,\) .* `tel"):
        tel.rows()
    with pytest.raises(ValueError, match=r"leading axes of shape \(8,\)"):
        tel.summary()
    with pytest.raises(IndexError, match=r"an int or a slice per leading axis"):
        tel[0, 0]
    with pytest.raises(IndexError, match=r"leading axes of shape \(\)"):
        third[0]


def test_vmapped_steps_are_read_per_example():
    amp = _linear(np.full((4, 4), 0.5))
    xs = jnp.array([[1.0, -3.0, 0.0, 0.0], [0.25, 0.0, 0.0, 0.0], [7.0, 0, 0, 0]])
    step = jax.vmap(telemetry(lambda m, x: m(x)), in_axes=(None, 0))
    _, tel = jax.jit(step)(amp, xs)
    assert tel.leading_shape == (3,)
    np.testing.assert_array_equal(_row(tel, "m", "activation").amax, [3.0, 0.25, 7.0])
    assert _row(tel[1], "m", "activation").amax == 0.25


class _EncoderDecoder(eqx.Module):
    enc: eqx.nn.Linear
    dec: eqx.nn.Linear

    def __call__(self, x):
        def body(h, blocks):
            enc, dec = blocks
            return dec(jnp.tanh(enc(h))), None

        return jax.lax.scan(body, x, (self.enc, self.dec))[0]


class _Block(eqx.Module):
    attn: eqx.nn.Linear
    mlp: eqx.nn.Linear


class _Blocks(eqx.Module):
    blocks: _Block

    def __call__(self, x):
        def body(h, block):
            return block.mlp(jnp.tanh(block.attn(h))), None

        return jax.lax.scan(body, x, self.blocks)[0]


def test_a_scan_over_two_stacks_names_each_stack():
    keys = jr.split(jr.key(0), 3)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))
    model = _EncoderDecoder(stack(keys), stack(jr.split(jr.key(1), 3)))
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(
        eqx_amp.autocast(model, policy=F16), jnp.ones(8)
    )
    assert {t.layer for t in tel.tensors} == {"m.enc[{0}]", "m.dec[{0}]"}
    assert {r.layer for r in tel.rows()} == {
        f"m.{s}[{i}]" for s in ("enc", "dec") for i in range(3)
    }
    weight = _row(tel, "m.dec[{0}]", "weight", at_cast=True)
    reference = jnp.max(jnp.abs(model.dec.weight), axis=(1, 2))
    np.testing.assert_array_equal(weight.amax, reference)
    # One stack of blocks of two layers: the index goes after the stack.
    blocks = eqx.filter_vmap(
        lambda k: _Block(
            eqx.nn.Linear(8, 8, key=k), eqx.nn.Linear(8, 8, key=jr.fold_in(k, 1))
        )
    )(keys)
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(
        eqx_amp.autocast(_Blocks(blocks), policy=F16), jnp.ones(8)
    )
    assert {t.layer for t in tel.tensors} == {"m.blocks[{0}].attn", "m.blocks[{0}].mlp"}


@pytest.mark.filterwarnings("ignore:`filter_amp` casts the weights")
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_an_inf_is_not_an_overflow():
    weight = np.full((8, 8), 0.5, np.float32)
    weight[2, 3] = np.inf
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(_linear(weight), jnp.ones(8))
    stats = _row(tel, "m", "weight", at_cast=True)
    assert float(stats.overflow) == 0.0
    assert float(stats.nonfinite) == np.float32(1 / 64)
    assert float(stats.amax) == np.inf
    # An inf and a value past float16's range that the sample (stride 33) misses:
    # the overflow is still known, exactly one value of the tensor.
    weight = np.full((256, 512), 0.5, np.float32)
    weight[9, 5] = np.inf
    weight[7, 3] = 1e5
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(_linear(weight), jnp.ones(512))
    stats = _row(tel, "m", "weight", at_cast=True)
    assert float(stats.overflow) == np.float32(1 / np.float32(weight.size))


def test_float32_subnormals_have_their_amax():
    # 1e-40 is a float32 subnormal, which the CPU's float max reads as zero.
    _, tel = jax.jit(telemetry(lambda m, x: m(x)))(
        _linear(np.full((8, 8), 1e-40)), jnp.ones(8)
    )
    stats = _row(tel, "m", "weight", at_cast=True)
    assert float(stats.amax) == np.float32(1e-40)
    assert float(stats.underflow) == 1.0 and float(stats.subnormal) == 0.0


def _words(text):
    return " ".join(text.replace("`", "").split())


def test_the_api_reference_promises_what_the_guide_does():
    """`TensorStats`' docstring (the API reference) and the debugging guide state
    the same contract, which the tests above check."""
    guide = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "debugging.md"
    guide_text = _words(guide.read_text())
    api = _words(eqx_amp.diagnostics.TensorStats.__doc__ or "")
    for promise in (
        "amax is exact",
        "float32 subnormals included",
        "NaN when the tensor holds a NaN",
        "an inf or NaN is not an overflow",
        "at least one value's share",
        "counted in every value of the tensor",
        "at most 4096 values per tensor",
    ):
        assert promise in api and promise in guide_text, promise
    assert "NaN ignored" not in api


class _Checkpointed(eqx.Module):
    mlp: eqx.nn.MLP
    remat: str = eqx.field(static=True)

    def __call__(self, x):
        if self.remat == "filter_checkpoint":
            return eqx.filter_checkpoint(lambda m, x: jax.vmap(m)(x))(self.mlp, x)
        params, static = eqx.partition(self.mlp, eqx.is_array)

        def run(params, x):
            return jax.vmap(eqx.combine(params, static))(x)

        if self.remat == "checkpoint":
            run = jax.checkpoint(run)
        elif self.remat == "dots_saveable":
            run = jax.checkpoint(run, policy=jax.checkpoint_policies.dots_saveable)
        return run(params, x)


def _batch_step(model, x):
    (loss, grads), _, _ = eqx_amp.filter_value_and_grad(
        lambda model, x: jnp.mean(model(x) ** 2)
    )(model, x, loss_scale=eqx_amp.StaticLossScale(jnp.float32(1024.0)))
    return loss, grads


def _by_row(tel):
    return {(t.layer, t.role, t.dtype, t.at_cast): t for t in tel.tensors}


@pytest.mark.parametrize("remat", ["checkpoint", "dots_saveable", "filter_checkpoint"])
@pytest.mark.parametrize("wrap", ["autocast", "filter_amp"])
def test_a_checkpointed_forward_recomputed_in_the_backward_is_measured_once(
    wrap, remat
):
    # `jax.checkpoint` runs the forward pass again inside the backward pass: its
    # casts (the activation, 16 x 16, cast again) are not output gradients, and the
    # backward products reading the recomputed activations are the layers'
    # parameter gradients. Layer 0 reads the step's input itself; the ReLUs'
    # jaxpr is one body shared by both calls.
    mlp = eqx.nn.MLP(16, 8, 16, 2, key=jr.key(0))
    x = jr.normal(jr.key(1), (16, 16))

    def measure(remat):
        amp = getattr(eqx_amp, wrap)(_Checkpointed(mlp, remat), policy=BF16)
        return _by_row(eqx.filter_jit(telemetry(_batch_step))(amp, x)[1])

    plain, checkpointed = measure("none"), measure(remat)
    assert set(checkpointed) == set(plain)
    roles = {(layer, role) for layer, role, _, _ in plain}
    for i in range(3):
        for role in ("weight", "activation", "output gradient", "parameter gradient"):
            assert (f"model.mlp.layers[{i}]", role) in roles
    out = "model.mlp.layers[2]"
    assert float(checkpointed[(out, "output gradient", "bfloat16", True)].size) == (
        16 * 8
    )
    assert float(checkpointed[(out, "parameter gradient", "bfloat16", False)].size) == (
        8 * 16
    )
    for key, stats in plain.items():
        for field in ("size", "sample", "amax", "underflow", "subnormal", "overflow"):
            np.testing.assert_allclose(
                getattr(checkpointed[key], field), getattr(stats, field), err_msg=key
            )


@pytest.mark.parametrize(
    "dtype", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
)
def test_what_a_cast_makes_is_read_from_the_values_before_it(dtype):
    """At a cast the counts are read from the values before it (one pass over one
    tensor): they must be what the cast makes, at every boundary, ties included."""
    from eqx_amp._diagnostics._statistics import _held, _magnitude_bits

    finfo = jnp.finfo(dtype)
    tiny, smallest, largest = (
        float(finfo.smallest_subnormal),
        float(finfo.smallest_normal),
        float(finfo.max),
    )
    edges = [tiny / 2, tiny, smallest - tiny / 2, smallest, largest]
    edges += [float(np.nextafter(np.float32(largest), np.float32(np.inf)))]
    # Halfway past the largest: inf for float16 and e5m2 (ties to even, their
    # largest is odd), the largest for e4m3fn (448 is even; only past it is NaN).
    step = largest - float(
        np.nextafter(np.asarray(largest, dtype), np.asarray(0, dtype))
    )
    edges += [largest + step / 2]
    below = [float(np.nextafter(np.float32(e), np.float32(0))) for e in edges]
    above = [float(np.nextafter(np.float32(e), np.float32(np.inf))) for e in edges]
    values = np.array(
        [0.0, 1e-45, 3e-39, 1.0, 1e30, np.inf, np.nan, *edges, *below, *above]
        + list(np.random.default_rng(0).lognormal(0, 30, 2000)),
        np.float32,
    )
    values = np.concatenate([values, -values])
    cast = np.asarray(jnp.asarray(values).astype(dtype)).astype(np.float32)
    held = np.abs(cast)
    subnormal, nonfinite, flushed, saturated = (
        np.asarray(m) for m in _held(_magnitude_bits(jnp.asarray(values)), dtype, True)
    )
    finite = np.isfinite(values)
    np.testing.assert_array_equal(subnormal, (held > 0) & (held < smallest))
    np.testing.assert_array_equal(nonfinite, ~np.isfinite(held))
    np.testing.assert_array_equal(flushed, finite & (values != 0) & (held == 0))
    np.testing.assert_array_equal(saturated, finite & (np.abs(values) > largest))


def _mxfp8_flushed(x: np.ndarray, axis: int) -> int:
    """How many nonzero values of `x` (float32) MXFP8 flushes to zero when quantised
    in blocks of 32 along `axis`: each block's scale is its amax over 448 rounded up
    to a power of two."""
    import ml_dtypes

    blocks = np.moveaxis(x, axis, -1).reshape(-1, 32)
    amax = np.max(np.abs(blocks), axis=1, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    quantised = (blocks / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return int(np.sum((quantised == 0) & (blocks != 0)))


@pytest.mark.filterwarnings("ignore:`filter_amp` casts the weights")
def test_mxfp8_counts_what_each_block_flushes():
    # One outlier among normal values: its block's scale flushes that block's small
    # values and no other block's. The activation (32 tokens x 64 features) is
    # quantised along the features for the forward product and along the tokens
    # for the weight gradient's: both casts are counted, every value (no sample).
    x = np.asarray(jr.normal(jr.key(1), (32, 64)), np.float32) * 0.05
    x[5, 40] = 3e4
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    model = eqx.nn.Linear(64, 32, key=jr.key(0))

    def activation(fp8):
        amp = eqx_amp.filter_amp(model, policy=BF16, fp8=fp8)
        _, tel = eqx.filter_jit(telemetry(_step))(amp, jnp.asarray(x))
        return _row(tel, "model", "activation", "float8_e4m3fn"), tel

    stats, tel = activation(eqx_amp.fp8.MXFP8)
    assert stats.scaling == "mxfp8" and float(stats.size) == 2 * x.size
    np.testing.assert_allclose(stats.sample, stats.size)
    flushed = _mxfp8_flushed(x, axis=1) + _mxfp8_flushed(x, axis=0)
    assert 0 < flushed < 64  # the outlier's row block and column block only
    np.testing.assert_allclose(stats.underflow, flushed / (2 * x.size))
    np.testing.assert_allclose(stats.amax, 3e4, rtol=1e-2)
    # The smallest block factor: the outlier's block, 2**-7 (3e4 / 448 -> 2**7).
    np.testing.assert_allclose(stats.scale, 2.0**-7)
    # One scale for the whole tensor flushes most values instead.
    tensorwise, _ = activation(eqx_amp.fp8.TENSORWISE)
    assert tensorwise.scaling == "tensorwise"
    assert float(tensorwise.underflow) > 20 * float(stats.underflow)
    # The block-scaled GEMM's output is the unscaled parameter gradient: measured
    # as it arrives, as a bfloat16 product's is.
    grad = _row(tel, "model", "parameter gradient", "bfloat16", at_cast=False)
    assert float(grad.size) == model.weight.size and grad.scaling is None
    assert "float8_e4m3fn (mxfp8)" in tel.summary(top=50)


# Rowwise and MXFP8 in the slow tier: the fast one measures MXFP8 casts in the
# checkpointed and scanned cases below.
@pytest.mark.filterwarnings("ignore:`filter_amp` casts the weights")
@pytest.mark.parametrize(
    "rule, scaling",
    [
        (eqx_amp.fp8.TENSORWISE, "tensorwise"),
        pytest.param(eqx_amp.fp8.ROWWISE, "rowwise", marks=pytest.mark.slow),
        pytest.param(eqx_amp.fp8.MXFP8, "mxfp8", marks=pytest.mark.slow),
    ],
)
def test_fp8_rows_say_how_each_cast_was_scaled(rule, scaling):
    mlp = eqx.nn.MLP(32, 32, 32, 2, key=jr.key(0))
    x = jr.normal(jr.key(1), (32, 32))
    amp = eqx_amp.filter_amp(mlp, policy=BF16, fp8=rule)
    with warnings.catch_warnings():
        # An MXFP8 product is a `cond` over the platforms' forms, not a `cond`
        # whose products go unmeasured.
        warnings.simplefilter("error")
        _, tel = eqx.filter_jit(telemetry(_step))(amp, x)
    rows = tel.rows()
    fp8_rows = [r for r in rows if r.dtype.startswith("float8")]
    assert fp8_rows and {r.scaling for r in fp8_rows} == {scaling}, rule
    assert all(r.scaling is None for r in rows if r not in fp8_rows)
    for i in range(3):
        for role in ("weight", "activation", "output gradient"):
            assert any(
                r.layer == f"model.layers[{i}]"
                and r.role == role
                and r.dtype.startswith("float8")
                for r in fp8_rows
            ), (rule, i, role)
        assert any(
            r.layer == f"model.layers[{i}]" and r.role == "parameter gradient"
            for r in rows
        ), (rule, i)


@pytest.mark.parametrize("remat", ["checkpoint", "filter_checkpoint"])
def test_a_checkpointed_mxfp8_forward_is_measured_once(remat):
    mlp = eqx.nn.MLP(32, 32, 32, 2, key=jr.key(0))
    x = jr.normal(jr.key(1), (32, 32))

    def measure(remat):
        amp = eqx_amp.filter_amp(
            _Checkpointed(mlp, remat), policy=BF16, fp8=eqx_amp.fp8.MXFP8
        )
        return _by_row(eqx.filter_jit(telemetry(_batch_step))(amp, x)[1])

    plain, checkpointed = measure("none"), measure(remat)
    # Known gap (documented in `telemetry`): under `jax.checkpoint` the backward
    # pass quantises the recomputed inputs again along the backward products'
    # axes. Those casts are a recomputation's, taken as measured in the forward
    # pass (the rows hold the forward quantisations: half the values), and the
    # weight gradient of a layer whose recomputed input is not traced back to its
    # forward twin (here the last, after a ReLU shared with the layer before) has
    # no row. The tensors measured are the same.
    lost = {key[:2] for key in set(plain) - set(checkpointed)}
    assert lost <= {(f"model.mlp.layers[{i}]", "parameter gradient") for i in range(3)}
    assert len(lost) <= 1
    assert set(checkpointed) <= set(plain)
    for key, stats in checkpointed.items():
        np.testing.assert_allclose(stats.amax, plain[key].amax, err_msg=key)
        assert stats.scaling == plain[key].scaling


@pytest.mark.parametrize("road", ["filter_amp", "autocast", "bimodel"])
def test_mxfp8_scan_stacked_blocks_have_one_entry_per_iteration(road):
    model = scanned_linears(3, 32, batched=True)
    mxfp8 = eqx_amp.fp8.MXFP8
    wrapped = {
        "filter_amp": lambda: eqx_amp.filter_amp(model, policy=BF16, fp8=mxfp8),
        "autocast": lambda: eqx_amp.autocast(
            model, policy=BF16, rules={jax.lax.dot_general_p: mxfp8}
        ),
        "bimodel": lambda: eqx_amp.BiModel(model, fp8=mxfp8),
    }[road]()

    def step(model, x):
        return eqx.filter_grad(lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2))(
            model, x
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, tel = eqx.filter_jit(telemetry(step))(
            wrapped, jr.normal(jr.key(1), (32, 32))
        )
    stacked = {
        (t.role, t.scaling) for t in tel.tensors if t.layer == "model.blocks[{0}]"
    }
    for role in ("weight", "activation", "output gradient"):
        assert (role, "mxfp8") in stacked, (road, role)
    assert ("parameter gradient", None) in stacked
    for t in tel.tensors:
        if t.layer == "model.blocks[{0}]":
            assert t.amax.shape == (3,)
    rows = {(r.layer, r.role) for r in tel.rows()}
    assert ("model.blocks[2]", "parameter gradient") in rows


def test_a_reduce_dtype_pullback_is_measured_as_a_product():
    """A reduce dtype's pullback is a `cond` over the platforms' forms of one
    product (a CPU emits float32), as the fp8 backward products are where a CPU may
    sum a half-emitting product in half (jax >= 0.11,
    `test_fp8_rows_say_how_each_cast_was_scaled`): measured as that product, not
    warned about as a `cond` whose products go unmeasured."""
    mlp = eqx.nn.MLP(16, 16, 16, 2, key=jr.key(0))
    amp = eqx_amp.filter_amp(mlp, policy=BF16.with_reduce_dtype(jnp.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, tel = eqx.filter_jit(telemetry(_step))(amp, jr.normal(jr.key(1), (8, 16)))
    layers = {r.layer for r in tel.rows() if r.role == "parameter gradient"}
    assert layers == {f"model.layers[{i}]" for i in range(3)}


@pytest.mark.parametrize("activation", [jnp.tanh, jnp.exp, jax.nn.relu, jax.nn.sigmoid])
def test_every_layer_has_its_gradient_rows_whatever_the_activation(activation):
    """tanh's and exp's derivatives multiply the output gradient by their forward
    output, the next layer's input: the product is a gradient, not that input (the
    first layer's gradient rows were dropped)."""
    model = eqx.nn.MLP(16, 16, 16, 1, activation=activation, key=jr.key(0))
    x = jr.normal(jr.key(1), (8, 16))

    def step(model, x):
        def loss(m):
            return jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)

        return eqx.filter_value_and_grad(loss)(model)

    amp = eqx_amp.filter_amp(model, policy="mixed_bfloat16")
    _, tel = eqx.filter_jit(eqx_amp.diagnostics.telemetry(step))(amp, x)
    for layer in ("model.layers[0]", "model.layers[1]"):
        roles = {t.role for t in tel.tensors if t.layer == layer}
        assert roles == {
            "weight", "activation", "output gradient", "parameter gradient"
        }, (layer, roles)  # fmt: skip


def test_a_step_under_delayed_fp8_scaling_is_measured_as_current_scalings():
    """Its rows on the batch `init` saw are current scaling's; on an input grown
    16-fold the scale trails the tensor, and the values it clips are counted."""
    model = eqx.nn.Linear(32, 32, key=jr.key(0))
    x, y = jr.normal(jr.key(1), (32, 32)), jr.normal(jr.key(2), (32, 32))

    def loss_fn(model, x, y):
        amp = eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=eqx_amp.fp8.TENSORWISE)
        return jnp.mean((amp(x).astype(jnp.float32) - y) ** 2)

    def step(model, scaling, x, y):
        def scaled(diff, x, y):
            model, scaling = diff
            with eqx_amp.fp8.delayed(scaling):
                return loss_fn(model, x, y)

        return eqx.filter_value_and_grad(scaled)((model, scaling), x, y)

    def rows(telemetry):
        return {(t.role, t.dtype, t.scaling): t for t in telemetry.tensors}

    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)
    measured = eqx.filter_jit(eqx_amp.diagnostics.telemetry(step))
    _, delayed = measured(model, scaling, x, y)
    current = eqx.filter_jit(
        eqx_amp.diagnostics.telemetry(eqx.filter_value_and_grad(loss_fn))
    )(model, x, y)[1]
    assert rows(delayed).keys() == rows(current).keys()
    for key, row in rows(current).items():
        assert float(rows(delayed)[key].amax) == float(row.amax), key
    fp8 = ("activation", "float8_e4m3fn", "tensorwise")
    assert float(rows(delayed)[fp8].overflow) == 0.0
    grown = x.at[0, 0].set(16 * jnp.max(jnp.abs(x)))
    _, stale = measured(model, scaling, grown, y)
    row = rows(stale)[fp8]
    # The amax of the tensor it quantises (the activation in bfloat16), not of
    # what the quantisation clipped it to.
    amax = jnp.max(jnp.abs(grown)).astype(jnp.bfloat16)
    assert float(row.amax) == float(amax) > 448 / float(row.scale)
    assert float(row.overflow) == 1 / x.size
    assert float(row.nonfinite) == 0.0

"""`autocast` on real models: values and gradients against float32, norm layers,
state, composition with Equinox and `filter_amp`."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import eqx_amp

from .helpers import (
    assert_matmuls_in,
    assert_scope_in_float32,
    assert_tree_close,
    eqns_named,
    float_dtypes,
    global_rel_error,
    in_dtypes,
    ops_in,
    rel_error,
    traced,
    walk_eqns,
)
from .models import CNN, BatchNormNet, TransformerBlock


F32, BF16, F16 = jnp.dtype("float32"), jnp.dtype("bfloat16"), jnp.dtype("float16")


#
# Numerics of common functions: values and gradients against float32.
#


@pytest.mark.parametrize(
    "fn, full_ops",
    [
        (lambda x: jax.nn.softmax(x @ x.T), ("exp", "reduce_sum")),
        (lambda x: jax.nn.log_softmax(x @ x.T), ("exp", "log", "reduce_sum")),
        (lambda x: jax.nn.logsumexp(x @ x.T, axis=-1), ("exp", "log", "reduce_sum")),
        (lambda x: jnp.linalg.norm(x @ x.T, axis=-1), ("reduce_sum",)),
        (lambda x: jax.nn.relu(x @ x.T), ()),
        (lambda x: jax.nn.gelu(x @ x.T), ()),
        (lambda x: jax.nn.gelu(x @ x.T, approximate=False), ()),
    ],
    ids=["softmax", "log_softmax", "logsumexp", "norm", "relu", "gelu", "gelu-erf"],
)
def test_functions_follow_the_rules(fn, full_ops, getkey):
    x = jr.normal(getkey(), (8, 16)) / 2  # moderate logits: bf16 rounds them by ~0.4%
    amp = eqx_amp.autocast(fn)
    jaxpr = traced(amp, x)
    assert ops_in(jaxpr, "dot_general") == [[BF16, BF16]]
    for op in full_ops:
        found = ops_in(jaxpr, op)
        assert found, f"no {op} in the autocast jaxpr"
        assert all(d == F32 for dtypes in found for d in dtypes), (op, found)
    assert amp(x).dtype == fn(x).dtype == F32
    assert rel_error(amp(x), fn(x)) < 2e-2
    loss = lambda f: lambda x: jnp.sum(f(x) ** 2)  # noqa: E731
    assert rel_error(jax.grad(loss(amp))(x), jax.grad(loss(fn))(x)) < 5e-2


def test_average_pooling_sums_its_windows_in_float32(getkey):
    """A 64 x 64 window of values near 1.5: a bfloat16 running sum stops at 2048
    (one ulp of it is 16, more than any value added), which averaged 0.5."""
    conv = eqx.nn.Conv2d(1, 1, 1, use_bias=False, key=getkey())
    conv = eqx.tree_at(lambda c: c.weight, conv, jnp.ones((1, 1, 1, 1)))
    pool = eqx.nn.AvgPool2d(64, 1)
    fn = lambda x: pool(conv(x))  # noqa: E731
    x = 1.0 + jr.uniform(getkey(), (1, 64, 64))
    amp = eqx_amp.autocast(fn)
    (found,) = ops_in(traced(amp, x), "reduce_window_sum")
    assert found == [F32]
    assert rel_error(amp(x), fn(x)) < 1e-2


def test_an_fft_of_an_activation_runs_in_float32(getkey):
    # XLA has no half-precision FFT: an RFFT of bfloat16 is refused.
    w = jr.normal(getkey(), (16, 16))
    fn = lambda x: jnp.abs(jnp.fft.rfft(x @ w)) ** 2  # noqa: E731
    x = jr.normal(getkey(), (8, 16))
    for policy in ("mixed_bfloat16", "mixed_float16"):
        amp = eqx_amp.autocast(fn, policy=policy)
        assert rel_error(amp(x), fn(x)) < 2e-2


@pytest.mark.parametrize(
    "norm, scope",
    [
        (eqx.nn.LayerNorm(16), "eqx.nn.LayerNorm"),
        (eqx.nn.RMSNorm(16), "eqx.nn.RMSNorm"),
        (eqx.nn.GroupNorm(4, 16), "eqx.nn.GroupNorm"),
    ],
)
def test_norm_layers_run_in_float32(norm, scope, getkey):
    linear = eqx.nn.Linear(16, 16, key=getkey())

    def fn(x):
        return norm(linear(x))

    amp = eqx_amp.autocast(fn, policy="mixed_float16")
    x = jr.normal(getkey(), (16,))
    jaxpr = traced(amp, x)
    assert ops_in(jaxpr, "dot_general") == [[F16, F16]]
    # All arithmetic under the norm's scope, not only the listed ops, reads float32
    # (the casts into it, and the `jit`s around parts of it, read float16).
    under_scope = [
        e
        for e, s in walk_eqns(jaxpr)
        if scope in s and e.primitive.name not in ("convert_element_type", "jit")
    ]
    assert len(under_scope) > 5
    for eqn in under_scope:
        assert all(d == F32 for d in in_dtypes(eqn) if jnp.issubdtype(d, jnp.floating))
    assert rel_error(amp(x), fn(x)) < 2e-2


@pytest.mark.parametrize(
    "norm",
    [eqx.nn.LayerNorm(16), eqx.nn.RMSNorm(16), eqx.nn.GroupNorm(4, 16)],
    ids=["LayerNorm", "RMSNorm", "GroupNorm"],
)
def test_norm_layers_hand_back_their_input_dtype(norm, getkey):
    """Equinox's norms end with `out.astype(orig_dtype)`, an identity in the traced
    float32 program; autocast restores it, so the ops after a norm see the dtype the
    norm was given (bfloat16 after a matmul, float32 when float32 data enters), as
    they do when the layer is called on half-precision input directly."""
    linear = eqx.nn.Linear(16, 16, key=getkey())

    def after_matmul(x):
        return jnp.tanh(norm(linear(x)))

    def on_the_data(x):
        return linear(jnp.tanh(norm(x)))

    x = jr.normal(getkey(), (16,))
    jaxpr = traced(eqx_amp.autocast(after_matmul), x)
    ((tanh, _),) = eqns_named(jaxpr, "tanh")
    assert in_dtypes(tanh) == [BF16]
    assert_scope_in_float32(jaxpr, type(norm).__name__)
    assert eqx_amp.autocast(after_matmul)(x).dtype == F32
    assert rel_error(eqx_amp.autocast(after_matmul)(x), after_matmul(x)) < 2e-2

    jaxpr = traced(eqx_amp.autocast(on_the_data), x)
    ((tanh, _),) = eqns_named(jaxpr, "tanh")
    assert in_dtypes(tanh) == [F32]


def test_only_norm_layers_hand_back_their_input_dtype(getkey):
    """A user's `FULL` scope (a loss, a softmax) and BatchNorm, which promotes with its
    float32 running statistics, keep their float32 results."""
    w = jr.normal(getkey(), (16, 16))

    def fn(x):
        with jax.named_scope("head"):
            y = jnp.exp(x @ w)
        return jnp.tanh(y)

    x = jr.normal(getkey(), (16,))
    amp = eqx_amp.autocast(lambda x: fn(x @ w), rules={"head": eqx_amp.FULL})
    ((tanh, _),) = eqns_named(traced(amp, x), "tanh")
    assert in_dtypes(tanh) == [F32]

    model, state = eqx.nn.make_with_state(BatchNormNet)(key=getkey())

    def forward(model, state, xs):
        return jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(xs, state)

    jaxpr = traced(eqx_amp.autocast(forward), model, state, jr.normal(getkey(), (4, 6)))
    after_norm = [
        e
        for e, s in walk_eqns(jaxpr)
        if "BatchNorm" not in s and e.primitive.name == "max"
    ]
    assert after_norm and all(in_dtypes(e)[0] == F32 for e in after_norm)


def test_norm_backward_pass_inside_the_function_is_not_cast_back(getkey):
    """Under `autocast(jax.grad(f))` the hand-back applies to the forward pass only:
    the norm's weight gradient leaves the backward pass in float32, however the
    function goes on to use it."""
    linear, norm = eqx.nn.Linear(8, 16, key=getkey()), eqx.nn.LayerNorm(16)
    x = jr.normal(getkey(), (8,))

    def loss(norm, x):
        return jnp.sum(jnp.tanh(norm(linear(x))) ** 2)

    def doubled_weight_grad(norm, x):
        return 2 * jax.grad(loss)(norm, x).weight

    amp = eqx_amp.autocast(doubled_weight_grad)
    jaxpr = traced(amp, norm, x)
    assert jaxpr.jaxpr.eqns[-1].primitive.name == "mul"
    assert in_dtypes(jaxpr.jaxpr.eqns[-1]) == [F32, F32]
    assert rel_error(amp(norm, x), doubled_weight_grad(norm, x)) < 3e-2


def test_transformer_block_values_and_gradients(getkey):
    model = TransformerBlock(16, 4, key=getkey())
    x = jr.normal(getkey(), (10, 16))
    amp = eqx_amp.autocast(model)
    jaxpr = traced(amp, x)
    assert_matmuls_in(jaxpr, BF16, at_least=8)
    assert_scope_in_float32(jaxpr, "eqx.nn.LayerNorm")
    assert rel_error(amp(x), model(x)) < 3e-2

    def loss(model, amp):
        f = eqx_amp.autocast(model) if amp else model
        return jnp.mean(f(x) ** 2)

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    assert_tree_close(grad(model, True), grad(model, False), tol=6e-2)


def test_cnn_and_batch_norm_with_state(getkey):
    cnn = CNN(key=getkey())
    x = jr.normal(getkey(), (1, 8, 8))
    jaxpr = traced(eqx_amp.autocast(cnn), x)
    assert ops_in(jaxpr, "conv_general_dilated") == [[BF16, BF16]] * 2
    assert_scope_in_float32(jaxpr, "eqx.nn.GroupNorm")

    model, state = eqx.nn.make_with_state(BatchNormNet)(key=getkey())
    xs = jr.normal(getkey(), (16, 6))

    def forward(model, state, xs):
        return jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(xs, state)

    amp = eqx_amp.autocast(forward)
    jaxpr = traced(amp, model, state, xs)
    assert_matmuls_in(jaxpr, BF16, at_least=2)
    assert_scope_in_float32(jaxpr, "BatchNorm")
    out, new_state = amp(model, state, xs)
    ref_out, ref_state = forward(model, state, xs)
    assert float_dtypes(new_state) == {F32}
    assert rel_error(out, ref_out) < 3e-2
    assert_tree_close(new_state, ref_state, tol=3e-2)


def test_conv_batch_norm_with_state_under_grad(getkey):
    conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=getkey())
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        4, axis_name="batch", mode="batch"
    )
    images = jr.normal(getkey(), (8, 1, 6, 6))
    # Not `mean(out**2)`: batch statistics normalise that to ~1 whatever the conv
    # weights are, so its gradient would be rounding noise.
    target = jr.normal(getkey(), (8, 4, 6, 6))

    def loss(params, state, images):
        conv, bn = params

        def one(image, state):
            return bn(conv(image), state)

        out, state = jax.vmap(
            one, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(images, state)
        return jnp.mean((out - target) ** 2), state

    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (value, new_state), grads = grad_fn((conv, bn), state, images)
    amp = eqx.filter_value_and_grad(eqx_amp.autocast(loss), has_aux=True)
    (amp_value, amp_state), amp_grads = eqx.filter_jit(amp)((conv, bn), state, images)
    jaxpr = traced(amp, (conv, bn), state, images)
    assert [BF16, BF16] in ops_in(jaxpr, "conv_general_dilated")
    assert_scope_in_float32(jaxpr, "eqx.nn.BatchNorm")
    assert float_dtypes(amp_state) == float_dtypes(new_state) == {F32}
    assert_tree_close(amp_state, new_state, tol=2e-2)
    assert rel_error(amp_value, value) < 2e-2
    assert float_dtypes(amp_grads) == {F32}
    assert global_rel_error(amp_grads, grads) < 5e-2


def test_attention_vmapped_model_jit_and_bound_method(getkey):
    attention = eqx.nn.MultiheadAttention(2, 8, key=getkey())
    q = jr.normal(getkey(), (4, 8))
    amp = eqx_amp.autocast(attention.__call__)
    assert_matmuls_in(traced(amp, q, q, q), BF16, at_least=6)
    assert rel_error(amp(q, q, q), attention(q, q, q)) < 3e-2

    mlp = eqx.nn.MLP(8, 3, 16, 1, key=getkey())
    xs = jr.normal(getkey(), (5, 8))
    vmapped = jax.jit(jax.vmap(eqx_amp.autocast(mlp)))
    assert vmapped(xs).dtype == F32
    assert_matmuls_in(jax.make_jaxpr(vmapped)(xs), BF16, at_least=2)
    inner = eqx_amp.autocast(eqx.filter_vmap(mlp))
    assert rel_error(inner(xs), vmapped(xs)) < 2e-2
    assert rel_error(inner(xs), jax.vmap(mlp)(xs)) < 3e-2


def test_float32_compute_is_bit_identical(getkey):
    model = TransformerBlock(8, 2, key=getkey())
    x = jr.normal(getkey(), (5, 8))
    amp = eqx_amp.autocast(model, policy="float32")
    np.testing.assert_array_equal(amp(x), model(x))


def test_bad_inputs():
    with pytest.raises(
        ValueError, match=r"The rule for .* is 'low', which is not a rule"
    ):
        eqx_amp.autocast(jnp.sin, rules={lax.sin_p: "low"})
    with pytest.raises(TypeError, match=r"`rules` keys must be JAX primitives"):
        eqx_amp.autocast(jnp.sin, rules={jnp.sin: eqx_amp.LOW})
    with pytest.raises(TypeError, match=r"`rules` must be a mapping"):
        eqx_amp.autocast(jnp.sin, rules=[eqx_amp.LOW])
    with pytest.raises(TypeError, match=r"`autocast` takes a callable.*got int"):
        eqx_amp.autocast(3)
    with pytest.raises(ValueError, match=r"Unknown policy 'bf17'"):
        eqx_amp.autocast(jnp.sin, policy="bf17")
    with pytest.raises(ValueError, match=r"is int8, not a real floating dtype"):
        eqx_amp.autocast(jnp.sin, policy="c=int8")


def test_decorator_form_and_pytree(getkey):
    @eqx_amp.autocast(policy="mixed_float16")
    def fn(x):
        return x @ x.T

    assert ops_in(traced(fn, jnp.ones((2, 2))), "dot_general") == [[F16, F16]]
    model = eqx.nn.Linear(2, 2, key=getkey())
    wrapped = eqx_amp.autocast(model)
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(wrapped, jnp.ones(2))
    assert float_dtypes(grads) == {F32}


#
# Random programs.
#


_UNARY = [
    jnp.sin,
    jnp.tanh,
    jax.nn.relu,
    jax.nn.gelu,
    jax.nn.sigmoid,
    lambda a: jnp.exp(-jnp.abs(a)),
    lambda a: jnp.log1p(jnp.abs(a)),
    lambda a: jax.nn.softmax(a, axis=-1),
    lambda a: a - jnp.mean(a, -1, keepdims=True),
    lambda a: jnp.cumsum(a, axis=-1) / 8,
]
_BINARY = [
    jnp.add,
    jnp.multiply,
    jnp.maximum,
    lambda a, b: a @ b.T @ a / 8,
    lambda a, b: jnp.where(a > b, a, b),
    lambda a, b: jnp.concatenate([a, b], axis=-1)[:, :8],
]


@st.composite
def _programs(draw):
    steps = draw(
        st.lists(
            st.tuples(
                st.booleans(),
                st.integers(0, 100),
                st.integers(0, 100),
                st.integers(0, 100),
            ),
            min_size=1,
            max_size=8,
        )
    )

    def program(x, y):
        pool = [x, y]
        for binary, op, i, j in steps:
            a, b = pool[i % len(pool)], pool[j % len(pool)]
            pool.append(
                _BINARY[op % len(_BINARY)](a, b)
                if binary
                else _UNARY[op % len(_UNARY)](a)
            )
        return pool[-1]

    return program


@settings(max_examples=25, deadline=None)
@given(_programs(), st.integers(0, 2**31 - 1))
def test_random_programs(program, seed):
    kx, ky = jr.split(jr.key(seed))
    x, y = jr.normal(kx, (4, 8)), jr.normal(ky, (4, 8))
    expected = jax.jit(program)(x, y)
    same = jax.jit(eqx_amp.autocast(program, policy="float32"))(x, y)
    np.testing.assert_array_equal(same, expected)
    low = jax.jit(eqx_amp.autocast(program))(x, y)
    assert low.dtype == expected.dtype
    np.testing.assert_allclose(low, expected, rtol=0.1, atol=0.1)


def test_composes_with_filter_amp(getkey):
    """`autocast(filter_amp(model))`: the boundary casts of `filter_amp` with the op
    rules of `autocast` inside. Both hand norm outputs back in half precision, so all
    three save the same activations."""
    model = CNN(key=getkey())
    x = jr.normal(getkey(), (4, 1, 8, 8))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def saved_bytes(wrap):
        def loss(params):
            return jnp.mean(jax.vmap(wrap(eqx.combine(params, static)))(x) ** 2)

        def residuals(params):
            return jax.tree_util.tree_leaves(jax.vjp(loss, params)[1])

        return sum(s.size * s.dtype.itemsize for s in jax.eval_shape(residuals, params))

    both = lambda m: eqx_amp.autocast(eqx_amp.filter_amp(m))  # noqa: E731
    assert (
        saved_bytes(both)
        == saved_bytes(eqx_amp.filter_amp)
        == saved_bytes(eqx_amp.autocast)
    )

    def head_softmax(m, x):
        return jax.nn.softmax(m(x))

    jaxpr = traced(eqx_amp.autocast(eqx_amp.filter_amp(head_softmax)), model, x[0])
    assert ops_in(jaxpr, "exp") == [[F32]]  # the rule still applies inside
    assert_matmuls_in(jaxpr, BF16, at_least=3)


def test_weights_too_large_for_float16_are_named(getkey):
    model = eqx.nn.Linear(3, 3, key=getkey())
    model = eqx.tree_at(lambda m: m.weight, model, model.weight.at[0, 1].set(1e5))
    with pytest.warns(
        UserWarning, match=r"`autocast` runs matmuls in float16.*value of \.weight"
    ):
        eqx_amp.autocast(model, policy="mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_amp.autocast(model, policy="mixed_bfloat16")


def test_arrays_made_in_the_model_do_not_widen_matmuls(getkey):
    """An RNN whose carry is `jnp.zeros(hidden)` (float32) runs 20% of its matmul
    FLOPs in bfloat16 under `filter_amp`; `autocast` casts every matmul's operands,
    so there it runs all of them in bfloat16."""

    class RNN(eqx.Module):
        cell: eqx.nn.GRUCell

        def __call__(self, xs):
            h0 = jnp.zeros(self.cell.hidden_size)
            return lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)[0]

    model = RNN(eqx.nn.GRUCell(8, 32, key=getkey()))
    xs = jr.normal(getkey(), (10, 8))
    report = eqx_amp.precision_report(eqx_amp.autocast(model), xs)
    assert report.low_precision_share == 1.0
    assert not report.wide_matmuls
    assert rel_error(eqx_amp.autocast(model)(xs), model(xs)) < 3e-2

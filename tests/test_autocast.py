import subprocess
import sys
import textwrap
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
    eqns_named,
    float_dtypes,
    in_dtypes,
    out_dtypes,
    traced,
    walk_eqns,
)
from .models import CNN, BatchNormNet, TransformerBlock


F32, BF16, F16 = jnp.dtype("float32"), jnp.dtype("bfloat16"), jnp.dtype("float16")


def _rel_error(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-12))


def _assert_tree_close(a, b, tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype
        assert _rel_error(x, y) < tol


def _global_rel_error(a, b):
    """Relative error of two gradient trees as one vector: leaves whose true gradient
    is zero (a conv bias under BatchNorm) hold only rounding noise, which a per-leaf
    relative error would magnify without bound."""
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])  # noqa: E731
    return _rel_error(flat(a), flat(b))


def _ops_in(jaxpr, name):
    return [in_dtypes(e) for e, _ in eqns_named(jaxpr, name)]


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
    assert _ops_in(jaxpr, "dot_general") == [[BF16, BF16]]
    for op in full_ops:
        found = _ops_in(jaxpr, op)
        assert found, f"no {op} in the autocast jaxpr"
        assert all(d == F32 for dtypes in found for d in dtypes), (op, found)
    assert amp(x).dtype == fn(x).dtype == F32
    assert _rel_error(amp(x), fn(x)) < 2e-2
    loss = lambda f: lambda x: jnp.sum(f(x) ** 2)  # noqa: E731
    assert _rel_error(jax.grad(loss(amp))(x), jax.grad(loss(fn))(x)) < 5e-2


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
    assert _ops_in(jaxpr, "dot_general") == [[F16, F16]]
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
    assert _rel_error(amp(x), fn(x)) < 2e-2


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
    (tanh, _), = eqns_named(jaxpr, "tanh")
    assert in_dtypes(tanh) == [BF16]
    assert_scope_in_float32(jaxpr, type(norm).__name__)
    assert eqx_amp.autocast(after_matmul)(x).dtype == F32
    assert _rel_error(eqx_amp.autocast(after_matmul)(x), after_matmul(x)) < 2e-2

    jaxpr = traced(eqx_amp.autocast(on_the_data), x)
    (tanh, _), = eqns_named(jaxpr, "tanh")
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
    (tanh, _), = eqns_named(traced(amp, x), "tanh")
    assert in_dtypes(tanh) == [F32]

    model, state = eqx.nn.make_with_state(BatchNormNet)(key=getkey())

    def forward(model, state, xs):
        return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            xs, state
        )

    jaxpr = traced(eqx_amp.autocast(forward), model, state, jr.normal(getkey(), (4, 6)))
    after_norm = [
        e for e, s in walk_eqns(jaxpr) if "BatchNorm" not in s and e.primitive.name == "max"
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
    assert _rel_error(amp(norm, x), doubled_weight_grad(norm, x)) < 3e-2


def test_transformer_block_values_and_gradients(getkey):
    model = TransformerBlock(16, 4, key=getkey())
    x = jr.normal(getkey(), (10, 16))
    amp = eqx_amp.autocast(model)
    jaxpr = traced(amp, x)
    assert_matmuls_in(jaxpr, BF16, at_least=8)
    assert_scope_in_float32(jaxpr, "eqx.nn.LayerNorm")
    assert _rel_error(amp(x), model(x)) < 3e-2

    def loss(model, amp):
        f = eqx_amp.autocast(model) if amp else model
        return jnp.mean(f(x) ** 2)

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    _assert_tree_close(grad(model, True), grad(model, False), tol=6e-2)


def test_cnn_and_batch_norm_with_state(getkey):
    cnn = CNN(key=getkey())
    x = jr.normal(getkey(), (1, 8, 8))
    jaxpr = traced(eqx_amp.autocast(cnn), x)
    assert _ops_in(jaxpr, "conv_general_dilated") == [[BF16, BF16]] * 2
    assert_scope_in_float32(jaxpr, "eqx.nn.GroupNorm")

    model, state = eqx.nn.make_with_state(BatchNormNet)(key=getkey())
    xs = jr.normal(getkey(), (16, 6))

    def forward(model, state, xs):
        return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            xs, state
        )

    amp = eqx_amp.autocast(forward)
    jaxpr = traced(amp, model, state, xs)
    assert_matmuls_in(jaxpr, BF16, at_least=2)
    assert_scope_in_float32(jaxpr, "BatchNorm")
    out, new_state = amp(model, state, xs)
    ref_out, ref_state = forward(model, state, xs)
    assert float_dtypes(new_state) == {F32}
    assert _rel_error(out, ref_out) < 3e-2
    _assert_tree_close(new_state, ref_state, tol=3e-2)


def test_conv_batch_norm_with_state_under_grad(getkey):
    conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=getkey())
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch", mode="batch")
    images = jr.normal(getkey(), (8, 1, 6, 6))
    # Not `mean(out**2)`: batch statistics normalise that to ~1 whatever the conv
    # weights are, so its gradient would be rounding noise.
    target = jr.normal(getkey(), (8, 4, 6, 6))

    def loss(params, state, images):
        conv, bn = params

        def one(image, state):
            return bn(conv(image), state)

        out, state = jax.vmap(one, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            images, state
        )
        return jnp.mean((out - target) ** 2), state

    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (value, new_state), grads = grad_fn((conv, bn), state, images)
    amp = eqx.filter_value_and_grad(eqx_amp.autocast(loss), has_aux=True)
    (amp_value, amp_state), amp_grads = eqx.filter_jit(amp)((conv, bn), state, images)
    jaxpr = traced(amp, (conv, bn), state, images)
    assert [BF16, BF16] in _ops_in(jaxpr, "conv_general_dilated")
    assert_scope_in_float32(jaxpr, "eqx.nn.BatchNorm")
    assert float_dtypes(amp_state) == float_dtypes(new_state) == {F32}
    _assert_tree_close(amp_state, new_state, tol=2e-2)
    assert _rel_error(amp_value, value) < 2e-2
    assert float_dtypes(amp_grads) == {F32}
    assert _global_rel_error(amp_grads, grads) < 5e-2


def test_gru_in_scan_keeps_its_carry_dtype(getkey):
    cell = eqx.nn.GRUCell(4, 8, key=getkey())
    xs = jr.normal(getkey(), (12, 4))

    def rnn(cell, xs):
        def step(h, x):
            h = cell(x, h)
            return h, h

        return lax.scan(step, jnp.zeros(8), xs)

    amp = eqx_amp.autocast(rnn)
    jaxpr = traced(amp, cell, xs)
    (scan_eqn, _), = eqns_named(jaxpr, "scan")
    num_consts = scan_eqn.params["num_consts"]
    assert in_dtypes(scan_eqn)[num_consts] == F32  # the carry
    assert out_dtypes(scan_eqn)[0] == F32
    assert_matmuls_in(jaxpr, BF16, at_least=2)
    (h, hs), (_, ref_hs) = amp(cell, xs), rnn(cell, xs)
    assert h.dtype == hs.dtype == F32
    assert _rel_error(hs, ref_hs) < 3e-2
    loss = lambda f: lambda c: jnp.sum(f(c, xs)[1] ** 2)  # noqa: E731
    _assert_tree_close(
        eqx.filter_grad(loss(amp))(cell), eqx.filter_grad(loss(rnn))(cell), tol=6e-2
    )


def test_cond_while_and_checkpoint(getkey):
    w = jr.normal(getkey(), (6, 6)) / 3

    def fn(x):
        x = lax.cond(x.sum() > 0, lambda a: jnp.tanh(a @ w), lambda a: a @ w.T, x)
        x = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1] @ w)), (0, x))[1]
        return jax.checkpoint(lambda a: jnp.exp(a @ w))(x)

    x = jr.normal(getkey(), (6,))
    amp = eqx_amp.autocast(fn)
    jaxpr = traced(amp, x)
    assert _ops_in(jaxpr, "dot_general") == [[BF16, BF16]] * 4
    assert _ops_in(jaxpr, "exp") == [[F32]]
    (while_eqn, _), = eqns_named(jaxpr, "while")
    assert out_dtypes(while_eqn)[1] == F32
    (cond_eqn, _), = eqns_named(jaxpr, "cond")
    assert out_dtypes(cond_eqn) == [F32]
    assert eqns_named(jaxpr, "checkpoint", "remat2")
    assert _rel_error(amp(x), fn(x)) < 3e-2

    def differentiable(x):  # while_loop has no reverse-mode derivative
        x = lax.cond(x.sum() > 0, lambda a: jnp.tanh(a @ w), lambda a: a @ w.T, x)
        return jnp.sum(jax.checkpoint(lambda a: jnp.exp(a @ w))(x))

    g_amp = jax.grad(eqx_amp.autocast(differentiable))(x)
    assert _rel_error(g_amp, jax.grad(differentiable)(x)) < 5e-2
    # The checkpointed exp runs twice under grad (forward and recomputed): both f32.
    grad_exps = _ops_in(jax.make_jaxpr(jax.grad(eqx_amp.autocast(differentiable)))(x), "exp")
    assert len(grad_exps) >= 1 and all(d == [F32] for d in grad_exps)


#
# Custom derivative rules: still used, and the forward pass follows the rules.
#


def _custom_functions(w):
    @jax.custom_jvp
    def jvp_fn(x):
        return jnp.tanh(x @ w)

    @jvp_fn.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        y = jvp_fn(x)
        return y, 3.0 * (t @ w)  # not the true derivative: it must still be used

    @jax.custom_vjp
    def vjp_fn(x):
        return jnp.sin(x @ w)

    def fwd(x):
        return vjp_fn(x), x @ w

    def bwd(residual, g):
        return (-5.0 * g @ w.T + 0.0 * residual @ w.T,)

    vjp_fn.defvjp(fwd, bwd)
    return jvp_fn, vjp_fn


def test_user_custom_jvp_and_custom_vjp_rules_are_used(getkey):
    w = jr.normal(getkey(), (5, 5)) / 2
    jvp_fn, vjp_fn = _custom_functions(w)
    x = jr.normal(getkey(), (5,))
    for fn, expected_scale in ((jvp_fn, 3.0), (vjp_fn, -5.0)):
        loss = lambda x, fn=fn: jnp.sum(fn(x))  # noqa: E731
        amp_grad = eqx.filter_grad(eqx_amp.autocast(loss))(x)
        assert _rel_error(amp_grad, expected_scale * w.sum(1)) < 2e-2
        assert _rel_error(amp_grad, jax.grad(loss)(x)) < 2e-2
        jaxpr = jax.make_jaxpr(eqx.filter_value_and_grad(eqx_amp.autocast(loss)))(x)
        # Under differentiation, the forward matmul (inside the user's rule) is
        # still bfloat16.
        assert [BF16, BF16] in _ops_in(jaxpr, "dot_general")


def test_natural_and_reversed_order_of_grad(getkey):
    model = eqx.nn.MLP(6, 2, 16, 2, key=getkey())
    x = jr.normal(getkey(), (6,))

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    ref_value, ref_grads = eqx.filter_value_and_grad(loss)(model, x)
    for f in (
        eqx.filter_value_and_grad(eqx_amp.autocast(loss)),
        eqx_amp.autocast(eqx.filter_value_and_grad(loss)),
    ):
        value, grads = eqx.filter_jit(f)(model, x)
        assert value.dtype == F32
        assert float_dtypes(grads) == {F32}
        assert _rel_error(value, ref_value) < 3e-2
        _assert_tree_close(grads, ref_grads, tol=6e-2)
    jaxpr = traced(eqx_amp.autocast(eqx.filter_value_and_grad(loss)), model, x)
    # The backward matmuls are rewritten too.
    assert_matmuls_in(jaxpr, BF16, at_least=6)


def test_attention_vmapped_model_jit_and_bound_method(getkey):
    attention = eqx.nn.MultiheadAttention(2, 8, key=getkey())
    q = jr.normal(getkey(), (4, 8))
    amp = eqx_amp.autocast(attention.__call__)
    assert_matmuls_in(traced(amp, q, q, q), BF16, at_least=6)
    assert _rel_error(amp(q, q, q), attention(q, q, q)) < 3e-2

    mlp = eqx.nn.MLP(8, 3, 16, 1, key=getkey())
    xs = jr.normal(getkey(), (5, 8))
    vmapped = jax.jit(jax.vmap(eqx_amp.autocast(mlp)))
    assert vmapped(xs).dtype == F32
    assert_matmuls_in(jax.make_jaxpr(vmapped)(xs), BF16, at_least=2)
    inner = eqx_amp.autocast(eqx.filter_vmap(mlp))
    assert _rel_error(inner(xs), vmapped(xs)) < 2e-2
    assert _rel_error(inner(xs), jax.vmap(mlp)(xs)) < 3e-2


def test_shard_map_body_is_rewritten():
    script = textwrap.dedent(
        """
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import eqx_amp
        mesh = Mesh(np.array(jax.devices()), ("data",))
        w = jnp.ones((4, 4)) / 4
        def body(x):
            return jax.lax.psum(jnp.exp(x @ w).sum(), "data")
        f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P())
        x = jnp.arange(32.0).reshape(8, 4) / 32
        amp = eqx_amp.autocast(f)
        jaxpr = jax.make_jaxpr(amp)(x)
        (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
        inner = {e.primitive.name: [v.aval.dtype.name for v in e.invars]
                 for e in eqn.params["jaxpr"].eqns}
        assert inner["dot_general"] == ["bfloat16", "bfloat16"], inner
        assert inner["exp"] == ["float32"], inner
        np.testing.assert_allclose(amp(x), f(x), rtol=2e-2)
        g = jax.grad(amp)(x)
        np.testing.assert_allclose(g, jax.grad(f)(x), rtol=5e-2)
        print("devices", len(jax.devices()), "ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "devices 8 ok" in result.stdout


#
# Rules.
#


def test_default_rules_table():
    assert eqx_amp.DEFAULT_RULES[lax.dot_general_p] is eqx_amp.LOW
    assert eqx_amp.DEFAULT_RULES[lax.conv_general_dilated_p] is eqx_amp.LOW
    for p in (lax.exp_p, lax.log_p, lax.rsqrt_p, lax.reduce_sum_p, lax.cumsum_p,
              lax.pow_p, lax.erf_inv_p):
        assert eqx_amp.DEFAULT_RULES[p] is eqx_amp.FULL, p
    for p in (lax.add_p, lax.mul_p, lax.select_n_p, lax.concatenate_p, lax.pad_p,
              lax.clamp_p, lax.atan2_p, lax.dynamic_update_slice_p, lax.scatter_add_p):
        assert eqx_amp.DEFAULT_RULES[p] is eqx_amp.PROMOTE, p
    assert eqx_amp.DEFAULT_RULES[lax.integer_pow_p] is eqx_amp.DEFAULT_RULES[lax.logistic_p]
    assert eqx_amp.DEFAULT_RULES[lax.gather_p] is eqx_amp.DEFAULT_RULES[lax.dynamic_slice_p]
    assert eqx_amp.DEFAULT_RULES["eqx.nn.LayerNorm"] is eqx_amp.FULL
    assert eqx_amp.DEFAULT_RULES["eqx_amp.full_precision"] is eqx_amp.KEEP
    assert repr(eqx_amp.LOW) == "eqx_amp.LOW"


def test_primitive_rules_and_builtin_values(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        return jnp.exp(x @ w)

    x = jr.normal(getkey(), (4,))
    full_matmul = traced(eqx_amp.autocast(fn, rules={lax.dot_general_p: eqx_amp.FULL}), x)
    assert _ops_in(full_matmul, "dot_general") == [[F32, F32]]
    low_exp = traced(eqx_amp.autocast(fn, rules={lax.exp_p: eqx_amp.LOW}), x)
    assert _ops_in(low_exp, "exp") == [[BF16]]
    kept = traced(eqx_amp.autocast(fn, rules={lax.dot_general_p: eqx_amp.KEEP}), x)
    assert _ops_in(kept, "dot_general") == [[F32, F32]]
    promoted = traced(eqx_amp.autocast(fn, rules={lax.exp_p: eqx_amp.PROMOTE}), x)
    assert _ops_in(promoted, "exp") == [[BF16]]


def test_jaxamp_signature_callable_rule(getkey):
    calls = []

    def to_float16(compute_dtype, original_dtypes, *invals, **params):
        calls.append((compute_dtype, tuple(original_dtypes)))
        return [v.astype(jnp.float16) for v in invals], params

    x = jr.normal(getkey(), (4,))
    amp = eqx_amp.autocast(lambda x: jnp.sin(x) * 2, rules={lax.sin_p: to_float16})
    jaxpr = traced(amp, x)
    assert _ops_in(jaxpr, "sin") == [[F16]]
    assert calls[0] == (BF16, (F32,))
    assert amp(x).dtype == F32


def test_scope_rules_innermost_wins_and_reach_sub_jaxprs(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        with jax.named_scope("outer"):
            y = jax.jit(lambda a: a @ w)(x)
            with jax.named_scope("inner"):
                z = jax.jit(lambda a: a @ w)(y)
        return z @ w

    x = jr.normal(getkey(), (4,))
    amp = eqx_amp.autocast(fn, rules={"outer": eqx_amp.FULL, "inner": eqx_amp.LOW})
    dots = [(s, in_dtypes(e)) for e, s in eqns_named(traced(amp, x), "dot_general")]
    assert dots == [
        ("outer", [F32, F32]),
        ("outer/inner", [BF16, BF16]),
        ("", [BF16, BF16]),
    ]


def test_full_precision_context_manager_keeps_traced_dtypes(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        with eqx_amp.full_precision():
            y = jnp.tanh(x @ w)
        return y @ w

    jaxpr = traced(eqx_amp.autocast(fn), jr.normal(getkey(), (4,)))
    assert _ops_in(jaxpr, "dot_general") == [[F32, F32], [BF16, BF16]]


def test_explicit_casts_outputs_and_integers(getkey):
    def fn(x, n):
        y = (x @ x.T).astype(jnp.float32)  # explicit: honoured
        z = (x @ x.T).astype(jnp.float16)
        return y, z, n * 2, jnp.argmax(y, axis=-1)

    x = jr.normal(getkey(), (3, 3))
    amp = eqx_amp.autocast(fn)
    y, z, n, idx = amp(x, jnp.arange(3))
    assert (y.dtype, z.dtype, n.dtype, idx.dtype) == (F32, F16, jnp.int32, jnp.int32)
    converts = [e.params["new_dtype"] for e, _ in eqns_named(traced(amp, x, jnp.arange(3)),
                                                             "convert_element_type")]
    assert F16 in converts and F32 in converts


def test_scatter_and_preferred_element_type(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        y = x @ w
        y = y.at[0].add(y[1])
        z = lax.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32)
        return y, z

    x = jr.normal(getkey(), (4,))
    amp = eqx_amp.autocast(fn)
    jaxpr = traced(amp, x)
    (scatter, _), = eqns_named(jaxpr, "scatter-add", "scatter_add")
    assert in_dtypes(scatter)[0] == BF16
    # The user's explicit float32 accumulation survives.
    assert [out_dtypes(e) for e, _ in eqns_named(jaxpr, "dot_general")] == [[BF16], [F32]]
    y, z = amp(x)
    ref_y, ref_z = fn(x)
    assert _rel_error(y, ref_y) < 2e-2 and _rel_error(z, ref_z) < 1e-6


def test_float32_compute_is_bit_identical(getkey):
    model = TransformerBlock(8, 2, key=getkey())
    x = jr.normal(getkey(), (5, 8))
    amp = eqx_amp.autocast(model, policy="float32")
    np.testing.assert_array_equal(amp(x), model(x))


def test_unknown_higher_order_primitive_warns_once(getkey):
    def fn(x):
        return lax.reduce(x, 1.0, lambda a, b: a * b + 0.5, (0,))

    x = jr.normal(getkey(), (4,))
    amp = eqx_amp.autocast(fn)
    with pytest.warns(UserWarning, match=r"does not know the higher-order primitive `reduce`"):
        out = amp(x)
    np.testing.assert_array_equal(out, fn(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp(x)  # once only


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"The rule for .* is 'low', which is not a rule"):
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

    assert _ops_in(traced(fn, jnp.ones((2, 2))), "dot_general") == [[F16, F16]]
    model = eqx.nn.Linear(2, 2, key=getkey())
    wrapped = eqx_amp.autocast(model)
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(wrapped, jnp.ones(2))
    assert float_dtypes(grads) == {F32}


#
# Random programs.
#


_UNARY = [jnp.sin, jnp.tanh, jax.nn.relu, jax.nn.gelu, jax.nn.sigmoid,
          lambda a: jnp.exp(-jnp.abs(a)), lambda a: jnp.log1p(jnp.abs(a)),
          lambda a: jax.nn.softmax(a, axis=-1), lambda a: a - jnp.mean(a, -1, keepdims=True),
          lambda a: jnp.cumsum(a, axis=-1) / 8]
_BINARY = [jnp.add, jnp.multiply, jnp.maximum, lambda a, b: a @ b.T @ a / 8,
           lambda a, b: jnp.where(a > b, a, b),
           lambda a, b: jnp.concatenate([a, b], axis=-1)[:, :8]]


@st.composite
def _programs(draw):
    steps = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 100), st.integers(0, 100),
                                    st.integers(0, 100)), min_size=1, max_size=8))

    def program(x, y):
        pool = [x, y]
        for binary, op, i, j in steps:
            a, b = pool[i % len(pool)], pool[j % len(pool)]
            pool.append(_BINARY[op % len(_BINARY)](a, b) if binary
                        else _UNARY[op % len(_UNARY)](a))
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


#
# Parameters are weakly typed: they follow the activations they meet.
#


def test_activations_flow_in_low_precision_between_layers(getkey):
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=getkey())
    jaxpr = traced(eqx_amp.autocast(mlp), jr.normal(getkey(), (8,)))
    # Bias adds and relus run on bfloat16 activations (parameters cast down to
    # meet them), as in a hand-cast model; only the output is cast back up.
    for name in ("add", "max", "custom_jvp_call"):
        found = _ops_in(jaxpr, name)
        assert found and all(d == BF16 for dtypes in found for d in dtypes), (name, found)
    last_convert = [e for e, _ in walk_eqns(jaxpr) if e.primitive.name == "convert_element_type"][-1]
    assert last_convert.params["new_dtype"] == F32


def test_data_is_strong_parameters_and_constants_are_weak(getkey):
    w = jr.normal(getkey(), (4, 4))
    linear = eqx.nn.Linear(4, 4, key=getkey())
    x = jr.normal(getkey(), (4,))

    # A data input meeting a bfloat16 activation: the wider data dtype wins.
    residual = traced(eqx_amp.autocast(lambda x: x @ w + x), x)
    assert _ops_in(residual, "add") == [[F32, F32]]
    # A closed-over constant meeting it: the constant follows the activation.
    constant = traced(eqx_amp.autocast(lambda x: x @ w + w[0]), x)
    assert _ops_in(constant, "add") == [[BF16, BF16]]
    # Module leaves are parameters, whether the module is `fn` or an argument.
    for amp, args in (
        (eqx_amp.autocast(linear), (x,)),
        (eqx_amp.autocast(lambda m, x: m(x)), (linear, x)),
    ):
        assert _ops_in(traced(amp, *args), "add") == [[BF16, BF16]]
    # Parameters meeting parameters keep their own dtype.
    params_only = traced(eqx_amp.autocast(lambda m: m.weight + m.bias), linear)
    assert _ops_in(params_only, "add") == [[F32, F32]]


def test_embedding_lookups_are_activations(getkey):
    """A parameter table read at positions the data chooses (`eqx.nn.Embedding`,
    vmapped or not) is read in the compute dtype, so a transformer's residual stream
    is bfloat16, as in a model cast by hand. Lookups of data and slices at constant
    positions are not cast, and `KEEP` gives float32 lookups back."""
    embed = eqx.nn.Embedding(32, 16, key=getkey())
    positions = jr.normal(getkey(), (8, 16))
    linear = eqx.nn.Linear(16, 16, key=getkey())
    tokens = jr.randint(getkey(), (8,), 0, 32)

    def residual_stream(tokens):
        x = jax.vmap(embed)(tokens) + positions
        return x + jax.vmap(linear)(x)

    def float_adds(jaxpr):
        return [d for d in _ops_in(jaxpr, "add") if jnp.issubdtype(d[0], jnp.floating)]

    amp = eqx_amp.autocast(residual_stream)
    (gather, _), = eqns_named(traced(amp, tokens), "gather")
    assert in_dtypes(gather)[0] == BF16
    assert float_adds(traced(amp, tokens)) == [[BF16, BF16]] * 3
    assert amp(tokens).dtype == F32
    assert _rel_error(amp(tokens), residual_stream(tokens)) < 2e-2

    one_token = traced(eqx_amp.autocast(embed), tokens[0])
    (dynamic_slice, _), = eqns_named(one_token, "dynamic_slice")
    assert in_dtypes(dynamic_slice)[0] == BF16

    keep = {lax.gather_p: eqx_amp.KEEP, lax.dynamic_slice_p: eqx_amp.KEEP}
    kept = traced(eqx_amp.autocast(residual_stream, rules=keep), tokens)
    assert float_adds(kept)[0] == [F32, F32]

    x = jr.normal(getkey(), (8, 16))
    data_lookup = traced(eqx_amp.autocast(lambda x, i: x[i] @ positions.T), x, tokens)
    (gather, _), = eqns_named(data_lookup, "gather")
    assert in_dtypes(gather)[0] == F32
    constant_slice = traced(
        eqx_amp.autocast(lambda m: lax.dynamic_slice_in_dim(m.weight, 2, 4)), embed
    )
    (dynamic_slice, _), = eqns_named(constant_slice, "dynamic_slice")
    assert in_dtypes(dynamic_slice)[0] == F32


def test_custom_jvp_with_symbolic_zeros_runs_at_its_traced_dtypes(getkey):
    @jax.custom_jvp
    def square(x):
        return x * x

    def square_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        t = jnp.zeros_like(x) if isinstance(t, jax.custom_derivatives.SymbolicZero) else t
        return square(x), 2 * x * t

    square.defjvp(square_jvp, symbolic_zeros=True)
    w = jr.normal(getkey(), (3, 3))

    def fn(x):
        return jnp.sum(square(x @ w))

    x = jr.normal(getkey(), (3,))
    amp = eqx_amp.autocast(fn)
    (call, _), = eqns_named(traced(amp, x), "custom_jvp_call")
    assert in_dtypes(call) == [F32]
    assert _rel_error(jax.grad(amp)(x), jax.grad(fn)(x)) < 3e-2


def test_range_limited_ops_go_to_float32_for_float16_only(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        h = x @ w
        return jax.nn.sigmoid(h) + h**3

    x = jr.normal(getkey(), (4,))
    for policy, expected in (("mixed_bfloat16", BF16), ("mixed_float16", F32)):
        jaxpr = traced(eqx_amp.autocast(fn, policy=policy), x)
        assert _ops_in(jaxpr, "integer_pow") == [[expected]], policy
        assert _ops_in(jaxpr, "logistic") == [[expected]], policy
    # x**3 overflows float16 from x = 41: in float32 it does not.
    big = jnp.full((4,), 50.0)
    cube = eqx_amp.autocast(lambda x: (x @ jnp.eye(4)) ** 3, policy="mixed_float16")
    assert jnp.all(jnp.isfinite(cube(big)))


def test_a_value_is_cast_once_per_dtype(getkey):
    w1, w2, w3 = (jr.normal(getkey(), (4, 4)) for _ in range(3))

    def fn(x):
        h = jnp.exp(x)  # float32 (FULL), read by three bfloat16 matmuls
        return h @ w1, h @ w2, h @ w3

    jaxpr = traced(eqx_amp.autocast(fn), jr.normal(getkey(), (4,)))
    (exp_eqn, _), = eqns_named(jaxpr, "exp")
    h = exp_eqn.outvars[0]
    casts_of_h = [e for e, _ in eqns_named(jaxpr, "convert_element_type") if e.invars[0] is h]
    assert len(casts_of_h) == 1


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
    assert saved_bytes(both) == saved_bytes(eqx_amp.filter_amp) == saved_bytes(eqx_amp.autocast)

    def head_softmax(m, x):
        return jax.nn.softmax(m(x))

    jaxpr = traced(eqx_amp.autocast(eqx_amp.filter_amp(head_softmax)), model, x[0])
    assert _ops_in(jaxpr, "exp") == [[F32]]  # the rule still applies inside
    assert_matmuls_in(jaxpr, BF16, at_least=3)

"""The one jaxpr layer (`eqx_amp/_jaxpr/`): the evaluator under which `autocast` and the
diagnostics run, and how faithfully it re-binds higher-order primitives."""

import collections
import importlib.metadata
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

import eqx_amp
from eqx_amp._jaxpr import _compat as compat
from eqx_amp._jaxpr._evaluate import evaluate
from eqx_amp._jaxpr._hook import Hook

from .helpers import (
    assert_matmuls_in,
    assert_tree_close,
    eqns_named,
    float_dtypes,
    in_dtypes,
    ops_in,
    out_dtypes,
    rel_error,
    run_script_on_eight_devices,
    traced,
)


F32, BF16, F16 = jnp.dtype("float32"), jnp.dtype("bfloat16"), jnp.dtype("float16")


def _every_higher_order_primitive(w):
    """A program with one of each higher-order primitive jax emits for user code."""

    @jax.custom_vjp
    def scaled(x):
        return x * 2.0

    scaled.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 2.0,))

    def fn(x):
        x = jax.jit(lambda a: jnp.tanh(a @ w))(x)
        x = lax.scan(lambda c, _: (jnp.sin(c @ w), c.sum()), x, None, length=3)[0]
        x = lax.cond(x.sum() > 0, lambda a: a @ w, lambda a: a @ w.T, x)
        x = lax.fori_loop(0, 2, lambda i, a: jnp.cos(a @ w), x)
        x = jax.checkpoint(lambda a: jnp.exp(a @ w))(x)
        x = jax.nn.relu(x)  # custom_jvp around a jit
        return jnp.sum(scaled(x))

    return fn


_HOPS = ("jit", "pjit", "scan", "while", "cond", "checkpoint", "remat2",
         "custom_jvp_call", "custom_vjp_call")  # fmt: skip


class _Counting(Hook):
    def __init__(self, eager=False):
        self.eager = eager
        self.seen = collections.Counter()

    def equation(self, eqn, invals, origins, frame, evaluate):
        self.seen[id(eqn)] += 1
        return evaluate(invals)


@pytest.mark.parametrize("eager", [False, True])
def test_an_identity_hook_reproduces_the_program(eager, getkey):
    w = jr.normal(getkey(), (4, 4)) / 2
    fn = _every_higher_order_primitive(w)
    x = jr.normal(getkey(), (4,))
    closed = jax.make_jaxpr(fn)(x)
    (out,), _ = evaluate(closed, [x], _Counting(eager))
    np.testing.assert_allclose(out, fn(x), rtol=1e-6)
    if not eager:
        rebuilt = jax.make_jaxpr(lambda x: evaluate(closed, [x], Hook())[0])(x)
        names = lambda j: sorted(e.primitive.name for e, _ in eqns_named(j, *_HOPS))  # noqa: E731
        assert names(rebuilt) == names(closed)
        grad = jax.grad(lambda x: evaluate(closed, [x], Hook())[0][0])(x)
        np.testing.assert_allclose(grad, jax.grad(fn)(x), rtol=1e-5)


def test_eager_hooks_see_every_loop_iteration(getkey):
    w = jr.normal(getkey(), (3, 3))

    def fn(x):
        return lax.scan(lambda c, _: (jnp.sin(c @ w), None), x, None, length=5)[0]

    closed = jax.make_jaxpr(fn)(jnp.ones(3))
    (scan_eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    sin_eqn = next(
        e
        for e in compat.open_jaxpr(scan_eqn.params["jaxpr"])[0].eqns
        if e.primitive.name == "sin"
    )
    eager, staged = _Counting(eager=True), _Counting()
    evaluate(closed, [jnp.ones(3)], eager)
    jax.make_jaxpr(lambda x: evaluate(closed, [x], staged)[0])(jnp.ones(3))
    assert eager.seen[id(sin_eqn)] == 5
    assert staged.seen[id(sin_eqn)] >= 1


def test_custom_jvp_rule_is_traced_once_per_equation_and_dtypes(getkey):
    w = jr.normal(getkey(), (3, 3))
    x = jr.normal(getkey(), (3,))
    closed = jax.make_jaxpr(lambda x: jax.nn.relu(x @ w))(x)
    (call,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "custom_jvp_call"]
    # The body's own equations: sub-jaxprs of it may be shared with the rule's
    # program (jax caches traced `jit`s), which is evaluated on every call.
    body_ids = {id(e) for e in compat.open_jaxpr(call.params["call_jaxpr"])[0].eqns}
    hook = _Counting()
    for _ in range(3):
        jax.jvp(lambda x: evaluate(closed, [x], hook)[0][0], (x,), (x,))
    # The primal body is evaluated once, to learn its output dtypes; later calls of
    # the rule at the same dtypes reuse what was traced.
    assert {hook.seen[i] for i in body_ids} == {1}


_INNER_JIT_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import eqx_amp

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
rows, cols = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P(None, "model"))
inner = jax.jit(
    lambda x, w: jnp.tanh(x @ w),
    in_shardings=(rows, None),
    out_shardings=cols,
    donate_argnums=(0,),
)
fn = lambda x, w: inner(x * 1.0, w) * 2.0
x, w = jnp.ones((8, 4)), jnp.ones((4, 4)) / 4
amp = eqx_amp.autocast(fn)

def jit_params(f):
    (eqn,) = [e for e in jax.make_jaxpr(f)(x, w).eqns if e.primitive.name in ("jit", "pjit")]
    keys = ("in_shardings", "out_shardings", "donated_invars", "compiler_options_kvs",
            "name", "keep_unused", "inline", "ctx_mesh")
    return {k: repr(eqn.params[k]) for k in keys}, eqn

original, _ = jit_params(fn)
rebuilt, eqn = jit_params(amp)
dots = [e for e in eqn.params["jaxpr"].eqns if e.primitive.name == "dot_general"]
lowered = jax.jit(amp).lower(x, w).as_text()
out = amp(x, w)
report = {
    "same_params": original == rebuilt,
    "differences": {k: (original[k], rebuilt[k]) for k in original if original[k] != rebuilt[k]},
    "dot_dtypes": [v.aval.dtype.name for v in dots[0].invars],
    "rows_constraint": '[{"data"}, {}]' in lowered,
    "cols_constraint": '[{}, {"model"}]' in lowered,
    "out_sharding": out.sharding.is_equivalent_to(cols, 2),
    "close": bool(np.allclose(out, fn(x, w), rtol=2e-2)),
}
"""


@pytest.mark.slow
def test_inner_jit_keeps_shardings_and_donation():
    report = run_script_on_eight_devices(_INNER_JIT_SCRIPT)
    assert report["same_params"], report["differences"]
    assert report["dot_dtypes"] == ["bfloat16", "bfloat16"]
    assert report["rows_constraint"] and report["cols_constraint"]
    assert report["out_sharding"]
    assert report["close"]


def test_callbacks_receive_the_dtypes_they_were_traced_with(getkey):
    seen = []

    def host(a):
        seen.append(a.dtype)
        return np.asarray(a) * 2

    w = jr.normal(getkey(), (3, 3))

    def fn(x):
        y = x @ w
        shape = jax.ShapeDtypeStruct(y.shape, y.dtype)
        return jax.pure_callback(host, shape, y, vmap_method="sequential") + y

    x = jr.normal(getkey(), (3,))
    out = eqx_amp.autocast(fn)(x)
    assert seen == [np.dtype("float32")]
    np.testing.assert_allclose(out, fn(x), rtol=3e-2, atol=0.1)


def test_outputs_are_arrays_of_the_traced_types(getkey):
    def fn(x):
        return x * 2, jnp.asarray(False), jnp.float32(1.5), jnp.int32(3)

    outs = eqx_amp.autocast(fn)(jnp.ones(2))
    for out, expected in zip(outs, fn(jnp.ones(2))):
        assert isinstance(out, jax.Array)
        assert out.dtype == expected.dtype

    model = eqx.nn.BatchNorm(3, "batch", mode="ema")
    state = eqx.nn.State(model)
    x = jr.normal(getkey(), (4, 3))
    forward = eqx_amp.autocast(jax.vmap(model, (0, None), (0, None), axis_name="batch"))
    new_state = forward(x, state)[1]
    # A training step selects between old and new state leafwise: the leaves must
    # be arrays of the same types.
    eqx_amp.select_tree(jnp.asarray(True), new_state, state)


def test_ragged_dot_runs_in_the_compute_dtype(getkey):
    assert compat.ragged_dot_general_p is not None
    assert eqx_amp.DEFAULT_RULES[compat.ragged_dot_general_p] is eqx_amp.LOW
    lhs = jr.normal(getkey(), (6, 4))
    rhs = jr.normal(getkey(), (2, 4, 3))
    sizes = jnp.array([2, 4], jnp.int32)
    fn = lambda lhs, rhs: lax.ragged_dot(lhs, rhs, sizes)  # noqa: E731
    ((eqn, _),) = eqns_named(
        traced(eqx_amp.autocast(fn), lhs, rhs), "ragged_dot_general"
    )
    assert in_dtypes(eqn)[:2] == [BF16, BF16]
    np.testing.assert_allclose(
        eqx_amp.autocast(fn)(lhs, rhs), fn(lhs, rhs), rtol=5e-2, atol=5e-2
    )


def test_a_callable_rule_gets_exactly_the_params_it_returns(getkey):
    def bf16_in_f32_out(compute_dtype, original_dtypes, *invals, **params):
        invals = [v.astype(jnp.bfloat16) for v in invals]
        return invals, dict(params, preferred_element_type=jnp.float32)

    w = jr.normal(getkey(), (4, 4))
    fn = eqx_amp.autocast(lambda x: x @ w, rules={lax.dot_general_p: bf16_in_f32_out})
    ((eqn, _),) = eqns_named(traced(fn, jnp.ones(4)), "dot_general")
    assert in_dtypes(eqn) == [BF16, BF16]
    assert out_dtypes(eqn) == [F32]


def test_a_rule_that_breaks_its_contract_is_named():
    bad = lambda compute_dtype, original_dtypes, *invals, **params: invals  # noqa: E731
    fn = eqx_amp.autocast(jnp.exp, rules={lax.exp_p: bad})
    with pytest.raises(
        TypeError, match=r"must return a pair `\(invals, params\)`.*1 inputs"
    ):
        fn(jnp.ones(2))
    with pytest.raises(
        ValueError, match=r"The rule for .*exp.* is <class .*float32.*not a rule"
    ):
        eqx_amp.autocast(jnp.exp, rules={lax.exp_p: jnp.float32})


def test_unknown_higher_order_primitive_warns_once(getkey):
    def fn(x):
        return lax.reduce(x, 1.0, lambda a, b: a * b + 0.5, (0,))

    x = jr.normal(getkey(), (4,))
    amp = eqx_amp.autocast(fn)
    with pytest.warns(
        UserWarning, match=r"does not know the higher-order primitive `reduce`"
    ):
        out = amp(x)
    np.testing.assert_array_equal(out, fn(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp(x)  # once only


def test_version_comes_from_the_installed_package():
    assert eqx_amp.__version__ == importlib.metadata.version("eqx_amp")


#
# `autocast` through each higher-order primitive.
#


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
    ((scan_eqn, _),) = eqns_named(jaxpr, "scan")
    num_consts, _ = compat.scan_counts(scan_eqn.params)
    assert in_dtypes(scan_eqn)[num_consts] == F32  # the carry
    assert out_dtypes(scan_eqn)[0] == F32
    assert_matmuls_in(jaxpr, BF16, at_least=2)
    (h, hs), (_, ref_hs) = amp(cell, xs), rnn(cell, xs)
    assert h.dtype == hs.dtype == F32
    assert rel_error(hs, ref_hs) < 3e-2
    loss = lambda f: lambda c: jnp.sum(f(c, xs)[1] ** 2)  # noqa: E731
    assert_tree_close(
        eqx.filter_grad(loss(amp))(cell), eqx.filter_grad(loss(rnn))(cell), tol=6e-2
    )


def test_cond_while_and_checkpoint(getkey):
    w = jr.normal(getkey(), (6, 6)) / 3

    def fn(x):
        x = lax.cond(x.sum() > 0, lambda a: jnp.tanh(a @ w), lambda a: a @ w.T, x)
        x = lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1] @ w)), (0, x)
        )[1]
        return jax.checkpoint(lambda a: jnp.exp(a @ w))(x)

    x = jr.normal(getkey(), (6,))
    amp = eqx_amp.autocast(fn)
    jaxpr = traced(amp, x)
    assert ops_in(jaxpr, "dot_general") == [[BF16, BF16]] * 4
    assert ops_in(jaxpr, "exp") == [[F32]]
    ((while_eqn, _),) = eqns_named(jaxpr, "while")
    assert out_dtypes(while_eqn)[1] == F32
    ((cond_eqn, _),) = eqns_named(jaxpr, "cond")
    assert out_dtypes(cond_eqn) == [F32]
    assert eqns_named(jaxpr, "checkpoint", "remat2")
    assert rel_error(amp(x), fn(x)) < 3e-2

    def differentiable(x):  # while_loop has no reverse-mode derivative
        x = lax.cond(x.sum() > 0, lambda a: jnp.tanh(a @ w), lambda a: a @ w.T, x)
        return jnp.sum(jax.checkpoint(lambda a: jnp.exp(a @ w))(x))

    g_amp = jax.grad(eqx_amp.autocast(differentiable))(x)
    assert rel_error(g_amp, jax.grad(differentiable)(x)) < 5e-2
    # The checkpointed exp runs twice under grad (forward and recomputed): both f32.
    grad_exps = ops_in(
        jax.make_jaxpr(jax.grad(eqx_amp.autocast(differentiable)))(x), "exp"
    )
    assert len(grad_exps) >= 1 and all(d == [F32] for d in grad_exps)


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
        assert rel_error(amp_grad, expected_scale * w.sum(1)) < 2e-2
        assert rel_error(amp_grad, jax.grad(loss)(x)) < 2e-2
        jaxpr = jax.make_jaxpr(eqx.filter_value_and_grad(eqx_amp.autocast(loss)))(x)
        # Under differentiation, the forward matmul (inside the user's rule) is
        # still bfloat16.
        assert [BF16, BF16] in ops_in(jaxpr, "dot_general")


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
        assert rel_error(value, ref_value) < 3e-2
        assert_tree_close(grads, ref_grads, tol=6e-2)
    jaxpr = traced(eqx_amp.autocast(eqx.filter_value_and_grad(loss)), model, x)
    # The backward matmuls are rewritten too.
    assert_matmuls_in(jaxpr, BF16, at_least=6)


@pytest.mark.slow
def test_shard_map_body_is_rewritten():
    script = textwrap.dedent(
        """
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
        report = {"devices": len(jax.devices())}
        """
    )
    assert run_script_on_eight_devices(script)["devices"] == 8


def test_custom_jvp_with_symbolic_zeros_runs_at_its_traced_dtypes(getkey):
    @jax.custom_jvp
    def square(x):
        return x * x

    def square_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        t = (
            jnp.zeros_like(x)
            if isinstance(t, jax.custom_derivatives.SymbolicZero)
            else t
        )
        return square(x), 2 * x * t

    square.defjvp(square_jvp, symbolic_zeros=True)
    w = jr.normal(getkey(), (3, 3))

    def fn(x):
        return jnp.sum(square(x @ w))

    x = jr.normal(getkey(), (3,))
    amp = eqx_amp.autocast(fn)
    ((call, _),) = eqns_named(traced(amp, x), "custom_jvp_call")
    assert in_dtypes(call) == [F32]
    assert rel_error(jax.grad(amp)(x), jax.grad(fn)(x)) < 3e-2


def test_bitcasts_see_the_dtypes_they_were_traced_with(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        bits = lax.bitcast_convert_type(x @ w, jnp.int32)  # float32 bits
        return bits, x @ w

    x = jr.normal(getkey(), (4,))
    bits, y = eqx_amp.autocast(fn)(x)
    assert bits.dtype == jnp.int32 and bits.shape == (4,)
    # The bits are those of the float32 value the op received.
    np.testing.assert_array_equal(
        bits, lax.bitcast_convert_type(y.astype(jnp.float32), jnp.int32)
    )


def test_custom_linear_solve_bodies_follow_the_rules(getkey):
    a = jr.normal(getkey(), (4, 4)) / 4 + 2 * jnp.eye(4)
    b = jr.normal(getkey(), (4,))

    def fn(a, b):
        def solve(matvec, rhs):  # a fixed-point iteration, enough for this a
            return lax.fori_loop(0, 30, lambda i, x: x + (rhs - matvec(x)) / 2, rhs / 2)

        return lax.custom_linear_solve(lambda x: a @ x, b, solve, transpose_solve=solve)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known: no "does not know" warning
        amp = eqx_amp.autocast(fn)
        jaxpr = traced(amp, a, b)
    ((solve_eqn, _),) = eqns_named(jaxpr, "custom_linear_solve")
    assert in_dtypes(solve_eqn) == in_dtypes(
        eqns_named(traced(fn, a, b), "custom_linear_solve")[0][0]
    )
    assert [BF16, BF16] in ops_in(jaxpr, "dot_general")  # inside the matvec
    np.testing.assert_allclose(amp(a, b), fn(a, b), rtol=5e-2, atol=5e-2)
    grad = jax.grad(lambda b: jnp.sum(amp(a, b)))(b)
    expected = jax.grad(lambda b: jnp.sum(fn(a, b)))(b)
    np.testing.assert_allclose(grad, expected, rtol=5e-2, atol=5e-2)

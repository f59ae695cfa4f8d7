"""`autocast`'s rule table: which dtype each primitive or named scope runs in, and
how values computed from parameters follow the activations they meet."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

import eqx_amp

from .helpers import (
    eqns_named,
    in_dtypes,
    ops_in,
    out_dtypes,
    rel_error,
    traced,
    walk_eqns,
)


F32, BF16, F16 = jnp.dtype("float32"), jnp.dtype("bfloat16"), jnp.dtype("float16")


def test_default_rules_table():
    assert eqx_amp.DEFAULT_RULES[lax.dot_general_p] is eqx_amp.LOW
    assert eqx_amp.DEFAULT_RULES[lax.conv_general_dilated_p] is eqx_amp.LOW
    for p in (
        lax.exp_p,
        lax.log_p,
        lax.rsqrt_p,
        lax.reduce_sum_p,
        lax.cumsum_p,
        lax.pow_p,
        lax.erf_inv_p,
    ):
        assert eqx_amp.DEFAULT_RULES[p] is eqx_amp.FULL, p
    for p in (
        lax.add_p,
        lax.mul_p,
        lax.select_n_p,
        lax.concatenate_p,
        lax.pad_p,
        lax.clamp_p,
        lax.atan2_p,
        lax.dynamic_update_slice_p,
        lax.scatter_add_p,
    ):
        assert eqx_amp.DEFAULT_RULES[p] is eqx_amp.PROMOTE, p
    assert eqx_amp.DEFAULT_RULES[lax.square_p] is eqx_amp.FULL
    assert (
        eqx_amp.DEFAULT_RULES[lax.gather_p]
        is eqx_amp.DEFAULT_RULES[lax.dynamic_slice_p]
    )
    assert eqx_amp.DEFAULT_RULES["eqx.nn.LayerNorm"] is eqx_amp.FULL
    assert eqx_amp.DEFAULT_RULES["eqx_amp.full_precision"] is eqx_amp.KEEP
    assert repr(eqx_amp.LOW) == "eqx_amp.LOW"


def test_primitive_rules_and_builtin_values(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        return jnp.exp(x @ w)

    x = jr.normal(getkey(), (4,))
    full_matmul = traced(
        eqx_amp.autocast(fn, rules={lax.dot_general_p: eqx_amp.FULL}), x
    )
    assert ops_in(full_matmul, "dot_general") == [[F32, F32]]
    low_exp = traced(eqx_amp.autocast(fn, rules={lax.exp_p: eqx_amp.LOW}), x)
    assert ops_in(low_exp, "exp") == [[BF16]]
    kept = traced(eqx_amp.autocast(fn, rules={lax.dot_general_p: eqx_amp.KEEP}), x)
    assert ops_in(kept, "dot_general") == [[F32, F32]]
    promoted = traced(eqx_amp.autocast(fn, rules={lax.exp_p: eqx_amp.PROMOTE}), x)
    assert ops_in(promoted, "exp") == [[BF16]]


def test_jaxamp_signature_callable_rule(getkey):
    calls = []

    def to_float16(compute_dtype, original_dtypes, *invals, **params):
        calls.append((compute_dtype, tuple(original_dtypes)))
        return [v.astype(jnp.float16) for v in invals], params

    x = jr.normal(getkey(), (4,))
    amp = eqx_amp.autocast(lambda x: jnp.sin(x) * 2, rules={lax.sin_p: to_float16})
    jaxpr = traced(amp, x)
    assert ops_in(jaxpr, "sin") == [[F16]]
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
    assert ops_in(jaxpr, "dot_general") == [[F32, F32], [BF16, BF16]]


def test_explicit_casts_outputs_and_integers(getkey):
    def fn(x, n):
        y = (x @ x.T).astype(jnp.float32)  # explicit: honoured
        z = (x @ x.T).astype(jnp.float16)
        return y, z, n * 2, jnp.argmax(y, axis=-1)

    x = jr.normal(getkey(), (3, 3))
    amp = eqx_amp.autocast(fn)
    y, z, n, idx = amp(x, jnp.arange(3))
    assert (y.dtype, z.dtype, n.dtype, idx.dtype) == (F32, F16, jnp.int32, jnp.int32)
    converts = [
        e.params["new_dtype"]
        for e, _ in eqns_named(traced(amp, x, jnp.arange(3)), "convert_element_type")
    ]
    assert F16 in converts and F32 in converts


def test_scatter_and_preferred_element_type(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        y = x @ w
        y = y.at[0].add(y[1])
        z = lax.dot(
            x.astype(jnp.bfloat16),
            w.astype(jnp.bfloat16),
            preferred_element_type=jnp.float32,
        )
        return y, z

    x = jr.normal(getkey(), (4,))
    amp = eqx_amp.autocast(fn)
    jaxpr = traced(amp, x)
    ((scatter, _),) = eqns_named(jaxpr, "scatter-add", "scatter_add")
    assert in_dtypes(scatter)[0] == BF16
    # The user's explicit float32 accumulation survives.
    assert [out_dtypes(e) for e, _ in eqns_named(jaxpr, "dot_general")] == [
        [BF16],
        [F32],
    ]
    y, z = amp(x)
    ref_y, ref_z = fn(x)
    assert rel_error(y, ref_y) < 2e-2 and rel_error(z, ref_z) < 1e-6


def test_activations_flow_in_low_precision_between_layers(getkey):
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=getkey())
    jaxpr = traced(eqx_amp.autocast(mlp), jr.normal(getkey(), (8,)))
    # Bias adds and relus run on bfloat16 activations (parameters cast down to
    # meet them), as in a hand-cast model; only the output is cast back up.
    for name in ("add", "max", "custom_jvp_call"):
        found = ops_in(jaxpr, name)
        assert found and all(d == BF16 for dtypes in found for d in dtypes), (
            name,
            found,
        )
    last_convert = [
        e for e, _ in walk_eqns(jaxpr) if e.primitive.name == "convert_element_type"
    ][-1]
    assert last_convert.params["new_dtype"] == F32


def test_data_is_strong_parameters_and_constants_are_weak(getkey):
    w = jr.normal(getkey(), (4, 4))
    linear = eqx.nn.Linear(4, 4, key=getkey())
    x = jr.normal(getkey(), (4,))

    # A data input meeting a bfloat16 activation: the wider data dtype wins.
    residual = traced(eqx_amp.autocast(lambda x: x @ w + x), x)
    assert ops_in(residual, "add") == [[F32, F32]]
    # A closed-over constant meeting it: the constant follows the activation.
    constant = traced(eqx_amp.autocast(lambda x: x @ w + w[0]), x)
    assert ops_in(constant, "add") == [[BF16, BF16]]
    # Module leaves are parameters, whether the module is `fn` or an argument.
    for amp, args in (
        (eqx_amp.autocast(linear), (x,)),
        (eqx_amp.autocast(lambda m, x: m(x)), (linear, x)),
    ):
        assert ops_in(traced(amp, *args), "add") == [[BF16, BF16]]
    # Parameters meeting parameters keep their own dtype.
    params_only = traced(eqx_amp.autocast(lambda m: m.weight + m.bias[None]), linear)
    assert ops_in(params_only, "add") == [[F32, F32]]


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
        return [d for d in ops_in(jaxpr, "add") if jnp.issubdtype(d[0], jnp.floating)]

    amp = eqx_amp.autocast(residual_stream)
    ((gather, _),) = eqns_named(traced(amp, tokens), "gather")
    assert in_dtypes(gather)[0] == BF16
    assert float_adds(traced(amp, tokens)) == [[BF16, BF16]] * 3
    assert amp(tokens).dtype == F32
    assert rel_error(amp(tokens), residual_stream(tokens)) < 2e-2

    one_token = traced(eqx_amp.autocast(embed), tokens[0])
    ((dynamic_slice, _),) = eqns_named(one_token, "dynamic_slice")
    assert in_dtypes(dynamic_slice)[0] == BF16

    keep = {
        lax.gather_p: eqx_amp.KEEP,
        lax.dynamic_slice_p: eqx_amp.KEEP,
    }
    kept = traced(eqx_amp.autocast(residual_stream, rules=keep), tokens)
    assert float_adds(kept)[0] == [F32, F32]

    x = jr.normal(getkey(), (8, 16))
    data_lookup = traced(eqx_amp.autocast(lambda x, i: x[i] @ positions.T), x, tokens)
    ((gather, _),) = eqns_named(data_lookup, "gather")
    assert in_dtypes(gather)[0] == F32
    constant_slice = traced(
        eqx_amp.autocast(lambda m: lax.dynamic_slice_in_dim(m.weight, 2, 4)), embed
    )
    ((dynamic_slice, _),) = eqns_named(constant_slice, "dynamic_slice")
    assert in_dtypes(dynamic_slice)[0] == F32


def test_range_limited_ops_go_to_float32_for_float16_only(getkey):
    w = jr.normal(getkey(), (4, 4))

    def fn(x):
        h = x @ w
        return jax.nn.sigmoid(h) + h**3

    x = jr.normal(getkey(), (4,))
    for policy, expected in (("mixed_bfloat16", BF16), ("mixed_float16", F32)):
        jaxpr = traced(eqx_amp.autocast(fn, policy=policy), x)
        assert ops_in(jaxpr, "integer_pow") == [[expected]], policy
        assert ops_in(jaxpr, "logistic") == [[expected]], policy
    # x**3 overflows float16 from x = 41: in float32 it does not.
    big = jnp.full((4,), 50.0)
    cube = eqx_amp.autocast(lambda x: (x @ jnp.eye(4)) ** 3, policy="mixed_float16")
    assert jnp.all(jnp.isfinite(cube(big)))


def test_squares_go_to_float32_so_a_fast_variance_does_not_cancel(getkey):
    # A norm layer that does not compute in float32 itself (Flax's, or a
    # hand-written one): variance as E[x^2] - E[x]^2, on activations whose mean is
    # 16 times their spread, as after a bias-free convolution.
    def variance(x, w):
        h = x @ w
        return jnp.mean(jnp.square(h), 0) - jnp.mean(h, 0) ** 2, jnp.mean(h**2, 0)

    w = jnp.eye(8)
    x = (16 + jr.normal(getkey(), (256, 8))).astype(BF16).astype(F32)
    for policy in ("mixed_bfloat16", "mixed_float16"):
        jaxpr = traced(eqx_amp.autocast(variance, policy=policy), x, w)
        assert ops_in(jaxpr, "square") == [[F32]], policy
        assert [
            in_dtypes(e)
            for e, _ in eqns_named(jaxpr, "integer_pow")
            if e.params["y"] == 2
        ] == [[F32]] * 2, policy
    amp, _ = eqx_amp.autocast(variance, policy="mixed_bfloat16")(x, w)
    exact, _ = variance(x, w)
    # bfloat16 inputs to the matmul round x by 2^-9 of 16 (0.03): the variance of
    # the rounded data differs by a few percent; squares in bfloat16 gave 6% to 2x.
    assert rel_error(amp, exact) < 0.05


def test_a_value_is_cast_once_per_dtype(getkey):
    w1, w2, w3 = (jr.normal(getkey(), (4, 4)) for _ in range(3))

    def fn(x):
        h = jnp.exp(x)  # float32 (FULL), read by three bfloat16 matmuls
        return h @ w1, h @ w2, h @ w3

    jaxpr = traced(eqx_amp.autocast(fn), jr.normal(getkey(), (4,)))
    ((exp_eqn, _),) = eqns_named(jaxpr, "exp")
    h = exp_eqn.outvars[0]
    casts_of_h = [
        e for e, _ in eqns_named(jaxpr, "convert_element_type") if e.invars[0] is h
    ]
    assert len(casts_of_h) == 1


def test_constants_saturate_instead_of_overflowing(getkey):
    """A constant cast to a narrower dtype is clipped to its finite range: float32's
    minimum, the fill value of a masked attention, becomes bfloat16's minimum, not
    -inf, so a fully masked row's softmax is not NaN."""
    mha = eqx.nn.MultiheadAttention(2, 8, key=getkey())
    x = jr.normal(getkey(), (5, 8))
    valid = jnp.array([True, True, True, False, False])
    mask = valid[:, None] & valid[None, :]  # rows 3 and 4 are fully masked

    def attend(m, q, mask):
        return m(q, q, q, mask=mask)

    expected = attend(mha, x, mask)
    for policy in ("mixed_bfloat16", "mixed_float16"):
        out = eqx_amp.autocast(attend, policy=policy)(mha, x, mask)
        assert np.all(np.isfinite(out)), policy
        assert rel_error(out, expected) < 2e-2

    # Under float16 a large constant meets a float16 activation: 65504, not inf.
    w = jr.normal(getkey(), (3, 3))
    fn = eqx_amp.autocast(lambda x: jnp.minimum(x @ w, 1e5), policy="mixed_float16")
    out = fn(jr.normal(getkey(), (3,)))
    assert np.all(np.isfinite(out))
    # Data is not clipped: an activation that overflows float16 stays visible.
    huge = eqx_amp.autocast(lambda x: x @ w, policy="mixed_float16")(
        jnp.full((3,), 1e5)
    )
    assert not np.all(np.isfinite(huge))


def test_linear_algebra_runs_in_float32(getkey):
    """LAPACK and cuSOLVER have no half-precision decompositions: a bfloat16 matmul
    output reaching `jnp.linalg.solve` or `cholesky` is cast up for them."""
    a = jr.normal(getkey(), (4, 4)) + 4 * jnp.eye(4)
    b = jr.normal(getkey(), (4,))
    solve = lambda a, b: jnp.linalg.solve(a @ a.T, b)  # noqa: E731
    chol = lambda a: jnp.linalg.cholesky(a @ a.T)  # noqa: E731
    for name in ("lu", "triangular_solve"):
        for eqn, _ in eqns_named(traced(eqx_amp.autocast(solve), a, b), name):
            assert set(in_dtypes(eqn)) <= {F32, jnp.dtype(jnp.int32)}, name
    assert rel_error(eqx_amp.autocast(solve)(a, b), solve(a, b)) < 2e-2
    assert rel_error(eqx_amp.autocast(chol)(a), chol(a)) < 2e-2


def test_keep_and_KEEP_cannot_be_swapped_silently(getkey):
    """`eqx_amp.keep` (a filter spec) and `eqx_amp.KEEP` (an autocast rule) are both
    founding names; each used in the other's place names the right one."""
    model = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    x = jnp.ones(4)
    with pytest.raises(TypeError, match=r"is `eqx_amp\.keep`, which builds a filter"):
        eqx_amp.autocast(model, rules={jax.lax.dot_general_p: eqx_amp.keep})(x)
    for rule in (eqx_amp.KEEP, eqx_amp.LOW, eqx_amp.FULL, eqx_amp.PROMOTE):
        message = rf"`{rule!r}` is an autocast rule.*`filter_spec=eqx_amp\.keep\("
        with pytest.raises(TypeError, match=message):
            eqx_amp.filter_amp(model, filter_spec=rule)(x)
        with pytest.raises(TypeError, match=message):
            eqx_amp.cast_tree(model, jnp.bfloat16, rule)
        with pytest.raises(TypeError, match=message):
            eqx_amp.BiModel(model, filter_spec=rule)

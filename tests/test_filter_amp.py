import ast
import functools as ft
import pathlib
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp

from .helpers import (
    assert_matmuls_in,
    assert_scope_in_float32,
    eqns_named,
    float_dtypes,
    in_dtypes,
    rel_error,
    traced,
    walk_eqns,
)
from .models import CNN, BatchNormNet, TransformerBlock


F32 = jnp.dtype(jnp.float32)


@pytest.fixture(params=[jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def half(request):
    return jnp.dtype(request.param)


def _policy(half):
    return eqx_amp.Policy(jnp.float32, half, jnp.float32)


def _assert_grads_close(amp_grads, ref_grads, tol):
    """Every gradient leaf is float32 and within `tol` relative error (in norm) of
    the float32 reference."""
    amp_leaves = jax.tree_util.tree_leaves(amp_grads)
    ref_leaves = jax.tree_util.tree_leaves(ref_grads)
    assert len(amp_leaves) == len(ref_leaves)
    for amp, ref in zip(amp_leaves, ref_leaves):
        assert amp.dtype == F32
        error = jnp.linalg.norm(amp - ref) / (jnp.linalg.norm(ref) + 1e-12)
        assert error < tol, f"relative gradient error {error:.3g} for shape {ref.shape}"


def _check_model(model, x, policy, tol, *, norm_scope=None, min_matmuls=1):
    """The four properties every AMP'd model must have: matmuls in the compute
    dtype, norms in float32, float32 outputs, and float32 gradients close to the
    float32 ones."""
    amp_model = eqx_amp.filter_amp(model, policy=policy)
    jaxpr = traced(amp_model, x)
    assert_matmuls_in(jaxpr, policy.compute_dtype, at_least=min_matmuls)
    if norm_scope is not None:
        assert_scope_in_float32(jaxpr, norm_scope)
    assert float_dtypes(amp_model(x)) == {F32}

    def loss(model, amp):
        out = eqx_amp.filter_amp(model, policy=policy)(x) if amp else model(x)
        return jnp.mean(out**2)

    grad_fn = eqx.filter_jit(eqx.filter_grad(loss))
    ref = grad_fn(model, False)
    grads = grad_fn(model, True)
    _assert_grads_close(grads, ref, tol)
    return jaxpr


def test_mlp(half, getkey):
    model = eqx.nn.MLP(8, 4, 32, 2, key=getkey())
    x = jr.normal(getkey(), (8,))
    jaxpr = _check_model(model, x, _policy(half), tol=3e-2, min_matmuls=3)
    assert len(eqns_named(jaxpr, "dot_general")) == 3


def test_transformer_block(half, getkey):
    model = TransformerBlock(16, 4, key=getkey())
    x = jr.normal(getkey(), (10, 16))
    jaxpr = _check_model(
        model, x, _policy(half), tol=5e-2, norm_scope="eqx.nn.LayerNorm", min_matmuls=8
    )
    # The attention projections, QK^T, AV and the MLP all run in half precision.
    assert len(eqns_named(jaxpr, "dot_general")) >= 8


def test_cnn_with_group_norm(half, getkey):
    model = CNN(key=getkey())
    x = jr.normal(getkey(), (1, 8, 8))
    jaxpr = _check_model(
        model, x, _policy(half), tol=5e-2, norm_scope="eqx.nn.GroupNorm"
    )
    assert len(eqns_named(jaxpr, "conv_general_dilated")) == 2


def test_batch_norm_state_keeps_its_dtype(half, getkey):
    model, state = eqx.nn.make_with_state(BatchNormNet)(key=getkey())
    amp_model = eqx_amp.filter_amp(model, policy=_policy(half))
    x = jr.normal(getkey(), (32, 6))

    def forward(x, state):
        return jax.vmap(
            amp_model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)

    jaxpr = traced(forward, x, state)
    assert_matmuls_in(jaxpr, half, at_least=2)
    assert_scope_in_float32(jaxpr, "BatchNorm")

    @eqx.filter_jit
    def step(model, state, x):
        def loss(model):
            amp = eqx_amp.filter_amp(model, policy=_policy(half))
            out, new_state = jax.vmap(
                amp, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
            )(x, state)
            return jnp.mean(out**2), new_state

        (value, new_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        return value, new_state, grads

    before = jax.tree_util.tree_leaves(state)
    for _ in range(3):
        value, state, grads = step(model, state, x)
        assert value.dtype == F32
        assert float_dtypes(state) == {F32}
        assert float_dtypes(grads) == {F32}
    after = jax.tree_util.tree_leaves(state)
    assert [a.dtype for a in after] == [b.dtype for b in before]
    assert not all(np.array_equal(a, b) for a, b in zip(after, before))  # stats moved


def test_under_filter_jit_and_vmap_lowered_hlo(half, getkey):
    model = eqx.nn.MLP(8, 4, 32, 2, key=getkey())
    x = jr.normal(getkey(), (16, 8))

    @eqx.filter_jit
    def forward(model, x):
        return jax.vmap(eqx_amp.filter_amp(model, policy=_policy(half)))(x)

    out = forward(model, x)
    assert out.dtype == F32 and out.shape == (16, 4)
    np.testing.assert_allclose(out, jax.vmap(model)(x), rtol=0.1, atol=0.05)
    hlo = forward.lower(model, x).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3
    short = {"bfloat16": "bf16", "float16": "f16"}[half.name]
    assert all(f"tensor<16x8x{short}>" in d or f"x{short}>" in d for d in dots), dots


@pytest.mark.parametrize(
    "form",
    [
        "module",
        "bound method",
        "closure",
        "nested closure",
        "partial",
        "argument",
        "decorator",
    ],
)
def test_callable_forms(form, getkey):
    model = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    x = jnp.ones(4)
    policy = eqx_amp.get_policy("mixed_bfloat16")

    def apply(m, x):
        return m(x)

    def closure(x):
        return model(x)

    def outer(x):
        return closure(x)

    if form == "module":
        fn, args = eqx_amp.filter_amp(model, policy=policy), (x,)
    elif form == "bound method":
        fn, args = eqx_amp.filter_amp(model.__call__, policy=policy), (x,)
    elif form == "closure":
        fn, args = eqx_amp.filter_amp(closure, policy=policy), (x,)
    elif form == "nested closure":
        fn, args = eqx_amp.filter_amp(outer, policy=policy), (x,)
    elif form == "partial":
        fn, args = eqx_amp.filter_amp(ft.partial(apply, model), policy=policy), (x,)
    elif form == "argument":
        fn, args = eqx_amp.filter_amp(apply, policy=policy), (model, x)
    else:
        fn, args = eqx_amp.filter_amp(policy=policy)(apply), (model, x)
    jaxpr = traced(fn, *args)
    assert_matmuls_in(jaxpr, jnp.bfloat16, at_least=2)
    assert fn(*args).dtype == F32
    # The model itself is untouched.
    assert float_dtypes(model) == {F32}


def test_wrapper_is_a_pytree_with_float32_gradients(getkey):
    model = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    amp_model = eqx_amp.filter_amp(model)
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(amp_model, jnp.ones(4))
    assert isinstance(grads.fn, eqx.nn.MLP)
    assert float_dtypes(grads) == {F32}
    assert eqx.tree_equal(amp_model.__wrapped__, model)


def test_user_spec_keeps_a_submodule_at_its_own_boundary(getkey):
    model = TransformerBlock(8, 2, key=getkey())
    spec = eqx_amp.keep(model, eqx.nn.MLP)
    jaxpr = traced(eqx_amp.filter_amp(model, filter_spec=spec), jnp.ones((4, 8)))
    for eqn, scope in eqns_named(jaxpr, "dot_general"):
        expected = F32 if "eqx.nn.MLP" in scope else jnp.bfloat16
        assert in_dtypes(eqn) == [expected, expected], scope
    assert any("eqx.nn.MLP" in s for _, s in eqns_named(jaxpr, "dot_general"))


def test_fully_kept_model_runs_in_param_dtype(getkey):
    norm = eqx.nn.LayerNorm(4)
    amp_norm = eqx_amp.filter_amp(norm, policy="mixed_float16")
    jaxpr = traced(amp_norm, jnp.ones(4))
    assert_scope_in_float32(jaxpr, "LayerNorm")
    assert amp_norm(jnp.ones(4)).dtype == F32


def test_boundary_keeps_isinstance_for_sequential_state(getkey):
    # eqx.nn.Sequential threads state only through layers that are StatefulLayer
    # instances: the kept BatchNorm must still be one.
    model, state = eqx.nn.make_with_state(BatchNormNet)(key=getkey())
    out, new_state = jax.vmap(
        eqx_amp.filter_amp(model),
        axis_name="batch",
        in_axes=(0, None),
        out_axes=(0, None),
    )(jnp.ones((4, 6)), state)
    assert out.shape == (4, 3)
    assert isinstance(new_state, eqx.nn.State)


def test_callable_leaf_spec_and_bool_spec(getkey):
    model = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    # Only the matrices in half precision.
    # As with `eqx.partition`, a callable spec sees every leaf, arrays or not.
    amp = eqx_amp.filter_amp(
        model, filter_spec=lambda leaf: eqx.is_array(leaf) and leaf.ndim == 2
    )
    cast_model = eqx_amp.cast_tree(model, jnp.bfloat16, amp.filter_spec)
    assert cast_model.layers[0].weight.dtype == jnp.bfloat16
    assert cast_model.layers[0].bias.dtype == F32
    # A bias kept in float32 beside a bfloat16 matmul mixes dtypes: the model's own
    # `dot + bias` decides (under standard promotion, float32 from there on).
    with jax.numpy_dtype_promotion("standard"):
        jaxpr = traced(amp, jnp.ones(4))
    first_dot, _ = eqns_named(jaxpr, "dot_general")[0]
    assert in_dtypes(first_dot) == [jnp.bfloat16, jnp.bfloat16]
    # Nothing cast: the whole model runs in float32 after its input is cast up.
    nothing = eqx_amp.filter_amp(model, filter_spec=False)
    jaxpr = traced(nothing, jnp.ones(4))
    assert_matmuls_in(jaxpr, F32, at_least=2)


def test_outputs(getkey):
    def fn(x):
        return {"f": x, "i": jnp.arange(2), "py": 1.0, "key": jr.key(0)}

    out = eqx_amp.filter_amp(fn, policy="p=f32,c=bf16,o=f16")(jnp.ones(2))
    assert out["f"].dtype == jnp.float16
    assert out["i"].dtype == jnp.int32
    assert out["py"] == 1.0


def test_integer_and_key_arguments_untouched(getkey):
    emb = eqx.nn.Embedding(10, 4, key=getkey())
    jaxpr = traced(eqx_amp.filter_amp(emb), jnp.array(3))
    assert jaxpr.in_avals[-1].dtype == jnp.int32
    assert eqx_amp.filter_amp(emb)(jnp.array(3)).dtype == F32


def test_full_precision_decorator(getkey):
    @eqx_amp.full_precision
    def softmax(logits):
        return jax.nn.softmax(logits)

    model = eqx.nn.Linear(4, 4, key=getkey())

    def forward(x):
        return softmax(model(x))

    amp = eqx_amp.filter_amp(forward)
    jaxpr = traced(amp, jnp.ones(4))
    exps = eqns_named(jaxpr, "exp")
    assert exps and all(in_dtypes(e) == [F32] for e, _ in exps)
    assert all("eqx_amp.full_precision" in s for _, s in exps)
    assert_matmuls_in(jaxpr, jnp.bfloat16)
    # Outputs go back to the caller's dtype.
    assert softmax(jnp.ones(3, jnp.bfloat16)).dtype == jnp.bfloat16
    assert softmax(jnp.ones(3, jnp.float16)).dtype == jnp.float16


def test_full_precision_on_a_module(getkey):
    head = eqx.nn.Linear(4, 2, key=getkey())
    half_head = eqx_amp.cast_tree(head, jnp.bfloat16)
    jaxpr = traced(eqx_amp.full_precision(half_head), jnp.ones(4, jnp.bfloat16))
    assert_matmuls_in(jaxpr, F32)
    assert (
        eqx_amp.full_precision(half_head)(jnp.ones(4, jnp.bfloat16)).dtype
        == jnp.bfloat16
    )


def test_full_precision_context_manager_opens_scope():
    def f(x):
        with eqx_amp.full_precision():
            y = jnp.exp(x)
        return jnp.sin(y)

    scopes = {e.primitive.name: s for e, s in walk_eqns(traced(f, jnp.ones(2)))}
    assert scopes["exp"] == "eqx_amp.full_precision"
    assert scopes["sin"] == ""

    @eqx_amp.full_precision()
    def g(x):
        return x * 2

    assert g(jnp.ones(2, jnp.float16)).dtype == jnp.float16
    jaxpr = traced(g, jnp.ones(2, jnp.float16))
    assert [in_dtypes(e) for e, _ in eqns_named(jaxpr, "mul")] == [[F32, F32]]


def test_full_precision_bad_input():
    with pytest.raises(TypeError, match=r"`full_precision` takes a callable.*got int"):
        eqx_amp.full_precision(3)  # type: ignore[arg-type]


def test_bad_inputs_raise_and_mutate_nothing(getkey):
    model = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    before = jax.tree_util.tree_map(lambda x: x, model)
    with pytest.raises(ValueError, match=r"`compute_dtype` must be a real floating"):
        eqx_amp.filter_amp(
            model, policy=eqx_amp.Policy(jnp.float32, jnp.int8, jnp.float32)
        )
    with pytest.raises(ValueError, match=r"'int8' in policy 'c=int8' is int8"):
        eqx_amp.filter_amp(model, policy="c=int8")
    with pytest.raises(ValueError, match=r"Unknown key 'compute_dtype'"):
        eqx_amp.filter_amp(model, policy="compute_dtype=bf16")
    with pytest.raises(ValueError, match=r"`filter_spec` does not match the structure"):
        eqx_amp.filter_amp(
            model,
            filter_spec=eqx_amp.default_filter_spec(
                eqx.nn.MLP(4, 2, 8, 2, key=getkey())
            ),
        )
    with pytest.raises(ValueError, match=r"`filter_spec` does not match the structure"):
        eqx_amp.filter_amp(model, filter_spec=[True, False])
    with pytest.raises(
        ValueError, match=r"not an `eqx.Module`, so there is no structure"
    ):
        eqx_amp.filter_amp(lambda x: model(x), filter_spec={"a": True})
    with pytest.raises(TypeError, match=r"`filter_amp` takes a callable.*got ndarray"):
        eqx_amp.filter_amp(np.ones(3))  # type: ignore[arg-type]
    assert eqx.tree_equal(model, before)
    assert float_dtypes(model) == {F32}


def test_weights_too_large_for_the_compute_dtype_are_named_once(getkey):
    model = eqx.nn.Linear(3, 3, key=getkey())
    model = eqx.tree_at(lambda m: m.bias, model, model.bias.at[1].set(-7e4))
    with pytest.warns(
        UserWarning,
        match=r"casts the weights to float16.*value of \.bias: it will be inf",
    ):
        amp = eqx_amp.filter_amp(model, policy="mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp(jnp.ones(3))  # said once, at `filter_amp(...)`
        eqx_amp.filter_amp(model, policy="mixed_bfloat16")
        spec = eqx_amp.keep(model, lambda m: m is model)
        eqx_amp.filter_amp(model, policy="mixed_float16", filter_spec=spec)


def test_closure_semantics(getkey):
    """What `filter_amp(fn)` casts in a plain function: the modules and arrays it
    closes over or takes as defaults, in a view made per call; lists and dicts are
    the function's own objects, never copies; a recursive function calls its view."""
    model = eqx.nn.Linear(3, 3, key=getkey())
    x = jnp.ones(3)

    log = []

    def logs(x):
        y = model(x)
        log.append(y.dtype)
        return y

    amp_logs = eqx_amp.filter_amp(logs)
    amp_logs(x)
    # The append is seen (the list is not copied), once (the call runs `logs` once,
    # checking nothing), and the model ran in bfloat16.
    assert log == [jnp.dtype(jnp.bfloat16)]

    def with_default(x, m=model):
        return m(x)

    report = eqx_amp.precision_report(eqx_amp.filter_amp(with_default), x)
    assert report.low_precision_share == 1.0
    assert with_default.__defaults__[0] is model  # the original is untouched

    def recursive(x, n):
        if n == 0:
            return model(x)
        return recursive(x, n - 1)

    report = eqx_amp.precision_report(eqx_amp.filter_amp(recursive), x, 3)
    assert report.low_precision_share == 1.0

    layers = [model]
    with pytest.raises(TypeError, match=r"closes over a list `layers` holding modules"):
        eqx_amp.filter_amp(lambda x: layers[0](x))
    kept = (model,)
    assert eqx_amp.filter_amp(lambda x: kept[0](x))(x).dtype == F32


class _Denoiser(eqx.Module):
    """A score model's shape: the time goes through a sinusoidal embedding."""

    linear: eqx.nn.Linear

    def __call__(self, t, y):
        freqs = jnp.arange(1, 5, dtype=t.dtype)
        embedding = jnp.sin(t * freqs).astype(y.dtype)
        return self.linear(jnp.concatenate([y, embedding])), t


def test_arg_spec_keeps_a_diffusion_time_in_float32(getkey):
    model = _Denoiser(eqx.nn.Linear(6, 2, key=getkey()))
    ts = jnp.linspace(8.0, 10.0, 1000)
    y = jnp.ones(2)
    cast_all = eqx_amp.filter_amp(model)
    keep_time = eqx_amp.filter_amp(model, arg_spec=((False, True), {}))
    seen_all = jax.vmap(lambda t: cast_all(t, y)[1])(ts)
    seen_kept = jax.vmap(lambda t: keep_time(t, y)[1])(ts)
    assert len(np.unique(np.asarray(seen_all))) < 100  # bfloat16 merges most times
    np.testing.assert_array_equal(seen_kept, ts)  # every time arrives as given
    report = eqx_amp.precision_report(keep_time, ts[0], y)
    assert set(report.ops["dot_general"]) == {("bfloat16", "bfloat16")}
    state_kept = eqx_amp.filter_amp(lambda s, x: s, arg_spec=True)
    state = eqx.nn.State(eqx.nn.BatchNorm(2, "batch", mode="batch"))
    assert eqx.tree_equal(state_kept(state, y), state)  # State is never cast
    with pytest.raises(ValueError, match=r"`arg_spec` does not fit the arguments"):
        eqx_amp.filter_amp(model, arg_spec=((False, True, True), {}))(ts[0], y)


class _RNN(eqx.Module):
    cell: eqx.nn.GRUCell
    carry_in_input_dtype: bool = eqx.field(static=True)

    def __call__(self, xs):
        dtype = xs.dtype if self.carry_in_input_dtype else jnp.float32
        h0 = jnp.zeros(self.cell.hidden_size, dtype)
        return jax.lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)[0]


class _SpectralMLP(eqx.Module):
    layer: eqx.nn.SpectralNorm

    def __call__(self, x, state):
        return self.layer(x, state)


def test_low_coverage_is_the_reports_to_say_naming_the_cause(getkey):
    """An RNN whose carry is made in float32 inside the model runs most of its
    matmuls wide under `filter_amp`, and so does a SpectralNorm layer (its float32
    state makes the weight float32): the first traced call of each warns once (it
    traces the model once, as the model alone would be), a concrete call says
    nothing, and `precision_report` names the cause."""
    eqx_amp.diagnostics.check_coverage(True)  # every model unchecked
    xs = jnp.ones((10, 8))
    wide = _RNN(eqx.nn.GRUCell(8, 32, key=getkey()), carry_in_input_dtype=False)
    fixed = _RNN(eqx.nn.GRUCell(8, 32, key=getkey()), carry_in_input_dtype=True)
    spectral, state = eqx.nn.make_with_state(_SpectralMLP)(
        eqx.nn.SpectralNorm(eqx.nn.Linear(8, 8, key=getkey()), "weight", key=getkey())
    )
    # As users run them: float32 values meet bfloat16 ones in these models.
    with jax.numpy_dtype_promotion("standard"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.make_jaxpr(eqx_amp.filter_amp(wide))(xs)
            eqx_amp.filter_amp(wide)(xs)
            jax.make_jaxpr(eqx_amp.filter_amp(wide))(xs)  # checked once
            eqx.filter_jit(eqx_amp.filter_amp(spectral))(jnp.ones(8), state)
        assert [w.category for w in caught] == 2 * [eqx_amp.diagnostics.CoverageWarning]
        assert "of _RNN run in bfloat16" in str(caught[0].message)
        assert "keep(model, eqx.nn.SpectralNorm)" in str(caught[1].message)
        advice = eqx_amp.precision_report(eqx_amp.filter_amp(wide), xs).advice
        assert re.search(
            r"Only 20% .* of _RNN run in bfloat16.*test_filter_amp\.py", advice
        )
        report = eqx_amp.precision_report(
            eqx_amp.filter_amp(spectral), jnp.ones(8), state
        )
        assert re.search(r"Only 0% .* of _SpectralMLP", report.advice)
        assert "eqx_amp.keep(model, eqx.nn.SpectralNorm)" in report.advice
    report = eqx_amp.precision_report(eqx_amp.filter_amp(fixed), xs)
    assert report.low_precision_share == 1.0 and report.advice == ""


def test_the_call_path_imports_neither_the_diagnostics_nor_fp8():
    """`filter_amp`'s module reaches fp8 through the rule given as `fp8=`
    (`Fp8Rule.run_in_fp8`), and leaves coverage to `precision_report`: none of its
    imports names either."""
    import eqx_amp._filter_amp as package

    imported = set()
    modules = pathlib.Path(package.__file__).parent.glob("*.py")
    nodes = [n for m in modules for n in ast.walk(ast.parse(m.read_text()))]
    for node in nodes:
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module_name = "." * node.level + (node.module or "")
            imported |= {f"{module_name}.{alias.name}" for alias in node.names}
    forbidden = ("_fp8", "fp8", "_report", "_nonfinite", "_coverage", "diagnostics")
    for name in imported:
        assert not set(name.split(".")) & set(forbidden), name
    assert ".._sharding.ReduceInHook" in imported  # the check reads the imports


def _warning_at(expected_line, message, call):
    """The one warning `call` makes that matches `message`, checked to point at
    `expected_line` of this file."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    found = [w for w in caught if re.search(message, str(w.message))]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert (found[0].filename, found[0].lineno) == (__file__, expected_line)


def test_an_fp8_filter_selecting_nothing_is_warned_of_at_the_users_line(getkey):
    """Both `fp8_filter` warnings name the line that calls `filter_amp`'s wrapper
    or builds the `BiModel`; they named the line above it (pytest's, here)."""
    model = eqx.nn.Linear(16, 16, key=getkey())
    x = jnp.ones(16)
    selects_nothing = lambda module: False  # noqa: E731

    def call():
        amp = eqx_amp.filter_amp(
            lambda y: model(y), fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=selects_nothing
        )
        amp(x)  # the line warned at

    line = call.__code__.co_firstlineno + 4
    _warning_at(line, r"`fp8_filter` selected no module", call)

    def build():
        eqx_amp.BiModel(model, fp8=eqx_amp.fp8.TENSORWISE, fp8_filter=selects_nothing)

    line = build.__code__.co_firstlineno + 1
    _warning_at(line, r"`fp8_filter` selects no module", build)


class _AffineFreeNorm(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __call__(self, x, state):
        return self.bn(self.lin(x), state)


@pytest.mark.parametrize("mode", ["ema", "batch"])
@pytest.mark.parametrize("road", ["filter_amp", "BiModel"])
def test_a_norm_layer_without_weights_is_kept(road, mode, getkey):
    """An affine-free BatchNorm has no floating leaf to be kept by the spec (its
    statistics are State): it still runs at its own float32 boundary (in "ema" mode
    it failed on a select of float32 statistics and a bfloat16 input)."""
    norm = eqx.nn.BatchNorm(8, "batch", channelwise_affine=False, mode=mode)
    model, state = eqx.nn.make_with_state(_AffineFreeNorm)(
        eqx.nn.Linear(4, 8, key=getkey()), norm
    )
    x = jr.normal(getkey(), (16, 4))
    wrap = eqx_amp.filter_amp if road == "filter_amp" else eqx_amp.BiModel
    amp = wrap(model, policy="mixed_bfloat16")
    batched = lambda f: jax.vmap(  # noqa: E731
        f, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )
    with jax.numpy_dtype_promotion("standard"):
        out, new_state = batched(amp)(x, state)
        expected, _ = batched(model)(x, state)
    assert out.dtype == jnp.float32
    assert rel_error(out, expected) < 2e-2
    for leaf in jax.tree.leaves(new_state):
        assert leaf.dtype in (jnp.float32, jnp.int32, jnp.bool_)

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eqx_amp
from eqx_amp._core._cast import half_dtype


F32, BF16, F16 = jnp.dtype("float32"), jnp.dtype("bfloat16"), jnp.dtype("float16")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("p=f32,c=f16,o=f32", (F32, F16, F32)),
        ("P = F32 , C = BF16", (F32, BF16, BF16)),
        ("c=bf16", (F32, BF16, BF16)),
        ("c=float16,o=full", (F32, F16, F32)),
        ("p=bf16", (BF16, BF16, BF16)),
        ("o=f16", (F32, F32, F16)),
        ("float32", (F32, F32, F32)),
        ("full", (F32, F32, F32)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("float16", (F16, F16, F16)),
        ("f64", (np.dtype("float64"),) * 3),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("mixed_float16", (F32, F16, F32)),
        (
            "c=float8_e4m3fn",
            (F32, jnp.dtype("float8_e4m3fn"), jnp.dtype("float8_e4m3fn")),
        ),
    ],
)
def test_get_policy_grammar(text, expected):
    policy = eqx_amp.get_policy(text)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_half_is_platform_half():
    assert jax.devices()[0].platform == "cpu"
    assert half_dtype() == BF16
    assert eqx_amp.get_policy("half") == eqx_amp.Policy(BF16, BF16, BF16)
    assert eqx_amp.get_policy("c=half").compute_dtype == BF16


def test_default_policy():
    policy = eqx_amp.default_policy()
    assert policy == eqx_amp.Policy(jnp.float32, half_dtype(), jnp.float32)
    assert str(policy) == "params=float32,compute=bfloat16,output=float32"


def test_spellings_compare_and_hash_equal():
    spellings = [
        eqx_amp.Policy(jnp.float32, jnp.bfloat16, jnp.float32),
        eqx_amp.Policy(np.float32, jnp.dtype(jnp.bfloat16), np.dtype("float32")),
        eqx_amp.Policy("f32", "bf16", "full"),
        eqx_amp.get_policy("mixed_bfloat16"),
    ]
    assert len(set(spellings)) == 1
    assert len({hash(p) for p in spellings}) == 1


def test_policy_is_static_value_not_pytree():
    policy = eqx_amp.default_policy()
    assert jax.tree_util.tree_leaves(policy) == [policy]
    f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), policy).dtype == BF16
    with pytest.raises(AttributeError, match=r"cannot assign to field 'compute_dtype'"):
        policy.compute_dtype = F16  # type: ignore[misc]


_dtype = st.sampled_from([F32, BF16, F16, np.dtype("float64")])


@given(_dtype, _dtype, _dtype)
def test_str_round_trips(p, c, o):
    policy = eqx_amp.Policy(p, c, o)
    assert eqx_amp.get_policy(str(policy)) == policy


def test_with_methods_and_casts():
    policy = eqx_amp.get_policy("mixed_float16")
    assert policy.with_compute_dtype("bf16").compute_dtype == BF16
    assert policy.with_param_dtype(jnp.float16).param_dtype == F16
    assert policy.with_output_dtype("f16").output_dtype == F16
    assert policy.compute_dtype == F16  # unchanged
    tree = {"w": jnp.ones(2), "n": jnp.arange(2), "s": 1.0}
    assert policy.cast_to_compute(tree)["w"].dtype == F16
    assert policy.cast_to_compute(tree)["n"].dtype == jnp.int32
    assert policy.cast_to_compute(tree)["s"] == 1.0
    assert policy.cast_to_output(policy.cast_to_compute(tree))["w"].dtype == F32
    assert policy.cast_to_param({"w": jnp.ones(2, F16)})["w"].dtype == F32
    assert repr(policy) == (
        "Policy(param_dtype=float32, compute_dtype=float16, output_dtype=float32)"
    )


def test_get_policy_passes_policies_through():
    policy = eqx_amp.default_policy()
    assert eqx_amp.get_policy(policy) is policy


@pytest.mark.parametrize(
    "text, match",
    [
        ("c=int8", r"'int8' in policy 'c=int8' is int8, not a real floating dtype"),
        ("q=f32", r"Unknown key 'q'.*accepted keys are 'p', 'params'"),
        ("bfloat17", r"Unknown policy 'bfloat17'.*'mixed_bfloat16'.*'bf16'"),
        ("mixed_bf16", r"Unknown policy 'mixed_bf16'.*`key=dtype` pairs"),
        ("compute", r"Unknown policy 'compute'"),
        ("c=bfloat17", r"Unknown dtype 'bfloat17' in policy 'c=bfloat17'.*keys: 'p'"),
        ("c=", r"Could not read 'c='.*expected `key=dtype`"),
        ("p=f32,,c=bf16", r"Could not read ''.*expected `key=dtype`"),
        ("p=f32,p=bf16", r"Key 'p' is given twice"),
        ("c=complex64", r"is complex64, not a real floating dtype"),
        ("", r"Unknown policy ''"),
    ],
)
def test_get_policy_errors(text, match):
    with pytest.raises(ValueError, match=match):
        eqx_amp.get_policy(text)


def test_get_policy_wrong_type():
    with pytest.raises(
        TypeError, match=r"`policy` must be a string or an `eqx_amp.Policy`"
    ):
        eqx_amp.get_policy(jnp.bfloat16)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [jnp.int32, "bool", np.complex64, "nonsense"])
def test_policy_rejects_non_floating_compute_dtype(bad):
    with pytest.raises(ValueError, match=r"`compute_dtype`"):
        eqx_amp.Policy(jnp.float32, bad, jnp.float32)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: eqx_amp.get_policy("c=float128"),
            r"'float128' in policy 'c=float128'.*JAX does not hold it",
        ),
        (
            lambda: eqx_amp.get_policy("c=float8_e8m0fnu"),
            r"float8_e8m0fnu: it has no sign",
        ),
        (
            lambda: eqx_amp.Policy(jnp.float32, jnp.float8_e8m0fnu, jnp.float32),
            r"`compute_dtype` is float8_e8m0fnu: it has no sign",
        ),
        (
            lambda: eqx_amp.Policy(None, None, None),
            r"`param_dtype` must be a floating dtype.*but got None",
        ),
        (
            lambda: eqx_amp.Policy(jnp.float32, None, jnp.float32),
            r"`compute_dtype` must be a floating dtype.*but got None",
        ),
    ],
)
def test_only_signed_floating_dtypes_jax_holds(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_policies_accept_every_signed_float8():
    policy = eqx_amp.get_policy("p=f32,c=float8_e4m3fn,o=f32")
    assert policy.compute_dtype == jnp.dtype(jnp.float8_e4m3fn)


def test_using_policy_sets_the_default_where_calls_are_traced(getkey):
    model = eqx.nn.Linear(2, 2, key=getkey())
    amp = eqx_amp.filter_amp(model)  # built outside: read when traced
    auto = eqx_amp.autocast(model)

    def matmul_dtypes(fn):
        return set(eqx_amp.precision_report(fn, jnp.ones(2)).ops["dot_general"])

    with eqx_amp.using_policy("mixed_float16") as policy:
        assert policy == eqx_amp.get_policy("mixed_float16")
        assert eqx_amp.default_policy() == policy
        assert matmul_dtypes(amp) == {("float16", "float16")}
        assert matmul_dtypes(auto) == {("float16", "float16")}
        explicit = eqx_amp.filter_amp(model, policy="mixed_bfloat16")
        assert matmul_dtypes(explicit) == {("bfloat16", "bfloat16")}  # explicit wins
        with eqx_amp.using_policy("float32"):
            assert matmul_dtypes(amp) == {("float32", "float32")}
        assert eqx_amp.BiModel(model).policy == policy
    assert eqx_amp.default_policy().compute_dtype == BF16
    assert matmul_dtypes(amp) == {("bfloat16", "bfloat16")}
    with pytest.raises(ValueError, match=r"Unknown policy 'f17'"):
        with eqx_amp.using_policy("f17"):
            pass


#
# The gradient-reduction dtype.
#


def test_reduce_dtype_follows_compute_unless_chosen():
    policy = eqx_amp.get_policy("mixed_bfloat16")
    assert policy.reduce_dtype == BF16
    assert str(policy) == "params=float32,compute=bfloat16,output=float32"
    chosen = policy.with_reduce_dtype("f32")
    assert chosen.reduce_dtype == F32
    assert (
        str(chosen) == "params=float32,compute=bfloat16,output=float32,reduce=float32"
    )
    assert repr(chosen).endswith("reduce_dtype=float32)")
    assert eqx_amp.get_policy(str(chosen)) == chosen
    assert eqx_amp.get_policy("c=bf16,o=f32,r=f32") == chosen
    assert eqx_amp.get_policy("p=f32,c=bf16,o=f32,reduce=bf16") == policy
    assert hash(policy.with_reduce_dtype(jnp.bfloat16)) == hash(policy)
    # Chosen apart from the compute dtype, it stays when the compute dtype changes;
    # left to follow it, it follows.
    assert chosen.with_compute_dtype("f16").reduce_dtype == F32
    assert policy.with_compute_dtype("f16").reduce_dtype == F16
    assert chosen.with_reduce_dtype(None) == policy
    assert eqx_amp.Policy(F32, F16, F32, reduce_dtype="float32").reduce_dtype == F32


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: eqx_amp.get_policy("c=bf16,r=f16"),
            r"`reduce_dtype` must be the compute dtype \(bfloat16\) or a wider .* "
            r"but got float16",
        ),
        (
            lambda: eqx_amp.get_policy("mixed_float16").with_reduce_dtype("bf16"),
            r"`reduce_dtype` must be the compute dtype \(float16\).*but got bfloat16",
        ),
        (
            lambda: eqx_amp.Policy(F32, F32, F32, reduce_dtype=jnp.int32),
            r"`reduce_dtype` must be a real floating dtype.*but got int32",
        ),
        (lambda: eqx_amp.get_policy("c=bf16,r=wide"), r"Unknown dtype 'wide'"),
        (
            lambda: eqx_amp.get_policy("r=f32,reduce=f32"),
            r"Key 'reduce' is given twice",
        ),
    ],
)
def test_reduce_dtype_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()

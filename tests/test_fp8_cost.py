"""`rule.where_it_pays()`: products whose fp8 GEMMs cannot pay for their
quantisation stay in the compute dtype, with the reason; an `fp8_filter` still
decides on its own."""

import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqx_amp
from eqx_amp._fp8._shapes import fp8_cost_reason

from .helpers import walk_eqns


MATMUL = (((1,), (0,)), ((), ()))
# Tokens a product runs over: GPT-2-small's batch 8 x seq 1024, and twice that.
GPT_TOKENS = 8192
TOKENS = 2 * GPT_TOKENS

# What the fp8 guide documents, written out again: (GPU, bfloat16 and fp8 dense
# peaks, memory bandwidth, bytes moved per value quantised, kernels per product).
_GPUS = {
    "tensorwise": ("an H100", 989e12, 1979e12, 3.35e12, 5, 6),
    "rowwise": ("an H100", 989e12, 1979e12, 3.35e12, 3 * 2 + 2 * 1, 9),
    "mxfp8": ("a B200", 2250e12, 4500e12, 8e12, 3 * 2 + 2 * 33 / 32, 9),
}
_KERNEL_S = 7e-6


def _figures(scaling, m, k, n, batch=1):
    """Microseconds saved, and spent, by the documented estimate."""
    _, bf16, fp8, bandwidth, per_value, kernels = _GPUS[scaling]
    flops = 2.0 * batch * m * n * k
    saved = 3 * flops * (1 / (0.7 * bf16) - 1 / (0.7 * fp8))
    quantised = batch * (m * k + k * n + m * n)
    cost = per_value * quantised / (0.8 * bandwidth) + kernels * _KERNEL_S
    return saved * 1e6, cost * 1e6


@pytest.mark.parametrize(
    ("scaling", "m", "k", "n", "pays"),
    [
        ("tensorwise", GPT_TOKENS, 768, 768, False),  # GPT-2-small's attention
        ("tensorwise", GPT_TOKENS, 768, 3072, False),  # its MLP: launches outweigh
        ("tensorwise", TOKENS, 768, 3072, True),
        ("tensorwise", TOKENS, 768, 768, False),  # never, at any length
        ("tensorwise", GPT_TOKENS, 768, 32768, True),  # its vocabulary projection
        ("tensorwise", 4096, 4096, 4096, True),  # Llama-3-8B's attention, 4096 tokens
        ("tensorwise", 4096, 4096, 14336, True),  # and its MLP
        ("tensorwise", 64, 32, 32, False),
        # Rowwise quantises each tensor along both axes: the MLP over 16384 tokens
        # and the vocabulary projection, which pay tensorwise, do not.
        ("rowwise", TOKENS, 768, 3072, False),
        ("rowwise", GPT_TOKENS, 768, 32768, False),
        ("rowwise", GPT_TOKENS, 768, 768, False),
        ("rowwise", 4096, 4096, 4096, True),
        ("rowwise", 4096, 4096, 14336, True),
        ("mxfp8", GPT_TOKENS, 768, 3072, False),  # a B200 gains less per FLOP
        ("mxfp8", GPT_TOKENS, 768, 32768, False),
        ("mxfp8", 4096, 4096, 4096, True),
        ("mxfp8", 4096, 4096, 14336, True),
        ("mxfp8", 2 * TOKENS, 2048, 2048, True),
        ("mxfp8", 2 * TOKENS, 2048, 256, False),
    ],
)
def test_cost_reason_is_the_documented_estimate(scaling, m, k, n, pays):
    reason = fp8_cost_reason(scaling, (m, k), (k, n), MATMUL)
    saved, cost = _figures(scaling, m, k, n)
    assert (saved > cost) == pays
    if pays:
        assert reason is None
    else:
        gpu = _GPUS[scaling][0]
        gemms = "MXFP8 GEMMs" if scaling == "mxfp8" else "fp8 GEMMs"
        assert reason == (
            f"too small to gain: its {gemms} would save {saved:.3g} us on {gpu}, "
            f"quantising costs {cost:.3g} us (`where_it_pays`)"
        )


@pytest.mark.parametrize("shape", [(GPT_TOKENS, 768, 768), (TOKENS, 768, 3072)])
def test_rowwise_costs_more_than_tensorwise(shape):
    """Rowwise quantises every tensor once along each of its axes, as a B200's MXFP8
    does, against tensorwise's one amax and one quantise pass: its fp8 GEMMs save
    what tensorwise's do, its quantisation costs more."""
    m, k, n = shape
    saved, tensorwise = _figures("tensorwise", m, k, n)
    rowwise_saved, rowwise = _figures("rowwise", m, k, n)
    assert rowwise_saved == saved
    assert rowwise > tensorwise
    reason = fp8_cost_reason("rowwise", (m, k), (k, n), MATMUL)
    assert reason is not None
    assert f"quantising costs {rowwise:.3g} us" in reason


def test_batched_and_transposed_dimension_numbers():
    # (b, k, m) x (b, n, k): 4 products of 2048 x 768 by 768 x 768 (each operand
    # batched, so 4 weights are quantised).
    dims = (((1,), (2,)), ((0,), (0,)))
    reason = fp8_cost_reason("tensorwise", (4, 768, 2048), (4, 768, 768), dims)
    saved, cost = _figures("tensorwise", 2048, 768, 768, batch=4)
    assert f"save {saved:.3g} us" in reason
    assert f"costs {cost:.3g} us" in reason


class _Block(eqx.Module):
    """Two projections of the same input, a wide one and a narrow one: at
    768 -> 3072 and 768 -> 768 over 16384 tokens, the wide one pays for tensorwise
    fp8 on an H100 and the narrow one does not; at 2048 -> 2048 and 2048 -> 256
    over 32768 tokens, the same for MXFP8 on a B200."""

    wide: eqx.nn.Linear
    narrow: eqx.nn.Linear

    def __init__(self, key, features=768, wide=3072, narrow=768):
        k1, k2 = jr.split(key)
        self.wide = eqx.nn.Linear(features, wide, key=k1)
        self.narrow = eqx.nn.Linear(features, narrow, key=k2)

    def __call__(self, x):
        return jnp.sum(self.wide(x)) + jnp.sum(self.narrow(x))


def _fp8_dots(fn, *args) -> list[int]:
    """The output features (768 or 3072) of the dots that multiply fp8 values, from the jaxpr: a
    dot whose operand is fp8, or fp8 converted up and multiplied by its inverse
    scale (how tensorwise products are written, for cuBLASLt to take the scales)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    eqns = [eqn for eqn, _ in walk_eqns(jaxpr.jaxpr)]
    producer = {v: e for e in eqns for v in e.outvars}

    def fp8(v, depth=0):
        if "float8" in str(getattr(v.aval, "dtype", "")):
            return True
        e = producer.get(v)
        if e is None or depth > 2:
            return False
        if e.primitive.name in ("mul", "convert_element_type"):
            return any(fp8(u, depth + 1) for u in e.invars if hasattr(u, "aval"))
        return False

    return sorted(
        next(n for n in e.outvars[0].aval.shape if n != TOKENS)
        for e in eqns
        if e.primitive is jax.lax.dot_general_p and all(fp8(v) for v in e.invars)
    )


@pytest.fixture(scope="module")
def block():
    """The block applied to each of 16384 tokens: `eqx.filter_vmap` inside the
    wrappers, so the products they decide on are the batched ones."""
    return eqx.filter_vmap(_Block(jr.key(0)))


X = jax.ShapeDtypeStruct((TOKENS, 768), jnp.float32)


def test_filter_amp_leaves_the_product_that_does_not_pay(block):
    rule = eqx_amp.fp8.TENSORWISE.where_it_pays()
    amp = eqx_amp.filter_amp(block, fp8=rule)
    fp8_dots = _fp8_dots(lambda x: amp(x), X)
    assert fp8_dots == [3072]
    report = eqx_amp.diagnostics.precision_report(amp, X)
    reasons = {skip.reason for skip in report.fp8_skipped}
    (reason,) = reasons
    assert reason.startswith("too small to gain: its fp8 GEMMs would save ")
    # Without the cost rule both products are fp8.
    plain = eqx_amp.filter_amp(block, fp8=eqx_amp.fp8.TENSORWISE)
    assert sorted(_fp8_dots(lambda x: plain(x), X)) == [768, 3072]


def test_an_fp8_filter_still_decides(block):
    rule = eqx_amp.fp8.TENSORWISE.where_it_pays()
    amp = eqx_amp.filter_amp(
        block,
        fp8=rule,
        fp8_filter=lambda m: isinstance(m, eqx.nn.Linear) and m.out_features == 768,
    )
    assert _fp8_dots(lambda x: amp(x), X) == [768]


def test_bimodel_and_autocast_follow_the_rule(block):
    rule = eqx_amp.fp8.TENSORWISE.where_it_pays()
    bimodel = eqx_amp.BiModel(block, fp8=rule)
    assert _fp8_dots(lambda x: bimodel(x), X) == [3072]
    forward = eqx_amp.autocast(block, rules={jax.lax.dot_general_p: rule})
    assert _fp8_dots(lambda x: forward(x), X) == [3072]


def test_gradients_match_the_rule_free_products_where_fp8_runs():
    # Small enough to run: a contracting size the cost rule refuses everywhere,
    # so the rule's step equals the compute-dtype step exactly.
    block = eqx.nn.Linear(32, 32, key=jr.key(1))
    x = jr.normal(jr.key(2), (64, 32))
    rule = eqx_amp.fp8.TENSORWISE.where_it_pays()
    amp = eqx_amp.filter_amp(eqx.filter_vmap(block), fp8=rule)
    bf16 = eqx_amp.filter_amp(eqx.filter_vmap(block))

    def loss(model, x):
        return jnp.sum(model(x).astype(jnp.float32) ** 2)

    g_rule = eqx.filter_grad(loss)(amp, x).fn
    g_bf16 = eqx.filter_grad(loss)(bf16, x).fn
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), g_rule, g_bf16)
    )
    out = eqx.filter_jit(lambda m, x: m(x))(amp, x)
    assert out.dtype == jnp.float32


def test_rule_identity_repr_and_pickle():
    rule = eqx_amp.fp8.ROWWISE.where_it_pays()
    assert repr(rule) == "eqx_amp.fp8.ROWWISE.where_it_pays()"
    assert rule != eqx_amp.fp8.ROWWISE
    assert rule == eqx_amp.fp8.ROWWISE.where_it_pays()
    assert pickle.loads(pickle.dumps(rule)) == rule
    both = eqx_amp.fp8.TENSORWISE.with_activation_products().where_it_pays()
    assert both == eqx_amp.fp8.TENSORWISE.where_it_pays().with_activation_products()
    assert pickle.loads(pickle.dumps(both)) == both


def test_mxfp8_pays_by_a_b200s_estimate():
    block = eqx.filter_vmap(_Block(jr.key(0), 2048, wide=2048, narrow=256))
    x = jax.ShapeDtypeStruct((2 * TOKENS, 2048), jnp.float32)
    rule = eqx_amp.fp8.MXFP8.where_it_pays()
    assert repr(rule) == "eqx_amp.fp8.MXFP8.where_it_pays()"
    saved, cost = _figures("mxfp8", 2 * TOKENS, 2048, 256)
    expected = (
        f"too small to gain: its MXFP8 GEMMs would save {saved:.3g} us on a B200, "
        f"quantising costs {cost:.3g} us (`where_it_pays`)"
    )
    wide_flops = 2 * (2 * TOKENS) * 2048 * 2048
    for wrapped in (
        eqx_amp.filter_amp(block, fp8=rule),
        eqx_amp.BiModel(block, fp8=rule),
        eqx_amp.autocast(block, rules={jax.lax.dot_general_p: rule}),
    ):
        report = eqx_amp.diagnostics.precision_report(wrapped, x)
        assert [skip.reason for skip in report.fp8_skipped] == [expected]
        assert report.block_scaled_flops == wide_flops
    # Without the estimate both products are block-scaled.
    plain = eqx_amp.filter_amp(block, fp8=eqx_amp.fp8.MXFP8)
    report = eqx_amp.diagnostics.precision_report(plain, x)
    assert report.fp8_skipped == ()
    assert report.block_scaled_flops == wide_flops * 9 // 8


def test_nvfp4_is_not_modelled():
    with pytest.raises(TypeError, match="NVFP4's 4-bit forward products are not"):
        eqx_amp.fp8.NVFP4.where_it_pays()

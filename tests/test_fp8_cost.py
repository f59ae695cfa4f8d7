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
TOKENS = 8192  # GPT-2-small's batch 8 x seq 1024


def _h100_figures(m, k, n, batch=1):
    """The documented estimate, written out again: microseconds saved, and spent."""
    flops = 2.0 * batch * m * n * k
    saved = 3 * flops * (1 / (0.7 * 989e12) - 1 / (0.7 * 1979e12))
    cost = 5 * batch * (m * k + k * n + m * n) / (0.8 * 3.35e12) + 6 * 3e-6
    return saved * 1e6, cost * 1e6


@pytest.mark.parametrize(
    ("m", "k", "n", "pays"),
    [
        (TOKENS, 768, 768, False),  # GPT-2-small's attention projections
        (TOKENS, 768, 3072, True),  # its MLP
        (TOKENS, 3072, 768, True),
        (4096, 4096, 14336, True),  # Llama-3-8B's MLP at one 4096-token sequence
        (64, 32, 32, False),
    ],
)
def test_cost_reason_is_the_documented_estimate(m, k, n, pays):
    reason = fp8_cost_reason((m, k), (k, n), MATMUL)
    saved, cost = _h100_figures(m, k, n)
    assert (saved > cost) == pays
    if pays:
        assert reason is None
    else:
        assert reason == (
            f"too small to gain: its fp8 GEMMs would save {saved:.3g} us on an H100, "
            f"quantising costs {cost:.3g} us (`where_it_pays`)"
        )


def test_batched_and_transposed_dimension_numbers():
    # (b, k, m) x (b, n, k): 4 products of 2048 x 768 by 768 x 768 (each operand
    # batched, so 4 weights are quantised).
    dims = (((1,), (2,)), ((0,), (0,)))
    reason = fp8_cost_reason((4, 768, 2048), (4, 768, 768), dims)
    saved, cost = _h100_figures(2048, 768, 768, batch=4)
    assert f"save {saved:.3g} us" in reason
    assert f"costs {cost:.3g} us" in reason


class _Block(eqx.Module):
    """A projection that pays in fp8 at 8192 tokens (768 -> 3072) and one that
    does not (768 -> 768)."""

    wide: eqx.nn.Linear
    narrow: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.wide = eqx.nn.Linear(768, 3072, key=k1)
        self.narrow = eqx.nn.Linear(768, 768, key=k2)

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
    """The block applied to each of 8192 tokens: `eqx.filter_vmap` inside the
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


def test_block_scales_are_not_modelled():
    with pytest.raises(TypeError, match="MXFP8's block scales are not modelled"):
        eqx_amp.fp8.MXFP8.where_it_pays()

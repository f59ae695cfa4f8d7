"""fp8 matmuls with current scaling: `eqx_amp.fp8.dot_general` and autocast's fp8 rules."""

import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp

from . import doc_blocks
from .helpers import run_script_on_eight_devices, walk_eqns


GUIDE = doc_blocks.REPO_ROOT / "docs" / "guides" / "fp8.md"


E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
MATMUL = (((1,), (0,)), ((), ()))  # (m, k) x (k, n)
# Round-to-nearest unit roundoff of e4m3 (3 mantissa bits) and e5m2 (2 bits), and
# the spacing of their subnormals (relative to their largest finite value).
U4, U5 = 2.0**-4, 2.0**-3
TINY4 = 2.0**-9 / 448.0
TINY5 = 2.0**-16 / 57344.0


def _operands(key, outliers: bool):
    kx, kw, ko = jr.split(key, 3)
    x = jr.normal(kx, (32, 64))
    w = 0.1 * jr.normal(kw, (64, 48))
    if outliers:  # a few activations 1000x the rest, as in large transformers
        x = x.at[jr.randint(ko, (4,), 0, 32), 3].set(1e5)
    return x, w


def _bound(x, w, u, tiny_x, tiny_w):
    """Elementwise bound on |fp8 product - exact product|: each factor is off by at
    most a relative `u` (plus a subnormal spacing at the tensor's scale)."""
    ax, aw = jnp.abs(x), jnp.abs(w)
    tx, tw = tiny_x * jnp.max(ax), tiny_w * jnp.max(aw)
    k = x.shape[1]
    return (
        (2 * u + u**2) * (ax @ aw)
        + tx * jnp.sum(aw, 0)[None, :]
        + tw * jnp.sum(ax, 1)[:, None]
        + k * tx * tw
    )


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_product_is_within_the_formats_bound(getkey, scaling, outliers):
    x, w = _operands(getkey(), outliers)
    y = eqx_amp.fp8.dot_general(x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    error = np.abs(np.asarray(y, np.float64) - exact)
    bound = np.asarray(_bound(x, w, U4, TINY4, TINY4), np.float64) * 1.01 + 1e-6
    assert (error <= bound).all(), float((error / bound).max())
    assert y.dtype == jnp.float32


def test_rowwise_scaling_keeps_outliers_to_their_rows(getkey):
    x, w = _operands(getkey(), outliers=True)
    exact = x @ w
    errors = {}
    for scaling in ("tensorwise", "rowwise"):
        y = eqx_amp.fp8.dot_general(
            x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32
        )
        clean = np.asarray(jnp.abs(x[:, 3]) < 100)  # the rows without an outlier
        errors[scaling] = float(
            jnp.linalg.norm((y - exact)[clean]) / jnp.linalg.norm(exact[clean])
        )
    assert errors["rowwise"] < 0.1 < errors["tensorwise"]


def test_scaling_is_what_keeps_small_values(getkey):
    """The ablation: fp8 values cast without a scale underflow (e4m3's smallest
    normal is 2**-6); scaled from their amax they keep 3 bits of mantissa."""
    x, w = _operands(getkey(), outliers=False)
    x, w = 1e-3 * x, 1e-2 * w
    exact = x @ w
    scaled = eqx_amp.fp8.dot_general(x, w, MATMUL, out_dtype=jnp.float32)
    unscaled = x.astype(E4M3).astype(jnp.float32) @ w.astype(E4M3).astype(jnp.float32)
    rel = lambda y: float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))  # noqa: E731
    assert rel(scaled) < 0.08
    assert rel(unscaled) > 0.5


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_gradients_are_within_bound_and_use_e5m2(getkey, scaling):
    x, w = _operands(getkey(), outliers=False)
    g = jr.normal(getkey(), (32, 48))

    def f(x, w):
        return eqx_amp.fp8.dot_general(
            x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32
        )

    _, pullback = jax.vjp(f, x, w)
    dx, dw = pullback(g)
    exact_dx, exact_dw = g @ w.T, x.T @ g
    # Each gradient multiplies the e5m2 gradient by an e4m3 operand.
    bound_dx = _bound(g, w.T, U5, TINY5, TINY4) * 1.01 + 1e-6
    bound_dw = _bound(x.T, g, U5, TINY4, TINY5) * 1.01 + 1e-6
    # Rowwise scales are finer than the tensorwise ones the bound assumes.
    assert (jnp.abs(dx - exact_dx) <= bound_dx).all()
    assert (jnp.abs(dw - exact_dw) <= bound_dw).all()
    for grad, exact in ((dx, exact_dx), (dw, exact_dw)):
        assert float(jnp.linalg.norm(grad - exact) / jnp.linalg.norm(exact)) < 0.15
    # The forward quantises to e4m3, the backward the gradient to e5m2; rowwise, each
    # backward product quantises its two operands again, per row of that product.
    jaxpr = jax.make_jaxpr(lambda x, w, g: jax.vjp(f, x, w)[1](g))(x, w, g)
    made = [
        e.params["new_dtype"]
        for e, _ in walk_eqns(jaxpr)
        if e.primitive.name == "convert_element_type"
    ]
    expected = (2, 1) if scaling == "tensorwise" else (4, 2)
    assert (made.count(E4M3), made.count(E5M2)) == expected


def test_under_vmap_the_scales_cover_the_whole_batch(getkey):
    """One example with an outlier sets the scale of the batch: the vmapped product
    is the batched one, and so are its gradients."""
    x, w = _operands(getkey(), outliers=True)
    per_example = (((0,), (0,)), ((), ()))
    batched = eqx_amp.fp8.dot_general(x, w, MATMUL, out_dtype=jnp.float32)
    vmapped = jax.vmap(
        lambda xi: eqx_amp.fp8.dot_general(xi, w, per_example, out_dtype=jnp.float32)
    )(x)
    np.testing.assert_array_equal(np.asarray(vmapped), np.asarray(batched))

    def loss_batched(w):
        return jnp.sum(
            jnp.sin(eqx_amp.fp8.dot_general(x, w, MATMUL, out_dtype=jnp.float32))
        )

    def loss_vmapped(w):
        y = jax.vmap(
            lambda xi: eqx_amp.fp8.dot_general(
                xi, w, per_example, out_dtype=jnp.float32
            )
        )(x)
        return jnp.sum(jnp.sin(y))

    np.testing.assert_array_equal(
        np.asarray(jax.grad(loss_vmapped)(w)), np.asarray(jax.grad(loss_batched)(w))
    )


def test_fp8_dot_general_errors():
    x = jnp.ones((16, 16))
    with pytest.raises(ValueError, match="`scaling` must be 'tensorwise' or 'rowwise'"):
        eqx_amp.fp8.dot_general(x, x, MATMUL, scaling="blockwise")
    with pytest.raises(
        TypeError, match="multiplies floating arrays, but `rhs` is int32"
    ):
        eqx_amp.fp8.dot_general(x, jnp.ones((16, 16), jnp.int32), MATMUL)
    with pytest.raises(
        ValueError, match="`out_dtype` must be bfloat16, float16 or wider"
    ):
        eqx_amp.fp8.dot_general(x, x, MATMUL, out_dtype=jnp.float8_e4m3fn)


@pytest.mark.parametrize(
    "scaling", ["tensorwise", "rowwise", "mxfp8", "nvfp4", "nvfp4_training"]
)
def test_fp8_dot_general_refuses_what_lax_refuses(scaling):
    # Contracting (4, 8) against (8, 4): the block-scaled products flatten each
    # group of axes, so without the check they paired the wrong values.
    lhs, rhs = jnp.ones((5, 4, 8)), jnp.ones((4, 8, 6))
    with pytest.raises(TypeError, match="contracting dimensions to have the same"):
        eqx_amp.fp8.dot_general(lhs, rhs, (((1, 2), (1, 0)), ((), ())), scaling=scaling)
    batched = (((2,), (2,)), ((0, 1), (1, 0)))
    lhs, rhs = jnp.ones((2, 3, 32)), jnp.ones((2, 3, 32))
    with pytest.raises(TypeError, match="batch dimensions to have the same shape"):
        eqx_amp.fp8.dot_general(lhs, rhs, batched, scaling=scaling)
    with pytest.raises(TypeError, match="dimension numbers to be nonnegative"):
        eqx_amp.fp8.dot_general(
            jnp.ones((16, 32)),
            jnp.ones((32, 16)),
            (((-1,), (0,)), ((), ())),
            scaling=scaling,
        )


@pytest.mark.parametrize("scaling", ["nvfp4", "nvfp4_training"])
def test_nvfp4_by_hand_needs_a_contracting_size_of_sixteens(scaling):
    with pytest.raises(ValueError, match="their size, 24, must be a multiple of 16"):
        eqx_amp.fp8.dot_general(
            jnp.ones((16, 24)), jnp.ones((24, 16)), MATMUL, scaling=scaling
        )
    outer = (((), ()), ((), ()))
    with pytest.raises(ValueError, match="their size, 1, must be a multiple of 16"):
        eqx_amp.fp8.dot_general(
            jnp.ones((16,)), jnp.ones((16,)), outer, scaling=scaling
        )


#
# autocast's fp8 rules.
#


class Head(eqx.Module):
    body: eqx.nn.MLP
    head: eqx.nn.Linear

    def __call__(self, x):
        hidden = jax.nn.relu(self.body(x))
        with jax.named_scope("head"):
            return self.head(hidden)


def _model(key):
    k1, k2 = jr.split(key)
    return Head(eqx.nn.MLP(32, 64, 64, 1, key=k1), eqx.nn.Linear(64, 16, key=k2))


def test_autocast_fp8_rule_runs_matmuls_in_fp8_and_reports_them(getkey):
    model, x = _model(getkey()), jr.normal(getkey(), (32, 32))
    rules = {jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE}
    forward = eqx_amp.autocast(
        eqx.filter_vmap(model), policy="mixed_bfloat16", rules=rules
    )
    y, exact = forward(x), jax.vmap(model)(x)
    assert y.dtype == jnp.float32
    assert float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)) < 0.1
    report = eqx_amp.precision_report(forward, x)
    fp8_pair = ("float8_e4m3fn", "float8_e4m3fn")
    assert report.flops_by_dtypes == {fp8_pair: report.matmul_flops}
    assert report.low_precision_share == 1.0
    assert report.fp8_skipped == ()
    # A scope rule keeps the head in bfloat16.
    rules = {jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE, "head": eqx_amp.LOW}
    forward = eqx_amp.autocast(
        eqx.filter_vmap(model), policy="mixed_bfloat16", rules=rules
    )
    report = eqx_amp.precision_report(forward, x)
    head_flops = 2 * 32 * 64 * 16
    assert report.flops_by_dtypes[("bfloat16", "bfloat16")] == head_flops
    assert report.flops_by_dtypes[fp8_pair] == report.matmul_flops - head_flops


def test_autocast_fp8_leaves_ineligible_shapes_in_the_compute_dtype_and_says_why(
    getkey,
):
    model = eqx.nn.MLP(32, 10, 64, 1, key=getkey())  # a head of 10 classes
    x = jr.normal(getkey(), (32, 32))
    forward = eqx_amp.autocast(
        eqx.filter_vmap(model),
        policy="mixed_bfloat16",
        rules={jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE},
    )
    report = eqx_amp.precision_report(forward, x)
    (skip,) = report.fp8_skipped
    assert skip.reason == "lhs free size 10 not a multiple of 16"
    assert skip.flops == 2 * 32 * 64 * 10
    assert report.flops_by_dtypes[("bfloat16", "bfloat16")] == skip.flops
    assert "matmuls left out of fp8" in str(report)


def test_autocast_fp8_inside_vmap_decides_on_the_batched_shapes(getkey):
    model, x = _model(getkey()), jr.normal(getkey(), (32, 32))
    rules = {jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE}
    inside = jax.vmap(eqx_amp.autocast(model, policy="mixed_bfloat16", rules=rules))
    outside = eqx_amp.autocast(
        eqx.filter_vmap(model), policy="mixed_bfloat16", rules=rules
    )
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda x: inside(x))(x)),
        np.asarray(jax.jit(lambda x: outside(x))(x)),
    )
    grads = [
        eqx.filter_jit(eqx.filter_grad(lambda m, f=f: jnp.sum(f(m)(x) ** 2)))(model)
        for f in (
            lambda m: jax.vmap(
                eqx_amp.autocast(m, policy="mixed_bfloat16", rules=rules)
            ),
            lambda m: eqx_amp.autocast(
                eqx.filter_vmap(m), policy="mixed_bfloat16", rules=rules
            ),
        )
    ]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_fp8_rule_errors(getkey):
    model, x = _model(getkey()), jnp.ones((16, 32))
    forward = eqx_amp.autocast(
        eqx.filter_vmap(model),
        policy="c=float8_e4m3fn",
        rules={jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE},
    )
    with pytest.raises(
        ValueError, match="the compute dtype must be bfloat16, float16 or wider"
    ):
        forward(x)
    with pytest.raises(
        TypeError, match="eqx_amp.fp8.TENSORWISE is applied by `autocast` itself"
    ):
        eqx_amp.fp8.TENSORWISE(jnp.bfloat16, [jnp.float32], x)
    assert repr(eqx_amp.fp8.ROWWISE) == "eqx_amp.fp8.ROWWISE"


# Slow tier, with the other docs pages' code.
@pytest.mark.slow
def test_fp8_guide_blocks_run(getkey):
    """The three blocks of docs/guides/fp8.md (`autocast` with the rule, with the rule
    that also takes activation products, `filter_amp` and `BiModel` with `fp8=`), on
    this test's model rather than the page's set-up."""
    # The first three (test_doc_snippets runs the page's others, MXFP8's included).
    code = [b for b in doc_blocks.blocks(GUIDE.read_text()) if not b.hidden][:3]
    assert len(code) == 3
    namespace = {
        "jax": jax,
        "eqx": eqx,
        "eqx_amp": eqx_amp,
        "model": eqx.nn.MLP(32, 10, 64, 2, key=getkey()),
        "x": jr.normal(getkey(), (16, 32)),
    }
    doc_blocks.run(code, "docs/guides/fp8.md", namespace)
    assert namespace["logits"].dtype == jnp.float32
    assert namespace["report"].fp8_skipped[0].reason.endswith("not a multiple of 16")
    assert namespace["forward"](namespace["x"]).dtype == jnp.float32
    assert jax.vmap(namespace["bimodel"])(namespace["x"]).dtype == jnp.float32


#
# filter_amp and BiModel: a filter over modules.
#

FP8_PAIR = ("float8_e4m3fn", "float8_e4m3fn")


def _classifier(key):
    return eqx.nn.MLP(32, 10, 64, 2, key=key)  # two 64-wide layers and a 10-class head


def test_filter_amp_fp8_with_a_module_filter(getkey):
    model, x = _classifier(getkey()), jr.normal(getkey(), (32, 32))
    hidden_flops, head_flops = 2 * 32 * (32 * 64 + 64 * 64), 2 * 32 * 64 * 10
    everything = eqx_amp.filter_amp(
        eqx.filter_vmap(model), policy="mixed_bfloat16", fp8=eqx_amp.fp8.TENSORWISE
    )
    report = eqx_amp.precision_report(everything, x)
    assert report.flops_by_dtypes == {
        FP8_PAIR: hidden_flops,
        ("bfloat16", "bfloat16"): head_flops,
    }
    assert [s.reason for s in report.fp8_skipped] == [
        "lhs free size 10 not a multiple of 16"
    ]
    # The filter leaves the head out on purpose: nothing is skipped.
    wide_only = eqx_amp.filter_amp(
        eqx.filter_vmap(model),
        policy="mixed_bfloat16",
        fp8=eqx_amp.fp8.ROWWISE,
        fp8_filter=lambda m: isinstance(m, eqx.nn.Linear) and m.out_features >= 64,
    )
    report = eqx_amp.precision_report(wide_only, x)
    assert report.flops_by_dtypes[FP8_PAIR] == hidden_flops and report.fp8_skipped == ()
    exact = jax.vmap(model)(x)
    for forward in (everything, wide_only):
        y = forward(x)
        assert y.dtype == jnp.float32
        assert float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)) < 0.1


@pytest.mark.slow  # 6 s; the fp8 examples train in the slow tier too
def test_filter_amp_and_bimodel_fp8_train(getkey):
    """Gradients through fp8 matmuls reach the float32 master, inside and outside
    `jax.vmap`, and a few steps lower the loss as bfloat16 does."""
    model = _classifier(getkey())
    x, y = jr.normal(getkey(), (64, 32)), jr.randint(getkey(), (64,), 0, 10)

    def loss(logits):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    def train(forward_of, model, steps=30):
        @eqx.filter_jit
        def step(model):
            value, grads = eqx.filter_value_and_grad(lambda m: loss(forward_of(m)(x)))(
                model
            )
            return value, eqx.apply_updates(
                model, jax.tree.map(lambda g: -0.2 * g, grads)
            )

        losses = []
        for _ in range(steps):
            value, model = step(model)
            losses.append(float(value))
        return losses

    bf16 = train(
        lambda m: jax.vmap(eqx_amp.filter_amp(m, policy="mixed_bfloat16")), model
    )
    fp8 = train(
        lambda m: jax.vmap(
            eqx_amp.filter_amp(m, policy="mixed_bfloat16", fp8=eqx_amp.fp8.TENSORWISE)
        ),
        model,
    )
    assert fp8[-1] < 0.9 * fp8[0]
    assert abs(fp8[-1] - bf16[-1]) < 0.02 * bf16[0]
    bimodel = eqx_amp.BiModel(
        model, policy="mixed_bfloat16", fp8=eqx_amp.fp8.TENSORWISE
    )
    report = eqx_amp.precision_report(jax.vmap(bimodel), x)
    assert FP8_PAIR in report.flops_by_dtypes
    (_, grads), *_ = eqx_amp.filter_value_and_grad(lambda m, x: loss(jax.vmap(m)(x)))(
        bimodel, x, loss_scale=eqx_amp.NoOpLossScale()
    )
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}


def test_filter_amp_fp8_errors(getkey):
    model = _classifier(getkey())
    with pytest.raises(
        TypeError,
        match="`fp8` must be `eqx_amp.fp8.TENSORWISE`, `eqx_amp.fp8.ROWWISE` or None",
    ):
        eqx_amp.filter_amp(model, fp8=True)
    with pytest.raises(
        ValueError, match="`fp8_filter` selects modules for `fp8=`, which is None"
    ):
        eqx_amp.filter_amp(model, fp8_filter=lambda m: True)
    with pytest.raises(
        TypeError, match="`fp8_filter` must be a callable `module -> bool`"
    ):
        eqx_amp.BiModel(model, fp8=eqx_amp.fp8.TENSORWISE, fp8_filter="Linear")
    x = jnp.ones((16, 32))
    reduced = eqx_amp.get_policy("mixed_bfloat16").with_reduce_dtype(jnp.float32)
    with pytest.raises(
        ValueError, match="with a `Policy.reduce_dtype` is not supported yet"
    ):
        eqx_amp.filter_amp(
            eqx.filter_vmap(model), policy=reduced, fp8=eqx_amp.fp8.TENSORWISE
        )(x)
    with pytest.raises(
        ValueError, match="the compute dtype must be bfloat16, float16 or wider"
    ):
        eqx_amp.filter_amp(
            eqx.filter_vmap(model), policy="c=float8_e5m2", fp8=eqx_amp.fp8.TENSORWISE
        )(x)


@pytest.mark.slow
def test_fp8_scales_under_gspmd_sharding_are_global():
    """Sharded over 8 devices, the amax of each operand is reduced across them: the
    product equals the unsharded one, and so do the gradients."""
    report = run_script_on_eight_devices(
        """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import eqx_amp
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
# The outlier (on the first device's rows) sets a scale that puts ordinary values
# among e4m3's subnormals: a device that scaled by its own amax would quantise its
# rows on a much finer grid.
x = jax.random.normal(jax.random.key(0), (64, 32)).at[5, 3].set(3e4)
w = 0.1 * jax.random.normal(jax.random.key(1), (32, 48))
dims = (((1,), (0,)), ((), ()))
product = jax.jit(lambda x, w: eqx_amp.fp8.dot_general(x, w, dims, out_dtype=jnp.float32))
def loss(x, w):
    return jnp.sum(jnp.sin(product(x, w) * 1e-3))
step = jax.jit(jax.value_and_grad(loss, (0, 1)))
sharded_x = jax.device_put(x, NamedSharding(mesh, P("data")))
sharded_w = jax.device_put(w, NamedSharding(mesh, P(None, "data")))
def relative_difference(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
away = slice(8, None)  # rows on the devices without the outlier
plain = product(x, w)
report = {
    "sharded": relative_difference(product(sharded_x, sharded_w)[away], plain[away]),
    "own_scale": relative_difference(product(x[away], w), plain[away]),
    "gradients": max(
        relative_difference(a, b)
        for a, b in zip(jax.tree.leaves(step(sharded_x, sharded_w)), jax.tree.leaves(step(x, w)))
    ),
}
"""
    )
    # What per-device scales would give, so the comparison below can fail.
    assert report["own_scale"] > 1e-2
    assert report["sharded"] < 1e-6
    # Sharding changes summation order only, which can flip the fp8 rounding of a
    # cotangent element that lies near a rounding boundary: one term of a sum.
    assert report["gradients"] < 1e-4


#
# Convolutions.
#


class SmallCNN(eqx.Module):
    first: eqx.nn.Conv2d  # one input channel: not an fp8 convolution
    second: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.first = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
        self.second = eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(32, 16, key=k3)

    def __call__(self, x):
        x = jax.nn.relu(self.second(jax.nn.relu(self.first(x))))
        return self.head(jnp.mean(x, axis=(1, 2)))


def test_convolutions_in_fp8_on_every_path(getkey):
    model, x = SmallCNN(getkey()), jr.normal(getkey(), (16, 1, 8, 8))
    rules = {
        jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE,
        jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE,
    }
    paths = {
        "autocast": eqx_amp.autocast(
            eqx.filter_vmap(model), policy="mixed_bfloat16", rules=rules
        ),
        "autocast in vmap": jax.vmap(
            eqx_amp.autocast(model, policy="mixed_bfloat16", rules=rules)
        ),
        "filter_amp": eqx_amp.filter_amp(
            eqx.filter_vmap(model), policy="mixed_bfloat16", fp8=eqx_amp.fp8.TENSORWISE
        ),
    }
    exact = jax.vmap(model)(x)
    second_flops = 2 * 16 * 8 * 8 * 32 * 16 * 9
    outputs = []
    for name, forward in paths.items():
        y = jax.jit(lambda x, forward=forward: forward(x))(x)
        outputs.append(np.asarray(y))
        assert float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)) < 0.05, name
        report = eqx_amp.precision_report(forward, x)
        assert report.flops_by_dtypes[FP8_PAIR] == second_flops + 2 * 16 * 32 * 16, name
        assert [s.reason for s in report.fp8_skipped] == [
            "input features 1 not a multiple of 16"
        ], name
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_fp8_convolution_gradients_match(getkey):
    model, x = SmallCNN(getkey()), jr.normal(getkey(), (16, 1, 8, 8))
    rules = {jax.lax.conv_general_dilated_p: eqx_amp.fp8.TENSORWISE}

    def loss(model, wrap):
        return jnp.sum(jnp.sin(wrap(model)(x)))

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    grads = grad(
        model,
        lambda m: eqx_amp.autocast(
            eqx.filter_vmap(m), policy="mixed_bfloat16", rules=rules
        ),
    )
    exact = grad(model, eqx.filter_vmap)
    error = float(
        jnp.linalg.norm(grads.second.weight - exact.second.weight)
        / jnp.linalg.norm(exact.second.weight)
    )
    assert error < 0.15
    assert grads.second.weight.dtype == jnp.float32


def _fp8_dots(jaxpr) -> list:
    return [
        e
        for e, _ in walk_eqns(jaxpr)
        if e.primitive.name == "dot_general"
        and all(v.aval.dtype in (E4M3, E5M2) for v in e.invars)
    ]


def _precision(eqn):
    precision = eqn.params["precision"]
    return None if precision is None else tuple(precision)


@pytest.mark.parametrize("road", ["dot_general", "filter_amp", "autocast", "bimodel"])
@pytest.mark.parametrize("rule", ["TENSORWISE", "ROWWISE"])
def test_backward_fp8_products_accumulate_precisely(getkey, road, rule):
    """The products of the backward pass (a weight's gradient sums over every token)
    ask for `Precision.HIGHEST`, which turns off cuBLASLt's fast fp8 accumulation
    (on an H100 it cost a GPT 12.7% of loss after 14 steps); the forward products
    keep the default. Read from the jaxpr of a gradient on every road."""
    fp8_rule = getattr(eqx_amp.fp8, rule)
    model, x = _classifier(getkey()), jr.normal(getkey(), (32, 32))
    if road == "dot_general":
        w = jr.normal(getkey(), (32, 64))

        def loss(w):
            out = eqx_amp.fp8.dot_general(
                x, w, MATMUL, scaling=rule.lower(), out_dtype=jnp.float32
            )
            return jnp.sum(out**2)

        jaxpr = jax.make_jaxpr(jax.grad(loss))(w)
    else:
        if road == "filter_amp":
            wrap = eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=fp8_rule)
        elif road == "autocast":
            rules = {jax.lax.dot_general_p: fp8_rule}
            wrap = eqx_amp.autocast(eqx.filter_vmap(model), rules=rules)
        else:
            wrap = eqx_amp.BiModel(model, fp8=fp8_rule)

        def loss(wrap):
            out = jax.vmap(wrap)(x) if road == "bimodel" else wrap(x)
            return jnp.sum(out**2)

        jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(loss))(wrap)[0]
    dots = _fp8_dots(jaxpr)
    forward = [e for e in dots if all(v.aval.dtype == E4M3 for v in e.invars)]
    backward = [e for e in dots if any(v.aval.dtype == E5M2 for v in e.invars)]
    assert forward and len(backward) == 2 * len(forward)
    highest = (jax.lax.Precision.HIGHEST,) * 2
    assert {_precision(e) for e in backward} == {highest}
    assert all(
        _precision(e) in (None, (jax.lax.Precision.DEFAULT,) * 2) for e in forward
    )


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_products_near_the_largest_bfloat16_are_the_same_under_jit(scaling):
    """Weights at bfloat16's largest value: the finite product eager mode gives is
    the one `jax.jit` gives (XLA once folded the two inverse scales into
    `amax_x * amax_w / 448**2`, which overflowed), forward and backward."""
    big = float(jnp.finfo(jnp.bfloat16).max)
    x = jnp.zeros((16, 16)).at[0, 0].set(1.5).at[1, 1].set(0.5)
    w = jnp.ones((16, 16)).at[1, :].set(big)
    g = jnp.full((16, 16), 1e-3)

    def f(x, w):
        out, pullback = jax.vjp(
            lambda x, w: eqx_amp.fp8.dot_general(
                x, w, MATMUL, scaling=scaling, out_dtype=jnp.float32
            ),
            x,
            w,
        )
        return out, pullback(g)

    eager, jitted = f(x, w), jax.jit(f)(x, w)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        assert bool(jnp.isfinite(a).all()) and bool(jnp.isfinite(b).all())
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6)
    assert float(jitted[0][1, 0]) == pytest.approx(0.5 * big, rel=0.07)


def test_autocast_fp8_leaves_products_of_two_activations_unless_asked(getkey):
    """Attention's `q @ k.T` and `probabilities @ v` read no parameter: an fp8 rule
    leaves them in the compute dtype and says why, unless the rule asks for them."""
    attention = eqx.nn.MultiheadAttention(2, 32, key=getkey())
    x = jr.normal(getkey(), (16, 32))

    def forward(x):
        return attention(x, x, x)

    projections = 4 * 2 * 16 * 32 * 32
    scores_and_values = 2 * (2 * 2 * 16 * 16 * 16)
    rule = eqx_amp.fp8.TENSORWISE
    report = eqx_amp.precision_report(
        eqx_amp.autocast(forward, rules={jax.lax.dot_general_p: rule}), x
    )
    assert report.flops_by_dtypes == {
        FP8_PAIR: projections,
        ("bfloat16", "bfloat16"): scores_and_values,
    }
    reasons = [s.reason for s in report.fp8_skipped]
    assert len(reasons) == 2
    assert all(r.startswith("reads no parameter (attention's scores") for r in reasons)
    assert all("`rule.with_activation_products()`" in r for r in reasons)

    everything = rule.with_activation_products()
    assert repr(everything) == "eqx_amp.fp8.TENSORWISE.with_activation_products()"
    assert everything != rule and everything.scaling == "tensorwise"
    assert pickle.loads(pickle.dumps(everything)) == everything
    assert pickle.loads(pickle.dumps(rule)) is rule
    forward_fp8 = eqx_amp.autocast(forward, rules={jax.lax.dot_general_p: everything})
    report = eqx_amp.precision_report(forward_fp8, x)
    assert report.flops_by_dtypes == {FP8_PAIR: projections + scores_and_values}
    assert report.fp8_skipped == ()
    # The products left in bfloat16 accumulate as the compute-dtype rule's do: no
    # float32 GEMM forward or backward.
    skipping = eqx_amp.autocast(forward, rules={jax.lax.dot_general_p: rule})
    grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(skipping(x))))(x)
    dots = [e for e, _ in walk_eqns(grad) if e.primitive.name == "dot_general"]
    assert dots and all(
        {v.aval.dtype for v in e.invars} <= {jnp.dtype(jnp.bfloat16), E4M3, E5M2}
        and e.outvars[0].aval.dtype != jnp.float32
        or {v.aval.dtype for v in e.invars} == {E4M3}
        for e in dots
    )
    exact = forward(x)
    for rule in (eqx_amp.fp8.TENSORWISE, everything):
        y = eqx_amp.autocast(forward, rules={jax.lax.dot_general_p: rule})(x)
        assert float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)) < 0.1

"""`autocast` on Flax NNX models (the `flax` extra): the model is split into its
states and merged inside a pure function, which `autocast` wraps. The same dtype
checks as for Equinox models, read from the traced jaxprs, plus NNX's own state
(BatchNorm statistics, Dropout's RNG state) and the example script.
docs/guides/flax_nnx.md describes what these tests pin down."""

import functools as ft
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import eqx_amp

from .helpers import (
    assert_matmuls_in,
    eqns_named,
    float_dtypes,
    global_rel_error,
    in_dtypes,
    ops_in,
    out_dtypes,
    rel_error,
    run_repo_script,
    walk_eqns,
)


nnx = pytest.importorskip(
    "flax.nnx", reason='needs the flax extra: pip install -e ".[flax]"'
)

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
POLICY = "params=float32,compute=bfloat16,output=float32"
# Relative errors of parameter gradients against float32 (CNN below, batch 16), over
# 20 seeds. bfloat16 keeps 8 significant bits (unit roundoff 2**-9, 0.2%).
# Parameters not behind a BatchNorm (the linear layers, the LayerNorm) get 0.7%
# (median of the worst of the three; at most 1.0%). The convolutions' gradients
# pass back through BatchNorm, whose backward pass subtracts the batch means of the
# incoming gradient and so cancels most of it: what is left carries the rounding of
# the bfloat16 convolutions and bias adds magnified, 5-10% per kernel. Over all
# parameters: 3.6% (median; at most 5.4%), as with Flax's own mixed precision
# (`dtype=jnp.bfloat16` on the convolutions and linear layers: 3.5%, at most 5.5%).
# The bounds leave room for that spread and catch a gradient that is wrong rather
# than rounded.
HEAD_GRAD_TOL = 2e-2
GRAD_TOL = 8e-2


class CNN(nnx.Module):
    """The example's model, smaller: convolution + BatchNorm, linear + LayerNorm,
    Dropout."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(16, rngs=rngs)
        self.linear1 = nnx.Linear(16 * 4 * 4, 32, rngs=rngs)
        self.norm3 = nnx.LayerNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm1(self.conv1(x)))
        x = nnx.relu(self.norm2(self.conv2(x)))
        x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.gelu(self.norm3(self.linear1(x))))
        return self.linear2(x)


class Block(nnx.Module):
    """A pre-norm transformer block: attention (a softmax) and an MLP."""

    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=dim, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


def split_cnn(seed: int = 0):
    model = CNN(nnx.Rngs(params=seed, dropout=seed + 1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, rest, images):
        # `copy=True`: `rest` is not differentiated, so NNX would refuse
        # BatchNorm's writes, inside `jax.grad`, to Variables made outside it.
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(images)
        _, _, rest = nnx.split(model, nnx.Param, ...)
        return logits, rest

    def predict(params, rest, images):
        model = nnx.merge(graphdef, params, rest, copy=True)
        model.eval()
        return model(images)

    return forward, predict, params, rest


def images_and_labels(seed: int = 0, batch: int = 16):
    key_x, key_y = jr.split(jr.key(seed))
    return jr.uniform(key_x, (batch, 8, 8, 1)), jr.randint(key_y, (batch,), 0, 10)


def cross_entropy(logits, labels):
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def assert_float32_in_and_out(eqns) -> None:
    for eqn, scope in eqns:
        dtypes = in_dtypes(eqn) + out_dtypes(eqn)
        assert all(d == F32 for d in dtypes if jnp.issubdtype(d, jnp.floating)), (
            f"{eqn.primitive} under {scope!r} runs in {dtypes}"
        )


def test_cnn_matmuls_and_bias_adds_in_bfloat16_norm_statistics_in_float32():
    forward, _, params, rest = split_cnn()
    images, _ = images_and_labels()
    amp = eqx_amp.autocast(forward, policy=POLICY)
    jaxpr = jax.make_jaxpr(amp)(params, rest, images)
    assert ops_in(jaxpr, "conv_general_dilated") == [[BF16, BF16]] * 2
    assert ops_in(jaxpr, "dot_general") == [[BF16, BF16]] * 2
    # The `nnx.State` of parameters is an argument, and its arrays are parameters:
    # the float32 biases follow the bfloat16 matmuls' outputs, as in a hand-cast
    # model. No other add sees bfloat16.
    assert ops_in(jaxpr, "add").count([BF16, BF16]) == 4  # 2 conv + 2 linear biases
    assert sum(BF16 in dtypes for dtypes in ops_in(jaxpr, "add")) == 4
    # NNX's norm layers open no named scope, so no scope rule covers them; their
    # statistics are float32 by the default primitive rules, with no rules passed,
    # although their inputs (the bias adds) are bfloat16: the squares, the means of
    # two BatchNorms and a LayerNorm (of x and x**2: 6 reductions) and their rsqrt.
    assert len(eqns_named(jaxpr, "square")) == 6
    assert len(eqns_named(jaxpr, "reduce_sum")) == 6
    assert len(eqns_named(jaxpr, "rsqrt")) == 3
    assert_float32_in_and_out(eqns_named(jaxpr, "square", "reduce_sum", "rsqrt"))
    # The rule the example needed before `square` was float32 by default changes
    # nothing now.
    with_rule = eqx_amp.autocast(
        forward, policy=POLICY, rules={jax.lax.square_p: eqx_amp.FULL}
    )
    assert str(jax.make_jaxpr(with_rule)(params, rest, images)) == str(jaxpr)
    # The guide's limitation: in training, NNX's norms hand back float32 (they
    # promote with the float32 statistics of their input), so what follows them
    # does not return to bfloat16: the ReLUs, the pooling and the GELU (its tanh)
    # after the LayerNorm.
    assert_float32_in_and_out(eqns_named(jaxpr, "reduce_window_max", "tanh"))
    assert len(eqns_named(jaxpr, "reduce_window_max", "tanh")) == 2


def test_cnn_state_comes_back_in_its_dtypes():
    forward, _, params, rest = split_cnn()
    images, _ = images_and_labels()
    amp = eqx_amp.autocast(forward, policy=POLICY)
    (logits, new_rest), (ref_logits, ref_rest) = (
        jax.jit(f)(params, rest, images) for f in (amp, forward)
    )
    assert logits.dtype == F32
    assert rel_error(logits, ref_logits) < 2e-2
    # BatchNorm's running statistics come back float32 and close to float32's;
    # Dropout's RNG key and counter are untouched by the casting (the same masks).
    stats, ref_stats, old_stats = (
        nnx.filter_state(r, nnx.BatchStat) for r in (new_rest, ref_rest, rest)
    )
    assert float_dtypes(stats) == {F32}
    # The update, not the statistics: momentum 0.99 keeps them within 1% of their
    # old values whatever the batch held.
    step, ref_step = (
        jtu.tree_map(jnp.subtract, s, old_stats) for s in (stats, ref_stats)
    )
    assert global_rel_error(step, ref_step) < 1e-2
    assert jtu.tree_structure(new_rest) == jtu.tree_structure(rest)
    for leaf, ref in zip(
        jtu.tree_leaves(nnx.filter_state(new_rest, nnx.RngState)),
        jtu.tree_leaves(nnx.filter_state(ref_rest, nnx.RngState)),
    ):
        assert leaf.dtype == ref.dtype
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf, ref = jr.key_data(leaf), jr.key_data(ref)
        np.testing.assert_array_equal(leaf, ref)
    (count,) = jtu.tree_leaves(nnx.filter_state(new_rest, nnx.RngCount))
    (old_count,) = jtu.tree_leaves(nnx.filter_state(rest, nnx.RngCount))
    assert int(count) == int(old_count) + 1


def test_cnn_evaluation_reads_the_running_statistics():
    forward, predict, params, rest = split_cnn()
    images, _ = images_and_labels()
    # A few training passes, so the running statistics are not their initial 0 and 1.
    for _ in range(3):
        _, rest = forward(params, rest, images)
    amp = eqx_amp.autocast(predict, policy=POLICY)
    jaxpr = jax.make_jaxpr(amp)(params, rest, images)
    assert_matmuls_in(jaxpr, BF16, at_least=4)
    # Only the LayerNorm reduces; BatchNorm reads its float32 running statistics.
    assert len(eqns_named(jaxpr, "reduce_sum")) == 2
    assert_float32_in_and_out(eqns_named(jaxpr, "reduce_sum", "rsqrt"))
    # The running statistics (`nnx.BatchStat`) are state, not parameters: float32
    # data, like `eqx.nn.State`. So BatchNorm normalises (`x - mean`) in float32
    # and hands back float32, as it does in training, and the ReLUs and the
    # pooling after it run in float32; only the bias adds after the products are
    # bfloat16.
    assert ops_in(jaxpr, "sub")[:2] == [[F32, F32]] * 2
    assert ops_in(jaxpr, "max").count([F32, F32]) == 3
    assert ops_in(jaxpr, "reduce_window_max") == [[F32]]
    assert ops_in(jaxpr, "add").count([BF16, BF16]) == 4
    assert ops_in(jaxpr, "tanh") == [[F32]]
    logits = jax.jit(amp)(params, rest, images)
    assert logits.dtype == F32
    # 0.55% on this seed.
    assert rel_error(logits, predict(params, rest, images)) < 2e-2


def test_cnn_gradients_are_float32_and_close_to_float32():
    forward, _, params, rest = split_cnn()
    images, labels = images_and_labels()

    def loss_fn(forward):
        def loss(params, rest, images, labels):
            logits, rest = forward(params, rest, images)
            return cross_entropy(logits, labels), rest

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    (ref_loss, _), ref_grads = loss_fn(forward)(params, rest, images, labels)
    amp = eqx_amp.autocast(forward, policy=POLICY)
    (loss, new_rest), grads = loss_fn(amp)(params, rest, images, labels)
    assert loss.dtype == F32
    assert rel_error(loss, ref_loss) < 1e-2
    assert jtu.tree_structure(grads) == jtu.tree_structure(params)
    assert float_dtypes(grads) == {F32}
    assert global_rel_error(grads, ref_grads) < GRAD_TOL
    for layer in ("linear1", "linear2", "norm3"):
        assert global_rel_error(grads[layer], ref_grads[layer]) < HEAD_GRAD_TOL
    assert float_dtypes(nnx.filter_state(new_rest, nnx.BatchStat)) == {F32}


def _dtypes_of(jaxpr):
    return [
        (eqn.primitive.name, in_dtypes(eqn), out_dtypes(eqn))
        for eqn, _ in walk_eqns(jaxpr)
    ]


def test_nnx_params_are_parameters_and_batch_stats_are_data():
    """Regression test: `autocast` treats `nnx.Param` variables (in the `nnx.State`
    that `nnx.split` returns) as parameters, as it treats Equinox modules' arrays;
    other variables (batch statistics) and raw arrays are data.
    The parameters as an argument and inside an Equinox module (`eqx.Partial`, the
    example's former workaround) run every op in the same dtypes."""
    forward, _, params, rest = split_cnn()
    images, _ = images_and_labels()
    as_argument = jax.make_jaxpr(eqx_amp.autocast(forward, policy=POLICY))(
        params, rest, images
    )
    as_module = jax.make_jaxpr(
        lambda params, rest, images: eqx_amp.autocast(
            eqx.Partial(forward, params), policy=POLICY
        )(rest, images)
    )(params, rest, images)
    assert _dtypes_of(as_argument) == _dtypes_of(as_module)
    assert ops_in(as_argument, "add").count([BF16, BF16]) == 4

    # The same function with the same arrays: a plain dict argument is data, whose
    # float32 bias promotes the matmul's output; an `nnx.Param` is a parameter,
    # which follows it; a batch statistic is state, which is data.
    w, x = jnp.ones((4, 4)), jnp.ones(4)

    def f(p, x):
        return jax.nn.relu(x @ w + p["b"][...])

    amp = eqx_amp.autocast(f, policy=POLICY)
    bias = jnp.zeros(4)
    for p, dtype in (
        ({"b": bias}, F32),
        (nnx.State({"b": bias}), F32),
        (nnx.State({"b": nnx.Param(bias)}), BF16),
        ({"b": nnx.Param(bias)}, BF16),
        (nnx.State({"b": nnx.BatchStat(bias)}), F32),
    ):
        jaxpr = jax.make_jaxpr(amp)(p, x)
        assert ops_in(jaxpr, "add") == [[dtype, dtype]], type(p)
        assert ops_in(jaxpr, "max") == [[dtype, dtype]], type(p)  # the ReLU


def test_nnx_norm_variance_in_float32_after_bfloat16_input():
    """Regression test: NNX's norms make their input float32 with
    `jnp.asarray(x, float32)`, an identity in the float32 program `autocast` traces,
    so nothing of theirs restores a bfloat16 input (here from a bias-free linear
    layer, as a bias-free convolution gives in a ResNet) before the fast variance
    E[x^2] - E[x]^2, which cancels when the mean is large against the spread. The
    default rules square in float32, so no user rule is needed."""
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(
        nnx.Linear(8, 8, use_bias=False, rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, rest, x):
        return nnx.merge(graphdef, params, rest, copy=True)(x)

    # Mean 16, spread 1; the identity weights and bfloat16-exact inputs make the
    # matmul exact in bfloat16, so every difference below is the norm's.
    params["layers"][0]["kernel"][...] = jnp.eye(8)
    x = (16 + jr.normal(jr.key(0), (256, 8))).astype(BF16).astype(F32)
    ref = forward(params, rest, x)

    amp = eqx_amp.autocast(forward, policy=POLICY)
    jaxpr = jax.make_jaxpr(amp)(params, rest, x)
    assert ops_in(jaxpr, "dot_general") == [[BF16, BF16]]
    assert ops_in(jaxpr, "square") == [[F32], [F32]]
    assert_float32_in_and_out(eqns_named(jaxpr, "square", "reduce_sum", "rsqrt"))
    assert rel_error(amp(params, rest, x), ref) < 1e-4
    # What the default guards against: a square that follows its bfloat16 input
    # (the default before the fix) puts the output percents off.
    old = eqx_amp.autocast(
        forward, policy=POLICY, rules={jax.lax.square_p: eqx_amp.PROMOTE}
    )
    assert ops_in(jax.make_jaxpr(old)(params, rest, x), "square") == [[BF16], [F32]]
    assert rel_error(old(params, rest, x), ref) > 1e-2


def test_transformer_block_attention_softmax_in_float32():
    dim = 16
    model = Block(dim, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    x = jr.normal(jr.key(1), (2, 10, dim))
    amp = eqx_amp.autocast(forward, policy=POLICY)
    jaxpr = jax.make_jaxpr(amp)(params, x)
    # Query, key, value and output projections, the two attention products, the MLP.
    assert_matmuls_in(jaxpr, BF16, at_least=8)
    # The softmax's exp and sum, and both LayerNorms' statistics, run in float32.
    assert len(eqns_named(jaxpr, "exp")) == 1
    assert len(eqns_named(jaxpr, "reduce_sum")) == 5
    assert_float32_in_and_out(eqns_named(jaxpr, "exp", "reduce_sum", "rsqrt"))
    # No norm between the MLP's up projection and its GELU: the bias add and the
    # GELU (its tanh) stay bfloat16, unlike after the CNN's norms.
    assert ops_in(jaxpr, "tanh") == [[BF16]]
    out = jax.jit(amp)(params, x)
    assert out.dtype == F32
    assert rel_error(out, forward(params, x)) < 2e-2

    def loss(params, forward):
        return jnp.mean(forward(params, x) ** 2)

    grads, ref_grads = (
        jax.jit(jax.grad(ft.partial(loss, forward=f)))(params) for f in (amp, forward)
    )
    assert float_dtypes(grads) == {F32}
    # No BatchNorm: 0.6% (median over 20 seeds; at most 0.7%), as for the CNN's
    # linear layers.
    assert global_rel_error(grads, ref_grads) < HEAD_GRAD_TOL


@pytest.mark.slow
def test_example_trains_in_bfloat16_to_float32_accuracy():
    out = run_repo_script("examples/flax_nnx.py", "--epochs", "4")
    accuracy = {
        name: float(value)
        for name, value in re.findall(
            r"^(fp32|amp) test accuracy: ([\d.]+)%", out, re.M
        )
    }
    assert set(accuracy) == {"fp32", "amp"}, out
    assert accuracy["fp32"] > 85, out
    assert abs(accuracy["amp"] - accuracy["fp32"]) < 3, out
    assert "amp parameter dtypes: ['float32']" in out
    (state_dtypes,) = re.findall(r"amp state dtypes: (.*)$", out, re.M)
    assert "'float32'" in state_dtypes and "'uint32'" in state_dtypes, out
    assert "bfloat16" not in state_dtypes, out
    assert "matmul/conv FLOPs in low precision: 100.0%" in out
    assert re.search(r"^conv_general_dilated +2  bfloat16, bfloat16$", out, re.M), out
    assert re.search(r"^dot_general +2  bfloat16, bfloat16$", out, re.M), out
    # The bias adds run in bfloat16 (the parameters follow the activations), and
    # the norms' squares in float32.
    assert re.search(r"^add +4  bfloat16, bfloat16$", out, re.M), out
    assert re.search(r"^square +6  float32$", out, re.M), out
    assert "Conv.__call__" not in out and "Linear.__call__" not in out, out

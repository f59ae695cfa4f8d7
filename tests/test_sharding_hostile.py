"""Hostile tests of `gather_params`, the gradient-reduction dtype and the two controls
of `axis_name` (`average`), in every mode JAX maps an axis in.

The matrix:

- modes: `jax.shard_map` (default `check_vma=True`), `jax.shard_map(check_vma=False)`
  and `jax.pmap` on 8 fake CPU devices (one subprocess, `slow`), and a named
  `jax.vmap` on one device (fast): the multi-device guide's FSDP recipe (specs, `pmean`
  loss, `average=False`) must give the float32 reference's gradients of the mean
  loss in every mode, and `average=True` over gathered shards must be refused in
  every mode (no type says "shard" without `check_vma`);
- the per-device-copy idiom (a stack of copies split with `P("d")`) must be refused
  with the fix that is right for it (one copy, replicated, `P()`), and that fix
  must give the reference;
- values: zeros, gradients in float16's subnormal range, gradients whose sum
  overflows float16 (finite with `reduce_dtype=float32`, as `check_vma=True` gives),
  one NaN on one device (every device then agrees the step is not finite);
- leaves: empty and scalar leaves, int, bool, key and None leaves next to the
  floating ones, sharded and replicated.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqx_amp

from .helpers import run_script_on_eight_devices


MEMBERS = 4  # the size of the named vmap axis
F16_REDUCE_F32 = eqx_amp.get_policy("p=f32,c=f16,o=f32,reduce=f32")
F16 = eqx_amp.get_policy("p=f32,c=f16,o=f32")


def _shards_and_specs(scale: float = 1.0):
    """A tree of every kind of leaf: a sharded weight, a sharded empty leaf, a
    replicated scalar, a sharded int leaf, a replicated bool, a key and None."""
    tree = {
        "w": scale * jr.normal(jr.key(0), (2 * MEMBERS, 3)),
        "empty": jnp.zeros((0, 3)),
        "scalar": jnp.asarray(0.5 * scale),
        "index": jnp.arange(2 * MEMBERS, dtype=jnp.int32),
        "flag": jnp.asarray(True),
        "key": jr.key(1),
        "none": None,
    }
    specs = {
        "w": P("d"),
        "empty": P("d"),
        "scalar": P(),
        "index": P("d"),
        "flag": P(),
        "key": P(),
        "none": None,
    }
    return tree, specs


def _model_loss(tree, x):
    """The loss of one member (one device) on its batch `x` of shape (2, 3)."""
    h = x.astype(tree["w"].dtype) @ tree["w"].T  # (2, 2 * MEMBERS)
    h = h * tree["scalar"] + jnp.sum(tree["empty"]).astype(h.dtype)
    ignored = jnp.where(tree["flag"], 0, 1) * tree["index"]  # zeros, int
    h = h + ignored[None, :].astype(h.dtype)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _reference(tree, xs):
    """float32 gradients of the mean over members of their losses."""
    floats = {k: tree[k] for k in ("w", "empty", "scalar")}

    def mean_loss(floats):
        return jnp.mean(jax.vmap(lambda x: _model_loss({**tree, **floats}, x))(xs))

    return jax.grad(mean_loss)(floats)


def _stack(tree, specs):
    """Each member's view: its shard of a sharded leaf, a copy of a replicated one."""

    def member(leaf, spec):
        if leaf is None:
            return None
        if spec == P("d"):
            return leaf.reshape(MEMBERS, leaf.shape[0] // MEMBERS, *leaf.shape[1:])
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jr.split(leaf, MEMBERS)
        return jnp.broadcast_to(leaf, (MEMBERS, *leaf.shape))

    return jax.tree.map(member, tree, specs, is_leaf=lambda x: x is None)


def _unstack(stacked, specs):
    def whole(leaf, spec):
        if leaf is None:
            return None
        if spec == P("d"):
            return leaf.reshape(-1, *leaf.shape[2:])
        return leaf[0]

    return jax.tree.map(whole, stacked, specs, is_leaf=lambda x: x is None)


def _vmapped_fsdp(policy, average=False):
    specs = _shards_and_specs()[1]

    def local_loss(shards, x):
        tree = eqx_amp.sharding.gather_params(shards, "d", specs=specs, policy=policy)
        return jax.lax.pmean(_model_loss(tree, x), "d")

    def member(shards, x):
        (loss, grads), _, finite = eqx_amp.filter_value_and_grad(
            local_loss, axis_name="d", average=average
        )(shards, x, loss_scale=eqx_amp.NoOpLossScale())
        return loss, grads, finite

    return jax.jit(jax.vmap(member, axis_name="d"))


_FSDP_F32 = _vmapped_fsdp("float32")
_FSDP_F16_REDUCE_F32 = _vmapped_fsdp(F16_REDUCE_F32)
_FSDP_F16 = _vmapped_fsdp(F16)


def _run_vmapped(step, tree, xs):
    specs = _shards_and_specs()[1]
    loss, grads, finite = step(_stack(tree, specs), xs)
    return loss, _unstack(grads, specs), finite


def _xs(scale=1.0):
    return scale * jr.normal(jr.key(2), (MEMBERS, 2, 3))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def test_fsdp_recipe_under_a_named_vmap_gives_the_mean_gradients():
    """Under a named vmap JAX transposes the loss's `pmean` into a `psum`: every
    member's cotangent is 4x what `check_vma=True` gives, so a summing
    reduce-scatter returned 4x the gradients (and replicated leaves crashed in
    `pvary`)."""
    tree, _ = _shards_and_specs()
    xs = _xs()
    loss, grads, finite = _run_vmapped(_FSDP_F32, tree, xs)
    reference = _reference(tree, xs)
    assert bool(jnp.all(finite))
    for name in ("w", "scalar"):
        assert _rel(grads[name], reference[name]) < 1e-6, name
    assert grads["empty"].shape == (0, 3)
    # Non-floating leaves get no gradient; their structure is kept.
    assert grads["index"] is None and grads["flag"] is None and grads["key"] is None
    assert grads["none"] is None
    expected_loss = jnp.mean(jax.vmap(lambda x: _model_loss(tree, x))(xs))
    np.testing.assert_allclose(loss, jnp.full(MEMBERS, expected_loss), rtol=1e-6)


def _per_member_max_gradient(tree, xs):
    """The largest gradient of one member's own loss: what it sends to the sum."""
    floats = {k: tree[k] for k in ("w", "empty", "scalar")}
    grads = jax.vmap(
        lambda x: jax.grad(lambda f: _model_loss({**tree, **f}, x))(floats)
    )(xs)
    return float(jnp.max(jnp.abs(grads["w"])))


@pytest.mark.parametrize("case", ["zeros", "subnormal", "large"])
@pytest.mark.parametrize("reduce", ["float16", "float32"])
def test_edge_values_under_a_named_vmap(case, reduce):
    """float16 compute: each member's cotangent is scaled before the sum (as
    `check_vma=True` scales it), so gradients in float16's subnormal range survive,
    and gradients whose sum exceeds float16's range stay finite even when they are
    reduced in float16."""
    data_scale = {"zeros": 1.0, "subnormal": 3e-3, "large": 20.0}[case]
    tree, _ = _shards_and_specs(0.0 if case == "zeros" else 1.0)
    if case == "large":  # the weights' gradients, not the scalar's, are the largest
        tree = {**tree, "scalar": jnp.asarray(8.0)}
    xs = _xs(data_scale)
    step = _FSDP_F16 if reduce == "float16" else _FSDP_F16_REDUCE_F32
    _, grads, finite = _run_vmapped(step, tree, xs)
    reference = _reference(tree, xs)
    assert bool(jnp.all(finite))
    if case == "zeros":
        assert not np.any(np.asarray(grads["w"])) and float(grads["scalar"]) == 0.0
        return
    largest = _per_member_max_gradient(tree, xs)
    if case == "subnormal":
        assert largest < 6.1e-5  # float16's smallest normal
        tolerance = 0.1  # float16 subnormals have few significant bits
    else:
        assert 65504 / MEMBERS < largest < 65504  # the sum would overflow float16
        tolerance = 5e-3
    assert _rel(grads["w"], reference["w"]) < tolerance
    assert _rel(grads["scalar"], reference["scalar"]) < tolerance


def test_one_nan_on_one_member_is_agreed_by_every_member():
    tree, _ = _shards_and_specs()
    xs = _xs().at[1, 0, 0].set(jnp.nan)
    _, grads, finite = _run_vmapped(_FSDP_F16_REDUCE_F32, tree, xs)
    assert not bool(jnp.any(finite))
    assert not bool(jnp.all(jnp.isfinite(grads["w"])))


def test_averaging_gathered_shards_is_refused_under_a_named_vmap():
    """No type says "shard" under vmap (or pmap, or `check_vma=False`): averaging the
    shards' gradients mixed different parameters' gradients, silently."""
    tree, specs = _shards_and_specs()
    step = _vmapped_fsdp("float32", average=True)
    with pytest.raises(
        ValueError,
        match=r"the loss gathers parameters sharded over 'd' with "
        r"`eqx_amp.sharding.gather_params`.*Pass `average=False`",
    ):
        step(_stack(tree, specs), _xs())


def test_gather_params_without_specs_says_which_modes_type_nothing_as_varying():
    tree, specs = _shards_and_specs()

    def member(shards):
        return eqx_amp.sharding.gather_params(shards, "d")

    with pytest.raises(
        ValueError,
        match=r"`jax.pmap`, `jax.vmap` and `jax.shard_map\(check_vma=False\)`",
    ):
        jax.vmap(member, axis_name="d")(_stack(tree, specs))


def test_a_stacked_copy_per_device_is_refused_with_the_fix_for_it():
    """`in_specs=P("d")` over a stack of whole copies (as for pmap) types each copy as
    varying: averaging is refused, and the message must not advise only
    `average=False`, which leaves every device its own un-averaged gradients."""
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    model = eqx.nn.Linear(3, 2, key=jr.key(0))
    stacked = jax.tree.map(lambda a: a[None], eqx.filter(model, eqx.is_array))
    static = eqx.filter(model, eqx.is_array, inverse=True)

    def loss(copy, x):
        return jax.lax.pmean(jnp.mean(jax.vmap(eqx.combine(copy, static))(x) ** 2), "d")

    def per_device(stacked, x):
        copy = jax.tree.map(lambda a: a[0], stacked)
        (_, grads), _, _ = eqx_amp.filter_value_and_grad(loss, axis_name="d")(
            copy, x, loss_scale=eqx_amp.NoOpLossScale()
        )
        return grads

    step = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")
    )
    with pytest.raises(ValueError) as error:
        step(stacked, jnp.ones((4, 3)))
    message = str(error.value)
    assert "a whole copy per device" in message
    assert "pass one copy, replicated, `in_specs=P()`" in message
    assert "jax.lax.pmean(loss, 'd')" in message
    assert "a shard of a parameter" in message and "`average=False`" in message


#
# 8 devices: shard_map with and without check_vma, and pmap.
#

_EIGHT_DEVICES = r"""
import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, numpy as np
from jax.sharding import PartitionSpec as P
import eqx_amp

n = jax.device_count()
mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
model = eqx.nn.MLP(8, 4, 16, 1, key=jr.key(0))
params, static = eqx.partition(model, eqx.is_array)
# The first layer's weight and bias are sharded; the head (4 rows) is replicated.
specs = jax.tree.map(lambda a: P("d") if a.shape[0] % n == 0 else P(), params)
x = jr.normal(jr.key(1), (4 * n, 8))
F16_F32 = eqx_amp.get_policy("p=f32,c=f16,o=f32,reduce=f32")
report = {}


def reference(params, x):
    mean = lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2)
    return jax.grad(mean)(params)


def rel(grads, ref):
    flat = lambda t: np.concatenate([np.ravel(a) for a in jax.tree.leaves(t)])
    a, b = flat(grads).astype(np.float64), flat(ref).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fsdp_body(policy, average=False):
    def local_loss(shards, x):
        gathered = eqx_amp.sharding.gather_params(shards, "d", specs=specs, policy=policy)
        m = eqx_amp.filter_amp(eqx.filter_vmap(eqx.combine(gathered, static)), policy=policy)
        return jax.lax.pmean(jnp.mean(m(x) ** 2), "d")

    def body(shards, x):
        (loss, grads), _, finite = eqx_amp.filter_value_and_grad(
            local_loss, axis_name="d", average=average
        )(shards, x, loss_scale=eqx_amp.NoOpLossScale())
        return loss, grads, finite
    return body


def stack(tree):
    return jax.tree.map(
        lambda a, s: a.reshape(n, a.shape[0] // n, *a.shape[1:]) if s == P("d")
        else jnp.broadcast_to(a, (n, *a.shape)),
        tree, specs,
    )


def unstack(tree):
    return jax.tree.map(
        lambda a, s: a.reshape(-1, *a.shape[2:]) if s == P("d") else a[0], tree, specs
    )


def run(mode, body, params, x):
    if mode == "pmap":
        loss, grads, finite = jax.pmap(body, axis_name="d")(stack(params), x.reshape(n, -1, 8))
        return loss, unstack(grads), finite
    f = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(specs, P("d")), out_specs=(P(), specs, P()),
        check_vma=(mode == "shard_map"),
    ))
    return f(params, x)


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def largest_device_gradient(x):
    # The largest gradient of one device's own loss: what it sends to the sum.
    per_device = jax.vmap(lambda xi: reference(params, xi))(x.reshape(n, -1, 8))
    return max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(per_device))


F16 = eqx_amp.get_policy("p=f32,c=f16,o=f32")
# Data scaled so that one device's largest gradient is 3e4 (the loss is quadratic).
big_x = x * float(np.sqrt(3e4 / largest_device_gradient(x)))
report["big/largest_device_gradient"] = largest_device_gradient(big_x)
modes = ["shard_map", "shard_map_unchecked", "pmap"]
ref = reference(params, x)
for mode in modes:
    for name, policy in (("f32", "float32"), ("f16_reduce_f32", F16_F32)):
        loss, grads, finite = run(mode, fsdp_body(policy), params, x)
        report[f"{mode}/{name}/error"] = rel(grads, ref)
        report[f"{mode}/{name}/finite"] = bool(np.all(finite))
        report[f"{mode}/{name}/dtypes"] = sorted({str(g.dtype) for g in jax.tree.leaves(grads)})
    # Gradients whose float16 sum overflows, reduced in float16: each device's
    # cotangent is scaled before the sum, as with check_vma=True, so it fits.
    loss, grads, finite = run(mode, fsdp_body(F16), params, big_x)
    report[f"{mode}/overflowing_sum/error"] = rel(grads, reference(params, big_x))
    report[f"{mode}/overflowing_sum/finite"] = bool(np.all(finite))
    # One NaN on one device: every device agrees.
    loss, grads, finite = run(mode, fsdp_body(F16_F32), params, x.at[5, 0].set(jnp.nan))
    report[f"{mode}/nan/finite_anywhere"] = bool(np.any(finite))
    report[f"{mode}/average_true"] = error_of(
        lambda: run(mode, fsdp_body("float32", average=True), params, x)
    )

# The collectives' dtypes without check_vma: gathered in float16, reduced in float32.
jaxpr = jax.make_jaxpr(jax.shard_map(
    lambda s, x: fsdp_body(F16_F32)(s, x)[1], mesh=mesh,
    in_specs=(specs, P("d")), out_specs=specs, check_vma=False,
))(params, x)


def walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from walk(inner)


report["unchecked/collectives"] = sorted({
    f"{e.primitive.name}:{e.invars[0].aval.dtype}" for e in walk(jaxpr.jaxpr)
    if e.primitive.name in ("all_gather", "reduce_scatter", "psum_scatter")
})

# The per-device-copy idiom: a stack of whole copies split with P("d").
stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), params)


def copy_loss(copy, x):
    return jax.lax.pmean(jnp.mean(jax.vmap(eqx.combine(copy, static))(x) ** 2), "d")


def per_device_copy(average):
    def body(stacked, x):
        copy = jax.tree.map(lambda a: a[0], stacked)
        (_, grads), _, _ = eqx_amp.filter_value_and_grad(
            copy_loss, axis_name="d", average=average
        )(copy, x, loss_scale=eqx_amp.NoOpLossScale())
        return jax.tree.map(lambda g: g[None], grads)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")))


report["copy/average_true"] = error_of(lambda: per_device_copy(True)(stacked, x))
# What the old advice, `average=False`, gives: each device its own gradients.
own = per_device_copy(False)(stacked, x)
report["copy/average_false/error"] = max(
    rel(jax.tree.map(lambda g: g[i], own), ref) for i in range(n)
)


# The advised fix: one copy, replicated, and the global mean loss.
def replicated(copy, x):
    (_, grads), _, _ = eqx_amp.filter_value_and_grad(copy_loss, axis_name="d")(
        copy, x, loss_scale=eqx_amp.NoOpLossScale()
    )
    return grads


grads = jax.jit(jax.shard_map(replicated, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))(params, x)
report["copy/replicated/error"] = rel(grads, ref)
"""


@pytest.fixture(scope="module")
def eight_devices():
    return run_script_on_eight_devices(_EIGHT_DEVICES)


MODES = ["shard_map", "shard_map_unchecked", "pmap"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fsdp_recipe_gives_the_mean_gradients_in_every_mode(eight_devices, mode):
    """`check_vma=False` and pmap returned 8x the gradients."""
    assert eight_devices[f"{mode}/f32/error"] < 1e-5
    assert eight_devices[f"{mode}/f16_reduce_f32/error"] < 5e-3
    for name in ("f32", "f16_reduce_f32"):
        assert eight_devices[f"{mode}/{name}/finite"]
        assert eight_devices[f"{mode}/{name}/dtypes"] == ["float32"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_edge_values_in_every_mode(eight_devices, mode):
    largest = eight_devices["big/largest_device_gradient"]
    assert 65504 / 8 < largest < 65504  # a sum of 8 would overflow float16
    assert eight_devices[f"{mode}/overflowing_sum/finite"]
    assert eight_devices[f"{mode}/overflowing_sum/error"] < 5e-3
    assert not eight_devices[f"{mode}/nan/finite_anywhere"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_averaging_gathered_shards_is_refused_in_every_mode(eight_devices, mode):
    message = eight_devices[f"{mode}/average_true"]
    assert message is not None and "pass `average=false`" in message.lower()


@pytest.mark.slow
def test_collectives_without_check_vma_are_half_gathers_and_float32_reductions(
    eight_devices,
):
    collectives = eight_devices["unchecked/collectives"]
    assert "all_gather:float16" in collectives
    assert {c for c in collectives if not c.startswith("all_gather")} == {
        "reduce_scatter:float32"
    }


@pytest.mark.slow
def test_the_per_device_copy_error_gives_the_fix_that_works(eight_devices):
    message = eight_devices["copy/average_true"]
    assert "pass one copy, replicated, `in_specs=P()`" in message
    # The old advice left every device its own gradients, far from the mean...
    assert eight_devices["copy/average_false/error"] > 0.05
    # ...and the advised one gives the reference.
    assert eight_devices["copy/replicated/error"] < 1e-5

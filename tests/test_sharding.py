"""Beyond one device: the gradient-reduction dtype (`Policy.reduce_dtype`), FSDP under
`jax.shard_map` (`gather_params`), the two controls of `axis_name`, and sharded
steps on 8 devices read from the program right after SPMD partitioning."""

import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqx_amp

from . import doc_blocks
from .helpers import (
    benchmark_row,
    collective_bytes,
    global_rel_error,
    run_repo_script,
    run_script_on_eight_devices,
    walk_eqns,
)


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
F32, BF16 = np.dtype("float32"), jnp.dtype("bfloat16")
BF16_F32_REDUCE = eqx_amp.get_policy("mixed_bfloat16").with_reduce_dtype(jnp.float32)


class Tiny(eqx.Module):
    """Every kind of parameter whose gradient is a sum over the data: an embedding
    table (a lookup), learned positions (a broadcast add), Linear weights and biases
    (a matmul and a broadcast add), a LayerNorm."""

    embed: eqx.nn.Embedding
    positions: jax.Array
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.embed = eqx.nn.Embedding(16, 8, key=k1)
        self.positions = 0.1 * jr.normal(k2, (6, 8))
        self.linear = eqx.nn.Linear(8, 12, key=k3)
        self.norm = eqx.nn.LayerNorm(12)
        self.head = eqx.nn.Linear(12, 16, key=k4)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + self.positions
        x = jax.vmap(self.norm)(jax.nn.gelu(jax.vmap(self.linear)(x)))
        return jax.vmap(self.head)(x)


def _loss(logits, tokens):
    logits = logits.astype(jnp.float32)
    return -jnp.mean(
        jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)
    )


def _tokens():
    return jr.randint(jr.key(1), (5, 6), 0, 16)


def _filter_amp(policy):
    return lambda m, t: _loss(jax.vmap(eqx_amp.filter_amp(m, policy=policy))(t), t)


def _filter_amp_outside_vmap(policy):
    return lambda m, t: _loss(
        eqx_amp.filter_amp(eqx.filter_vmap(m), policy=policy)(t), t
    )


def _autocast(policy):
    forward = lambda m, t: jax.vmap(m)(t)  # noqa: E731
    return lambda m, t: _loss(eqx_amp.autocast(forward, policy=policy)(m, t), t)


def _autocast_inside_vmap(policy):
    return lambda m, t: _loss(jax.vmap(eqx_amp.autocast(m, policy=policy))(t), t)


PATHS = {
    "filter_amp": _filter_amp,
    "filter_amp_outside_vmap": _filter_amp_outside_vmap,
    "autocast": _autocast,
    "autocast_inside_vmap": _autocast_inside_vmap,
}


def _grad_of(path, policy, model, tokens):
    return eqx.filter_jit(eqx.filter_grad(PATHS[path](policy)))(model, tokens)


def _weight_shapes(model):
    return {tuple(x.shape) for x in jax.tree_util.tree_leaves(model) if eqx.is_array(x)}


def _gradient_sums(jaxpr, shapes):
    """The ops of a gradient program that sum a parameter's gradient: matmuls,
    reductions and scatter-adds whose output has a parameter's shape (or its
    transpose), with the dtypes their inputs had before any convert right in front
    (the CPU runtime has no half x half -> float32 matmul, so there eqx_amp feeds it
    float32 operands that hold the half values), and their output dtype."""
    shapes = shapes | {s[::-1] for s in shapes}
    found = []
    for sub in _jaxprs(jaxpr):
        made_by = {v: e for e in sub.eqns for v in e.outvars}

        def source_dtype(var):
            eqn = made_by.get(var)
            if eqn is not None and eqn.primitive.name == "convert_element_type":
                return eqn.invars[0].aval.dtype
            return var.aval.dtype

        for eqn in sub.eqns:
            name = eqn.primitive.name
            if name not in ("dot_general", "reduce_sum", "scatter-add", "scatter_add"):
                continue
            out = eqn.outvars[0].aval
            if tuple(out.shape) in shapes and len(out.shape) >= 1:
                ins = [source_dtype(v) for v in eqn.invars if hasattr(v.aval, "dtype")]
                found.append((name, tuple(out.shape), ins, out.dtype))
    return found


def _jaxprs(jaxpr):
    """`jaxpr` and every jaxpr nested in it."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            values = value if isinstance(value, (tuple, list)) else (value,)
            for v in values:
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield from _jaxprs(inner)


@pytest.mark.parametrize("path", list(PATHS))
def test_reduce_dtype_sums_every_parameter_gradient_in_it(path, getkey):
    model, tokens = Tiny(getkey()), _tokens()
    jaxpr = eqx.filter_make_jaxpr(lambda m: _grad_of(path, BF16_F32_REDUCE, m, tokens))(
        model
    )[0]
    sums = _gradient_sums(jaxpr, _weight_shapes(model))
    kinds = {name for name, *_ in sums}
    # The weight gradients (matmuls), the bias and position gradients (sums over
    # the batch) and the embedding gradient (a scatter-add) are all there...
    assert {"dot_general", "reduce_sum"} <= kinds
    assert kinds & {"scatter-add", "scatter_add"}
    for name, shape, ins, out in sums:
        # ...and each emits float32; the matmuls still read bfloat16 operands.
        assert out == F32, (name, shape, ins, out)
        if name == "dot_general":
            assert ins == [BF16, BF16], (name, shape, ins)


def test_without_a_reduce_dtype_weight_gradients_are_summed_in_the_compute_dtype(
    getkey,
):
    """The control: the same check fails for the default policy."""
    model, tokens = Tiny(getkey()), _tokens()
    policy = eqx_amp.get_policy("mixed_bfloat16")
    jaxpr = eqx.filter_make_jaxpr(lambda m: _grad_of("filter_amp", policy, m, tokens))(
        model
    )[0]
    dots = [
        s for s in _gradient_sums(jaxpr, _weight_shapes(model)) if s[0] == "dot_general"
    ]
    assert dots and all(out == BF16 for *_, out in dots)


@pytest.mark.parametrize("path", list(PATHS))
def test_reduce_dtype_gradients_match_float32(path, getkey):
    model, tokens = Tiny(getkey()), _tokens()
    reference = eqx.filter_jit(eqx.filter_grad(lambda m, t: _loss(jax.vmap(m)(t), t)))(
        model, tokens
    )
    default = _grad_of(path, eqx_amp.get_policy("mixed_bfloat16"), model, tokens)
    reduced = _grad_of(path, BF16_F32_REDUCE, model, tokens)
    for grads in (default, reduced):
        assert eqx.tree_equal(
            jax.tree_util.tree_structure(grads), jax.tree_util.tree_structure(reference)
        )
        assert {x.dtype for x in jax.tree_util.tree_leaves(grads)} == {F32}
    assert global_rel_error(reduced, reference) < 2e-2
    # Summing in float32 is no worse than summing in bfloat16.
    assert global_rel_error(reduced, reference) <= 1.1 * global_rel_error(
        default, reference
    )


def test_reduce_dtype_report_counts_each_matmul_once_in_the_compute_dtype(getkey):
    """A reduce dtype's matmuls have a CPU form (float32 operands holding the half
    values) beside the one other platforms run: the report counts the latter, once."""
    model, tokens = Tiny(getkey()), _tokens()
    reports = {
        name: eqx_amp.precision_report(
            lambda m: eqx.filter_grad(PATHS["filter_amp"](policy))(m, tokens), model
        )
        for name, policy in (
            ("default", eqx_amp.get_policy("mixed_bfloat16")),
            ("reduced", BF16_F32_REDUCE),
        )
    }
    assert reports["reduced"].matmul_flops == reports["default"].matmul_flops > 0
    assert set(reports["reduced"].flops_by_dtypes) == {("bfloat16", "bfloat16")}
    assert reports["reduced"].ops["dot_general"] == {("bfloat16", "bfloat16"): 6}


def test_reduce_dtype_under_vmap_gives_one_weight_gradient_per_batch(getkey):
    """Under `jax.vmap` the weight gradient is one contraction over the batch, not
    one per example summed afterwards."""
    model, tokens = Tiny(getkey()), _tokens()
    jaxpr = eqx.filter_make_jaxpr(
        lambda m: _grad_of("filter_amp", BF16_F32_REDUCE, m, tokens)
    )(model)[0]
    linear_weights = {model.linear.weight.shape, model.head.weight.shape}
    weight_grads = 0
    for eqn, _ in walk_eqns(jaxpr):
        if eqn.primitive.name == "dot_general":
            shape = tuple(eqn.outvars[0].aval.shape)
            assert shape[-2:] not in linear_weights or len(shape) == 2, shape
            weight_grads += shape in linear_weights
    assert weight_grads >= 2


def test_bimodel_reduce_dtype(getkey):
    model, tokens = Tiny(getkey()), _tokens()
    bimodel = eqx_amp.BiModel(model, policy=BF16_F32_REDUCE)

    def loss(m, t):
        return _loss(jax.vmap(m)(t), t)

    def grads_of(b):
        (_, grads), *_ = eqx_amp.filter_value_and_grad(loss)(
            b, tokens, loss_scale=eqx_amp.NoOpLossScale()
        )
        return grads

    jaxpr = eqx.filter_make_jaxpr(grads_of)(bimodel)[0]
    dots = [
        s for s in _gradient_sums(jaxpr, _weight_shapes(model)) if s[0] == "dot_general"
    ]
    assert dots and all(out == F32 and ins == [BF16, BF16] for _, _, ins, out in dots)
    reference = eqx.filter_jit(eqx.filter_grad(loss))(model, tokens)
    assert global_rel_error(eqx.filter_jit(grads_of)(bimodel), reference) < 2e-2


def test_reduce_dtype_composes_with_checkpoint_scan_and_jit(getkey):
    """Remat'd blocks scanned over, inside a jit: the sums still run in float32 and
    the gradients are right."""
    keys = jr.split(getkey(), 3)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(keys)
    params, static = eqx.partition(layers, eqx.is_array)
    x = jr.normal(getkey(), (4, 8))

    def forward(params, x):
        @eqx.filter_checkpoint
        def block(h, p):
            return jnp.tanh(jax.vmap(eqx.combine(p, static))(h)), None

        return jax.lax.scan(block, x, params)[0]

    def loss(params, x, policy):
        run = forward if policy is None else eqx_amp.filter_amp(forward, policy=policy)
        return jnp.sum(jax.jit(run)(params, x).astype(jnp.float32) ** 2)

    reference = jax.grad(loss)(params, x, None)
    grads = jax.grad(loss)(params, x, BF16_F32_REDUCE)
    assert global_rel_error(grads, reference) < 2e-2
    jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=2)(params, x, BF16_F32_REDUCE)
    sums = _gradient_sums(jaxpr, {(8, 8), (8,)})
    assert sums and all(out == F32 for *_, out in sums)


#
# filter_amp keeps the types and tree structure of what it is given.
#


def test_filter_amp_hands_over_the_users_types(getkey):
    """Kept Equinox norm layers are passed as they are (they compute in float32 and
    return their input's dtype by themselves), so the argument's structure matches
    the user's trees: `eqx.combine` and `tree_map` with a spec tree work inside."""
    model = eqx.nn.Sequential(
        [
            eqx.nn.Linear(4, 8, key=getkey()),
            eqx.nn.LayerNorm(8),
            eqx.nn.Linear(8, 3, key=getkey()),
        ]
    )
    params, static = eqx.partition(model, eqx.is_array)
    spec = jax.tree_util.tree_map(lambda _: True, params)
    seen = {}

    @eqx_amp.filter_amp(policy="mixed_bfloat16")
    def forward(params, x):
        seen["norm"] = type(params.layers[1])
        jax.tree_util.tree_map(lambda leaf, s: leaf, params, spec)
        return eqx.combine(params, static)(x)

    x = jr.normal(getkey(), (4,))
    out = forward(params, x)
    assert seen["norm"] is eqx.nn.LayerNorm
    assert out.dtype == F32
    # The same numbers as running the norm at its own call boundary in float32.
    cast = lambda layer: jax.tree_util.tree_map(  # noqa: E731
        lambda a: a.astype(BF16) if eqx.is_inexact_array(a) else a, layer
    )
    h = cast(model.layers[0])(x.astype(BF16))
    h = model.layers[1](h.astype(F32)).astype(BF16)
    expected = cast(model.layers[2])(h).astype(F32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


#
# gather_params and the two controls of axis_name, on one device.
#


def _one_device_mesh():
    return jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def test_gather_params_casts_before_the_gather_and_sums_in_the_reduce_dtype(getkey):
    model = eqx.nn.Linear(8, 4, key=getkey())
    params, static = eqx.partition(model, eqx.is_array)
    specs = eqx.nn.Linear(8, 4, key=getkey())  # a tree of the same structure
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (4, 8))

    def loss(shards, x):
        gathered = eqx_amp.sharding.gather_params(
            shards, "data", specs=specs, policy=BF16_F32_REDUCE
        )
        assert {a.dtype for a in jax.tree_util.tree_leaves(gathered)} == {BF16}
        out = jax.vmap(eqx.combine(gathered, static))(x.astype(BF16))
        return jax.lax.pmean(jnp.sum(out.astype(jnp.float32) ** 2), "data")

    step = jax.shard_map(
        jax.grad(loss), mesh=_one_device_mesh(), in_specs=(specs, P()), out_specs=specs
    )
    jaxpr = jax.make_jaxpr(step)(params, x)
    collectives = {
        (e.primitive.name, e.invars[0].aval.dtype)
        for e, _ in walk_eqns(jaxpr)
        if e.primitive.name in ("all_gather", "reduce_scatter", "psum_scatter")
    }
    assert ("all_gather", BF16) in collectives
    assert {d for name, d in collectives if name != "all_gather"} == {F32}
    grads = step(params, x)
    reference = jax.grad(lambda p: jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2))(
        params
    )
    assert {a.dtype for a in jax.tree_util.tree_leaves(grads)} == {F32}
    assert global_rel_error(grads, reference) < 2e-2


def test_gather_params_errors(getkey):
    params = eqx.filter(eqx.nn.Linear(8, 4, key=getkey()), eqx.is_array)
    with pytest.raises(ValueError, match="found no array in the tree that varies over"):
        eqx_amp.sharding.gather_params(params, "data")
    with pytest.raises(
        NameError, match=r"`axis_name='data'` is not the name of an axis"
    ):
        eqx_amp.sharding.gather_params(params, "data", specs=P("data"))
    with pytest.raises(TypeError, match="`axis_name` must be the \\(hashable\\) name"):
        eqx_amp.sharding.gather_params(params, ["data"])
    with pytest.raises(ValueError, match="`specs` must be a pytree prefix of `shards`"):
        eqx_amp.sharding.gather_params(params, "data", specs=[P("data"), P(), P()])
    with pytest.raises(ValueError, match="names 'data' at dimension 1, but the array"):
        eqx_amp.sharding.gather_params(params, "data", specs=P(None, "data"))
    # `specs` that shard nothing over the axis: refused as the typed case is.
    with pytest.raises(ValueError, match="found no array in the tree that `specs`"):
        eqx_amp.sharding.gather_params(params, "data", specs=P())
    with pytest.raises(ValueError, match="found no array in the tree that `specs`"):
        eqx_amp.sharding.gather_params(params, "data", specs=P(None, "model"))


def test_average_refuses_sharded_parameters_and_can_be_turned_off(getkey):
    model = eqx.nn.Linear(8, 4, key=getkey())
    params, static = eqx.partition(model, eqx.is_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (4, 8))

    def loss(shards, x):
        model = eqx.combine(
            eqx_amp.sharding.gather_params(shards, "data", specs=specs), static
        )
        out = jax.vmap(eqx_amp.filter_amp(model))(x)
        return jax.lax.pmean(jnp.sum(out**2), "data")

    def step(average):
        def grads(shards, x):
            (_, g), _, finite = eqx_amp.filter_value_and_grad(
                loss, axis_name="data", average=average
            )(shards, x, loss_scale=eqx_amp.NoOpLossScale())
            return g, finite

        return jax.jit(
            jax.shard_map(
                grads,
                mesh=_one_device_mesh(),
                in_specs=(specs, P()),
                out_specs=(specs, P()),
            )
        )

    with pytest.raises(
        ValueError, match=r"but `\.weight` varies over 'data' \(a shard"
    ):
        step(True)(params, x)
    grads, finite = step(False)(params, x)
    assert bool(finite)
    with pytest.raises(TypeError, match="`average` must be a bool, but got 'no'"):
        eqx_amp.filter_value_and_grad(loss, axis_name="data", average="no")


#
# 8 devices.
#


_SHARDED_ROWS: dict[tuple[str, str], list[dict]] = {}


def sharded_rows(mesh: str, engine: str) -> list[dict]:
    """The sharded benchmark's cases for one mesh and engine, measured once on 8
    simulated CPU devices (a test selected alone pays for its own group only)."""
    if (mesh, engine) not in _SHARDED_ROWS:
        out = run_repo_script(
            "benchmarks/sharded.py",
            "--quick",
            "--only",
            f"{mesh}/{engine}",
            "--json",
            "-",
        )
        _SHARDED_ROWS[mesh, engine] = json.loads(out.strip().splitlines()[-1])
    return _SHARDED_ROWS[mesh, engine]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["filter_amp", "autocast", "bimodel"])
@pytest.mark.parametrize("mesh", ["fsdp", "fsdp_tp"])
@pytest.mark.parametrize("engine", ["jit", "shard_map"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_sharded_steps_on_eight_devices(path, mesh, engine, dtype):
    rows = sharded_rows(mesh, engine)
    where = dict(mesh=mesh, engine=engine, dtype=dtype)
    row = benchmark_row(rows, variant=path, **where)
    hand = benchmark_row(rows, variant="hand", **where)
    fp32 = benchmark_row(rows, variant="fp32", mesh=mesh, engine=engine)
    # Weights are cast before they are gathered: half the bytes of float32, no more
    # than the hand-cast step (float32 only for the norm layers, as by hand).
    gathers = row["collectives"]["param_gather"]
    assert set(gathers) <= {dtype, "f32"}
    assert collective_bytes(row, "param_gather") <= collective_bytes(
        hand, "param_gather"
    )
    assert collective_bytes(row, "param_gather", {"f32"}) <= collective_bytes(
        hand, "param_gather", {"f32"}
    )
    assert collective_bytes(row, "param_gather") <= 0.5 * collective_bytes(
        fp32, "param_gather"
    ) + collective_bytes(hand, "param_gather", {"f32"})
    # Gradients are reduced in the dtype asked for: bfloat16 cases keep the compute
    # dtype (as by hand, the same bytes), float16 cases ask for float32.
    reductions = row["collectives"]["grad_reduce"]
    if row["reduce"] == "compute":
        assert row["reduce"] == "compute" and dtype == "bf16"
        assert reductions == hand["collectives"]["grad_reduce"]
    else:
        assert dtype == "f16" and set(reductions) == {"f32"}
    # Gradients land where GSPMD puts the float32 step's, and match its values.
    assert row["grad_shardings"] == fp32["grad_shardings"]
    assert row["grad_error"] < (2e-2 if dtype == "bf16" else 5e-3)


@pytest.mark.slow
def test_all_finite_is_one_collective_over_sharded_gradients():
    """XLA combines the per-leaf reductions of `all_finite` into one all-reduce."""
    report = run_script_on_eight_devices(
        """
import re
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import eqx_amp
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
leaves = [
    jax.device_put(jnp.ones((16, 8 * (i + 1))), NamedSharding(mesh, P("data")))
    for i in range(10)
]
f = jax.jit(eqx_amp.all_finite)
text = f.lower(leaves).compile().as_text()
leaves[3] = leaves[3].at[5, 2].set(jnp.inf)
report = {
    "all_reduces": len(re.findall(r"\\sall-reduce(?:-start)?\\(", text)),
    "finite": bool(f(leaves[:3] + leaves[4:])),
    "with_inf": bool(f(leaves)),
}
"""
    )
    assert report == {"all_reduces": 1, "finite": True, "with_inf": False}


def test_a_vmap_outside_the_wrapper_of_a_scanned_model_is_named(getkey):
    """Under a `jax.vmap` applied outside `filter_amp`, JAX batches a scan body after
    eqx_amp traced it: the gradients inside are per example, and the user is told
    how to put the wrapper outside. Outside, they are one contraction."""
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
        jr.split(getkey(), 2)
    )
    params, static = eqx.partition(layers, eqx.is_array)

    class Stack(eqx.Module):
        params: eqx.nn.Linear

        def __call__(self, x):
            def block(h, p):
                return jnp.tanh(eqx.combine(p, static)(h)), None

            return jax.lax.scan(block, x, self.params)[0]

    model, x = Stack(params), jr.normal(getkey(), (4, 8))

    def inside(m):
        return jnp.sum(jax.vmap(eqx_amp.filter_amp(m, policy=BF16_F32_REDUCE))(x))

    def outside(m):
        return jnp.sum(
            eqx_amp.filter_amp(eqx.filter_vmap(m), policy=BF16_F32_REDUCE)(x)
        )

    with pytest.warns(
        UserWarning, match=r"this `scan` runs under a `jax.vmap` applied"
    ):
        eqx.filter_grad(inside)(model)
    jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(outside))(model)[0]
    weight_grads = [
        e.outvars[0].aval.shape
        for e, _ in walk_eqns(jaxpr)
        if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-2:] == (8, 8)
    ]
    assert weight_grads and all(len(s) == 2 for s in weight_grads)
    assert (
        global_rel_error(
            eqx.filter_grad(inside)(model), eqx.filter_grad(outside)(model)
        )
        < 1e-2
    )


@pytest.mark.slow
def test_multi_device_guide_runs_on_eight_devices():
    """The Python blocks of docs/guides/multi-device.md (its hidden set-up too) run as
    written on 8 devices (with optax, under JAX's default promotion, as a user would;
    tests/test_doc_snippets.py runs them on one)."""
    code = doc_blocks.blocks((REPO_ROOT / "docs/guides/multi-device.md").read_text())
    assert sum(not b.hidden for b in code if b.runs) >= 4
    report = run_script_on_eight_devices(
        "\n".join(b.source for b in code if b.runs)
        + """
import numpy as np
report = {
    "devices": jax.device_count(),
    "loss": float(loss),
    "finite": bool(finite),
    "grad_dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(grads)}),
    "sharded": [str(p.sharding.spec) for p in jax.tree.leaves(params)],
}
""",
        promotion="standard",
    )
    assert report["devices"] == 8
    assert np.isfinite(report["loss"]) and report["finite"]
    assert report["grad_dtypes"] == ["float32"]
    assert (
        report["sharded"].count("P('data',)") == 4
    )  # the weights and the first biases


@pytest.mark.parametrize("reduce", [None, jnp.float32])
def test_custom_jvp_activations_differentiate_inside_shard_map(getkey, reduce):
    """`jax.nn.relu` is a custom_jvp: its rule is traced at the arriving types,
    varying manual axes included, or its ops would mix varying and invariant values
    (this failed for `autocast` inside `jax.shard_map` before)."""
    model = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    policy = eqx_amp.get_policy("mixed_bfloat16").with_reduce_dtype(reduce)
    x = jr.normal(getkey(), (4, 4))

    def loss(model, x, wrap):
        return jnp.sum(
            wrap(eqx.filter_vmap(model), policy=policy)(x).astype(jnp.float32)
        )

    for wrap in (eqx_amp.autocast, eqx_amp.filter_amp):
        # Jitted: an eager `shard_map` dispatches each op on its own.
        grads = jax.jit(
            jax.shard_map(
                lambda x: eqx.filter_grad(loss)(model, x, wrap),
                mesh=_one_device_mesh(),
                in_specs=P("data"),
                out_specs=P(),
                check_vma=False,
            )
        )(x)
        grads_vma = jax.jit(
            jax.shard_map(
                lambda x: jax.tree.map(
                    lambda g: jax.lax.psum(g, "data"),
                    eqx.filter_grad(loss)(model, x, wrap),
                ),
                mesh=_one_device_mesh(),
                in_specs=P("data"),
                out_specs=P(),
            )
        )(x)
        reference = eqx.filter_grad(loss)(model, x, lambda f, policy: f)
        assert global_rel_error(grads_vma, reference) < 2e-2
        assert global_rel_error(grads, reference) < 2e-2


def test_specs_that_call_a_shard_replicated_are_refused(getkey):
    params = eqx.filter(eqx.nn.Linear(8, 4, key=getkey()), eqx.is_array)
    in_specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    wrong = eqx.tree_at(lambda p: p.bias, in_specs, P())

    def body(shards):
        return eqx_amp.sharding.gather_params(shards, "data", specs=wrong)

    step = jax.shard_map(
        body, mesh=_one_device_mesh(), in_specs=(in_specs,), out_specs=in_specs
    )
    with pytest.raises(ValueError, match=r"`specs` gives an array of shape \(4,\) no"):
        jax.eval_shape(step, params)

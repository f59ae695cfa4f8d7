"""fp8 at scale (issue 29): weights that feed fp8 products are quantised on their
shard with their whole weight's scale and all-gathered in fp8, on both engines.

Fast: `gather_params(..., fp8=...)` on a one-device mesh (the collectives it binds,
its numbers, its errors), and the dtype fp8 matmuls' backward products emit.
Slow: the sharded benchmark's fp8 cases on 8 CPU devices (one subprocess), read
from the programs right after SPMD partitioning.
"""

import functools as ft
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqx_amp

from .helpers import (
    benchmark_row,
    collective_bytes,
    global_rel_error,
    run_repo_script,
    walk_eqns,
)


BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
FP8 = eqx_amp.fp8.TENSORWISE
MX = eqx_amp.fp8.MXFP8


class _Net(eqx.Module):
    up: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    down: eqx.nn.Linear

    def __init__(self, key, width=32):
        k1, k2 = jr.split(key)
        self.up = eqx.nn.Linear(width, 2 * width, key=k1)
        self.norm = eqx.nn.LayerNorm(2 * width)
        self.down = eqx.nn.Linear(2 * width, width, key=k2)

    def __call__(self, x):
        return self.down(self.norm(jax.nn.relu(self.up(x))))


def _mesh():
    return jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _loss(static, specs, fp8, road="filter_amp", model_fp8=FP8, **options):
    def loss(shards, x):
        gathered = eqx_amp.sharding.gather_params(
            shards, "data", specs=specs, fp8=fp8, **options
        )
        model = eqx.combine(gathered, static)
        if road == "filter_amp":
            out = jax.vmap(eqx_amp.filter_amp(model, fp8=model_fp8))(x)
        else:
            # The gathered weights are bfloat16: so are the inputs.
            rules = {jax.lax.dot_general_p: model_fp8}
            out = eqx_amp.autocast(eqx.filter_vmap(model), rules=rules)(
                x.astype(jnp.bfloat16)
            )
        return jax.lax.pmean(jnp.mean(out.astype(jnp.float32) ** 2), "data")

    return loss


def _step(static, specs, fp8, road="filter_amp", model_fp8=FP8, **options):
    loss = _loss(static, specs, fp8, road, model_fp8, **options)
    # Jitted: an eager `shard_map` dispatches each op of the step on its own.
    return jax.jit(
        jax.shard_map(
            jax.grad(loss), mesh=_mesh(), in_specs=(specs, P()), out_specs=specs
        )
    )


def _collectives(jaxpr) -> list[tuple[str, jnp.dtype, tuple]]:
    names = ("all_gather", "reduce_scatter", "psum_scatter", "pmax")
    return [
        (e.primitive.name, e.invars[0].aval.dtype, e.invars[0].aval.shape)
        for e, _ in walk_eqns(jaxpr)
        if e.primitive.name in names
    ]


def test_fp8_gather_quantises_shards_with_one_pmax_and_reduces_in_bf16(getkey):
    model = _Net(getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (64, 32))
    step = _step(static, specs, FP8)
    found = _collectives(jax.make_jaxpr(step)(params, x))
    # The two Linear weights gather in fp8; their biases and the norm as before.
    assert sorted(s for n, d, s in found if n == "all_gather" and d == E4M3) == [
        (32, 64),
        (64, 32),
    ]
    assert {d for n, d, s in found if n == "all_gather" and d != E4M3} <= {BF16, F32}
    # One pmax for both weights' amaxes.
    assert [(d, s) for n, d, s in found if n == "pmax"] == [(F32, (2,))]
    # Gradients are reduce-scattered in the reduce dtype, returned in float32.
    assert {d for n, d, s in found if "scatter" in n} == {BF16, F32}
    grads = step(params, x)
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}
    # As accurate as the one-device fp8 step (whose products quantise the weights'
    # bfloat16 copies: other roundings, the same error).
    one_device = jax.jit(
        jax.grad(
            lambda p: jnp.mean(
                jax.vmap(eqx_amp.filter_amp(eqx.combine(p, static), fp8=FP8))(x) ** 2
            )
        )
    )(params)
    reference = jax.jit(
        jax.grad(lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2))
    )(params)
    assert (
        global_rel_error(grads, reference)
        < 1.1 * global_rel_error(one_device, reference) + 1e-3
    )


def _weight_amaxes(jaxpr, shapes) -> int:
    """How many max-reductions of the program read an array of one of `shapes`."""
    return sum(
        e.primitive is jax.lax.reduce_max_p and e.invars[0].aval.shape in shapes
        for e, _ in walk_eqns(jaxpr)
    )


@pytest.mark.parametrize("road", ["filter_amp", "autocast"])
def test_fp8_products_read_the_gathered_fp8_weights(getkey, road):
    """The fp8 matmuls read the gathered fp8 values and their scale: the only
    amaxes of weight-shaped arrays are the shards' (one per weight, on a one-device
    mesh of the weight's shape), none quantises a gathered weight again."""
    model = _Net(getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (48, 32))  # no activation of a weight's shape
    shapes = {(64, 32), (32, 64)}
    with_gather = jax.make_jaxpr(_step(static, specs, FP8, road))(params, x)
    without = jax.make_jaxpr(_step(static, specs, None, road))(params, x)
    assert _weight_amaxes(with_gather, shapes) == 2
    # Without fp8 gathers each product quantises its weight itself.
    assert _weight_amaxes(without, shapes) == 2
    assert not any(e.primitive.name == "pmax" for e, _ in walk_eqns(without))
    grads = _step(static, specs, FP8, road)(params, x)
    reference = jax.grad(lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2))(
        params
    )
    assert global_rel_error(grads, reference) < 0.1


class _ReadTwice(eqx.Module):
    """Two layers, the first applied twice: its weight feeds two fp8 products."""

    twice: eqx.nn.Linear | eqx.nn.Conv2d
    out: eqx.nn.Linear | eqx.nn.Conv2d

    def __init__(self, kind: str, key):
        k1, k2 = jr.split(key)
        if kind == "linear":
            self.twice = eqx.nn.Linear(32, 32, key=k1)
            self.out = eqx.nn.Linear(32, 16, key=k2)
        else:
            self.twice = eqx.nn.Conv2d(16, 16, 3, padding=1, key=k1)
            self.out = eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.twice(jax.nn.relu(self.twice(x)))))


@pytest.mark.parametrize("road", ["filter_amp", "autocast", "bimodel"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_fp8_roads_quantise_each_weight_once_amaxes_together(getkey, road, kind):
    """On one device or under GSPMD, each fp8 road quantises each weight (a matrix
    or a convolution kernel) its products read once per call, however many read it,
    from one vector of all the weights' amaxes (which XLA reduces in one
    all-reduce)."""
    model = _ReadTwice(kind, getkey())
    x = jr.normal(getkey(), (48, 32) if kind == "linear" else (4, 16, 8, 8))
    primitive = (
        jax.lax.dot_general_p if kind == "linear" else jax.lax.conv_general_dilated_p
    )
    if road == "filter_amp":
        wrap = ft.partial(eqx_amp.filter_amp, fp8=FP8)
    elif road == "autocast":
        wrap = ft.partial(eqx_amp.autocast, rules={primitive: FP8})
    else:
        wrap = ft.partial(eqx_amp.BiModel, fp8=FP8)

    def loss(m):
        out = eqx.filter_vmap(wrap(m))(x)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(eqx.filter_grad(loss))(model)
    shapes = {model.twice.weight.shape, model.out.weight.shape}
    assert _weight_amaxes(jaxpr, shapes) == 2
    stacks = [e for e, _ in walk_eqns(jaxpr) if e.primitive.name == "stack"]
    assert [e.outvars[0].aval.shape for e in stacks] == [(2,)]
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    reference = eqx.filter_jit(
        eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))
    )(model)
    assert global_rel_error(grads, reference) < 0.1


def test_gathered_fp8_weights_quantise_again_to_the_same_values(getkey):
    """Where a product cannot read the gathered fp8 values (the model reshapes or
    slices the weight first), it quantises the weight handed on in the compute
    dtype again, with its own amax, to exactly the gathered values (fp8 values
    times their inverse scale: a gathered amax that rounded down to the bottom of
    e4m3's top binade doubles the scale and the fp8 values with it)."""
    w = jr.normal(getkey(), (64, 32)) * 3.0
    w = w.at[0, 0].set(1e-9).at[1, 1].set(-57.0)
    quantized, scale = FP8.gather_shard(w, jnp.max(jnp.abs(w)), lambda x: x)
    gathered = FP8.dequantize(quantized, scale, BF16)
    again, again_scale = FP8.gather_shard(
        gathered, jnp.max(jnp.abs(gathered.astype(F32))), lambda x: x
    )
    assert again.dtype == E4M3
    assert (again.astype(F32) / again_scale == quantized.astype(F32) / scale).all()


def test_fp8_gather_errors_name_the_leaf(getkey):
    model = _Net(getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (8, 32))

    def trace(fp8, **options):
        jax.make_jaxpr(_step(static, specs, fp8, **options))(params, x)

    with pytest.raises(TypeError, match="rowwise products quantise each weight"):
        trace(eqx_amp.fp8.ROWWISE)
    with pytest.raises(TypeError, match="`fp8` must be eqx_amp.fp8.TENSORWISE"):
        trace("fp8")
    for rule in (eqx_amp.fp8.TENSORWISE, eqx_amp.fp8.MXFP8):
        with pytest.raises(TypeError, match="cannot follow `where_it_pays\\(\\)`"):
            trace(rule.where_it_pays())
    with pytest.raises(ValueError, match="compute dtype, which must be bfloat16"):
        trace(FP8, policy=eqx_amp.Policy(F32, jnp.float8_e4m3fn, F32))
    # A weight `fp8_filter` picks that cannot be gathered in fp8, by name.
    odd = eqx.partition(_Net(getkey(), width=24), eqx.is_inexact_array)
    odd_specs = jax.tree_util.tree_map(lambda _: P("data"), odd[0])
    with pytest.raises(ValueError, match=r"the weight \.up\.weight .* multiple of 16"):
        jax.make_jaxpr(
            _step(odd[1], odd_specs, FP8, fp8_filter=lambda m: m is not None)
        )(odd[0], jr.normal(getkey(), (8, 24)))
    with pytest.raises(ValueError, match=r"\.up\.weight .*`filter_spec` keeps it"):
        trace(FP8, fp8_filter=lambda m: m is not None, filter_spec=False)
    # By default such a weight gathers as without fp8; if none is left, it says so.
    with pytest.raises(ValueError, match="found no weight to gather in fp8"):
        jax.make_jaxpr(_step(odd[1], odd_specs, FP8))(
            odd[0], jr.normal(getkey(), (8, 24))
        )
    with pytest.raises(ValueError, match="found no weight to gather in fp8"):
        trace(FP8, fp8_filter=lambda m: isinstance(m, eqx.nn.Embedding))


def test_fp8_gather_refuses_a_non_floating_weight_by_name(getkey):
    class Table(eqx.Module):
        weight: jax.Array

    tree = {"table": Table(jnp.ones((16, 16), jnp.int32))}
    specs = {"table": Table(P("data"))}

    def gather(shards):
        return eqx_amp.sharding.gather_params(
            shards, "data", specs=specs, fp8=FP8, fp8_filter=lambda m: True
        )

    step = jax.shard_map(gather, mesh=_mesh(), in_specs=(specs,), out_specs=specs)
    with pytest.raises(TypeError, match=r"\['table'\]\.weight .* not floating"):
        jax.make_jaxpr(step)(tree)


def test_fp8_backward_products_emit_the_reduce_dtype(getkey):
    """Under GSPMD a weight gradient is summed across devices on the output of the
    product that makes it: fp8 roads emit it in the policy's reduce dtype."""
    model = _Net(getkey())
    x = jr.normal(getkey(), (16, 32))

    def backward_dtypes(policy):
        def loss(m):
            forward = eqx_amp.autocast(
                eqx.filter_vmap(m), policy=policy, rules={jax.lax.dot_general_p: FP8}
            )
            return jnp.mean(forward(x).astype(jnp.float32) ** 2)

        jaxpr = jax.make_jaxpr(jax.grad(loss))(model)
        return {
            e.params["preferred_element_type"]
            for e, _ in walk_eqns(jaxpr)
            if e.primitive.name == "dot_general"
            and e.invars[0].aval.dtype.itemsize == 1
        }

    bf16 = eqx_amp.get_policy("mixed_bfloat16")
    # The forward products write bfloat16 too (their still-scaled sums).
    assert backward_dtypes(bf16) == {BF16}
    assert backward_dtypes(bf16.with_reduce_dtype(jnp.float32)) == {F32, BF16}


#
# 8 devices.
#


@pytest.fixture(scope="module")
def fp8_rows() -> list[dict]:
    out = run_repo_script("benchmarks/sharded.py", "--fp8", "--json", "-")
    return json.loads(out.strip().splitlines()[-1])


# A BiModel's fp8 step on the jit engine only (the benchmark's shard_map step runs
# the gathered compute copy without fp8 products).
_ROADS = [
    (path, engine)
    for path in ("autocast", "filter_amp", "bimodel")
    for engine in ("jit", "shard_map")
    if path != "bimodel" or engine == "jit"
]


# MXFP8 on the shard_map engine: `gather_params` gathers its weights. (On the jit
# engine a CPU's program dequantises the weights to float32 before its products,
# and GSPMD gathers that; a B200's cannot be compiled yet: the fp8 guide.)
_MXFP8_ROADS = [("autocast", "shard_map"), ("filter_amp", "shard_map")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "engine", "dtype"),
    [(*r, "fp8") for r in _ROADS] + [(*r, "mxfp8") for r in _MXFP8_ROADS],
)
@pytest.mark.parametrize("mesh", ["fsdp", "fsdp_tp"])
def test_fp8_weights_gather_in_fp8_on_eight_devices(
    fp8_rows, path, mesh, engine, dtype
):
    where = dict(mesh=mesh, engine=engine)
    row = benchmark_row(fp8_rows, variant=path, dtype=dtype, **where)
    bf16 = benchmark_row(fp8_rows, variant="autocast", dtype="bf16", **where)
    gathers = row["collectives"]["param_gather"]
    # Weights feeding fp8 products gather in fp8 (MXFP8: with their e8m0 block
    # scales); the rest (embedding, biases) in bfloat16; never float32.
    assert gathers.get("f8e4m3fn", 0) > 0
    if dtype == "mxfp8":
        assert gathers.get("f8e8m0fnu", 0) > 0
        assert set(gathers) <= {"f8e4m3fn", "f8e8m0fnu", "bf16"}
        assert row["fp8_gather_ratio"] <= 0.55, row["fp8_gather_ratio"]
        assert row["collectives"]["grad_reduce"] == bf16["collectives"]["grad_reduce"]
        assert row["grad_shardings"] == bf16["grad_shardings"]
        assert row["grad_error"] < 1.05 * row["grad_error_one_device"]
        # Block scales need no amax from other shards.
        assert row["weight_amax_all_reduces"] == 0
        assert row["small_all_reduces"] == bf16["small_all_reduces"]
        return
    assert set(gathers) <= {"f8e4m3fn", "bf16"}
    ratio = collective_bytes(row, "param_gather") / collective_bytes(
        bf16, "param_gather"
    )
    assert ratio <= (0.55 if mesh == "fsdp" else 0.65), ratio
    # The weights gathered in fp8 move half their bfloat16 bytes (on `fsdp_tp` the
    # embedding, which no fp8 product reads, is a larger share of the rest).
    assert row["fp8_gather_ratio"] <= 0.55, row["fp8_gather_ratio"]
    # Gradients are reduced in bfloat16 (the default reduce dtype), as bf16's are.
    assert row["collectives"]["grad_reduce"] == bf16["collectives"]["grad_reduce"]
    # They land where the bfloat16 step's do, and are as accurate as one device's
    # fp8 gradients (up to the bfloat16 reductions bfloat16's steps pay too).
    assert row["grad_shardings"] == bf16["grad_shardings"]
    assert row["grad_error"] < 1.05 * row["grad_error_one_device"]
    if engine == "shard_map" and mesh == "fsdp":
        # One all-reduce of all the weights' amaxes together, right after SPMD
        # partitioning.
        assert row["small_all_reduces"] == bf16["small_all_reduces"] + 1
    # After XLA's passes: one all-reduce of all the weights' amaxes on the data
    # axis; on `fsdp_tp` one per group of devices the weights are split over
    # (`data`, `model`, and GSPMD's transposed groups for weights split over both).
    assert row["weight_amax_all_reduces"] == (
        1 if mesh == "fsdp" else 3 - (engine == "shard_map")
    )


@pytest.mark.parametrize(
    "case", ["zeros", "tiny", "subnormal", "largest", "one_nan", "one_inf"]
)
@pytest.mark.parametrize("rule", [FP8, MX], ids=["tensorwise", "mxfp8"])
def test_fp8_gather_edge_values(getkey, case, rule):
    """The gathered weight of one edge-valued Linear: zeros and tiny weights stay
    finite (the scale is capped), float32's largest values stay finite, and one
    inf/NaN makes the step's gradients non-finite rather than finite and wrong
    (MXFP8: its block only, a row of 32 here; the other rows are as without it)."""
    model = _Net(getkey())
    w = original = model.up.weight
    w = {
        "zeros": jnp.zeros_like(w),
        "tiny": jnp.full_like(w, 1e-37),
        "subnormal": jnp.full_like(w, 1e-40),
        # The compute dtype's largest (float32's is past bfloat16's, cast or not).
        "largest": w / jnp.max(jnp.abs(w)) * float(jnp.finfo(BF16).max),
        "one_nan": w.at[3, 5].set(jnp.nan),
        "one_inf": w.at[3, 5].set(jnp.inf),
    }[case]
    model = eqx.tree_at(lambda m: m.up.weight, model, w)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)

    def gathered(shards):
        return eqx_amp.sharding.gather_params(shards, "data", specs=specs, fp8=rule)

    out = jax.jit(
        jax.shard_map(gathered, mesh=_mesh(), in_specs=(specs,), out_specs=specs)
    )(params)
    got = out.up.weight.astype(F32)
    if case in ("one_nan", "one_inf"):
        assert not bool(jnp.isfinite(got[3, 5]))
        if rule is MX:
            plain = eqx.tree_at(lambda p: p.up.weight, params, original)
            want = jax.jit(
                jax.shard_map(
                    gathered, mesh=_mesh(), in_specs=(specs,), out_specs=specs
                )
            )(plain).up.weight.astype(F32)
            rows = jnp.arange(w.shape[0]) != 3
            assert bool(jnp.all(got[rows] == want[rows]))
            assert not bool(jnp.any(got[3].at[5].set(0.0)))  # its block's others: 0
        x = jr.normal(getkey(), (16, 32))
        grads = _step(static, specs, rule, model_fp8=rule)(params, x)
        assert not all(
            bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads)
        )
        return
    assert bool(jnp.all(jnp.isfinite(got)))
    if case == "zeros":
        assert not bool(jnp.any(got))
    elif case == "largest":
        # Within e4m3's relative rounding (2**-4) of bfloat16's copy of the weight.
        want = w.astype(BF16).astype(F32)
        assert float(jnp.max(jnp.abs(got - want) / jnp.abs(want).max())) < 2**-3
    else:  # tiny and subnormal: the capped scale keeps them finite, maybe flushed
        assert float(jnp.max(jnp.abs(got))) <= 2 * float(jnp.max(jnp.abs(w)))


# Slow tier: `jax.checking_leaks` traces without caches and scans the heap; the four
# roads took a quarter of the fast tier's time.
@pytest.mark.slow
@pytest.mark.parametrize(
    "road", ["filter_amp", "autocast", "bimodel", "gather", "mxfp8 gather"]
)
def test_fp8_roads_hold_no_tracer_past_the_trace(getkey, road):
    """What a road records of a weight's fp8 form (quantised once per call, or
    gathered in fp8) lives no longer than the trace: `jax.checking_leaks` finds no
    tracer of a finished trace, over retraces, and after them no tracer is left."""
    import gc

    model = _Net(getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)

    def loss(params, x):
        model = eqx.combine(params, static)
        if road == "filter_amp":
            out = jax.vmap(eqx_amp.filter_amp(model, fp8=FP8))(x)
        elif road == "autocast":
            rules = {jax.lax.dot_general_p: FP8}
            out = eqx_amp.autocast(eqx.filter_vmap(model), rules=rules)(x)
        else:
            out = jax.vmap(eqx_amp.BiModel(model, fp8=FP8))(x)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    if road == "gather":
        steps = [_step(static, specs, FP8)]
    elif road == "mxfp8 gather":
        steps = [_step(static, specs, MX, model_fp8=MX)]
    else:  # the forward pass alone, and with its gradient
        steps = [jax.jit(loss), jax.jit(jax.grad(loss))]

    def live_tracers() -> int:
        gc.collect()
        return sum(isinstance(o, jax.core.Tracer) for o in gc.get_objects())

    before = live_tracers()
    with jax.checking_leaks():
        for step in steps:
            for batch in (16, 32, 48):  # a retrace each
                out = step(params, jr.normal(getkey(), (batch, 32)))
                assert {x.dtype for x in jax.tree_util.tree_leaves(out)} == {F32}
    assert live_tracers() == before


def _weight_blocks(jaxpr, shapes) -> int:
    """How many MXFP8 block amaxes of the program read a weight of one of `shapes`
    laid out in blocks of 32 along one of its axes."""
    blocked = set()
    for r, c in shapes:
        blocked |= {(1, r, c // 32, 32), (1, r // 32, 32, c)}
    return sum(
        e.primitive is jax.lax.reduce_max_p and e.invars[0].aval.shape in blocked
        for e, _ in walk_eqns(jaxpr)
    )


@pytest.mark.parametrize("road", ["filter_amp", "autocast"])
def test_mxfp8_gathers_e4m3_values_and_e8m0_scales(getkey, road):
    """`gather_params(..., fp8=MXFP8)` quantises each weight shard in blocks of 32
    along its last axis (no `pmax`: a block lies within a shard) and all-gathers
    e4m3 values and e8m0 scales, 33/64 of bfloat16's bytes; the forward products
    read them rather than quantise the gathered weight again, and the step is as
    accurate as the MXFP8 step that gathers bfloat16. Under `jax.shard_map`'s
    default `check_vma=True` too, where `jax.nn.scaled_matmul` (the CUDA branch)
    drops the varying type its operands have."""
    model = _Net(getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (48, 32))
    step = _step(static, specs, MX, road, model_fp8=MX)
    without = _step(static, specs, None, road, model_fp8=MX)
    jaxpr, jaxpr_without = (jax.make_jaxpr(s)(params, x) for s in (step, without))
    found = _collectives(jaxpr)
    gathers = sorted((d.name, s) for n, d, s in found if n == "all_gather")
    weights = {(64, 32), (32, 64)}
    assert [g for g in gathers if g[1] in weights | {(64, 1), (32, 2)}] == [
        ("float8_e4m3fn", (32, 64)),
        ("float8_e4m3fn", (64, 32)),
        ("float8_e8m0fnu", (32, 2)),
        ("float8_e8m0fnu", (64, 1)),
    ]
    assert not [n for n, _, _ in found if n == "pmax"]
    fp8_bytes = sum(
        jnp.dtype(d).itemsize * int(np.prod(s))
        for n, d, s in found
        if n == "all_gather" and jnp.dtype(d) in (E4M3, E8M0)
    )
    bf16_bytes = sum(
        2 * int(np.prod(s))
        for n, d, s in _collectives(jaxpr_without)
        if n == "all_gather" and s in weights
    )
    assert fp8_bytes / bf16_bytes == pytest.approx(33 / 64)
    # The shard's block amaxes replace the forward products' own: as many as
    # without the fp8 gather.
    assert _weight_blocks(jaxpr, weights) == _weight_blocks(jaxpr_without, weights)
    grads, grads_without = step(params, x), without(params, x)
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}
    reference = jax.grad(lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2))(
        params
    )
    assert (
        global_rel_error(grads, reference)
        < 1.1 * global_rel_error(grads_without, reference) + 1e-3
    )


def test_mxfp8_gather_errors_name_the_leaf(getkey):
    """A weight `fp8_filter` picks whose last axis is not a multiple of 32, or whose
    shards would split blocks, is refused by name; by default such weights, and
    convolutions' (MXFP8 convolutions are tensorwise), gather as without fp8.
    ROWWISE is refused: no one gathered form serves its products."""
    odd = eqx.partition(_Net(getkey(), width=48), eqx.is_inexact_array)
    odd_specs = jax.tree_util.tree_map(lambda _: P("data"), odd[0])
    x = jr.normal(getkey(), (8, 48))
    pick_all = lambda m: m is not None  # noqa: E731
    with pytest.raises(
        ValueError, match=r"\.up\.weight .*\(48\) is not a multiple of 32"
    ):
        jax.make_jaxpr(_step(odd[1], odd_specs, MX, model_fp8=MX, fp8_filter=pick_all))(
            odd[0], x
        )
    # By default the (48, 96) weight gathers in MXFP8, the (96, 48) one in bf16.
    found = _collectives(
        jax.make_jaxpr(_step(odd[1], odd_specs, MX, model_fp8=MX))(odd[0], x)
    )
    weights = {(96, 48), (48, 96)}
    assert sorted(
        (d.name, s) for n, d, s in found if n == "all_gather" and s in weights
    ) == [
        ("bfloat16", (96, 48)),
        ("float8_e4m3fn", (48, 96)),
    ]
    assert "split blocks of 32" in MX.gather_problem((64, 16), (64, 32), 1)
    assert MX.gather_problem((32, 32), (64, 32), 0) is None
    # Convolutions under MXFP8 are tensorwise: their weights are not picked.
    conv = eqx.nn.Conv2d(32, 32, 1, key=getkey())
    assert MX.gathers_by_default(odd[1].up) and not MX.gathers_by_default(conv)
    assert FP8.gathers_by_default(conv)
    with pytest.raises(TypeError, match="TENSORWISE or eqx_amp.fp8.MXFP8"):
        jax.make_jaxpr(_step(odd[1], odd_specs, "mxfp8"))(odd[0], x)


@pytest.mark.parametrize("mode", ["check_vma=False", "named vmap"])
def test_mxfp8_gathers_under_every_mapping(getkey, mode):
    """Under `jax.shard_map(check_vma=False)` and a named `jax.vmap` (two members,
    each holding half of every weight's rows), the MXFP8 gather gives the gradients
    of `check_vma=True` on one device: the blocks lie along the rows' last axis, so
    each member quantises its rows as the whole weight's are quantised."""
    model = _Net(getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (48, 32))
    reference = _step(static, specs, MX, model_fp8=MX)(params, x)
    loss = _loss(static, specs, MX, model_fp8=MX)
    if mode == "check_vma=False":
        grads = jax.jit(
            jax.shard_map(
                jax.grad(loss),
                mesh=_mesh(),
                in_specs=(specs, P()),
                out_specs=specs,
                check_vma=False,
            )
        )(params, x)
    else:
        halves = jax.tree_util.tree_map(
            lambda a: a.reshape(2, a.shape[0] // 2, *a.shape[1:]), params
        )
        members = jax.jit(
            jax.vmap(jax.grad(loss), in_axes=(0, None), axis_name="data")
        )(halves, x)
        grads = jax.tree_util.tree_map(lambda g: g.reshape(-1, *g.shape[2:]), members)
    for got, want in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference)
    ):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-6)


class _Stack(eqx.Module):
    """Three Linear layers stacked (weights `(3, 64, 32)`) and run by `lax.scan`."""

    layers: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jr.split(key, 4)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 32, key=k))(keys[:3])
        self.out = eqx.nn.Linear(32, 32, key=keys[3])

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(x, p):
            return jnp.tanh(eqx.combine(p, static)(x)), None

        return self.out(jax.lax.scan(body, x, params)[0])


def test_mxfp8_gathers_stacked_weights_of_scanned_layers(getkey):
    """Stacked `eqx.nn.Linear` weights (a leading layer axis, `lax.scan` over it) are
    blocked along their last axis like a single layer's and gather in MXFP8 (their
    biases in bfloat16); the step is as accurate as the one that gathers bfloat16."""
    model = _Stack(getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = jax.tree_util.tree_map(lambda _: P("data"), params)
    x = jr.normal(getkey(), (48, 32))

    def step(fp8):
        def loss(shards, x):
            gathered = eqx_amp.sharding.gather_params(
                shards, "data", specs=specs, fp8=fp8
            )
            # The wrapper outside the vmap: a vmap outside it would batch the
            # scanned MXFP8 products after tracing (the fp8 guide).
            model = eqx.filter_vmap(eqx.combine(gathered, static))
            out = eqx_amp.filter_amp(model, fp8=MX)(x)
            return jax.lax.pmean(jnp.mean(out.astype(jnp.float32) ** 2), "data")

        # The data sharded too: the scan's carry varies over the axis from the start.
        return jax.jit(
            jax.shard_map(
                jax.grad(loss),
                mesh=_mesh(),
                in_specs=(specs, P("data")),
                out_specs=specs,
            )
        )

    found = _collectives(jax.make_jaxpr(step(MX))(params, x))
    assert sorted(
        (d.name, s) for n, d, s in found if n == "all_gather" and len(s) >= 2
    ) == [
        ("bfloat16", (3, 32)),  # the stacked biases, which no product reads
        ("float8_e4m3fn", (3, 32, 32)),
        ("float8_e4m3fn", (32, 32)),
        ("float8_e8m0fnu", (3, 32, 1)),
        ("float8_e8m0fnu", (32, 1)),
    ]
    grads, without = step(MX)(params, x), step(None)(params, x)
    reference = jax.grad(lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2))(
        params
    )
    assert (
        global_rel_error(grads, reference)
        < 1.1 * global_rel_error(without, reference) + 1e-3
    )

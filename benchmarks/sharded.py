"""Sharded training steps: what mixed precision sends between devices.

A small GPT's gradient step is compiled on 8 devices (8 simulated CPU devices where
there is no accelerator), for float32, the hand-cast model and eqx_amp's three paths
(`filter_amp`, `autocast`, `BiModel`), in bfloat16 and in float16 with loss scaling,
on two meshes and with both of JAX's engines:

- meshes: `fsdp`, the parameters sharded over 8 devices on one `data` axis; and
  `fsdp_tp`, 4 `data` x 2 `model`, with Megatron-style tensor parallelism (query,
  key, value and MLP-in projections split by output, output and MLP-out projections
  split by input) over `model` and FSDP over `data`;
- engines: `jit` (GSPMD: `jax.jit` over `NamedSharding`s) and `shard_map` (FSDP by
  hand over `data` with `eqx_amp.sharding.gather_params`, the `model` axis left to GSPMD).

For each it reads the program right after SPMD partitioning (XLA's dump of the
`spmd-partitioning` pass: the CPU backend widens half-precision collectives later,
so the compiled program would not show their dtype) and reports the collectives by
kind and dtype, with their bytes (of each result), whether each reduction sums a
parameter gradient (its shape is a parameter's), the gradient's error against the
unsharded float32 step, whether the gradients keep the parameters' shardings, and
the compiled memory per device.

    python benchmarks/sharded.py                  # the table
    python benchmarks/sharded.py --json out.json  # and every measurement
    python benchmarks/run.py --preset sharded     # the same, from the suite
"""

import atexit
import os
import shutil
import sys
import tempfile


_DUMP = tempfile.mkdtemp(prefix="eqx_amp_spmd_")
# XLA dumps every module it compiles there (hundreds of MB over a run).
atexit.register(shutil.rmtree, _DUMP, ignore_errors=True)
# Both must be set before JAX is imported.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Only the measured steps (`_measure` names them `step_<case>`): every other module
# would be dumped too, LLVM IR and object files included.
_flags += f" --xla_dump_to={_DUMP} --xla_dump_hlo_pass_re=spmd-partitioning"
_flags += " --xla_dump_hlo_module_re=^jit_step_"
# XLA's CPU backend widens half-precision all-reduces to float32 in a pass that
# crashes on the all-reduces of a `shard_map` manual over some mesh axes only (the
# `model` axis is left to GSPMD here); without it the CPU sums in the half dtype,
# as accelerators do.
_flags += " --xla_disable_hlo_passes=all-reduce-promotion"
os.environ["XLA_FLAGS"] = _flags.strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools as ft  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
from collections.abc import Callable  # noqa: E402


_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(1, str(_HERE.parent))  # the checkout's eqx_amp, installed or not

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
from _models import GPT, cross_entropy  # noqa: E402
from _variants import hand_cast  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import eqx_amp  # noqa: E402


_HALF = {"bf16": jnp.bfloat16, "f16": jnp.float16}
DATA, MODEL = "data", "model"
MESHES = {"fsdp": (8, 1), "fsdp_tp": (4, 2)}
ENGINES = ("jit", "shard_map")
PATHS = ("filter_amp", "autocast", "bimodel")
# The paths measured with fp8 products (a BiModel's on the jit engine only: its
# shard_map step runs the gathered compute copy as it is).
_FP8_PATHS = ("autocast", "filter_amp", "bimodel")
# Bytes of one element, by the dtype names XLA prints.
_ITEMSIZE = {
    "f64": 8,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e8m0fnu": 1,
}
# fp8 cases compute in bfloat16 with tensorwise fp8 products, mxfp8 cases with
# block-scaled ones.
FP8_RULES = {"fp8": eqx_amp.fp8.TENSORWISE, "mxfp8": eqx_amp.fp8.MXFP8}
_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\(?[a-z0-9]+\[[^=]*?)\s"
    r"(?P<kind>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Case:
    variant: str  # fp32, hand, filter_amp, autocast, bimodel
    dtype: str  # f32, bf16, f16, fp8 (bfloat16 with fp8 products and gathers)
    reduce: str  # the reduce dtype asked for: "compute" or "f32"
    mesh: str
    engine: str

    @property
    def name(self) -> str:
        return f"{self.variant}_{self.dtype}_{self.reduce}_{self.mesh}_{self.engine}"

    @property
    def policy(self) -> eqx_amp.Policy:
        half = _HALF.get(self.dtype, jnp.bfloat16)
        policy = eqx_amp.Policy(jnp.float32, half, jnp.float32)
        return policy.with_reduce_dtype(jnp.float32 if self.reduce == "f32" else None)


def cases(
    quick: bool = False, only: str | None = None, fp8: bool = False
) -> list[Case]:
    """Every case of the table; `quick` (the test suite's) asks bfloat16 for its
    compute-dtype reduction and float16 for a float32 one; `only` ("MESH/ENGINE")
    keeps one mesh and engine; `fp8` keeps the cases the fp8 ones are compared
    with (float32, bfloat16 by hand and by `autocast`) and the fp8 ones."""
    out = []
    for mesh in MESHES:
        for engine in ENGINES:
            if only is not None and only != f"{mesh}/{engine}":
                continue
            out.append(Case("fp32", "f32", "compute", mesh, engine))
            if fp8 or not quick:
                out += [
                    Case(v, dtype, "compute", mesh, engine)
                    for dtype in FP8_RULES
                    for v in _FP8_PATHS
                    if v != "bimodel" or engine == "jit"
                ]
            if fp8:
                out.append(Case("hand", "bf16", "compute", mesh, engine))
                out.append(Case("autocast", "bf16", "compute", mesh, engine))
                continue
            for dtype in ("bf16", "f16"):
                out.append(Case("hand", dtype, "compute", mesh, engine))
                reduces = (
                    ["compute" if dtype == "bf16" else "f32"]
                    if quick
                    else [
                        "compute",
                        "f32",
                    ]
                )
                for path in PATHS:
                    out += [Case(path, dtype, r, mesh, engine) for r in reduces]
    return out


#
# The model and its shardings.
#


def make_model(key) -> GPT:
    return GPT(vocab=64, width=64, depth=1, heads=4, seq=16, key=key)


_COLUMN_PARALLEL = ("query_proj", "key_proj", "value_proj", "mlp_in")
_ROW_PARALLEL = ("output_proj", "mlp_out")


def param_spec(path: str, leaf, mesh: str) -> P:
    """Where each parameter lives: FSDP over `data` and, on `fsdp_tp`, Megatron
    tensor parallelism over `model` (a Linear's weight is `(out, in)`)."""
    n_data = MESHES[mesh][0]
    if mesh == "fsdp_tp":
        layer = next((n for n in _COLUMN_PARALLEL + _ROW_PARALLEL if n in path), None)
        if layer in _COLUMN_PARALLEL:
            return P(MODEL, DATA) if path.endswith("weight") else P(MODEL)
        if layer in _ROW_PARALLEL:
            return P(DATA, MODEL) if path.endswith("weight") else P()
    if leaf.ndim >= 1 and leaf.shape[0] % n_data == 0 and "norm" not in path:
        return P(DATA)
    return P()


def data_only(spec: P) -> P:
    """The `data` part of a spec: what a `shard_map` manual over `data` is told."""
    return P(
        *(
            DATA if DATA in ((e,) if not isinstance(e, tuple) else e) else None
            for e in spec
        )
    )


def spec_tree(params, mesh: str):
    return jtu.tree_map_with_path(
        lambda path, leaf: param_spec(jtu.keystr(path), leaf, mesh), params
    )


#
# The steps.
#


def _loss_scale(case: Case):
    if case.dtype == "f16":
        return eqx_amp.StaticLossScale(jnp.float32(2.0**10))
    return eqx_amp.NoOpLossScale()


def _forward(case: Case, model, tokens):
    """Logits of `model` on a batch, as the case's variant runs it."""
    inputs = tokens[:, :-1]
    if case.variant in ("fp32", "bimodel"):
        return jax.vmap(model)(inputs)
    if case.variant == "hand":
        return jax.vmap(hand_cast(model, _HALF[case.dtype]))(inputs)
    fp8 = FP8_RULES.get(case.dtype)
    if case.variant == "filter_amp":
        return jax.vmap(eqx_amp.filter_amp(model, policy=case.policy, fp8=fp8))(inputs)
    if case.variant == "autocast":
        rules = None if fp8 is None else {jax.lax.dot_general_p: fp8}
        return eqx_amp.autocast(
            lambda m, x: jax.vmap(m)(x), policy=case.policy, rules=rules
        )(model, inputs)
    raise ValueError(case.variant)


def _hand_gather(shards, dims, dtype):
    """The hand-cast FSDP gather: cast (norm layers excepted) and all-gather."""
    cast = hand_cast_params(shards, dtype)
    return jtu.tree_map(
        lambda dim, x: (
            x if dim is None else jax.lax.all_gather(x, DATA, axis=dim, tiled=True)
        ),
        dims,
        cast,
        is_leaf=lambda d: d is None,
    )


def hand_cast_params(params, dtype):
    spec = eqx_amp.default_filter_spec(params)
    return jtu.tree_map(
        lambda keep, x: x.astype(dtype) if keep and eqx.is_inexact_array(x) else x,
        spec,
        params,
    )


def build_step(case: Case, static, mesh) -> Callable:
    """`step(params, tokens) -> grads` for the case's engine."""
    loss_scale = _loss_scale(case)

    def loss(params, tokens):
        return cross_entropy(
            _forward(case, eqx.combine(params, static), tokens), tokens[:, 1:]
        )

    if case.engine == "jit":
        if case.variant == "bimodel":

            def step(params, tokens):
                bimodel = eqx_amp.BiModel(
                    eqx.combine(params, static),
                    policy=case.policy,
                    fp8=FP8_RULES.get(case.dtype),
                )
                (_, grads), *_ = eqx_amp.filter_value_and_grad(
                    lambda m, t: cross_entropy(jax.vmap(m)(t[:, :-1]), t[:, 1:])
                )(bimodel, tokens, loss_scale=loss_scale)
                return eqx.filter(grads, eqx.is_inexact_array)

            return step

        def step(params, tokens):
            (_, grads), *_ = eqx_amp.filter_value_and_grad(loss)(
                params, tokens, loss_scale=loss_scale
            )
            return grads

        return step

    def local_loss(shards, tokens, specs):
        if case.variant in ("fp32", "hand"):
            dims = jtu.tree_map(
                lambda s, x: next((i for i, e in enumerate(s) if e == DATA), None),
                specs,
                shards,
                is_leaf=lambda s: isinstance(s, P),
            )
            dtype = jnp.float32 if case.variant == "fp32" else _HALF[case.dtype]
            params = _hand_gather(shards, dims, dtype)
        else:
            params = eqx_amp.sharding.gather_params(
                shards,
                DATA,
                specs=specs,
                policy=case.policy,
                fp8=FP8_RULES.get(case.dtype),
            )
        return jax.lax.pmean(loss(params, tokens), DATA)

    def sharded_step(shards, tokens, specs):
        if case.variant == "bimodel":
            # FSDP of a BiModel: differentiate with respect to its compute copy's
            # shards, which the gather casts no further.
            shards = eqx_amp.BiModel(eqx.combine(shards, static), policy=case.policy)
            shards = eqx.filter(shards.compute, eqx.is_inexact_array)
        (_, grads), *_ = eqx_amp.filter_value_and_grad(
            ft.partial(local_loss, specs=specs), axis_name=DATA, average=False
        )(shards, tokens, loss_scale=loss_scale)
        return grads

    return sharded_step


#
# Reading the partitioned program.
#


def partitioned_hlo(name: str) -> str:
    files = sorted(glob.glob(f"{_DUMP}/*jit_{name}*after_spmd-partitioning*.txt"))
    if not files:
        raise RuntimeError(f"no SPMD-partitioned dump for {name} in {_DUMP}")
    return pathlib.Path(files[-1]).read_text()


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*?)\)"
)
# Ops that move a parameter without computing from it, and the elementwise ops of
# an fp8 quantisation (scaled, clipped, non-finite values kept).
_PASS_THROUGH = {"convert", "copy", "bitcast", "reshape", "transpose", "custom-call"}
# The ops that quantise a weight: its fp8 values (scaled, clamped) and, for MXFP8,
# its e8m0 block scales (a block amax's exponent bits, rounded up).
_QUANTISING = {
    "multiply",
    "clamp",
    "select",
    "reduce",
    "abs",
    "divide",
    "bitcast-convert",
    "shift-right-logical",
    "shift-left",
    "and",
    "add",
    "minimum",
    "compare",
}


def _reaches_parameter(name: str, defs: dict) -> bool:
    """Whether `name` is an entry parameter, possibly converted or reshaped, or
    quantised to fp8 (through any operand of the quantising ops)."""
    seen, todo = set(), [name]
    while todo:
        name = todo.pop()
        if name not in defs or name in seen:
            continue
        seen.add(name)
        opcode, operands = defs[name]
        if opcode == "parameter":
            return True
        if opcode in _PASS_THROUGH and operands:
            todo.append(operands[0])
        elif opcode in _QUANTISING:
            todo.extend(operands)
    return False


def collectives(text: str, param_shapes: set[tuple[int, ...]]) -> list[dict]:
    """Every collective of a partitioned program: its kind, dtype and bytes (of its
    result), and its group: `param_gather` (an all-gather of a parameter, cast or
    not), `grad_reduce` (a collective of the backward pass whose result has the
    shape of a parameter or of a piece of one: the gradients' reductions and the
    gathers GSPMD adds to reshard them) or `other` (activations)."""
    defs = {}
    for line in text.splitlines():
        match = _DEFINITION.match(line)
        if match:
            defs[match[1]] = (match[2], re.findall(r"%([\w.\-]+)", match[3]))
    found = []
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        op_name = _OP_NAME.search(line)
        backward = op_name is not None and "transpose(" in op_name.group(1)
        definition = _DEFINITION.match(line)
        operands = defs[definition[1]][1] if definition else []
        for dtype, dims in _SHAPE.findall(match["type"]):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if (
                match["kind"] == "all-gather"
                and operands
                and _reaches_parameter(operands[0], defs)
            ):
                group = "param_gather"
            elif backward and shape in param_shapes:
                group = "grad_reduce"
            else:
                group = "other"
            found.append(
                {
                    "kind": match["kind"],
                    "rank": len(shape),
                    "dtype": dtype,
                    "bytes": int(np.prod(shape, dtype=np.int64))
                    * _ITEMSIZE.get(dtype, 4),
                    "group": group,
                }
            )
    return found


_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=")


def weight_amax_all_reduces(text: str) -> int:
    """How many all-reduces of a compiled program reduce the amaxes fp8 roads take
    of weights before any product (their ops' names hold the scope
    `eqx_amp.fp8/weight_amaxes`), counted after XLA's passes, which combine
    independent all-reduces into one."""
    lines = {
        m.group(1): line for line in text.splitlines() if (m := _NAMED.match(line))
    }

    def of_weight_amaxes(name: str) -> bool:
        op_name = _OP_NAME.search(lines.get(name, ""))
        return op_name is not None and "weight_amaxes" in op_name.group(1)

    count = 0
    for line in lines.values():
        head, _, rest = line.partition(" all-reduce(")
        if not rest:
            head, _, rest = line.partition(" all-reduce-start(")
        if not rest:
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        count += any(map(of_weight_amaxes, operands))
    return count


def summarise(found: list[dict]) -> dict:
    """Bytes by group and dtype."""
    table = collections.defaultdict(collections.Counter)
    for c in found:
        table[c["group"]][c["dtype"]] += c["bytes"]
    return {group: dict(by_dtype) for group, by_dtype in table.items()}


def piece_shapes(shape: tuple[int, ...], mesh: str) -> set[tuple[int, ...]]:
    """`shape` with any of its dimensions split over any of the mesh's axes."""
    n_data, n_model = MESHES[mesh]
    splits = {1, n_data, n_model, n_data * n_model}
    pieces = {()}
    for size in shape:
        pieces = {p + (size // k,) for p in pieces for k in splits if size % k == 0}
    return pieces


def _rel_error(a, b) -> float:
    flat = lambda t: np.concatenate(  # noqa: E731
        [np.ravel(np.asarray(x, np.float32)) for x in jtu.tree_leaves(t)]
    )
    x, y = flat(a), flat(b)
    return float(np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-30))


def _one_device_error(case: Case, model, tokens, reference) -> float:
    """The gradient error of the case's path on one device, unsharded."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    one = dataclasses.replace(case, engine="jit")
    return _rel_error(jax.jit(build_step(one, static, None))(params, tokens), reference)


def measure(case: Case, model, tokens, reference) -> dict:
    mesh = jax.make_mesh(
        MESHES[case.mesh], (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = spec_tree(params, case.mesh)
    shardings = jtu.tree_map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.device_put(params, shardings)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(DATA)))
    step = build_step(case, static, mesh)
    if case.engine == "shard_map":
        manual = jtu.tree_map(data_only, specs, is_leaf=lambda s: isinstance(s, P))
        step = jax.shard_map(
            ft.partial(step, specs=manual),
            mesh=mesh,
            in_specs=(manual, P(DATA)),
            out_specs=manual,
            axis_names={DATA},
        )
    named = ft.wraps(step)(lambda p, t: step(p, t))
    named.__name__ = named.__qualname__ = f"step_{case.name}"
    compiled = jax.jit(named).lower(params, tokens).compile()
    amax_all_reduces = weight_amax_all_reduces(compiled.as_text())
    grads = compiled(params, tokens)
    shapes = set().union(
        *(piece_shapes(x.shape, case.mesh) for x in jtu.tree_leaves(params))
    )
    found = collectives(partitioned_hlo(named.__name__), shapes)
    memory = compiled.memory_analysis()
    per_device = (
        None
        if memory is None
        else int(
            memory.temp_size_in_bytes
            + memory.argument_size_in_bytes
            + memory.output_size_in_bytes
        )
    )
    return {
        **dataclasses.asdict(case),
        "name": case.name,
        "collectives": summarise(found),
        "grad_error": _rel_error(grads, reference),
        "grad_error_one_device": (
            _one_device_error(case, model, tokens, reference)
            if case.dtype in FP8_RULES or case.variant == "autocast"
            else None
        ),
        # Small float32 all-reduces: the loss's mean, fp8 amaxes.
        "small_all_reduces": sum(
            c["kind"] == "all-reduce" and c["rank"] <= 1 and c["dtype"] == "f32"
            for c in found
        ),
        # All-reduces of the compiled program (after XLA's combiners) that reduce
        # fp8 weights' amaxes.
        "weight_amax_all_reduces": amax_all_reduces,
        # Where GSPMD put each gradient (the step does not constrain them).
        "grad_shardings": [str(g.sharding.spec) for g in jtu.tree_leaves(grads)],
        "memory_per_device": per_device,
    }


def run(quick: bool = False, only: str | None = None, fp8: bool = False) -> list[dict]:
    key_model, key_data = jr.split(jr.key(0))
    model = make_model(key_model)
    tokens = jr.randint(key_data, (16, 17), 0, 64)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def reference_loss(p):
        return cross_entropy(
            jax.vmap(eqx.combine(p, static))(tokens[:, :-1]), tokens[:, 1:]
        )

    reference = jax.jit(jax.grad(reference_loss))(params)
    rows = []
    for case in cases(quick, only, fp8):
        print("measuring", case.name, file=sys.stderr, flush=True)
        rows.append(measure(case, model, tokens, reference))
    _add_fp8_gather_ratios(rows)
    return rows


def _add_fp8_gather_ratios(rows: list[dict]) -> None:
    """For each fp8 row: the bytes of its fp8 weight all-gathers over those of the
    same weights in the bfloat16 `autocast` step of its mesh and engine (all of
    that step's weight gathers, less those the fp8 step makes in bfloat16: the
    weights no fp8 product reads, which gather as they did)."""
    bf16 = {
        (r["mesh"], r["engine"]): r["collectives"].get("param_gather", {})
        for r in rows
        if r["variant"] == "autocast" and r["dtype"] == "bf16"
    }
    for r in rows:
        gathers = r["collectives"].get("param_gather", {})
        if r["dtype"] not in FP8_RULES or (r["mesh"], r["engine"]) not in bf16:
            continue
        same = sum(bf16[r["mesh"], r["engine"]].values()) - gathers.get("bf16", 0)
        # MXFP8 weights gather their e8m0 block scales beside the e4m3 values.
        fp8 = gathers.get("f8e4m3fn", 0) + gathers.get("f8e8m0fnu", 0)
        r["fp8_gather_ratio"] = fp8 / same if same else None


def _fmt_bytes(by_dtype: dict | None) -> str:
    if not by_dtype:
        return "-"
    return " ".join(f"{d}:{b / 1024:.1f}K" for d, b in sorted(by_dtype.items()))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| variant | dtype | reduce | mesh | engine | all-gather | gradient reductions "
        "| other collectives | grad error vs f32 (one device) | memory/device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["collectives"]
        memory = (
            "-"
            if r["memory_per_device"] is None
            else f"{r['memory_per_device'] / 2**20:.2f} MiB"
        )
        one = r.get("grad_error_one_device")
        one = "" if one is None else f" ({one:.2e})"
        lines.append(
            f"| {r['variant']} | {r['dtype']} | {r['reduce']} | {r['mesh']} | "
            f"{r['engine']} | {_fmt_bytes(c.get('param_gather'))} | "
            f"{_fmt_bytes(c.get('grad_reduce'))} | {_fmt_bytes(c.get('other'))} | "
            f"{r['grad_error']:.2e}{one} | {memory} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test suite's cases")
    parser.add_argument(
        "--fp8", action="store_true", help="the fp8 cases and those they compare with"
    )
    parser.add_argument(
        "--json", help="write every measurement to this file ('-': stdout)"
    )
    groups = [f"{mesh}/{engine}" for mesh in MESHES for engine in ENGINES]
    parser.add_argument("--only", choices=groups, help="one mesh and engine")
    args = parser.parse_args(argv)
    devices = jax.devices()
    if len(devices) < 8:
        sys.exit(
            f"The sharded preset needs 8 devices; this machine has {len(devices)} "
            f"{devices[0].platform} device(s). On CPU it simulates 8."
        )
    rows = run(args.quick, args.only, args.fp8)
    if args.json == "-":
        print(json.dumps(rows))
        return
    print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}")
    print(markdown(rows))
    ratios = [r for r in rows if r.get("fp8_gather_ratio") is not None]
    if ratios:
        print("\nfp8 weight all-gathers x the same weights' in bfloat16:")
        for r in ratios:
            print(
                f"  {r['variant']} {r['dtype']} {r['mesh']} {r['engine']}: "
                f"{r['fp8_gather_ratio']:.2f}x; weight amaxes in "
                f"{r['weight_amax_all_reduces']} all-reduce(s) after XLA's passes"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

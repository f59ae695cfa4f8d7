"""Diagnostics: what ran in which dtype, and which op overflowed."""

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._autocast import _jax_compat as compat


_MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")
# Ops that move data without arithmetic: not worth listing as full-precision work.
_DATA_MOVEMENT = frozenset(
    {
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
        "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "rev",
        "copy", "copy_p", "convert_element_type", "select_n", "iota", "split",
        "sharding_constraint", "stop_gradient", "pjit", "jit", "closed_call",
        "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat2", "scan", "while",
        "cond", "shard_map",
    }
)  # fmt: skip


def _trace(fn: Callable, args: tuple, kwargs: dict) -> Any:
    if not callable(fn):
        raise TypeError(f"Expected a callable to inspect, but got {type(fn).__name__}.")
    return eqx.filter_make_jaxpr(fn)(*args, **kwargs)[0]


def _sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, int]]:
    """Sub-jaxprs of an equation with how many times each runs per run of the
    equation (scan bodies run `length` times; while bodies an unknown number of
    times, counted once)."""
    repeats = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if compat.is_jaxpr(v):
                yield compat.open_jaxpr(v)[0], repeats


def _source(eqn: Any, enclosing: str) -> str:
    # Ops inside library sub-jaxprs (`jnp.var` is a jit) have no user frame of their
    # own: the line that called the library is the useful one.
    line = compat.source_line(eqn)
    return enclosing if line == compat.UNKNOWN_SOURCE else line


def _walk(
    jaxpr: Any, scopes: tuple[str, ...] = (), repeats: int = 1, enclosing: str = ""
) -> Iterator:
    for eqn in jaxpr.eqns:
        eqn_scopes = scopes + compat.scope_names(eqn)
        source = _source(eqn, enclosing or compat.UNKNOWN_SOURCE)
        yield eqn, eqn_scopes, repeats, source
        for sub, times in _sub_jaxprs(eqn):
            yield from _walk(sub, eqn_scopes, repeats * times, source)


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_low(dtype: Any) -> bool:
    return _floating(dtype) and jnp.dtype(dtype).itemsize < 4


def _matmul_flops(eqn: Any) -> int:
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        per_output = math.prod(rhs.shape) // rhs.shape[out_feature_dim]
        return 2 * math.prod(out.shape) * per_output
    if eqn.primitive.name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract)
    lhs = eqn.invars[0].aval  # ragged dots: an upper bound
    return 2 * math.prod(out.shape) * lhs.shape[-1]


def _dtype_names(atoms: Any) -> tuple[str, ...]:
    return tuple(a.aval.dtype.name for a in atoms if hasattr(a.aval, "dtype"))


@dataclasses.dataclass(frozen=True)
class OpSite:
    """Where an op comes from: its primitive, input dtypes, named scope and source
    line, and how many times it appears."""

    primitive: str
    dtypes: tuple[str, ...]
    scope: str
    source: str
    count: int


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What a function runs in which dtype. Print it for a table.

    **Fields:**

    - `ops`: primitive name -> {input dtypes -> count}.
    - `matmul_flops`, `low_precision_flops`: FLOPs of matmuls and convolutions, all
        and those whose operands are narrower than 32 bits (scan bodies multiplied by
        their length; while bodies and every cond branch counted once).
    - `low_precision_share`: their ratio (0.0 when there are no matmuls).
    - `casts`: how many casts between floating dtypes the program holds.
    - `full_precision_ops`: the arithmetic ops that read 32-bit (or wider) floats,
        with their scope and source line, most frequent first.
    """

    ops: dict[str, dict[tuple[str, ...], int]]
    matmul_flops: int
    low_precision_flops: int
    casts: int
    full_precision_ops: tuple[OpSite, ...]

    @property
    def low_precision_share(self) -> float:
        return (
            self.low_precision_flops / self.matmul_flops if self.matmul_flops else 0.0
        )

    def __str__(self) -> str:
        lines = [
            f"matmul/conv FLOPs in low precision: {self.low_precision_share:.1%} "
            f"({self.low_precision_flops:,} of {self.matmul_flops:,})",
            f"casts between floating dtypes: {self.casts}",
            "",
            f"{'primitive':<24} {'count':>6}  input dtypes",
        ]
        for name in sorted(self.ops, key=lambda n: -sum(self.ops[n].values())):
            for dtypes, count in sorted(self.ops[name].items(), key=lambda kv: -kv[1]):
                lines.append(f"{name:<24} {count:>6}  {', '.join(dtypes) or '-'}")
        if self.full_precision_ops:
            lines += ["", "full-precision ops (primitive x count, scope, source):"]
            for site in self.full_precision_ops[:25]:
                scope = site.scope or "<no scope>"
                lines.append(
                    f"  {site.primitive} x{site.count}  {scope}  {site.source}"
                )
            if len(self.full_precision_ops) > 25:
                lines.append(f"  ... {len(self.full_precision_ops) - 25} more sites")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):  # IPython / notebooks
        printer.text(str(self))


def precision_report(fn: Callable, *args: Any, **kwargs: Any) -> PrecisionReport:
    """Reports which ops `fn(*args, **kwargs)` runs in which dtype, through every
    sub-jaxpr: counts and dtypes per primitive, the share of matmul/conv FLOPs in low
    precision, the number of casts, and the ops that run in full precision with
    their scope and source line. Works for plain functions and for `filter_amp` and
    `autocast` ones (it reads the program they actually trace).

    **Arguments:**

    - `fn`: the function to inspect; `args` and `kwargs` as it is called (arrays or
        `jax.ShapeDtypeStruct`s; nothing is run).

    **Returns:**

    A `PrecisionReport`; `print(report)` shows a table.

    **Example:**

    ```python
    report = eqx_amp.precision_report(eqx_amp.autocast(model), x)
    print(report)
    assert report.low_precision_share == 1.0
    ```
    """
    jaxpr = _trace(fn, args, kwargs)
    ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sites: collections.Counter = collections.Counter()
    matmul_flops = low_flops = casts = 0
    for eqn, scopes, repeats, source in _walk(jaxpr.jaxpr):
        name = eqn.primitive.name
        in_dtypes = _dtype_names(eqn.invars)
        ops[name][in_dtypes] += 1
        if name in _MATMULS:
            flops = _matmul_flops(eqn) * repeats
            matmul_flops += flops
            if all(_is_low(a.aval.dtype) for a in eqn.invars[:2]):
                low_flops += flops
        if name == "convert_element_type":
            old, new = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
            casts += int(_floating(old) and _floating(new) and old != new)
        floats = [a.aval.dtype for a in eqn.invars if _floating(a.aval.dtype)]
        if name not in _DATA_MOVEMENT and floats and not any(map(_is_low, floats)):
            sites[(name, in_dtypes, "/".join(scopes), source)] += 1
    full_ops = tuple(
        OpSite(name, dtypes, scope, source, count)
        for (name, dtypes, scope, source), count in sites.most_common()
    )
    return PrecisionReport(
        ops={k: dict(v) for k, v in ops.items()},
        matmul_flops=matmul_flops,
        low_precision_flops=low_flops,
        casts=casts,
        full_precision_ops=full_ops,
    )


#
# find_nonfinite
#


_DOMAIN_OPS = frozenset(
    {"log", "log1p", "rsqrt", "sqrt", "div", "rem", "pow", "acos", "asin", "atanh",
     "acosh", "lgamma", "digamma", "erf_inv", "tan"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class NonfiniteOp:
    """The first op whose output is inf/nan while its inputs are finite.

    **Fields:** `primitive`, `scope`, `source` (file:line), `input_dtypes`,
    `input_ranges` (min and max of each floating input), `output_dtype`,
    `dtype_max` (the largest finite value of the output dtype), `hint`.
    """

    primitive: str
    scope: str
    source: str
    input_dtypes: tuple[str, ...]
    input_ranges: tuple[tuple[float, float], ...]
    output_dtype: str
    dtype_max: float
    hint: str

    def __str__(self) -> str:
        ranges = ", ".join(
            f"{d}[{lo:.4g}, {hi:.4g}]"
            for d, (lo, hi) in zip(self.input_dtypes, self.input_ranges)
        )
        return (
            f"first non-finite value: `{self.primitive}` in scope "
            f"'{self.scope or '<no scope>'}' at {self.source}\n"
            f"  inputs: {ranges or 'none'}\n"
            f"  output dtype {self.output_dtype} (largest finite value {self.dtype_max:.6g})\n"
            f"  hint: {self.hint}"
        )


class _Found(Exception):
    def __init__(self, op: NonfiniteOp):
        self.op = op


def _all_finite(values: list) -> bool:
    return all(
        bool(np.all(np.isfinite(np.asarray(v, np.float32))))
        for v in values
        if eqx.is_array(v) and _floating(v.dtype)
    )


def _hint(name: str, out_dtype: np.dtype) -> str:
    if name == "convert_element_type" and _is_low(out_dtype):
        return (
            f"a value too large for {out_dtype.name} (max "
            f"{float(jnp.finfo(out_dtype).max):.6g}) was cast down to it, at a call "
            "boundary or an explicit astype: keep it in float32 from where it is made "
            "(compute with its logarithm, return it in float32), or use bfloat16."
        )
    if _is_low(out_dtype):
        return (
            f"{name} overflowed {out_dtype.name} (max {float(jnp.finfo(out_dtype).max):.6g}): "
            "keep it in float32 with an `autocast` rule or `eqx_amp.full_precision`, "
            "scale its inputs down, or use bfloat16, which has float32's range."
        )
    if name in _DOMAIN_OPS:
        return (
            f"{name} got an input outside its domain (a log or division of zero, a "
            "square root of a negative, ...): guard it, e.g. with an epsilon or "
            "`jnp.where`."
        )
    return (
        f"{name} overflowed {out_dtype.name} (max {float(jnp.finfo(out_dtype).max):.6g}): "
        "its inputs are too large; check the scale of the values reaching it."
    )


def _check(eqn: Any, where: "_Where", invals: list, outvals: list) -> None:
    if _all_finite(outvals) or not _all_finite(invals):
        return
    bad = next(
        v
        for v in outvals
        if eqx.is_array(v) and _floating(v.dtype) and not _all_finite([v])
    )
    floats = [v for v in invals if eqx.is_array(v) and _floating(v.dtype)]
    ranges = tuple(
        (float(jnp.min(v.astype(jnp.float32))), float(jnp.max(v.astype(jnp.float32))))
        if v.size
        else (0.0, 0.0)
        for v in floats
    )
    out_dtype = jnp.dtype(bad.dtype)
    raise _Found(
        NonfiniteOp(
            primitive=eqn.primitive.name,
            scope="/".join(where.scopes),
            source=where.source,
            input_dtypes=tuple(v.dtype.name for v in floats),
            input_ranges=ranges,
            output_dtype=out_dtype.name,
            dtype_max=float(jnp.finfo(out_dtype).max),
            hint=_hint(eqn.primitive.name, out_dtype),
        )
    )


@dataclasses.dataclass(frozen=True)
class _Where:
    scopes: tuple[str, ...] = ()
    source: str = ""

    def enter(self, eqn: Any) -> "_Where":
        source = _source(eqn, self.source or compat.UNKNOWN_SOURCE)
        return _Where(self.scopes + compat.scope_names(eqn), source)


def _run(jaxpr: Any, consts: list, args: list, where: _Where) -> list:
    env: dict[Any, Any] = {}

    def read(atom):
        return atom.val if isinstance(atom, compat.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        eqn_where = where.enter(eqn)
        runner = _RUNNERS.get(eqn.primitive.name)
        outvals = (
            runner(eqn, invals, eqn_where)
            if runner
            else compat.concrete_bind(eqn, invals)
        )
        _check(eqn, eqn_where, invals, outvals)
        env.update(zip(eqn.outvars, outvals))
    return [read(v) for v in jaxpr.outvars]


def _run_closed(closed: Any, args: list, where: _Where) -> list:
    jaxpr, consts = compat.open_jaxpr(closed)
    return _run(jaxpr, consts, args, where)


def _run_call(param: str) -> Callable:
    return lambda eqn, invals, where: _run_closed(eqn.params[param], invals, where)


def _run_scan(eqn, invals, where):
    p = compat.scan_params(eqn.params)
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry = invals[:n_consts], invals[n_consts : n_consts + n_carry]
    xs = invals[n_consts + n_carry :]
    ys = []
    steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in steps:
        outs = _run_closed(p["jaxpr"], [*consts, *carry, *(x[i] for x in xs)], where)
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if p["reverse"]:
        ys.reverse()
    n_ys = len(eqn.outvars) - n_carry
    stacked = [
        jnp.stack([y[k] for y in ys]) if ys else jnp.zeros(v.aval.shape, v.aval.dtype)
        for k, v in zip(range(n_ys), eqn.outvars[n_carry:])
    ]
    return [*carry, *stacked]


def _run_while(eqn, invals, where):
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
    carry = invals[n_cond + n_body :]
    while bool(_run_closed(eqn.params["cond_jaxpr"], [*cond_consts, *carry], where)[0]):
        carry = _run_closed(eqn.params["body_jaxpr"], [*body_consts, *carry], where)
    return carry


def _run_cond(eqn, invals, where):
    index, *operands = invals
    branches = eqn.params["branches"]
    chosen = branches[int(np.clip(int(index), 0, len(branches) - 1))]
    return _run_closed(chosen, operands, where)


_RUNNERS: dict[str, Callable] = {
    "jit": _run_call("jaxpr"),
    "pjit": _run_call("jaxpr"),
    "closed_call": _run_call("call_jaxpr"),
    "core_call": _run_call("call_jaxpr"),
    "checkpoint": _run_call("jaxpr"),
    "remat2": _run_call("jaxpr"),
    "custom_jvp_call": _run_call("call_jaxpr"),
    "custom_vjp_call": _run_call("call_jaxpr"),
    "scan": _run_scan,
    "while": _run_while,
    "cond": _run_cond,
}


def find_nonfinite(fn: Callable, *args: Any, **kwargs: Any) -> NonfiniteOp | None:
    """Runs `fn(*args, **kwargs)` op by op, through every sub-jaxpr (jit, scan
    iterations, while iterations, the cond branch taken, custom_jvp/custom_vjp
    functions), and names the first op whose output is inf or nan while its inputs
    are finite.

    Call it outside `jit` with concrete arrays: it is a debugging tool, and runs
    eagerly. It works on gradients too: `find_nonfinite(jax.grad(loss), params, x)`.

    **Arguments:**

    - `fn`: the function to run; `args` and `kwargs` as it is called.

    **Returns:**

    `None` if every value is finite, otherwise a `NonfiniteOp` with the primitive,
    its named scope (Equinox's layers open scopes, so this names the layer), source
    line, input ranges, the output dtype's largest value, and a hint. `print` it for
    a readable message.

    **Raises:**

    `ValueError` if an argument already holds inf or nan (naming which one), or if
    called inside a JAX transformation.

    **Example:**

    ```python
    bad = eqx_amp.find_nonfinite(eqx_amp.filter_amp(model, policy="mixed_float16"), x)
    if bad is not None:
        print(bad)  # first non-finite value: `exp` in scope 'Head' at model.py:12 ...
    ```
    """
    leaves = jtu.tree_leaves_with_path((args, kwargs))
    for path, leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            raise ValueError(
                "`find_nonfinite` runs eagerly, op by op, and needs concrete arrays: "
                "call it outside `jax.jit`, `jax.grad` and other transformations."
            )
        if eqx.is_array(leaf) and _floating(leaf.dtype) and not _all_finite([leaf]):
            raise ValueError(
                f"The argument at {jtu.keystr(path)} already holds inf or nan: the "
                "problem is upstream of this function."
            )
    closed = _trace(fn, args, kwargs)
    flat = [leaf for _, leaf in leaves if eqx.is_array(leaf)]
    try:
        _run_closed(closed, flat, _Where())
    except _Found as found:
        return found.op
    return None

"""`precision_report`: what ran in which dtype, and the matmul FLOPs in each."""

import collections
import dataclasses
import math
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
from jax import lax

from .._core._cast import is_floating_array, is_floating_dtype, is_half_dtype
from .._core._describe import is_module
from .._core._platform import CPU_FORM_SCOPE
from .._filter_amp._first_call import unchecked
from .._fp8 import FP8_SCOPE, FP8_SKIPPED_SCOPE, block_scaled_flops
from .._jaxpr import _compat as compat
from .._jaxpr._evaluate import evaluate
from .._jaxpr._hook import (
    MATMUL_PRIMITIVES,
    Frame,
    Hook,
    Origin,
    is_higher_order,
    leaf_origins,
)
from ._causes import WideCauses, state_inputs
from ._coverage import coverage_advice


# Ops that move data without arithmetic: not worth listing as full-precision work.
_DATA_MOVEMENT = frozenset(
    {
        lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p, lax.transpose_p,
        lax.slice_p, lax.dynamic_slice_p, lax.dynamic_update_slice_p, lax.gather_p,
        lax.concatenate_p, lax.pad_p, lax.rev_p, lax.copy_p,
        lax.convert_element_type_p, lax.select_n_p, lax.iota_p, lax.split_p,
        compat.sharding_constraint_p,
    }
)  # fmt: skip


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


def trace(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """The jaxpr of `fn(*args, **kwargs)`, with the arrays `fn` holds (a module's
    weights) as inputs rather than constants."""
    if not callable(fn):
        raise TypeError(f"Expected a callable to inspect, but got {type(fn).__name__}.")
    with unchecked():  # the report gives the advice the check would
        return eqx.filter_make_jaxpr(_call)(fn, args, kwargs)[0]


def _is_input(leaf: Any) -> bool:
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def matmul_flops(eqn: Any) -> int:
    out = eqn.outvars[0].aval
    if eqn.primitive is lax.conv_general_dilated_p:
        rhs = eqn.invars[1].aval
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        per_output = math.prod(rhs.shape) // rhs.shape[out_feature_dim]
        return 2 * math.prod(out.shape) * per_output
    if eqn.primitive is lax.dot_general_p:
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
class WideMatmul:
    """A matmul or convolution with an operand of 32 bits or more: where it is, its
    FLOPs, and why that operand is wide (which op made it, and from what)."""

    primitive: str
    dtypes: tuple[str, ...]
    flops: int
    scope: str
    source: str
    reason: str
    # What the wide operand was computed from: "data", "params" or "constant".
    origin: str = "data"
    # The named scope of the op that first made the wide operand's data wide, the
    # cause (`"eqx.nn.SpectralNorm"` where a layer's float32 state made it, not the
    # layers that only passed the wide value on), `""` outside every scope, for an
    # argument, or unknown.
    made_in: str = ""


@dataclasses.dataclass(frozen=True)
class Fp8Skip:
    """A matmul an fp8 rule left in the compute dtype, and why (its shapes)."""

    source: str
    reason: str
    flops: int
    scope: str


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
    - `full_precision_ops`: the arithmetic ops that read only 32-bit (or wider)
        floats, with their scope and source line, most frequent first.
    - `flops_by_dtypes`: matmul/conv FLOPs per pair of operand dtypes, mixed pairs
        (`("bfloat16", "float32")`) included.
    - `wide_matmuls`: the matmuls and convolutions with an operand of 32 bits or
        more, most FLOPs first, each with the reason that operand is wide.
    - `fp8_skipped`: the matmuls an fp8 rule (`eqx_amp.fp8.TENSORWISE`) left in the
        compute dtype, with the reason. A product whose operands are conversions up
        from fp8, or such conversions times one scale (what an fp8 GEMM reads),
        counts in `flops_by_dtypes` under the fp8 dtypes it reads
        (`("float8_e4m3fn", "float8_e4m3fn")` forward, e5m2 with e4m3 backward) and
        as low precision. Products whose results nothing uses are not counted (they
        never run).
    - `block_scaled_flops`: the FLOPs of block-scaled products
        (`eqx_amp.fp8.MXFP8`, `eqx_amp.fp8.NVFP4`), which count in
        `flops_by_dtypes` under `("float8_e4m3fn", "float8_e4m3fn")` (NVFP4's
        forward products: `("float4_e2m1fn", "float4_e2m1fn")`) too.
    - `advice`: where less than half of the matmul FLOPs of a mixed-precision
        model run in low precision (those on parameters the filter spec keeps
        aside), what to change: the largest wide matmul, what made its wide
        operand (an array made in float32 inside the model, a layer's float32
        state such as `eqx.nn.SpectralNorm`'s) and the fix; `""` otherwise.
        Printed at the top of the table.
    """

    ops: dict[str, dict[tuple[str, ...], int]]
    matmul_flops: int
    low_precision_flops: int
    casts: int
    full_precision_ops: tuple[OpSite, ...]
    flops_by_dtypes: dict[tuple[str, ...], int] = dataclasses.field(
        default_factory=dict
    )
    wide_matmuls: tuple["WideMatmul", ...] = ()
    fp8_skipped: tuple[Fp8Skip, ...] = ()
    advice: str = ""
    block_scaled_flops: int = 0

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
        ]
        if self.block_scaled_flops:
            lines.append(
                "block-scaled (MXFP8, NVFP4) matmul FLOPs: "
                f"{self.block_scaled_flops / max(self.matmul_flops, 1):.1%} "
                f"({self.block_scaled_flops:,})"
            )
        if self.advice:
            # Never inside a word: the advice names files, which a reader copies.
            advice = textwrap.wrap(
                f"advice: {self.advice}",
                88,
                break_long_words=False,
                break_on_hyphens=False,
            )
            lines += ["", *advice]
        lines += ["", f"{'primitive':<24} {'count':>6}  input dtypes"]
        for name in sorted(self.ops, key=lambda n: -sum(self.ops[n].values())):
            for dtypes, count in sorted(self.ops[name].items(), key=lambda kv: -kv[1]):
                lines.append(f"{name:<24} {count:>6}  {', '.join(dtypes) or '-'}")
        if self.wide_matmuls:
            lines += ["", "matmuls with a wide operand (FLOPs, dtypes, source: why):"]
            for site in self.wide_matmuls[:10]:
                lines.append(
                    f"  {site.flops:,}  {', '.join(site.dtypes)}  {site.source}: "
                    f"{site.reason}"
                )
        if self.fp8_skipped:
            lines += ["", "matmuls left out of fp8 (FLOPs, source: why):"]
            for skip in self.fp8_skipped[:10]:
                lines.append(f"  {skip.flops:,}  {skip.source}: {skip.reason}")
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


# The higher-order primitives whose sub-jaxprs' outputs are their own outputs, one
# for one (the others, loops, keep every output of their bodies live).
_OUTPUTS_ONE_FOR_ONE = compat.present(
    compat.jit_p,
    compat.closed_call_p,
    compat.remat_p,
    compat.custom_jvp_call_p,
    compat.custom_vjp_call_p,
    compat.shard_map_p,
    compat.cond_p,
    compat.call_p,
)


def dead_equations(closed: Any) -> dict[int, Any]:
    """The equations of a program (its sub-jaxprs too) whose outputs nothing uses
    and which have no effects: what XLA removes before anything runs (a `jax.vjp`'s
    recomputed product in a backward rule whose primal output is dropped). Keyed by
    `id`, each equation kept alive with its entry."""
    dead: dict[int, Any] = {}

    def bury(eqn: Any) -> None:
        # Nothing inside a dead higher-order equation runs either.
        dead[id(eqn)] = eqn
        for sub in compat.sub_jaxprs(eqn.params):
            for inner in compat.open_jaxpr(sub)[0].eqns:
                bury(inner)

    def visit(jaxpr: Any, live_outputs: list[bool]) -> None:
        jaxpr, _ = compat.open_jaxpr(jaxpr)
        live = {
            v
            for v, used in zip(jaxpr.outvars, live_outputs)
            if used and not isinstance(v, compat.Literal)
        }
        for eqn in reversed(jaxpr.eqns):
            used = [v in live for v in eqn.outvars]
            if not any(used) and not eqn.effects:
                bury(eqn)
                continue
            one_for_one = eqn.primitive in _OUTPUTS_ONE_FOR_ONE
            for sub in compat.sub_jaxprs(eqn.params):
                n_out = len(compat.open_jaxpr(sub)[0].outvars)
                visit(sub, used if one_for_one else [True] * n_out)
            live.update(v for v in eqn.invars if not isinstance(v, compat.Literal))

    outvars = compat.open_jaxpr(closed)[0].outvars
    visit(closed, [True] * len(outvars))
    return dead


def _is_fp8(dtype: Any) -> bool:
    return is_floating_dtype(dtype) and jnp.dtype(dtype).itemsize == 1


def _fp8_skipped_reason(frame: Frame) -> str | None:
    for scope in reversed(frame.scopes):
        if scope.startswith(FP8_SKIPPED_SCOPE):
            return scope.partition(": ")[2] or "not eligible"
    return None


def precision_report(fn: Callable, *args: Any, **kwargs: Any) -> PrecisionReport:
    """Reports which ops `fn(*args, **kwargs)` runs in which dtype, through every
    sub-jaxpr: counts and dtypes per primitive, the share of matmul/conv FLOPs in low
    precision, the number of casts, and the ops that run in full precision with
    their scope and source line. Works for plain functions and for `filter_amp` and
    `autocast` ones (it reads the program they actually trace). Where less than
    half of a mixed-precision model's matmul FLOPs run in low precision,
    `report.advice` names the cause and the fix (what `filter_amp` warns of on
    a model's first traced call).

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
    closed = trace(fn, args, kwargs)
    jaxpr, _ = compat.open_jaxpr(closed)
    # The avals themselves: they carry the varying manual axes of a `shard_map`.
    structs = [v.aval for v in jaxpr.invars]
    reports = []

    def run(*xs):
        outs, report = counted_run(closed, (fn, args, kwargs), xs)
        reports.append(report)
        return outs

    jax.eval_shape(run, *structs)
    return dataclasses.replace(reports[0], advice=coverage_advice(reports[0], fn))


def counted_run(
    closed: Any, tree: Any, leaves: Sequence[Any]
) -> tuple[list, PrecisionReport]:
    """The outputs of `closed`, the program traced from the arrays of `tree`
    (`(fn, args, kwargs)`), on `leaves`, those arrays or tracers of them; and the
    report of what it ran (no `advice`: that needs the wrapper the user holds).

    ```python
    outs, report = counted_run(closed, (fn, args, kwargs), leaves)
    ```
    """
    census = _Census(dead_equations(closed), state_inputs(tree))
    census.causes.start(leaves)
    outs = evaluate(closed, leaves, census, origins=_argument_origins(tree))[0]
    return outs, census.report()


def _argument_origins(tree: Any) -> list[Origin]:
    """The arrays of Equinox modules (`fn` itself, or arguments) are parameters."""
    return leaf_origins(eqx.filter(tree, _is_input), is_module)


class _Census(Hook):
    """Counts every equation the program runs, as the evaluator meets it."""

    def __init__(self, dead: dict[int, Any], state_flags: list[bool]):
        # Equations whose outputs nothing uses: they never run, and are not counted.
        self._dead = dead
        self.causes = WideCauses(state_flags)
        self.ops: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        self.sites: collections.Counter = collections.Counter()
        self.matmul_flops = self.low_flops = self.casts = 0
        self.block_scaled_flops = 0
        self.flops_by_dtypes: collections.Counter = collections.Counter()
        self.wide: list[WideMatmul] = []
        self.fp8_skipped: list[Fp8Skip] = []
        # id(value) -> (value, "`op` at file:line"): which op made each value. The
        # value is kept alive with its entry, so its id cannot be reused.
        self._made_by: dict[int, tuple[Any, str]] = {}
        # id(value) -> the named scope of the op that made it (kept alive above).
        self._made_in: dict[int, str] = {}
        # id(higher-order equation) -> (it, where its wide floating inputs were made)
        self._entering: dict[int, tuple[Any, list[str]]] = {}
        # JAX may trace a loop body twice (to settle its carry types): count each
        # equation once per place it is called from.
        self._seen: set = set()
        # id(value) -> (value, fp8 dtype name): the values converted up from fp8,
        # which a product reads as fp8 (the pattern XLA makes an fp8 GEMM of).
        self._from_fp8: dict[int, tuple[Any, str]] = {}

    def equation(self, eqn, invals, origins, frame, evaluate):
        caller = None if frame.caller is None else id(frame.caller[1])
        key = (id(eqn), caller, frame.scopes, frame.repeats)
        # What the program runs on a CPU only (`with_cpu_form`), beside the form it
        # describes, is neither counted nor explained.
        described = CPU_FORM_SCOPE not in frame.scopes
        if described and key not in self._seen and id(eqn) not in self._dead:
            self._seen.add(key)
            self._count(eqn, frame, invals)
            if eqn.primitive in MATMUL_PRIMITIVES:
                self._explain_wide_operands(eqn, frame, invals, origins)
        inherited = self.causes.entering(eqn, invals, frame)
        if is_higher_order(eqn):
            self._entering[id(eqn)] = (eqn, self._wide_sources(invals))
        outvals = evaluate(invals)
        made_by = f"`{eqn.primitive.name}` at {frame.source(eqn)}"
        scope = "/".join(frame.scopes)
        for value in outvals:
            self._made_by.setdefault(id(value), (value, made_by))
            self._made_in.setdefault(id(value), scope)
        self.causes.made(eqn, outvals, frame, made_by, inherited)
        if eqn.primitive is lax.convert_element_type_p:
            source = self._from_fp8.get(id(invals[0]), (None, None))[1]
            if source is None and _is_fp8(eqn.invars[0].aval.dtype):
                source = eqn.invars[0].aval.dtype.name
            # Widening keeps the fp8 values exact; narrowing would not. A product an
            # fp8 rule left out of fp8 reads what it was given (bfloat16 copies).
            widening = jnp.dtype(eqn.params["new_dtype"]).itemsize > 1
            if source is not None and widening and not _fp8_skipped_reason(frame):
                self._from_fp8.setdefault(id(outvals[0]), (outvals[0], source))
        elif eqn.primitive is lax.mul_p:
            # fp8 values times one scale (a dequantisation): a product reading them
            # is still an fp8 GEMM, which applies the scale itself.
            sources = [self._from_fp8.get(id(v), (None, None))[1] for v in invals]
            scalar = [math.prod(jnp.shape(v)) == 1 for v in invals]
            for source, other_is_scalar in zip(sources, reversed(scalar)):
                if source is not None and other_is_scalar:
                    self._from_fp8.setdefault(id(outvals[0]), (outvals[0], source))
        return outvals

    def _read_dtypes(self, eqn, invals) -> tuple[str, ...]:
        """The dtypes a product's operands hold: fp8 for conversions up from fp8."""
        return tuple(
            self._from_fp8.get(id(value), (None, atom.aval.dtype.name))[1]
            for atom, value in zip(eqn.invars[:2], invals[:2])
            if hasattr(atom.aval, "dtype")
        )

    def _explain_wide_operands(self, eqn, frame, invals, origins) -> None:
        operands = list(zip(eqn.invars[:2], invals[:2], origins[:2]))
        wide = [
            (value, origin)
            for atom, value, origin in operands
            if _floating_aval(atom)
            and not is_half_dtype(atom.aval.dtype)
            # float32 copies of fp8 values: an fp8 matmul
            and id(value) not in self._from_fp8
        ]
        if not wide:
            return
        value, origin = wide[0]
        self.wide.append(
            WideMatmul(
                primitive=eqn.primitive.name,
                dtypes=_dtype_names(eqn.invars[:2]),
                flops=matmul_flops(eqn) * frame.repeats,
                scope="/".join(frame.scopes),
                source=frame.source(eqn),
                reason=self._why_wide(value, origin, frame),
                origin=origin.name.lower(),
                made_in=self.causes.scope(value, frame),
            )
        )

    def _wide_sources(self, values: list) -> list[str]:
        return [
            self._made_by[id(v)][1]
            for v in values
            if is_floating_array(v)
            and not is_half_dtype(v.dtype)
            and id(v) in self._made_by
        ]

    def _why_wide(self, value: Any, origin: Origin, frame: Frame) -> str:
        dtype = jnp.dtype(value.dtype).name
        made = self._made_by.get(id(value))
        if made:
            where = f"made by {made[1]}"
        elif frame.caller is not None:
            caller_frame, call = frame.caller
            where = (
                f"an input or loop carry of `{call.primitive.name}` at "
                f"{caller_frame.source(call)}"
            )
            entering = self._entering.get(id(call), (None, []))[1]
            if entering:
                where += f", which enters it as {dtype} made by {entering[0]}"
        else:
            where = "an input of the function"
        cause = self.causes.of(value, frame)
        if cause is not None and cause[1] not in where:
            first = (
                f"made {dtype} by {cause[1]}"
                if cause[1]
                else "an input of the function"
            )
            where += f", first {first}"
        if origin is Origin.CONSTANT:
            what = f"a {dtype} array created inside the model (a constant, `jnp.zeros`)"
        elif origin is Origin.PARAMS:
            what = f"a {dtype} parameter (the filter spec keeps it) or made from one"
        else:
            what = f"{dtype} data (an argument, state, a loop carry, or made from them)"
        return f"{what}, {where}"

    def _count(self, eqn: Any, frame: Frame, invals: list) -> None:
        name = eqn.primitive.name
        in_dtypes = _dtype_names(eqn.invars)
        self.ops[name][in_dtypes] += 1
        if eqn.primitive in MATMUL_PRIMITIVES:
            flops = matmul_flops(eqn) * frame.repeats
            self.matmul_flops += flops
            read = self._read_dtypes(eqn, invals)
            self.flops_by_dtypes[read] += flops
            if read and all(map(is_half_dtype, read)):
                self.low_flops += flops
            skipped = _fp8_skipped_reason(frame)
            if skipped is not None:
                self.fp8_skipped.append(
                    Fp8Skip(frame.source(eqn), skipped, flops, "/".join(frame.scopes))
                )
        block_scaled = block_scaled_flops(eqn)
        if block_scaled is not None:
            flops = block_scaled * frame.repeats
            self.matmul_flops += flops
            self.low_flops += flops
            self.block_scaled_flops += flops
            self.flops_by_dtypes[_dtype_names(eqn.invars[:2])] += flops
        if eqn.primitive is lax.convert_element_type_p:
            old, new = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
            floating = is_floating_dtype(old) and is_floating_dtype(new)
            self.casts += int(floating and old != new)
        floats = [a.aval.dtype for a in eqn.invars if _floating_aval(a)]
        if (
            FP8_SCOPE not in frame.scopes  # an fp8 matmul's scales: float32 by design
            and eqn.primitive not in _DATA_MOVEMENT
            and not is_higher_order(eqn)
            and floats
            and not any(map(is_half_dtype, floats))
        ):
            source = frame.source(eqn)
            self.sites[(name, in_dtypes, "/".join(frame.scopes), source)] += 1

    def report(self) -> PrecisionReport:
        full_ops = tuple(
            OpSite(name, dtypes, scope, source, count)
            for (name, dtypes, scope, source), count in self.sites.most_common()
        )
        return PrecisionReport(
            ops={k: dict(v) for k, v in self.ops.items()},
            matmul_flops=self.matmul_flops,
            low_precision_flops=self.low_flops,
            casts=self.casts,
            full_precision_ops=full_ops,
            flops_by_dtypes=dict(self.flops_by_dtypes),
            wide_matmuls=tuple(sorted(self.wide, key=lambda w: -w.flops)),
            fp8_skipped=tuple(self.fp8_skipped),
            block_scaled_flops=self.block_scaled_flops,
        )


def _floating_aval(atom: Any) -> bool:
    return hasattr(atom.aval, "dtype") and is_floating_dtype(atom.aval.dtype)

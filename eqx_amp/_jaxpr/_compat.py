"""Every private or version-sensitive JAX name eqx_amp touches, in one place.

Tested on jax 0.10.x, 0.11.x and 0.12.x (`TESTED_JAX`). Each shim says what it needs
and why no public API does it. Version differences are found by feature detection
(what a param dict holds, which attribute exists), never by comparing version
numbers, and nowhere but here.

The package has no upper bound on jax. On a newer jax, `import eqx_amp` warns once
(`warn_if_untested`) and never fails: a private name that moved is recorded in
`MISSING_INTERNALS` instead of raising at import, so the call-boundary path
(`filter_amp`, `BiModel`, loss scaling, the optimizer transforms), which needs none of
them, keeps working. The jaxpr layer (`autocast`, the diagnostics, the fp8 and
reduce-dtype passes) checks `require_known_internals()` on entry and turns an
internal it does not know into one `UnsupportedJaxError` naming the jax version and
the tested range (`unknown_internals`), never a bare `KeyError`/`AttributeError`.
"""

import contextlib
import importlib
import os
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.core
import jax.extend as jex
import numpy as np


# The jax minors the test suite runs on (CI: the oldest and the newest).
TESTED_JAX = ((0, 10), (0, 12))


def _tested_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_JAX
    return f"{lo_major}.{lo_minor}.x to {hi_major}.{hi_minor}.x"


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def warn_if_untested(version: str | None = None) -> bool:
    """Warns (once per import) when jax is newer than the newest tested minor;
    returns whether it warned."""
    version = jax.__version__ if version is None else version
    minor = _minor(version)
    if minor is None or minor <= TESTED_JAX[1]:
        return False
    warnings.warn(
        f"eqx_amp is tested with jax {_tested_range()}; this is jax {version}. "
        "filter_amp, BiModel, loss scaling and the optimizer transforms use only "
        "public JAX APIs; autocast, precision_report, find_nonfinite and the fp8 "
        "rules read JAX internals and raise an error naming what changed if they "
        "meet one they do not know.",
        UserWarning,
        stacklevel=3,
    )
    return True


class UnsupportedJaxError(RuntimeError):
    """The jaxpr layer met a JAX internal that this eqx_amp does not know."""


def unsupported(what: str) -> UnsupportedJaxError:
    return UnsupportedJaxError(
        f"eqx_amp's jaxpr layer (autocast, precision_report, find_nonfinite, fp8 and "
        f"reduce-dtype passes) does not know this JAX internal of jax "
        f"{jax.__version__}: {what}. eqx_amp is tested with jax {_tested_range()}: "
        "install one of those (for example `pip install 'jax<0.13'`) or a newer "
        "eqx_amp. filter_amp, BiModel, loss scaling and the optimizer transforms do "
        "not need JAX internals and keep working."
    )


# Private names that could not be found on this jax, each "module.name".
MISSING_INTERNALS: list[str] = []


def _internal(module: str, name: str | None = None, *, required: bool = True) -> Any:
    """The module `module` (or its attribute `name`), or None, recorded in
    `MISSING_INTERNALS` if `required`, where this jax has moved or removed it."""
    try:
        found = importlib.import_module(module)
        return found if name is None else getattr(found, name)
    except (ImportError, AttributeError):
        if required:
            MISSING_INTERNALS.append(module if name is None else f"{module}.{name}")
        return None


def require_known_internals() -> None:
    """Raises `UnsupportedJaxError` if a private name the jaxpr layer needs is
    missing from this jax."""
    if MISSING_INTERNALS:
        raise unsupported("missing " + ", ".join(MISSING_INTERNALS))


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def unknown_internals(eqn: Any) -> Iterator[None]:
    """Turns a `KeyError`/`AttributeError`/`IndexError` raised by eqx_amp's own code
    while it reads an equation (a param or attribute this jax no longer has) into an
    `UnsupportedJaxError`. Errors raised inside user code or JAX pass unchanged."""
    try:
        yield
    except (KeyError, AttributeError, IndexError) as error:
        innermost = traceback.extract_tb(error.__traceback__)[-1].filename
        if not os.path.abspath(innermost).startswith(_PACKAGE_ROOT):
            raise
        raise unsupported(
            f"the `{eqn.primitive}` equation ({type(error).__name__}: {error}; "
            f"its params are {sorted(eqn.params)})"
        ) from error


# No public API re-enters an equation's source info or names the user's frame.
source_info_util = _internal("jax._src.source_info_util")
# Callback primitives, `shard_map_p`, `linear_solve_p` and `ragged_dot_general_p`
# are not in jax.extend.
_callback = _internal("jax._src.callback")
_debugging = _internal("jax._src.debugging", required=False)
_solves = _internal("jax._src.lax.control_flow.solves", required=False)
_lax_internal = _internal("jax._src.lax.lax", required=False)
_batching = _internal("jax._src.interpreters.batching")
_core = _internal("jax._src.core")
_ad = _internal("jax._src.interpreters.ad")

# Source lines of traced ops name the user's code, not eqx_amp's casts and wrappers
# (Equinox registers its own files the same way).
if source_info_util is not None:
    source_info_util.register_exclusion(_PACKAGE_ROOT)

Literal = jex.core.Literal
Jaxpr = jex.core.Jaxpr
# jax >= 0.11: the same class as `Jaxpr`, which jax 0.12's stubs leave unexported.
ClosedJaxpr = jex.core.ClosedJaxpr  # pyright: ignore[reportPrivateImportUsage]
Primitive = jex.core.Primitive

#
# Primitives, as objects. `jax.extend.core.primitives` has most of them.
#

_primitives = jex.core.primitives


def _primitive(name: str, *, required: bool = True) -> Any:
    primitive = getattr(_primitives, name, None)
    if primitive is None and required:
        MISSING_INTERNALS.append(f"jax.extend.core.primitives.{name}")
    return primitive


jit_p = _primitive("jit_p")
closed_call_p = _primitive("closed_call_p")
# JAX main replaces `call_p`/`closed_call_p` with `eval_jaxpr_p`: detect either.
call_p = _primitive("call_p", required=False)
eval_jaxpr_p = _primitive("eval_jaxpr_p", required=False)
remat_p = _primitive("remat_p")
scan_p = _primitive("scan_p")
while_p = _primitive("while_p")
cond_p = _primitive("cond_p")
custom_jvp_call_p = _primitive("custom_jvp_call_p")
custom_vjp_call_p = _primitive("custom_vjp_call_p")
shard_map_p = _internal("jax._src.shard_map", "shard_map_p")
add_jaxvals_p = _primitive("add_jaxvals_p", required=False)
sharding_constraint_p = _primitive("sharding_constraint_p")
# `shard_map` marks a replicated value varying along an axis with this primitive,
# which no public API names (jax 0.10 to 0.12).
PVARY_NAME = "pvary"
# The named scope under which `jax.checkpoint`'s backward pass recomputes the forward
# equations (`ad_checkpoint.remat_transpose`; jax 0.10 to 0.12), which no public API
# names.
REMATERIALISED_SCOPE = "rematted_computation"
# `lax.custom_linear_solve` (inside `jnp.linalg.solve`): its jaxprs sit in a
# namedtuple param.
linear_solve_p = getattr(_solves, "linear_solve_p", None)
# `jax.lax.ragged_dot` binds `ragged_dot_general_p`; no `jax.lax.ragged_dot_p` exists.
ragged_dot_general_p = getattr(_lax_internal, "ragged_dot_general_p", None)

# Callbacks run Python code that was traced at fixed dtypes: their operands must
# arrive in those dtypes.
CALLBACK_PRIMITIVES = frozenset(
    p
    for p in (
        getattr(_callback, "pure_callback_p", None),
        getattr(_callback, "io_callback_p", None),
        getattr(_debugging, "debug_callback_p", None),
    )
    if p is not None
)


def present(*primitives: Primitive | None) -> frozenset[Primitive]:
    """The primitives of `primitives` that this jax has."""
    return frozenset(p for p in primitives if p is not None)


#
# Jaxprs.
#


def open_jaxpr(jaxpr: Any) -> tuple[Any, list]:
    """`(jaxpr, consts)` of a closed or an open jaxpr. JAX 0.11 merged `ClosedJaxpr`
    into `Jaxpr`, so this asks for the attributes rather than the type."""
    if (
        hasattr(jaxpr, "consts")
        and hasattr(jaxpr, "jaxpr")
        and jaxpr.jaxpr is not jaxpr
    ):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, list(getattr(jaxpr, "consts", ()) or ())


def is_jaxpr(value: Any) -> bool:
    return isinstance(value, (Jaxpr, ClosedJaxpr))


def sub_jaxprs(params: dict) -> Iterator[Any]:
    """Every jaxpr among an equation's params (in tuples too: `cond` branches)."""
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if is_jaxpr(v):
                yield v


def scan_counts(params: dict) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation. jax <= 0.11 stores the counts;
    jax 0.12 stores `ft_in`, a flat tree of (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def branch_platforms(params: dict) -> tuple | None:
    """For a `cond` made by `lax.platform_dependent`, the platforms of each branch
    (a tuple of names, or None for the default one), aligned with `branches`; None
    for an ordinary `cond`. Its index comes from the platform the program is
    lowered for, and only that branch is lowered."""
    return params.get("branches_platforms")


def replace_jaxprs(params: dict, replace: Callable[[Any], Any]) -> dict:
    """`params` with every jaxpr among them (in tuples and namedtuples too) replaced
    by `replace(jaxpr)`."""

    def visit(value):
        if is_jaxpr(value):
            return replace(value)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*map(visit, value))
        if isinstance(value, (tuple, list)):
            return type(value)(map(visit, value))
        return value

    return {k: visit(v) for k, v in params.items()}


def shard_map_params(params: dict) -> dict:
    """`jax.shard_map` keyword arguments rebuilt from a `shard_map` equation
    (`check_rep` and `axis_names` are the names older jax used)."""
    axis_names = params.get("newly_manual_axes", params.get("axis_names", frozenset()))
    check = params.get("check_vma", params.get("check_rep", True))
    return {
        "mesh": params["mesh"],
        "in_specs": params["in_specs"],
        "out_specs": params["out_specs"],
        "axis_names": frozenset(axis_names),
        "check_vma": check,
    }


def bind_jit(params: dict, jaxpr: Any, args: list) -> list:
    """Binds `jit` with every param of the original equation (shardings, layouts,
    donation, mesh context, compiler options, name, inlining) and a new body.
    `jax.jit` cannot take flat per-argument shardings that include "unspecified",
    so the primitive is bound directly, as JAX's own rules do."""
    return jit_p.bind(*args, **dict(params, jaxpr=jaxpr))


def bind_params(eqn: Any) -> dict:
    """The keyword arguments `eqn.primitive.bind` takes. For call-like primitives
    this turns jaxpr params into `subfuns`; first-order primitives are unchanged.
    (`get_bind_params` returned `(subfuns, params)` before jax 0.9.2.)"""
    result = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(result, tuple):
        subfuns, params = result
        return dict(params, subfuns=subfuns) if subfuns else dict(params)
    return dict(result)


def bind(eqn: Any, invals: list, params: dict | None = None) -> list:
    """Binds an equation's primitive, with its own params or the given ones."""
    params = bind_params(eqn) if params is None else params
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def wrap_like(fn: Callable, original: Any) -> Any:
    """A `lu.WrappedFun` for `fn`, carrying the debug info of `original` (the
    custom_jvp/custom_vjp primitives take their rules as WrappedFuns)."""
    return jex.linear_util.wrap_init(fn, debug_info=original.debug_info)


def call_wrapped(fun: Any, *args: Any) -> Any:
    return fun.call_wrapped(*args)


def retype_update_jaxpr(params: dict, dtype: np.dtype) -> dict:
    """Scatter primitives carry their combiner as a jaxpr typed at the operand's
    dtype; once the operand changes dtype, the combiner must too."""
    update_jaxpr = params.get("update_jaxpr")
    if update_jaxpr is None:
        return params
    consts = params.get("update_consts", ())
    if all(v.aval.dtype == dtype for v in update_jaxpr.invars):
        return params
    scalar = jax.ShapeDtypeStruct((), dtype)
    combiner = ClosedJaxpr(update_jaxpr, consts)
    closed = jax.make_jaxpr(lambda a, b: jex.core.jaxpr_as_fun(combiner)(a, b))(
        scalar, scalar
    )
    jaxpr, new_consts = open_jaxpr(closed)
    return dict(params, update_jaxpr=jaxpr, update_consts=tuple(new_consts))


#
# Source information: named scopes, source lines, the per-equation context.
#

_TRANSFORM_WRAPPER = re.compile(r"^[A-Za-z_]+\((.*)\)$")


def scope_names(eqn: Any) -> tuple[str, ...]:
    """The named scopes an equation was traced under, relative to its jaxpr, with
    transform wrappers such as `jvp(...)` and `transpose(...)` removed."""
    names = []
    for name in str(eqn.source_info.name_stack).split("/"):
        while match := _TRANSFORM_WRAPPER.match(name):
            name = match.group(1)
        if name:
            names.append(name)
    return tuple(names)


def is_transposed(eqn: Any) -> bool:
    """Whether an equation belongs to a backward pass (`jax.grad` traced inside the
    function): JAX marks those name stacks `transpose(...)`."""
    return "transpose(" in str(eqn.source_info.name_stack)


@contextlib.contextmanager
def equation_context(eqn: Any) -> Iterator[None]:
    """Re-binds under the equation's own source line and named scopes (so the new
    program keeps them, for diagnostics and for nested `autocast`), and under its
    per-equation context (compute type, xla metadata), as `jax.core.eval_jaxpr`
    does."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    manager = getattr(getattr(eqn, "ctx", None), "manager", contextlib.nullcontext())
    with source_info_util.user_context(
        eqn.source_info.traceback, name_stack=name_stack
    ):
        with manager:
            yield


UNKNOWN_SOURCE = "<unknown>"


def source_line(eqn: Any) -> str:
    """`file.py:line (function)` of the user frame an equation was traced from. JAX
    records it on every equation but exposes no public reader."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return UNKNOWN_SOURCE
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def varying_axes(value: Any) -> frozenset:
    """The mapped axes over which `value` may differ from device to device, as
    `jax.shard_map` (with `check_vma=True`) types it. The public `jax.typeof` gives
    the type; where the set lives on it changed (`.vma` before jax 0.10)."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def is_traced(value: Any) -> bool:
    """Whether `value` is a tracer (of any transformation), not a concrete array."""
    return isinstance(value, jax.core.Tracer)


def current_trace() -> Any:
    """The trace JAX is building now, the innermost: a value made while tracing a
    body (a scan's, a branch's) is that body's alone, even when it was computed
    from an array the body closes over. No public API names the trace."""
    if _core is None or not hasattr(_core, "trace_ctx"):
        raise unsupported("jax._src.core.trace_ctx is missing")
    return _core.trace_ctx.trace


def is_differentiated(value: Any) -> bool:
    """Whether `value` is being differentiated at its innermost level (`jax.grad`,
    `jax.vjp` and `jax.jvp` trace it). No public API says which transformation a
    tracer belongs to."""
    if _ad is None:
        raise unsupported("jax._src.interpreters.ad is missing")
    return isinstance(value, (_ad.JVPTracer, _ad.LinearizeTracer))


def is_batched(value: Any) -> bool:
    """Whether `value` is being traced by `jax.vmap` at the innermost level, where a
    function bound on it is batched before it is differentiated. No public API says
    which transformation a tracer belongs to."""
    if _batching is None:
        raise unsupported("jax._src.interpreters.batching.BatchTracer is missing")
    return isinstance(value, _batching.BatchTracer)


def abstract_like(value: Any, dtype: Any) -> jax.ShapeDtypeStruct:
    """An abstract value of `value`'s shape, with `dtype` and `value`'s varying
    manual axes: a function traced inside `jax.shard_map` at it gets the implicit
    casts to varying that JAX inserts when it meets varying values."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is None or not manual.varying:
        return jax.ShapeDtypeStruct(value.shape, dtype)
    return jax.ShapeDtypeStruct(
        value.shape, dtype, sharding=aval.sharding, manual_axis_type=manual
    )


#
# Manual axes.
#

# Whether the enclosing `jax.shard_map` checks varying types: no public API says.
_check_vma = _internal("jax._src.config", "_check_vma")


def is_unchecked_manual_axis(axis_name: Any) -> bool:
    """Whether `axis_name` is a manual axis of a `jax.shard_map` traced with
    `check_vma=False`, as `jax.pmap` is (it runs through `shard_map(check_vma=False)`).
    There JAX types no value as varying and transposes a `psum` into another `psum`,
    so gradients are per device. JAX's own `pvary` reads the same state."""
    if _check_vma is None:
        raise unsupported("jax._src.config._check_vma is missing")
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return all(name in manual for name in names) and not bool(_check_vma.value)

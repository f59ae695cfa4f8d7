"""Every private JAX API the interpreter touches, in one place.

Tested on jax 0.10.x (see pyproject.toml). Each shim says what it needs and why no
public API does it; where JAX versions differ, the difference is detected here and
nowhere else.
"""

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend as jex
import numpy as np
from jax._src import source_info_util  # no public API re-enters an eqn's source info


# Source lines of traced ops name the user's code, not eqx_amp's casts and wrappers
# (Equinox registers its own files the same way).
source_info_util.register_exclusion(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)

Literal = jex.core.Literal
Jaxpr = jex.core.Jaxpr
ClosedJaxpr = jex.core.ClosedJaxpr


def open_jaxpr(jaxpr: Any) -> tuple[Any, list]:
    """`(jaxpr, consts)` of a `ClosedJaxpr` or an open `Jaxpr`. JAX 0.11 merges the
    two classes, so this asks for the attribute rather than the type."""
    if hasattr(jaxpr, "consts") and hasattr(jaxpr, "jaxpr"):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def is_jaxpr(value: Any) -> bool:
    return isinstance(value, (Jaxpr, ClosedJaxpr))


def has_sub_jaxprs(params: dict) -> bool:
    for value in params.values():
        if is_jaxpr(value):
            return True
        if isinstance(value, (tuple, list)) and any(is_jaxpr(v) for v in value):
            return True
    return False


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


def bind_params(eqn: Any) -> dict:
    """The keyword arguments `eqn.primitive.bind` takes. For call-like primitives
    this turns jaxpr params into `subfuns`; first-order primitives are unchanged."""
    return dict(eqn.primitive.get_bind_params(eqn.params))


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
    closed = jax.make_jaxpr(
        lambda a, b: jex.core.jaxpr_as_fun(ClosedJaxpr(update_jaxpr, consts))(a, b)
    )(scalar, scalar)
    return dict(params, update_jaxpr=closed.jaxpr, update_consts=tuple(closed.consts))


def scan_params(params: dict) -> dict:
    """The scan params the interpreter needs. JAX 0.10 and 0.11 both changed the
    param set of `scan`; only these are read."""
    return {
        "jaxpr": params["jaxpr"],
        "num_consts": params["num_consts"],
        "num_carry": params["num_carry"],
        "length": params["length"],
        "reverse": params.get("reverse", False),
        "unroll": params.get("unroll", 1),
    }


def shard_map_params(params: dict) -> dict:
    """`jax.shard_map` keyword arguments rebuilt from a `shard_map` equation."""
    axis_names = params.get("newly_manual_axes", params.get("axis_names", frozenset()))
    check = params.get("check_vma", params.get("check_rep", True))
    return {
        "mesh": params["mesh"],
        "in_specs": params["in_specs"],
        "out_specs": params["out_specs"],
        "axis_names": frozenset(axis_names),
        "check_vma": check,
    }


UNKNOWN_SOURCE = "<unknown>"


def source_line(eqn: Any) -> str:
    """`file.py:line (function)` of the user frame an equation was traced from. JAX
    records it on every equation but exposes no public reader."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return UNKNOWN_SOURCE
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def concrete_bind(eqn: Any, invals: list) -> list:
    """Binds an equation's primitive eagerly, as `jax.core.eval_jaxpr` would."""
    out = eqn.primitive.bind(*invals, **bind_params(eqn))
    return list(out) if eqn.primitive.multiple_results else [out]

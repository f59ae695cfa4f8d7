"""The advice `precision_report` gives when less than half of a mixed-precision
model's matmul FLOPs run in low precision: the cause (the largest wide matmul, and
what made its wide operand) and the fix.

`filter_amp` says the same on a model's first traced call (`_first_call.py`),
from the one trace of the call."""

import functools as ft
import types
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax.numpy as jnp

from .._autocast._autocast import AutocastWrapper
from .._bimodel import BiModel
from .._core._cast import is_half_dtype
from .._core._filters import LAYERS_RETURNING_INPUT_DTYPE_SCOPES
from .._core._policy import resolve_policy
from .._core._wrapper import FunctionWrapper
from .._filter_amp._boundary import kept_layer_names
from .._filter_amp._filter_amp import AmpWrapper


if TYPE_CHECKING:
    from ._report import PrecisionReport, WideMatmul


_LOW_COVERAGE = (
    "Only {share:.0%} of the matmul/convolution FLOPs of {name} run in {dtype} "
    "(matmuls on parameters the filter spec keeps are not counted): the rest read a "
    "wider operand. The largest, {worst_share:.0%} of them, is `{primitive}` at "
    "{source}, whose wide operand is {reason}. {fix} `wide_matmuls` lists every "
    "such matmul."
)
_KEEP_LAYERS = (
    "{layers} make{s} {its} result float32 from {its} own float32 state or "
    "parameters: keep {them} in the parameter dtype, where {they} then run{s} by "
    "choice (`filter_spec=eqx_amp.keep(model, {types})`), or use `eqx_amp.autocast`, "
    "which casts every matmul's operands."
)
_CAST_WHERE_MADE = (
    "Cast that array to the compute dtype where it is made or enters "
    "(`jnp.zeros(n, x.dtype)`, `h.astype(x.dtype)`), or use `eqx_amp.autocast`, "
    "which casts every matmul's operands."
)


def coverage_advice(report: "PrecisionReport", fn: Any) -> str:
    """What to change when less than half of the matmul FLOPs of a mixed-precision
    program run in low precision, `""` otherwise. A program with no half-precision
    value is not mixed precision (nothing to say), and under `autocast` the wide
    matmuls are those its rules keep, by choice."""
    if not _is_mixed_precision(report) or any(
        isinstance(node, AutocastWrapper) for node in _wrapped_chain(fn)
    ):
        return ""
    # Matmuls on parameters the filter spec keeps wide were asked for.
    chosen = sum(w.flops for w in report.wide_matmuls if w.origin == "params")
    unasked = [w for w in report.wide_matmuls if w.origin != "params"]
    considered = report.matmul_flops - chosen
    if not unasked or report.low_precision_flops >= 0.5 * considered:
        return ""
    worst = unasked[0]
    return _LOW_COVERAGE.format(
        share=report.low_precision_flops / considered,
        name=model_name(fn),
        dtype=_compute_dtype(fn, report),
        worst_share=worst.flops / considered,
        primitive=worst.primitive,
        source=worst.source,
        reason=worst.reason,
        fix=_coverage_fix(unasked, _kept_layers(fn)),
    )


def _is_mixed_precision(report: "PrecisionReport") -> bool:
    dtypes = {d for by_dtypes in report.ops.values() for ds in by_dtypes for d in ds}
    return any(_is_half_name(d) for d in dtypes)


def _is_half_name(name: str) -> bool:
    try:
        return is_half_dtype(jnp.dtype(name))
    except TypeError:  # not a dtype JAX knows by that name (a key, a token)
        return False


def _compute_dtype(fn: Any, report: "PrecisionReport") -> str:
    """The compute dtype of the `filter_amp` or `BiModel` in `fn` (the policy in
    force now, which the report traced under, where it has none); else the half
    dtype the matmuls read most."""
    for node in _wrapped_chain(fn):
        if isinstance(node, (AmpWrapper, BiModel)):
            return resolve_policy(node.policy).compute_dtype.name
    by_dtype: dict[str, int] = {}
    for dtypes, flops in report.flops_by_dtypes.items():
        for dtype in filter(_is_half_name, dtypes):
            by_dtype[dtype] = by_dtype.get(dtype, 0) + flops
    return max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else "low precision"


def _coverage_fix(unasked: Sequence["WideMatmul"], kept: set[str]) -> str:
    """The fix for the wide matmuls: keeping the Equinox layers whose own state
    made their operands wide (`SpectralNorm`), or casting an array where it is
    made. A kept layer (BatchNorm by default) hands back what it was given: a wide
    result there comes from upstream."""
    layers: list[str] = []
    for wide in unasked:
        # The outermost Equinox layer the operand was made in.
        scopes = [s for s in wide.made_in.split("/") if s.startswith("eqx.nn.")]
        if (
            scopes
            and scopes[0] not in layers
            and scopes[0].removeprefix("eqx.nn.") not in kept
            and scopes[0] not in LAYERS_RETURNING_INPUT_DTYPE_SCOPES
        ):
            layers.append(scopes[0])
    if not layers:
        return _CAST_WHERE_MADE
    many = len(layers) > 1
    return _KEEP_LAYERS.format(
        layers=", ".join(f"`{layer}`" for layer in layers),
        s="" if many else "s",
        its="their" if many else "its",
        them="them" if many else "it",
        they="they" if many else "it",
        types=", ".join(layers),
    )


def _wrapped_chain(fn: Any) -> Iterator[Any]:
    """`fn`, what it wraps, what that wraps, and so on: through eqx_amp's and
    Equinox's wrappers, `functools.partial`, and the functions `jax.vmap` and
    `jax.jit` return (`__wrapped__`)."""
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        yield fn
        if isinstance(fn, FunctionWrapper):
            fn = fn.fn
        elif isinstance(fn, BiModel):
            fn = fn.master
        elif isinstance(fn, ft.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            fn = _called_wrapper(fn)


def _called_wrapper(fn: Any) -> Any:
    """The one eqx_amp wrapper (`filter_amp`, `autocast`, `BiModel`) that a lambda
    calls, through its closure, defaults or globals (`jax.jit(lambda x:
    amp_model(x))`); `None` for none or several, or for a named function."""
    if not isinstance(fn, types.FunctionType) or fn.__name__ != "<lambda>":
        return None
    cells = [cell.cell_contents for cell in fn.__closure__ or ()]
    named = [fn.__globals__.get(name) for name in fn.__code__.co_names]
    found = {
        id(value): value
        for value in [*cells, *(fn.__defaults__ or ()), *named]
        if isinstance(value, (FunctionWrapper, BiModel))
    }
    return next(iter(found.values())) if len(found) == 1 else None


def _kept_layers(fn: Any) -> set[str]:
    """The classes of the layers the `filter_amp` or `BiModel` in `fn` runs in the
    parameter dtype at their own call boundary."""
    for node in _wrapped_chain(fn):
        if isinstance(node, AmpWrapper) and isinstance(node.fn, eqx.Module):
            return kept_layer_names(node.fn, node.filter_spec)
        if isinstance(node, BiModel):
            return kept_layer_names(node.master, node.filter_spec)
    return set()


def model_name(fn: Any) -> str:
    """What the user would call the function: a module's class (`eqx.nn.Sequential`
    with its layers, what an Equinox transform wraps), a function's name; through
    `filter_amp`, `autocast`, `BiModel`, `jax.vmap`, `jax.jit` and a lambda calling
    one wrapper:

    ```python
    model_name(jax.jit(lambda x: filter_amp(model)(x)))  # "MLP", not "<lambda>"
    ```
    """
    if isinstance(fn, FunctionWrapper):  # `filter_amp`, `autocast`
        return model_name(fn.fn)
    if isinstance(fn, BiModel):
        return model_name(fn.master)
    if isinstance(fn, eqx.nn.Sequential):
        return f"Sequential({', '.join(model_name(layer) for layer in fn.layers)})"
    if isinstance(fn, eqx.Module) and type(fn).__module__.startswith("equinox."):
        wrapped = getattr(type(fn), "__wrapped__", None)
        if wrapped is not None:  # `eqx.filter_vmap(model)` and the like
            transform = _EQUINOX_TRANSFORMS.get(type(fn).__name__, type(fn).__name__)
            return f"{model_name(getattr(fn, '__wrapped__'))} under {transform}"
    if isinstance(fn, ft.partial):
        return model_name(fn.func)
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None and not isinstance(fn, eqx.Module):  # `jax.vmap(f)`
        return model_name(wrapped)
    called = _called_wrapper(fn)
    if called is not None:  # `jax.jit(lambda x: amp_model(x))`
        return model_name(called)
    if isinstance(fn, (types.FunctionType, types.MethodType)):
        return fn.__qualname__
    return type(fn).__name__


_EQUINOX_TRANSFORMS = {
    "_VmapWrapper": "`eqx.filter_vmap`",
    "_PmapWrapper": "`eqx.filter_pmap`",
    "_JitWrapper": "`eqx.filter_jit`",
    "_GradWrapper": "`eqx.filter_grad`",
    "_ValueAndGradWrapper": "`eqx.filter_value_and_grad`",
    "_CheckpointWrapper": "`eqx.filter_checkpoint`",
}

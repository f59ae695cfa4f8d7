"""Per-layer precision telemetry, collected inside the training step: `telemetry`
wraps a step so that it also returns, as traced values, what mixed precision did
to each layer's weights, activations, output gradients and parameter gradients."""

import collections
import inspect
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, ParamSpec, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float

from .._bimodel import BiModel
from .._core._wrapper import FunctionWrapper, check_callable
from .._fp8._delayed import DelayedScaling
from .._jaxpr._evaluate import evaluate_making
from .._jaxpr._hook import Origin, cast_to
from ._measure import Measure
from ._naming import Naming, Path, index_position, keyed_paths
from ._statistics import Measured, combine


_P = ParamSpec("_P")
_T = TypeVar("_T")
Fraction = Float[Array, "*iterations"]


class TensorStats(eqx.Module):
    """What mixed precision did to one tensor role of one layer in one step.

    `layer` is the layer's path in the step's arguments (`model.blocks[3].attn.qkv`);
    a layer inside `lax.scan`-stacked blocks has one entry per iteration along
    each array's last axes, and `{0}` (`{1}`, ...) in `layer` where that
    iteration's index goes (`m.enc[{0}]` and `m.dec[{0}]` for a scan over
    `(m.enc, m.dec)`). `role` is `"weight"`, `"activation"` (into a product),
    `"output gradient"` (the gradient arriving at a product in the backward pass) or
    `"parameter gradient"`; `dtype` the half or fp8 dtype the tensor was cast to or
    is held in. `at_cast` says whether it was measured at a cast into that dtype
    (so that `underflow` and `overflow` are known) or only as it arrived.

    `amax` is the largest magnitude before the cast (before scaling, for fp8).
    `amax` is exact: one max pass over the tensor, float32 subnormals included,
    and NaN when the tensor holds a NaN. `overflow` is the fraction of the tensor's
    `size` values that the cast saturated or overflowed (finite values beyond the
    dtype's largest finite value: an inf or NaN is not an overflow), `nonfinite`
    the fraction that are inf or NaN after it. Whether the tensor holds such values
    is exact: `overflow` and `nonfinite` are then at least one value's share.
    The fractions (`overflow`, `nonfinite`, `underflow`: flushed to zero by the
    cast, `subnormal`: held as subnormals, with less precision) are exact too on
    GPUs and TPUs, counted in every value of the tensor (`sample` equals `size`) in
    the same pass that takes `amax`. On a CPU, where that pass costs arithmetic
    rather than memory traffic, they are counted in a sample of `sample` values
    taken at a fixed stride, at most 4096 values per tensor (the whole tensor when
    it is smaller): a fraction `p` estimated from `n` values is off by about
    `sqrt(p (1 - p) / n)`, under 0.8 percentage points for one tensor. `scale` is
    the fp8 scale used (the smallest, for rowwise and block scales), or None outside
    fp8, and `scaling` how the fp8 cast was scaled: `"tensorwise"`, `"rowwise"`,
    `"mxfp8"` (one power-of-two scale per block of 32 values, where `underflow` and
    `overflow` count the values each block's own scale flushes or saturates; an
    outlier flushes the small values of its block only), or `"nvfp4"` (NVFP4's
    forward casts to `float4_e2m1fn`, per block of 16). Under `shard_map` a tensor that
    differs from device to device (a batch shard) is counted on each device, one
    that is the same on every device (a replicated weight) once; with
    `check_vma=False` (and under `pmap`) JAX does not say which, and every device's
    tensor is counted. Tensors inside `lax.while_loop` and `lax.cond` are not
    measured (a warning says when products run there).

    The steps or examples of a `Telemetry` (its `leading_shape`) come first in
    each array, then the scan iterations:

    ```python
    _, stats = telemetry(step)(model, x)
    stats.tensors[0].amax  # float32[] for one step, float32[n] in n scanned blocks
    ```
    """

    layer: str = eqx.field(static=True)
    role: str = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    at_cast: bool = eqx.field(static=True)
    size: Fraction
    sample: Fraction
    amax: Fraction
    underflow: Fraction
    subnormal: Fraction
    overflow: Fraction
    nonfinite: Fraction
    scale: Fraction | None
    scaling: str | None = eqx.field(static=True, default=None)


_FIELDS = (
    "size", "sample", "amax", "underflow", "subnormal", "overflow", "nonfinite",
    "scale",
)  # fmt: skip


class TensorRow(NamedTuple):
    """One layer, role and scan iteration of a `Telemetry`, as Python numbers."""

    layer: str
    role: str
    dtype: str
    amax: float
    underflow: float | None  # None: not measured at a cast
    subnormal: float
    overflow: float | None
    nonfinite: float
    scale: float | None
    scaling: str | None = None  # "tensorwise", "rowwise", "mxfp8" or "nvfp4"

    def severity(self) -> tuple[float, ...]:
        """Worst first: non-finite values, then overflow, then underflow."""
        return (
            self.nonfinite,
            self.overflow or 0.0,
            self.underflow or 0.0,
            self.subnormal,
        )


_HEADER = (
    "layer", "role", "dtype", "amax", "underflow", "subnormal", "overflow",
    "nonfinite", "scale",
)  # fmt: skip
_INDEX_LEADING = (
    "`Telemetry[...]` takes an int or a slice per leading axis (the steps of a "
    "`lax.scan` or the examples of a `jax.vmap`)."
)
_TOP_IS_POSITIVE = "`top` must be a positive int, the number of rows to print"
_NEEDS_CONCRETE = (
    "`Telemetry.rows()` and `summary()` read concrete values: call them on the "
    "`Telemetry` the jitted step returned, outside `jax.jit`."
)


class Telemetry(eqx.Module):
    """What `eqx_amp.diagnostics.telemetry(step)` returns next to the step's outputs:
    a pytree of a few arrays (log it, or `print(telemetry.summary())`), read as one
    `TensorStats` per layer, role and dtype (`tensors`).

    The statistics are packed into one array per shape of entry (scalars, one entry
    per iteration of a scan, ...), so that a step returns a few arrays, not eight
    per tensor (each output of a compiled program has a cost of its own).

    A `Telemetry` of several steps or examples, stacked by a `lax.scan` over steps
    or made by `jax.vmap(telemetry(step))`, has their axes in front
    (`leading_shape`): each `TensorStats` array has them first, and `telemetry[i]`
    is step or example `i`, whose `rows()` and `summary()` read one step.

    ```python
    def run(model, xs):
        def one(model, x):
            (model, loss), stats = telemetry(train_step)(model, x)
            return model, stats

        return jax.lax.scan(one, model, xs)

    model, stats = eqx.filter_jit(run)(model, xs)
    stats.leading_shape  # (len(xs),)
    print(stats[-1].summary())  # the last step
    ```
    """

    packed: tuple[Float[Array, "..."], ...]  # (*leading, tensors, fields, *iterations)
    entries: tuple[tuple[str, str, str, bool, str | None, bool, int, int], ...] = (
        eqx.field(static=True)
    )  # (layer, role, dtype, at_cast, scaling, has scale, which packed array, row)
    iterations: tuple[int, ...] = eqx.field(static=True)  # per packed array

    @property
    def leading_shape(self) -> tuple[int, ...]:
        """The shape of the steps or examples in front of every statistic: `()` for
        one step, `(n,)` for `n` steps stacked by a `lax.scan` or examples of a
        `jax.vmap`."""
        if not self.packed:
            return ()
        first, iterations = self.packed[0], self.iterations[0]
        return tuple(first.shape[: first.ndim - 2 - iterations])

    def __getitem__(self, index: Any) -> "Telemetry":
        """Step or example `index` (ints and slices, one per leading axis) of a
        `Telemetry` with leading axes: `telemetry[3]`, `telemetry[-1]`."""
        leading = self.leading_shape
        indices = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(i, (int, slice)) for i in indices) or len(indices) > len(
            leading
        ):
            raise IndexError(
                f"{_INDEX_LEADING} This one has leading axes of shape {leading}, "
                f"not indexable by {index!r}."
            )
        packed = tuple(p[index] for p in self.packed)
        return Telemetry(packed, self.entries, self.iterations)

    @property
    def tensors(self) -> tuple[TensorStats, ...]:
        """One `TensorStats` per layer, role and dtype (their arrays are numpy
        arrays once the step has run, with the `leading_shape` in front)."""
        try:
            packed = [np.asarray(p) for p in self.packed]
        except jax.errors.TracerArrayConversionError:
            packed = list(self.packed)
        leading = (slice(None),) * len(self.leading_shape)
        stats = []
        for layer, role, dtype, at_cast, scaling, has_scale, which, row in self.entries:
            values: Any = {
                k: packed[which][(*leading, row, i)] for i, k in enumerate(_FIELDS)
            }
            if not has_scale:
                values["scale"] = None
            stats.append(
                TensorStats(layer, role, dtype, at_cast, **values, scaling=scaling)
            )
        return tuple(stats)

    def rows(self) -> list[TensorRow]:
        """One row per layer, role, dtype and scan iteration, worst first."""
        leading = self.leading_shape
        if leading:
            raise ValueError(
                f"`Telemetry.rows()` and `summary()` read one step, and this "
                f"`Telemetry` has leading axes of shape {leading} (from `jax.vmap` "
                "or a `lax.scan` over steps): index it first, `telemetry[i]` for "
                "step or example `i` (or `jax.tree.map(lambda x: x[i], telemetry)`)."
            )
        rows = [row for stats in self.tensors for row in _rows(stats)]
        return sorted(rows, key=TensorRow.severity, reverse=True)

    def summary(self, top: int = 10) -> str:
        """A table of the `top` worst rows (non-finite values, overflow, underflow,
        subnormals, in that order)."""
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"{_TOP_IS_POSITIVE}, not {top!r}.")
        rows = self.rows()
        table: list[tuple[str, ...]] = [_HEADER]
        for r in rows[:top]:
            table.append(
                (
                    r.layer,
                    r.role,
                    r.dtype if r.scaling is None else f"{r.dtype} ({r.scaling})",
                    f"{r.amax:.3g}",
                    _percent(r.underflow),
                    _percent(r.subnormal),
                    _percent(r.overflow),
                    _percent(r.nonfinite),
                    "-" if r.scale is None else f"{r.scale:.3g}",
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
        more = len(rows) - top
        if more > 0:
            lines.append(f"... and {more} more rows (`Telemetry.rows()` has them all)")
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.summary()


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.3g}%"


def _rows(stats: TensorStats) -> list[TensorRow]:
    try:
        values = {
            k: np.asarray(getattr(stats, k))
            for k in ("amax", "underflow", "subnormal", "overflow", "nonfinite")
        }
        scale = None if stats.scale is None else np.asarray(stats.scale)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(_NEEDS_CONCRETE) from None
    rows = []
    for index in np.ndindex(values["amax"].shape):
        at = {k: float(v[index]) for k, v in values.items()}
        rows.append(
            TensorRow(
                stats.layer.format(*index),
                stats.role,
                stats.dtype,
                at["amax"],
                at["underflow"] if stats.at_cast else None,
                at["subnormal"],
                at["overflow"] if stats.at_cast else None,
                at["nonfinite"],
                None if scale is None else float(scale[index]),
                stats.scaling,
            )
        )
    return rows


def _layer_name(path: Path, stack: tuple[frozenset[Path], ...], leaves: set) -> str:
    """The path as a format string, with a `[{k}]` where the index of the k-th scan
    around the layer goes."""
    parts = [p.replace("{", "{{").replace("}", "}}") for p in path]
    at = [index_position(path, scanned, leaves) for scanned in stack]
    # Innermost first, so that each position still refers to the original path.
    for axis, n in reversed(list(enumerate(at))):
        parts.insert(n, f"[{{{axis}}}]")
    return "".join(parts)


def _finish(made: list[Measured], leaves: set[Path]) -> Telemetry:
    """The named measurements, one `TensorStats` per layer, role and dtype;
    `leaves` are the paths of the parameters."""
    groups: dict[tuple, list[Measured]] = collections.defaultdict(list)
    for m in made:
        site = m.site
        if site.layer is None:
            continue  # never read by a product: not a layer's tensor
        name = _layer_name(site.layer, m.stack, leaves)
        key = (name, site.role, site.dtype, site.at_cast, site.scaling, m.amax.shape)
        groups[key].append(m)
    # Every entry's raw values go into one array per shape (one concatenation),
    # and the fractions are computed on those arrays: per-entry arithmetic would be
    # a handful of tiny kernels per entry on a GPU.
    raw_names = (
        "size", "sampled", "amax", "flushed", "subnormal", "saturated", "nonfinite",
        "any_saturated", "any_nonfinite",
    )  # fmt: skip
    raws: dict[tuple, list[Array]] = {}
    entries = []
    for (name, role, dtype, at_cast, scaling, shape), group in groups.items():
        m = combine(group)
        scale = jnp.full(shape, np.nan, jnp.float32) if m.scale is None else m.scale
        rows = raws.setdefault(shape, [])
        which = list(raws).index(shape)
        has_scale = m.scale is not None
        row = len(rows) // (len(raw_names) + 1)
        entries.append((name, role, dtype, at_cast, scaling, has_scale, which, row))
        values = [getattr(m, k) for k in raw_names] + [scale]
        rows.extend(jnp.broadcast_to(v, shape).astype(jnp.float32) for v in values)
    packed = []
    for shape, rows in raws.items():
        r = jnp.stack(rows).reshape(-1, len(raw_names) + 1, *shape)
        size, sampled = jnp.maximum(r[:, 0], 1.0), jnp.maximum(r[:, 1], 1.0)
        # A CPU's sample can miss the one inf among a million: the exact flags set
        # a floor under the counts.
        overflow = jnp.maximum(r[:, 5] / sampled, r[:, 7] / size)
        nonfinite = jnp.maximum(r[:, 6] / sampled, r[:, 8] / size)
        fields = (r[:, 0], r[:, 1], r[:, 2], r[:, 3] / sampled, r[:, 4] / sampled)
        fields += (overflow, nonfinite, r[:, 9])
        packed.append(jnp.stack(fields, axis=1))
    return Telemetry(tuple(packed), tuple(entries), tuple(len(shape) for shape in raws))


class _MeasuredStep(eqx.Module, Generic[_P, _T]):
    fn: Callable[_P, _T]

    @property
    def __wrapped__(self) -> Callable[_P, _T]:
        return self.fn

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> tuple[_T, Telemetry]:
        if not args:
            raise ValueError(_NEEDS_PARAMETERS)
        return _measure(self.fn, args, kwargs)


_NEEDS_PARAMETERS = (
    "`telemetry(step)` reads the parameters from `step`'s first positional "
    "argument (the model, as `eqx_amp.filter_value_and_grad` differentiates it); "
    "call it with the model first."
)


def _argument_names(fn: Callable, count: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return [
        positional[i] if i < len(positional) else f"args[{i}]" for i in range(count)
    ]


def _views(model: Any) -> list[Any]:
    """The models a wrapper holds, whose paths name its leaves: a `filter_amp` or
    `autocast` wrapper's function, a `BiModel`'s compute and master copies."""
    if isinstance(model, BiModel):
        return [model.compute, model.master]
    if isinstance(model, FunctionWrapper):
        return [model.fn, *_views(model.fn)]
    return []


def _of_a_scaling(dynamic: Any) -> list[bool]:
    """For each array leaf of `dynamic`: whether it belongs to a `DelayedScaling`."""
    is_scaling = lambda x: isinstance(x, DelayedScaling)  # noqa: E731
    marked = jtu.tree_map(
        lambda node: jtu.tree_map(lambda _: True, node) if is_scaling(node) else False,
        dynamic,
        is_leaf=is_scaling,
    )
    return jtu.tree_leaves(marked)


def _measure(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, Telemetry]:
    names = _argument_names(fn, len(args))
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    paths = [
        path
        for i, arg in enumerate(dynamic[0])
        for path in keyed_paths(arg, names[i], _views(args[i]))
    ] + [path for k, v in dynamic[1].items() for path in keyed_paths(v, k)]
    in_model = len(jtu.tree_leaves(dynamic[0][0]))
    # A `DelayedScaling`'s arrays are constants of the step: a weight times one of
    # its scales is still the weight.
    origins = [Origin.PARAMS] * in_model + [
        Origin.CONSTANT if scaling else Origin.DATA
        for scaling in _of_a_scaling(dynamic)[in_model:]
    ]
    static_out = []

    def flat_fn(*leaves):
        call_args, call_kwargs = eqx.combine(
            jtu.tree_unflatten(treedef, leaves), static
        )
        out = fn(*call_args, **call_kwargs)
        dynamic_out, static_part = eqx.partition(out, eqx.is_array)
        static_out.append(static_part)
        return dynamic_out

    closed, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
    naming = Naming()
    naming.paths.update(zip(closed.jaxpr.invars, paths))
    outs, _, made = evaluate_making(closed, leaves, Measure(naming), origins=origins)
    flat_shapes, out_treedef = jtu.tree_flatten(out_shapes)
    outs = [jnp.asarray(v) for v in cast_to(outs, [s.dtype for s in flat_shapes])]
    out = eqx.combine(jtu.tree_unflatten(out_treedef, outs), static_out[0])
    return out, _finish(made, set(paths[:in_model]))


def telemetry(step: Callable[_P, _T]) -> Callable[_P, tuple[_T, Telemetry]]:
    """Per-layer precision telemetry, collected inside the training step.

    Wraps `step` (a whole training step: forward, backward through
    `eqx_amp.filter_value_and_grad` or `jax.grad`, the update) so that it returns
    `(step's outputs, telemetry)`, where `telemetry` is a `Telemetry` pytree: for each
    layer (named by its path in the step's arguments, `model.blocks[3].attn.qkv`) and
    tensor role (weight, activation into a product, output gradient, parameter
    gradient), the largest magnitude, the fractions of values that underflow to
    zero, that are subnormal, that overflow or saturate in the half or fp8 dtype
    they are cast to or held in, and for fp8 products the scale used. The numbers
    are traced values computed inside the step (no host callbacks): return them from
    the jitted step and log them.

    `step`'s first positional argument holds the parameters (a model, a `BiModel`,
    a `filter_amp` wrapper). It works with `filter_amp`, `autocast`, `BiModel` and
    fp8, under `jax.jit`, inside `lax.scan`-stacked blocks (one entry per
    iteration), under `jax.vmap` and in a `lax.scan` over steps (one entry per
    example or step: `Telemetry.leading_shape`), and under `shard_map` and sharded
    `jit` (global values). What runs inside `lax.while_loop` and `lax.cond` (`redo_on_nan > 0` retries, for one) is
    not measured, nor, under `jax.checkpoint`, an MXFP8 layer's backward
    quantisations of the recomputed inputs (the debugging guide says more).
    Collect every N steps by calling the wrapped step then and `step`
    itself otherwise: `step` is not changed, so its compiled program is today's.

    **Arguments:**

    - `step`: the training step, called as `step(model, *args, **kwargs)`.

    **Returns:**

    A callable with `step`'s arguments, returning `(step's outputs, Telemetry)`.

    ```python
    measured_step = eqx.filter_jit(eqx_amp.diagnostics.telemetry(train_step))
    (model, opt_state, loss_scale, loss), stats = measured_step(
        model, opt_state, loss_scale, x, y
    )
    print(stats.summary())
    ```
    """
    check_callable(step, "telemetry")
    return cast(Any, eqx.module_update_wrapper(_MeasuredStep(step)))

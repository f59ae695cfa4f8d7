"""`find_nonfinite`: which op made the first inf or NaN from finite inputs."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._core._cast import is_floating_dtype, is_half_dtype
from .._jaxpr._evaluate import evaluate
from .._jaxpr._hook import Frame, Hook, Origin, is_higher_order
from ._report import trace


_DOMAIN_OPS = frozenset(
    {"log", "log1p", "rsqrt", "sqrt", "div", "rem", "pow", "acos", "asin", "atanh",
     "acosh", "lgamma", "digamma", "erf_inv", "tan"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class NonfiniteOp:
    """The op that made an inf/nan reaching the output from finite inputs.

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


def _nonfinite(value: Any) -> bool:
    if isinstance(value, (float, complex, np.inexact)):  # a literal: `-jnp.inf`
        return not np.isfinite(value)
    # Reduced where the array lives: only the answer comes to the host, and an array
    # spread over several processes' devices cannot come whole to any of them.
    return (
        eqx.is_array(value)
        and jnp.issubdtype(value.dtype, jnp.inexact)
        and not bool(jnp.isfinite(value).all())
    )


def _all_finite(values: list) -> bool:
    return not any(map(_nonfinite, values))


def _hint(name: str, in_dtypes: tuple[str, ...], out_dtype: np.dtype) -> str:
    largest = f"{float(jnp.finfo(out_dtype).max):.6g}"
    # bfloat16 has float32's range: suggest it only where the trouble is float16's.
    use_bfloat16 = (
        ", or use bfloat16, which has float32's range"
        if out_dtype == jnp.float16
        else ""
    )
    if name == "convert_element_type" and is_half_dtype(out_dtype):
        source = in_dtypes[0] if in_dtypes else "a wider dtype"
        return (
            f"a {source} value too large for {out_dtype.name} (max {largest}) was "
            "cast down to it, at a call boundary, an autocast rule or an explicit "
            "astype: keep it in float32 from where it is made (compute with its "
            f"logarithm, return it in float32){use_bfloat16}."
        )
    if is_half_dtype(out_dtype):
        return (
            f"{name} overflowed {out_dtype.name} (max {largest}): keep it in float32 "
            "with an `autocast` rule or `eqx_amp.full_precision`, or scale its inputs "
            f"down{use_bfloat16}."
        )
    if name in _DOMAIN_OPS:
        return (
            f"{name} got an input outside its domain (a log or division of zero, a "
            "square root of a negative, ...): guard it, e.g. with an epsilon or "
            "`jnp.where`."
        )
    return (
        f"{name} overflowed {out_dtype.name} (max {largest}): its inputs are too "
        "large; check the scale of the values reaching it."
    )


_CONSTANT_HINT = (
    "a constant of the program already holds inf or nan (a literal such as "
    "`jnp.inf` or `-jnp.inf`, a mask fill value, or an array the function closes "
    "over), and this op reads it: where it is meant (a mask), some row has nothing "
    "left unmasked; otherwise fix the constant."
)


def _describe_op(eqn: Any, frame: Frame, invals: list, bad: Any) -> NonfiniteOp:
    floats = [v for v in invals if eqx.is_array(v) and is_floating_dtype(v.dtype)]
    ranges = tuple(
        (float(jnp.min(v.astype(jnp.float32))), float(jnp.max(v.astype(jnp.float32))))
        if v.size
        else (0.0, 0.0)
        for v in floats
    )
    out_dtype = jnp.dtype(bad.dtype)
    in_dtypes = tuple(v.dtype.name for v in floats)
    return NonfiniteOp(
        primitive=eqn.primitive.name,
        scope="/".join(frame.scopes),
        source=frame.source(eqn),
        input_dtypes=in_dtypes,
        input_ranges=ranges,
        output_dtype=out_dtype.name,
        # `finfo` of a complex dtype describes its real and imaginary parts.
        dtype_max=float(jnp.finfo(out_dtype).max),
        hint=_hint(eqn.primitive.name, in_dtypes, out_dtype),
    )


class _NonfiniteSources(Hook):
    """Runs the program eagerly and traces each inf or nan back to the op that made
    it from finite inputs. A non-finite value the program never lets out (a NaN
    constant `jnp.var` selects away) is not a source of anything."""

    eager = True

    def __init__(self):
        # id(value) -> (value, the op that made its inf/nan). The value is kept
        # alive with its entry, so its id cannot be reused.
        self._source_of: dict[int, tuple[Any, NonfiniteOp]] = {}
        self._found: list[NonfiniteOp] = []  # every source, in the order made

    def equation(self, eqn, invals, origins, frame, evaluate):
        found_before = len(self._found)
        outvals = evaluate(invals)
        bad_out = [v for v in outvals if _nonfinite(v)]
        if not bad_out:
            return outvals
        inherited = [
            self._source_of[id(v)][1]
            for v in invals
            if _nonfinite(v) and id(v) in self._source_of
        ]
        if inherited:
            source = min(inherited, key=self._found.index)
        elif is_higher_order(eqn) and len(self._found) > found_before:
            # Made inside the call: the first op in it that made one.
            source = self._found[found_before]
        elif _all_finite(invals):
            source = _describe_op(eqn, frame, invals, bad_out[0])
            self._found.append(source)
        elif all(
            o == Origin.CONSTANT for v, o in zip(invals, origins) if _nonfinite(v)
        ):
            # Arguments were checked before the run: a constant (a literal such as
            # `jnp.inf`, an array the function closes over) held it.
            made = _describe_op(eqn, frame, invals, bad_out[0])
            source = dataclasses.replace(made, hint=_CONSTANT_HINT)
            self._found.append(source)
        else:
            return outvals  # made from an argument that already held inf or nan
        for value in bad_out:
            self._source_of.setdefault(id(value), (value, source))
        return outvals

    def first_reaching(self, outputs: list) -> NonfiniteOp | None:
        sources = [
            self._source_of[id(v)][1]
            for v in outputs
            if _nonfinite(v) and id(v) in self._source_of
        ]
        return min(sources, key=self._found.index) if sources else None


def find_nonfinite(fn: Callable, *args: Any, **kwargs: Any) -> NonfiniteOp | None:
    """Runs `fn(*args, **kwargs)` op by op, through every sub-jaxpr (jit, scan
    iterations, while iterations, the cond branch taken, custom_jvp/custom_vjp
    functions), and names the op that made the inf or nan that reaches the output:
    the first op whose output is inf or nan while its inputs are finite, among those
    whose non-finite values flow on to what `fn` returns. An inf or nan the program
    makes and then discards (`jnp.var` selects a NaN constant away) is not reported.

    Call it outside `jit` with concrete arrays: it is a debugging tool, and runs
    eagerly. It works on gradients too: `find_nonfinite(jax.grad(loss), params, x)`.

    **Arguments:**

    - `fn`: the function to run; `args` and `kwargs` as it is called.

    **Returns:**

    `None` if every output is finite, otherwise a `NonfiniteOp` with the primitive,
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
    leaves = jtu.tree_leaves_with_path((fn, args, kwargs))
    for path, leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            raise ValueError(
                "`find_nonfinite` runs eagerly, op by op, and needs concrete arrays: "
                "call it outside `jax.jit`, `jax.grad` and other transformations."
            )
        if (
            eqx.is_array(leaf)
            and is_floating_dtype(leaf.dtype)
            and not _all_finite([leaf])
        ):
            where = (
                f"The function's array at {jtu.keystr(path[1:])}"
                if path[0].idx == 0
                else f"The argument at [{path[0].idx - 1}]{jtu.keystr(path[1:])}"
            )
            raise ValueError(
                f"{where} already holds inf or nan: the problem is upstream of this "
                "function."
            )
    closed = trace(fn, args, kwargs)
    flat = [leaf for _, leaf in leaves if eqx.is_array(leaf)]
    sources = _NonfiniteSources()
    outputs, _ = evaluate(closed, flat, sources)
    return sources.first_reaching(outputs)

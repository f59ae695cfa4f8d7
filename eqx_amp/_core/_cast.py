"""Casting pytrees: only real floating arrays are ever touched."""

import functools as ft
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._filters import STATE_TYPES, FilterSpec, selection_mask


def is_floating_dtype(dtype: Any) -> bool:
    """True for real floating dtypes (float8 to float64)."""
    return jnp.issubdtype(dtype, jnp.floating)


def is_half_dtype(dtype: Any) -> bool:
    """True for real floating dtypes narrower than float32: what mixed precision
    computes in (bfloat16, float16, the float8 types)."""
    return is_floating_dtype(dtype) and jnp.dtype(dtype).itemsize < 4


def is_inexact_array(leaf: Any) -> bool:
    """True for arrays of a floating or complex dtype: what `eqx.filter_grad`
    differentiates, and so what a loss scale scales."""
    return eqx.is_inexact_array(leaf) or (
        isinstance(leaf, (np.ndarray, np.generic))
        and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )


def is_floating_array(leaf: Any) -> bool:
    """True for JAX and NumPy arrays (and NumPy scalars) of a real floating dtype.

    Integer, boolean, complex and PRNG-key arrays, Python scalars and every other
    object are False: mixed precision never changes them. (Tracers are `jax.Array`s.)
    """
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return False
    return is_floating_dtype(leaf.dtype)


def cast_leaf(leaf: Any, dtype: np.dtype) -> Any:
    """Casts one leaf if it is a floating array not already of `dtype`.

    Arrays already in `dtype` are returned as they are, so no convert op is traced.
    """
    if is_floating_array(leaf) and leaf.dtype != dtype:
        return leaf.astype(dtype)
    return leaf


# One vocabulary of dtype words, for policies and for `cast_tree` alike (jmp's).
HALF_WORDS = ("half", "16")
FULL_WORDS = ("full", "single", "32")
DTYPE_ALIASES = {
    "f16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f32": "float32",
    "float32": "float32",
    "f64": "float64",
    "float64": "float64",
    "double": "float64",
}
ACCEPTED_DTYPE_WORDS = ", ".join(
    repr(w) for w in (*HALF_WORDS, *FULL_WORDS, *DTYPE_ALIASES)
)


@ft.cache  # the devices do not change, and policies are resolved at every trace
def half_dtype() -> np.dtype:
    """The half-precision dtype this platform computes fastest in.

    bfloat16 on TPUs, CPUs and NVIDIA GPUs with native bfloat16 support (compute
    capability 8.0 and up); float16 on older GPUs.
    """
    device = jax.devices()[0]
    if device.platform in ("gpu", "cuda", "rocm"):
        capability = getattr(device, "compute_capability", None)
        if capability is not None:
            major = int(str(capability).split(".")[0])
            if major < 8:
                return jnp.dtype(jnp.float16)
    return jnp.dtype(jnp.bfloat16)


def _jax_floating_dtypes() -> frozenset[np.dtype]:
    """The real floating dtypes JAX holds that can carry signed values (not
    `float8_e8m0fnu`, an unsigned exponent-only scale format; not NumPy's
    `float128`, which JAX does not hold)."""
    found = set()
    for name in dir(jnp):
        if not (name.startswith("float") or name == "bfloat16"):
            continue
        try:
            dtype = jnp.dtype(getattr(jnp, name))
        except TypeError:
            continue
        if is_floating_dtype(dtype) and float(jnp.finfo(dtype).min) < 0:
            found.add(dtype)
    return frozenset(found)


_SIGNED_FLOATING = _jax_floating_dtypes()


def floating_dtype(dtype: Any, argname: str = "dtype") -> np.dtype:
    """`dtype` as an `np.dtype`, from any spelling: a JAX or NumPy dtype or type, or
    a word (`"bf16"`, `"float16"`, `"half"` for the platform's half dtype, `"full"`
    for float32, or any floating dtype name JAX holds). A `ValueError` naming
    `argname` and the accepted words if it is not a signed real floating dtype that
    JAX holds."""
    original = dtype
    if dtype is None:
        # `np.dtype(None)` is float64: never a silent default.
        raise ValueError(
            f"`{argname}` must be a floating dtype such as jnp.bfloat16 or one of "
            f"{ACCEPTED_DTYPE_WORDS}, but got None."
        )
    if isinstance(dtype, str):
        word = dtype.strip().lower()
        if word in HALF_WORDS:
            return half_dtype()
        if word in FULL_WORDS:
            return jnp.dtype(jnp.float32)
        dtype = DTYPE_ALIASES.get(word, word)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(
            f"`{argname}` must be a floating dtype such as jnp.bfloat16, or one of "
            f"{ACCEPTED_DTYPE_WORDS}, but got {original!r}."
        ) from None
    if not is_floating_dtype(dtype):
        raise ValueError(
            f"`{argname}` must be a real floating dtype (float16, bfloat16, float32, "
            f"float64, or a float8 type), but got {dtype.name}. Mixed precision only "
            "changes floating arrays; integer, boolean and complex arrays are never "
            "cast."
        )
    if dtype not in _SIGNED_FLOATING:
        accepted = ", ".join(sorted(d.name for d in _SIGNED_FLOATING))
        try:
            unsigned = float(jnp.finfo(dtype).min) >= 0
        except ValueError:
            unsigned = False
        reason = (
            "it has no sign (an exponent-only scale format), so values and gradients "
            "cannot be held in it"
            if unsigned
            else "JAX does not hold it"
        )
        raise ValueError(
            f"`{argname}` is {dtype.name}: {reason}. Accepted floating dtypes: "
            f"{accepted}."
        )
    return dtype


def cast_tree(tree: PyTree, dtype: Any, filter_spec: FilterSpec = True) -> PyTree:
    """Casts the floating arrays of `tree` that `filter_spec` selects to `dtype`.

    Integer, boolean, complex and PRNG-key arrays, Python scalars and non-array
    leaves are never touched, so a whole model (or a batch holding labels and keys)
    can be passed as it is.

    **Arguments:**

    - `tree`: any pytree.
    - `dtype`: a real floating dtype, in any spelling a policy accepts
        (`jnp.bfloat16`, `"bf16"`, `"float16"`, `"half"` for the platform's half
        dtype, ...).
    - `filter_spec`: what `eqx.partition` accepts: a bool, a callable `leaf -> bool`,
        or a pytree prefix of `tree` with those as leaves. `True` casts, `False`
        keeps the leaf's dtype.

    **Returns:**

    A pytree of the same structure.

    **Example:**

    ```python
    model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    half = eqx_amp.cast_tree(model, jnp.bfloat16)
    norms_kept = eqx_amp.cast_tree(model, jnp.bfloat16, eqx_amp.default_filter_spec(model))
    ```
    """
    dtype = floating_dtype(dtype)
    if filter_spec is True:
        return jtu.tree_map(lambda leaf: cast_leaf(leaf, dtype), tree)
    mask = selection_mask(tree, filter_spec)
    return jtu.tree_map(
        lambda selected, leaf: cast_leaf(leaf, dtype) if selected else leaf, mask, tree
    )


def widest_floating_dtype(tree: PyTree) -> np.dtype | None:
    """The widest dtype among the floating arrays of `tree`, or `None` if it has none."""
    return widest_dtype(
        leaf.dtype for leaf in jtu.tree_leaves(tree) if is_floating_array(leaf)
    )


def widest_dtype(dtypes: Iterable[Any]) -> np.dtype | None:
    """The dtype `dtypes` promote to (bfloat16 and float16 give float32), or `None`
    for none. Standard promotion on purpose: a user's strict-promotion setting must not
    turn this bookkeeping into an error."""
    dtypes = frozenset(jnp.dtype(d) for d in dtypes)
    return _promote(dtypes) if dtypes else None


@ft.cache  # `jnp.result_type` costs ~0.2 ms, and autocast asks once per op
def _promote(dtypes: frozenset[np.dtype]) -> np.dtype:
    with jax.numpy_dtype_promotion("standard"):
        return jnp.dtype(jnp.result_type(*dtypes))


def at_least_float32(dtype: Any) -> np.dtype:
    """`dtype` widened to float32 if it is narrower (float64 stays float64)."""
    # `_promote` itself: `widest_dtype` may return `None`, which two dtypes never give.
    return _promote(frozenset({jnp.dtype(dtype), jnp.dtype(jnp.float32)}))


def cast_all_but_state(
    tree: PyTree, dtype_of: Callable[[np.dtype], np.dtype]
) -> PyTree:
    """Casts every floating array to `dtype_of(its dtype)`, except in `eqx.nn.State`
    (running statistics keep their dtype across steps)."""

    def cast(leaf):
        if is_floating_array(leaf):
            return cast_leaf(leaf, dtype_of(leaf.dtype))
        return leaf

    return jtu.tree_map(
        lambda x: x if _is_state(x) else cast(x), tree, is_leaf=_is_state
    )


def _largest_finite(
    tree: PyTree, mask: PyTree[bool] | None, above: float = 0.0
) -> list[tuple[str, float]]:
    """`(path, largest finite magnitude)` of each concrete floating array of `tree`
    that `mask` selects and whose dtype can hold a value `above` (so an array that
    is already in a narrow dtype costs nothing). Traced arrays cannot be checked and
    are passed over."""
    leaves = jtu.tree_leaves_with_path(tree)
    selected = [True] * len(leaves) if mask is None else jtu.tree_leaves(mask)
    candidates = [
        (path, leaf)
        for (path, leaf), keep in zip(leaves, selected)
        if keep
        and is_floating_array(leaf)
        and not isinstance(leaf, jax.core.Tracer)
        and leaf.size
        and float(jnp.finfo(leaf.dtype).max) > above
    ]
    # One reduction per leaf where it lives, brought to the host in one transfer;
    # computed now even when a caller is being traced (the leaves are concrete).
    with jax.ensure_compile_time_eval():
        largest = jax.device_get(
            [
                jnp.max(jnp.where(jnp.isfinite(leaf), jnp.abs(leaf), 0))
                for _, leaf in candidates
            ]
        )
    return [(jtu.keystr(path), float(v)) for (path, _), v in zip(candidates, largest)]


def overflowing_leaves(
    tree: PyTree, dtype: Any, mask: PyTree[bool] | None = None
) -> list[str]:
    """The paths of the concrete floating arrays of `tree` (those `mask` selects)
    holding a finite value too large for `dtype`: casting them would store inf."""
    limit = float(jnp.finfo(jnp.dtype(dtype)).max)
    largest = _largest_finite(tree, mask, above=limit)
    return [path for path, value in largest if value > limit]


# The dtypes a policy set later (`eqx_amp.using_policy`) may compute in. Not every
# float8 type: a record that changes only when a weight crosses one of these few
# limits keeps a wrapper rebuilt every step from being traced again.
_NARROW_FLOATS = tuple(
    jnp.dtype(name)
    for name in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
)


def overflows_by_dtype(
    tree: PyTree, mask: PyTree[bool] | None
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """For each dtype a policy could compute in, the paths of the
    concrete floating arrays of `tree` (those `mask` selects) holding a finite value
    too large for it. Hashable, so that a wrapper built before its policy is known
    (`policy=None`) can carry it as static data and warn where the policy is read,
    even where its weights are traced by then."""
    smallest_limit = min(float(jnp.finfo(dtype).max) for dtype in _NARROW_FLOATS)
    largest = _largest_finite(tree, mask, above=smallest_limit)
    record = []
    for dtype in _NARROW_FLOATS:
        limit = float(jnp.finfo(dtype).max)
        paths = tuple(path for path, value in largest if value > limit)
        if paths:
            record.append((dtype.name, paths))
    return tuple(record)


def describe_leaves(paths: list[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


KEEP_OR_RESCALE = (
    "Keep those weights in float32 with a filter spec (`eqx_amp.keep(model, ...)`), "
    "use bfloat16 (float32's range), or rescale the model."
)


def warn_if_cast_overflows(
    tree: PyTree,
    dtype: Any,
    mask: PyTree[bool] | None,
    *,
    cast_by: str,
    fix: str,
    stacklevel: int = 3,
) -> None:
    """Warns, naming the leaves, where concrete weights of `tree` would become inf
    when cast to `dtype`. `cast_by` opens the message ("`filter_amp` casts the
    weights to"), `fix` ends it."""
    warn_of_overflow(
        overflowing_leaves(tree, dtype, mask),
        dtype,
        cast_by=cast_by,
        fix=fix,
        stacklevel=stacklevel + 1,
    )


def warn_of_overflow(
    paths: list[str] | tuple[str, ...],
    dtype: Any,
    *,
    cast_by: str,
    fix: str,
    stacklevel: int,
) -> None:
    """The warning of `warn_if_cast_overflows`, for leaves found before."""
    if not paths:
        return
    many = len(paths) > 1
    warnings.warn(
        f"{cast_by} {jnp.dtype(dtype).name}, which cannot hold the value"
        f"{'s' if many else ''} of {describe_leaves(list(paths))}: "
        f"{'they' if many else 'it'} will be inf in every forward pass, so every "
        "step's gradients will be non-finite and a dynamic loss scale will sit at its "
        f"floor. {fix}",
        stacklevel=stacklevel,
    )


def drop_state(tree: PyTree) -> PyTree:
    """`tree` with every `eqx.nn.State` replaced by `None`."""
    return jtu.tree_map(lambda x: None if _is_state(x) else x, tree, is_leaf=_is_state)


def _is_state(node: Any) -> bool:
    return isinstance(node, STATE_TYPES)

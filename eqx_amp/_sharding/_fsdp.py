"""Under `jax.shard_map` FSDP the gradient reduction is the reduce-scatter that
transposes the gather of the parameters, so `gather_params` casts before it gathers
(to half, or to fp8 with its scales) and the gradients are reduced in that dtype."""

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, PyTree

from .._core._axes import check_axis_name, unbound_axis_name_error
from .._core._cast import cast_leaf, is_floating_array, widest_dtype
from .._core._describe import describe, in_selected_modules, is_none
from .._core._filters import FilterSpec, default_filter_spec, selection_mask
from .._core._policy import Policy, resolve_policy
from .._jaxpr import _compat as compat


def _is_manual_axis(axis_name: Hashable) -> bool:
    """Whether `axis_name` is an axis of an enclosing `jax.shard_map` (or `jax.pmap`),
    rather than of a `jax.vmap`."""
    return axis_name in jax.sharding.get_abstract_mesh().manual_axes


# Under `jax.shard_map(check_vma=False)`, `jax.pmap` and a named `jax.vmap`, JAX
# transposes a `psum` (and so the `pmean` of the FSDP recipe's loss) into another
# `psum`: every device's cotangent is the axis size times what it is with
# `check_vma=True`, which is why replicated gradients are averaged there
# (`axis_name` with `average=True`). The transpose of the gather averages in those
# modes for the same reason, so the recipe's gradients are the same in every mode.

# The axes `gather_params` gathered shards over while a gradient function traced
# its loss (`recording_gathers`): averaging those gradients would mix shards, and
# without `check_vma` no type says so.
_gathers: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "eqx_amp_gathers", default=None
)


def _record_gather(axis_name: Hashable) -> None:
    gathered = _gathers.get()
    if gathered is not None:
        gathered.add(axis_name)


@contextlib.contextmanager
def recording_gathers() -> Iterator[set]:
    """Collects the axes `gather_params` gathers shards over inside the block."""
    gathered: set = set()
    token = _gathers.set(gathered)
    try:
        yield gathered
    finally:
        _gathers.reset(token)


_NOTHING_SHARDED_BY_SPECS = (
    "`gather_params` found no array in the tree that `specs` shards over the axis "
    "{axis!r}: nothing would be gathered. Name {axis!r} in the `specs` (the shards' "
    "`in_specs`) of the arrays sharded over it."
)
_NOTHING_SHARDED = (
    "`gather_params` found no array in the tree that varies over the axis {axis!r}. "
    "Without `specs`, it gathers the arrays `jax.shard_map` types as differing per "
    "device (those passed in with {axis!r} in their `in_specs`), which needs "
    "`check_vma=True` (the default: `jax.pmap`, `jax.vmap` and "
    "`jax.shard_map(check_vma=False)` type no array as varying); or pass `specs=`, "
    "the shards' `in_specs`."
)


def _gather_one(
    leaf: Any,
    axis_name: Hashable,
    axis: int | None,
    compute_dtype: np.dtype | None,
    reduce_dtype: np.dtype,
    per_device: bool,
    fp8: Any = None,
    in_fp8: "_InFp8 | None" = None,
) -> Any:
    """`leaf` cast to `compute_dtype` (if given) and gathered along `axis` (a shard)
    or marked as varying over the axis (`axis=None`: a replicated leaf, which the
    data it meets varies with). Its gradient is summed across the axis, by a
    reduce-scatter or a psum, in `reduce_dtype` (or in the gradient's own dtype, if
    wider); averaged with `per_device` (`jax.pmap`, `shard_map(check_vma=False)`, a
    named `jax.vmap`). With `fp8` (a tensorwise or MXFP8 rule) and `in_fp8` (what
    its quantisation needs from the whole weight), the shard is quantised to fp8
    and gathered in it: fp8 matmuls read those values, other ops read them in the
    compute dtype. The gradient passes
    straight through the rounding, as the fp8 product's does."""

    def cast(x):
        return x if compute_dtype is None else cast_leaf(x, compute_dtype)

    if not is_floating_array(leaf):
        return (
            lax.all_gather(leaf, axis_name, axis=axis, tiled=True)
            if axis is not None
            else leaf
        )

    if axis is None and axis_name in compat.varying_axes(leaf):
        raise ValueError(
            f"`specs` gives an array of shape {leaf.shape} no dimension sharded over "
            f"{axis_name!r}, but `shard_map` passed it in as a shard (typed as "
            f"varying over {axis_name!r}): `specs` must be the shards' `in_specs`."
        )
    fp8_values = None  # made without a derivative: `backward` passes it through
    if in_fp8 is not None and axis is not None:
        fp8_values = fp8.gather_shard(
            leaf,
            in_fp8.amax,
            lambda x: lax.all_gather(x, axis_name, axis=axis, tiled=True),
        )

    @jax.custom_vjp
    def gather(leaf, fp8_values):
        if axis is None:
            if not _is_manual_axis(axis_name):
                return cast(leaf)  # `jax.vmap` has no varying types
            return lax.pcast(cast(leaf), axis_name, to="varying")
        if fp8_values is not None:
            return fp8.dequantize(*fp8_values, compute_dtype)
        return lax.all_gather(cast(leaf), axis_name, axis=axis, tiled=True)

    def forward(leaf, fp8_values):
        return gather(leaf, fp8_values), fp8_values

    # The rule closes over the leaf's dtype, never the leaf: JAX keeps a rule with
    # the program it traced, and a tracer in it would outlive the trace.
    leaf_dtype = leaf.dtype

    def backward(fp8_values, cotangent):
        cotangent = cotangent.astype(widest_dtype([reduce_dtype, cotangent.dtype]))
        if per_device:
            # Scaled before the sum, as `check_vma=True` scales each device's
            # cotangent: a sum that fits there fits here.
            size = np.asarray(lax.axis_size(axis_name), cotangent.dtype)
            cotangent = cotangent / size
        if axis is None:
            summed = lax.psum(cotangent, axis_name)
        else:
            summed = lax.psum_scatter(
                cotangent, axis_name, scatter_dimension=axis, tiled=True
            )
        return summed.astype(leaf_dtype), jtu.tree_map(jnp.zeros_like, fp8_values)

    gather.defvjp(forward, backward)
    gathered = gather(leaf, fp8_values)
    if fp8_values is not None:
        # The model's fp8 matmuls read the gathered fp8 values themselves.
        fp8.remember(gathered, *fp8_values)
    return gathered


def gather_params(
    shards: PyTree,
    axis_name: Hashable,
    *,
    specs: PyTree | None = None,
    policy: Policy | str | None = None,
    filter_spec: FilterSpec | None = None,
    fp8: Any = None,
    fp8_filter: Callable[[eqx.Module], bool] | None = None,
) -> PyTree:
    """Gathers parameters sharded over a `jax.shard_map` axis (FSDP), casting them to
    the compute dtype first, so that the all-gather moves half-precision bytes; their
    gradients are summed back into shards with a reduce-scatter in the policy's
    `reduce_dtype`.

    Under `jax.pmap`, `jax.shard_map(check_vma=False)` and a named `jax.vmap`, where
    JAX transposes the loss's `pmean` into a `psum` (every device's gradient is the
    axis size times larger), the reduce-scatter averages instead, so the FSDP recipe
    below gives the same gradients in every mode.

    **Arguments:**

    - `shards`: a pytree (a model, or its arrays from `eqx.partition`) inside
        `jax.shard_map`.
    - `axis_name`: the mesh axis the parameters are sharded over.
    - `specs`: the `PartitionSpec`s the shards came in with (their `in_specs`, a
        pytree prefix of `shards`): each array is gathered along the dimension whose
        entry names `axis_name`. Arrays whose spec does not name it are replicated:
        they are cast like the rest, and their gradients are summed over the axis
        in the reduce dtype too (rather than by JAX's implicit psum in the compute
        dtype). `None`: the arrays `jax.shard_map` types as varying over the axis
        (which needs `check_vma=True`, the default) are gathered along their first
        dimension.
    - `policy`: a `Policy` or policy string: floating leaves selected by
        `filter_spec` are cast to its `compute_dtype` before the gather, and
        gradients are summed in its `reduce_dtype`. `None` means
        `default_policy()`.
    - `filter_spec`: which floating leaves are cast (as in `filter_amp`); `None`
        means `default_filter_spec(shards)`: norm layers stay in their dtype.
    - `fp8`: `eqx_amp.fp8.TENSORWISE` to all-gather the weights that feed fp8
        products in `float8_e4m3fn`: each shard is quantised with the scale of its
        whole weight (the amaxes of all these weights take one `pmax` together)
        and gathered in fp8 (half bfloat16's bytes). `eqx_amp.fp8.MXFP8`: each
        shard is quantised in blocks of 32 along the weight's last axis (an
        `eqx.nn.Linear`'s input features, which its forward product contracts)
        and gathered as e4m3 values and e8m0 block scales (33/64 of bfloat16's
        bytes). The model's fp8 matmuls (`filter_amp(..., fp8=...)`, an fp8 rule
        of `autocast`, the same rule) read those fp8 values; other ops read the
        weight in the compute dtype (which quantises again to the same values;
        MXFP8's backward product for the input quantises it along the output
        features). The model must run those products in fp8: this only moves the
        bytes. Gradients are reduce-scattered as without it.
    - `fp8_filter`: the modules whose weights (arrays of two dimensions or more,
        other than a `bias`: a stacked layer's) are gathered in fp8; `None` means
        the layers whose gathered weight fits the format: tensorwise,
        `eqx.nn.Linear` and `eqx.nn.Conv` with every dimension a multiple of 16;
        MXFP8, `eqx.nn.Linear` (stacked ones too) with the last axis a multiple of
        32 in every shard. The others gather as without `fp8`. A weight it selects
        that cannot be gathered in fp8 (not floating, not cast by `filter_spec`, a
        shape that does not fit) is an error naming it.

    **Returns:**

    The gathered tree, with the structure and types of `shards`.

    **Raises:**

    `ValueError` if nothing in `shards` is sharded over `axis_name`, or `specs` does
    not fit `shards`, or `fp8` is given and no weight can be gathered in fp8 (or
    one `fp8_filter` selects cannot); `TypeError` for an `fp8` that is not
    `TENSORWISE` or `MXFP8` (a `where_it_pays()` rule included: a gather cannot
    tell which products pay); `NameError` if `axis_name` is not a mapped axis here.

    **Example:**

    ```python
    policy = eqx_amp.get_policy("mixed_bfloat16").with_reduce_dtype(jnp.float32)

    @ft.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("data")), out_specs=P())
    def loss_fn(shards, tokens):
        model = eqx_amp.sharding.gather_params(shards, "data", specs=specs, policy=policy)
        logits = jax.vmap(eqx_amp.filter_amp(model, policy=policy))(tokens)
        return jax.lax.pmean(cross_entropy(logits, tokens), "data")
    ```
    """
    check_axis_name(axis_name)
    policy = resolve_policy(policy)
    spec = default_filter_spec(shards) if filter_spec is None else filter_spec
    mask = selection_mask(shards, spec)
    dims = _gathered_dims(shards, axis_name, specs)
    per_device = not _is_manual_axis(axis_name) or compat.is_unchecked_manual_axis(
        axis_name
    )
    if any(d is not None for d in jtu.tree_leaves(dims, is_leaf=is_none)):
        _record_gather(axis_name)

    def gather(selected, dim, in_fp8, leaf):
        if not eqx.is_array(leaf):
            return leaf
        compute = policy.compute_dtype if selected else None
        return _gather_one(
            leaf, axis_name, dim, compute, policy.reduce_dtype, per_device, fp8, in_fp8
        )

    with unbound_axis_name_error(axis_name):
        if fp8 is None:
            plans = jtu.tree_map(lambda _: None, mask)
        else:
            if not hasattr(fp8, "check_gather"):
                raise TypeError(
                    "`fp8` must be eqx_amp.fp8.TENSORWISE or eqx_amp.fp8.MXFP8, "
                    f"not {fp8!r}."
                )
            fp8.check_gather(policy.compute_dtype)
            plans = _fp8_plans(shards, axis_name, dims, mask, fp8, fp8_filter)
        return jtu.tree_map(gather, mask, dims, plans, shards)


class _InFp8(NamedTuple):
    """A weight shard to gather in fp8, with what its quantisation needs from the
    whole weight (the rule's `weight_amaxes`)."""

    amax: Array | None


def _fp8_plans(shards, axis_name, dims, mask, fp8, fp8_filter) -> PyTree:
    """For each leaf: `_InFp8` if it is gathered in fp8, else None. Tensorwise
    amaxes of all of them take one `pmax`."""
    chosen = in_selected_modules(shards, fp8_filter or fp8.gathers_by_default)
    flat, treedef = jtu.tree_flatten_with_path(shards)
    size = lax.axis_size(axis_name)
    picked = []
    for (path, leaf), dim, cast, wanted in zip(
        flat, *(treedef.flatten_up_to(t) for t in (dims, mask)), chosen
    ):
        if not (
            wanted
            and eqx.is_array(leaf)
            and leaf.ndim >= 2
            and dim is not None
            and not _is_bias(path)
        ):
            picked.append(False)
            continue
        shape = tuple(n * size if i == dim else n for i, n in enumerate(leaf.shape))
        problem = _fp8_gather_problem(leaf, cast) or fp8.gather_problem(
            leaf.shape, shape, dim
        )
        if problem is not None and fp8_filter is not None:
            raise (TypeError if "floating" in problem else ValueError)(
                f"`gather_params(..., fp8=...)`: the weight {jtu.keystr(path)} "
                f"(shard {describe(leaf)}) cannot be gathered in fp8: {problem}."
            )
        picked.append(problem is None)
    if not any(picked):
        raise ValueError(_NO_FP8_WEIGHT.format(axis=axis_name))
    amaxes = iter(
        fp8.weight_amaxes([x for (_, x), p in zip(flat, picked) if p], axis_name)
    )
    return treedef.unflatten([_InFp8(next(amaxes)) if p else None for p in picked])


def _is_bias(path) -> bool:
    """Whether `path` names a bias: stacked layers' biases have two dimensions, and
    no product reads them."""
    last = path[-1] if path else None
    return getattr(last, "name", None) == "bias"


def _fp8_gather_problem(leaf, cast: bool) -> str | None:
    if not is_floating_array(leaf):
        return "it is not floating (only floating weights are quantised)"
    if not cast:
        return "`filter_spec` keeps it in its dtype, so no product reads it in fp8"
    return None


_NO_FP8_WEIGHT = (
    "`gather_params(..., fp8=...)` found no weight to gather in fp8 (sharded over "
    "{axis!r}, in a module `fp8_filter` selects, by default `eqx.nn.Linear` and, "
    "tensorwise, `eqx.nn.Conv`; tensorwise: every dimension a multiple of 16; "
    "MXFP8: the last a multiple of 32 in every shard): leave `fp8` out."
)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.PartitionSpec)


def _spec_dim(spec: Any, axis_name: Hashable, leaf: Any) -> int | None:
    """The dimension of `leaf` that `spec` shards over `axis_name`, if any."""
    if spec is None or not eqx.is_array(leaf):
        return None
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis_name in names:
            if dim >= leaf.ndim:
                raise ValueError(
                    f"The spec {spec} names {axis_name!r} at dimension {dim}, but the "
                    f"array it describes has shape {leaf.shape}."
                )
            return dim
    return None


def _gathered_dims(shards: PyTree, axis_name: Hashable, specs: PyTree | None):
    """For each leaf of `shards`: the dimension to gather along, or `None`."""
    if specs is None:
        with unbound_axis_name_error(axis_name):
            dims = jtu.tree_map(
                lambda leaf: (
                    0
                    if eqx.is_array(leaf) and axis_name in compat.varying_axes(leaf)
                    else None
                ),
                shards,
            )
        has_arrays = any(eqx.is_array(x) for x in jtu.tree_leaves(shards))
        if has_arrays and all(
            d is None for d in jtu.tree_leaves(dims, is_leaf=is_none)
        ):
            raise ValueError(_NOTHING_SHARDED.format(axis=axis_name))
        return dims
    try:
        dims = jtu.tree_map(
            lambda spec, subtree: jtu.tree_map(
                lambda leaf: _spec_dim(spec, axis_name, leaf), subtree
            ),
            specs,
            shards,
            is_leaf=_is_spec,
        )
    except ValueError as error:
        if "spec" in str(error):
            raise
        raise ValueError(
            "`specs` must be a pytree prefix of `shards` whose leaves are "
            f"`PartitionSpec`s or None (the shards' `in_specs`). JAX: {error}"
        ) from None
    has_arrays = any(eqx.is_array(x) for x in jtu.tree_leaves(shards))
    if has_arrays and all(d is None for d in jtu.tree_leaves(dims, is_leaf=is_none)):
        raise ValueError(_NOTHING_SHARDED_BY_SPECS.format(axis=axis_name))
    return dims

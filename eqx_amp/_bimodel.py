"""Master and compute weights: `BiModel`.

A `BiModel` keeps a model twice, the way Apex's O2 and Optimisers.jl's
`MixedPrecision` do: the master weights in the parameter dtype (float32), which the
optimiser updates, and a copy in the compute dtype (float16, bfloat16), which the
forward and backward passes read. Gradients are taken with respect to the compute
copy, so the gradient tree the backward pass builds is in half precision: half the
bytes of a float32 one. The half copy lives between steps, so each step casts the
weights once (in `apply_updates`) instead of at every call.

Storage: `master` is the whole model. The compute copy is stored only where it
differs from the master, in a tree with the master's structure holding the
compute-dtype arrays and `None` everywhere else; leaves the filter spec keeps
(normalisation layers, by default) are held once, in `master`. `.compute` rebuilds
the whole model from the two.
"""

import functools as ft
import warnings
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, Self, TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._core._cast import (
    KEEP_OR_RESCALE,
    cast_all_but_state,
    describe_leaves,
    drop_state,
    is_floating_array,
    is_half_dtype,
    overflowing_leaves,
    warn_if_cast_overflows,
)
from ._core._describe import in_selected_modules, is_none
from ._core._filters import FilterSpec, default_filter_spec, selection_mask
from ._core._policy import Policy, resolve_policy
from ._core._wrapper import user_stacklevel
from ._filter_amp._filter_amp import check_fp8_options, filter_amp
from ._fp8 import Fp8Rule
from ._loss_scaling._scaled_step import GradThrough
from ._optim._rounding import round_to_nearest
from ._optim._updates import add_in_float32, paired_leaves


_P = ParamSpec("_P")
_T = TypeVar("_T")

_NESTED_BIMODEL = (
    "`model` is already a `BiModel`. Pass `bimodel.master` to build a new one with "
    "another policy or filter spec."
)
_COMPUTE_MISMATCH = (
    "`compute` must have the structure of `bimodel.compute` (the structure of "
    "`bimodel.master`: the same containers, module types and static fields), but "
    "it does not."
)


class BiModel(GradThrough, Generic[_P, _T]):
    """A model held twice: float32 master weights for the optimiser, and a
    half-precision compute copy for the forward and backward passes.

    Calling a `BiModel` runs the compute copy with the semantics of
    `eqx_amp.filter_amp`: floating arguments are cast to the compute dtype,
    submodules whose leaves the filter spec keeps (normalisation layers, by default)
    run in the parameter dtype with casts at their own boundary, `eqx.nn.State` is
    never cast, and floating outputs are cast to the output dtype. The compute copy
    is already cast, so the call casts no weights.

    Gradients are taken with respect to the compute copy: pass the `BiModel` as the
    differentiated argument of any of eqx_amp's gradient functions
    (`filter_value_and_grad`, `filter_grad`, `scaled_value_and_grad`,
    `scaled_grad`), or apply any transform through `with_compute`. The backward pass
    builds a half-precision gradient tree, which the loss scale unscales to float32.
    The intended training step (the float16 short form):

    1. `(loss, grads), opt_state = loss_fn(bimodel, x, y, opt_state=opt_state)`
        with `loss_fn` decorated by `eqx_amp.scaled_value_and_grad`: float32
        gradients with the structure of `master`;
    2. `optim.update(grads, opt_state, eqx.filter(bimodel.master,
        eqx.is_inexact_array))`: float32 updates against the float32 master
        (`optim = eqx_amp.loss_scaling(optax.adam(...))` skips non-finite steps);
    3. `bimodel.apply_updates(updates)`: adds them to the master and casts the new
        master to the compute copy.

    Invariant: `bimodel.compute` equals the master cast to the compute dtype (the
    spec-selected leaves), bit for bit, after every step.

    A `BiModel` is an `eqx.Module`, so a pytree: it passes through `eqx.filter_jit`,
    `eqx.filter_shard` (or `jax.device_put` on its array leaves),
    `eqx_amp.select_tree` and `eqx.tree_serialise_leaves` like any model. Leaves the spec keeps are stored
    once.

    **Arguments:**

    - `model`: the model (any pytree, usually an `eqx.Module`). Its floating arrays
        (other than those of `eqx.nn.State` / `eqx.nn.StateIndex`) are cast to the
        policy's parameter dtype to make the master.
    - `policy`: a `Policy` or a policy string; `None` means `default_policy()`.
    - `filter_spec`: which floating leaves get a compute-dtype copy, as
        `eqx.partition` accepts; `None` means `default_filter_spec(model)`.
    - `fp8`, `fp8_filter`: fp8 matmuls for the selected modules, as for
        `eqx_amp.filter_amp` (`fp8=eqx_amp.fp8.TENSORWISE`).

    **Attributes:**

    - `master`: the model in the parameter dtype.
    - `compute`: the whole model (the structure of `master`), with the
        spec-selected leaves in the compute dtype and the kept leaves shared with
        `master`.
    - `policy`: the resolved `Policy`.

    **Example:**

    ```python
    bimodel = eqx_amp.BiModel(model, policy="mixed_float16")
    optim = eqx_amp.loss_scaling(optax.adam(1e-3))
    opt_state = optim.init(eqx.filter(bimodel.master, eqx.is_inexact_array))

    @eqx_amp.scaled_value_and_grad
    def loss_fn(model, x, y):  # `model` is the BiModel: call it like the model
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @eqx.filter_jit
    def step(bimodel, opt_state, x, y):
        (loss, grads), opt_state = loss_fn(bimodel, x, y, opt_state=opt_state)
        params = eqx.filter(bimodel.master, eqx.is_inexact_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return bimodel.apply_updates(updates), opt_state, loss
    ```
    """

    master: PyTree
    # The compute-dtype arrays, one entry per leaf of `master`, `None` wherever the
    # compute copy is the master's own leaf (kept by the spec, not floating, or
    # already in the compute dtype): those leaves are stored once. Flat, not in the
    # structure of `master`, so that the model's modules appear once in a `BiModel`
    # (`eqx.nn.inference_mode(bimodel)` finds each `Dropout` once).
    _compute_only: tuple[Any, ...]
    policy: Policy = eqx.field(static=True)
    # The resolved filter spec, one bool per leaf of `master`. Part of the pytree
    # structure, so two `BiModel`s with different specs never mix under `jit`.
    _selected: tuple[bool, ...] = eqx.field(static=True, repr=False)
    fp8: Fp8Rule | None = eqx.field(static=True, default=None)
    fp8_filter: Callable[[eqx.Module], bool] | None = eqx.field(
        static=True, default=None
    )
    # `fp8_filter` applied once, to the model given: one bool per leaf of `master`
    # (an identity test, `m is model.head`, holds for that model only).
    _fp8_selected: tuple[bool, ...] | None = eqx.field(
        static=True, default=None, repr=False
    )

    def __init__(
        self,
        model: Callable[_P, _T] | PyTree,
        *,
        policy: Policy | str | None = None,
        filter_spec: FilterSpec | None = None,
        fp8: Fp8Rule | None = None,
        fp8_filter: Callable[[eqx.Module], bool] | None = None,
    ):
        if isinstance(model, BiModel):
            raise TypeError(_NESTED_BIMODEL)
        policy = resolve_policy(policy)
        spec = default_filter_spec(model) if filter_spec is None else filter_spec
        mask = selection_mask(model, spec)
        _check_master_fits(model, policy)
        master = cast_all_but_state(model, lambda _: policy.param_dtype)
        compute = policy.compute_dtype
        _warn_if_compute_overflows(master, policy, mask)

        def compute_only(selected, leaf):
            if selected and is_floating_array(leaf) and leaf.dtype != compute:
                return leaf.astype(compute)
            return None

        selected = jtu.tree_leaves(mask)
        self.master = master
        self._compute_only = tuple(map(compute_only, selected, jtu.tree_leaves(master)))
        self.policy = policy
        self._selected = tuple(bool(s) for s in selected)
        check_fp8_options(fp8, fp8_filter)  # here, not at the first call in a jit
        self.fp8 = fp8
        self.fp8_filter = fp8_filter
        self._fp8_selected = _fp8_selection(model, fp8_filter)
        _warn_if_master_is_half(policy)

    @property
    def compute(self) -> PyTree:
        """The whole model with the spec-selected floating leaves in the compute
        dtype: the structure of `master`, sharing its kept leaves."""
        leaves, treedef = jtu.tree_flatten(self.master)
        return jtu.tree_unflatten(
            treedef,
            [m if c is None else c for m, c in zip(leaves, self._compute_only)],
        )

    @property
    def filter_spec(self) -> PyTree[bool]:
        """The resolved filter spec: a tree of bools with the structure of
        `master`, `True` where a leaf is selected for the compute dtype."""
        return jtu.tree_unflatten(jtu.tree_structure(self.master), self._selected)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Runs the compute copy with `filter_amp` semantics (see the class
        docstring)."""
        if not callable(self.master):
            raise TypeError(
                f"This `BiModel` holds a {type(self.master).__name__}, which is not "
                "callable. Call its compute copy yourself: `bimodel.compute`."
            )
        # The selected leaves are already in the compute dtype, so `filter_amp` casts
        # no weights: it adds the kept submodules' boundaries and casts the
        # arguments and outputs.
        compute = self.compute
        fp8, fp8_filter = self.fp8, self.fp8_filter
        if self._fp8_selected is not None:
            # The modules of this compute copy whose arrays the filter selected.
            picked = {
                id(leaf)
                for leaf, selected in zip(jtu.tree_leaves(compute), self._fp8_selected)
                if selected
            }
            fp8_filter = ft.partial(_all_arrays_in, picked)
            if not picked:  # said when the `BiModel` was made
                fp8, fp8_filter = None, None
        amp = filter_amp(
            compute,
            policy=self.policy,
            filter_spec=self.filter_spec,
            fp8=fp8,
            fp8_filter=fp8_filter,
        )
        return amp(*args, **kwargs)

    def with_compute(self, compute: PyTree) -> Self:
        """This `BiModel` with its compute copy replaced by `compute`.

        It exists to differentiate with respect to the compute copy with any
        transform: `eqx.filter_grad(lambda c: loss_fn(bimodel.with_compute(c), x))(
        bimodel.compute)` gives gradients in the compute dtype for the cast leaves
        (and in the parameter dtype for the kept ones). `compute` should be
        `bimodel.compute` or a stand-in for it with the same dtypes (a tracer, under
        differentiation); the kept leaves of the result come from `compute`, the
        master's own copies of the cast leaves are left as they are.

        **Arguments:**

        - `compute`: a pytree with the structure of `bimodel.compute`.

        **Returns:**

        A `BiModel` whose `compute` is `compute`.
        """
        if jtu.tree_structure(compute) != jtu.tree_structure(self.master):
            raise ValueError(_COMPUTE_MISMATCH)

        master_leaves, treedef = jtu.tree_flatten(self.master)
        compute_leaves = jtu.tree_leaves(compute)
        owns = [own is not None for own in self._compute_only]
        master = jtu.tree_unflatten(
            treedef,
            [m if own else c for m, c, own in zip(master_leaves, compute_leaves, owns)],
        )
        compute_only = tuple(c if own else None for c, own in zip(compute_leaves, owns))
        return self._replace(master, compute_only)

    def apply_updates(self, updates: PyTree) -> Self:
        """Adds float32 updates to the master weights and refreshes the compute copy.

        **Arguments:**

        - `updates`: a pytree with the structure of `master` (as
            `optimizer.update(grads, opt_state, eqx.filter(bimodel.master,
            eqx.is_inexact_array))` returns it), with `None` where there is nothing
            to update. Each update is added in at least float32 and the sum is
            rounded once to the dtype of its master leaf.

        **Returns:**

        A new `BiModel`; this one is unchanged. Its compute copy is the new master
        cast to the compute dtype, so the invariant holds bit for bit.

        **Raises:**

        `ValueError` naming `updates`, if its structure does not match `master`, if
        it has an update for a leaf that is not a floating array, or if an update
        is not a floating array of the master leaf's shape; `ValueError` naming the
        leaves, where the new master weights are concrete (outside `jit`) and one
        is too large for the master dtype. A `UserWarning` naming the leaves where
        one is too large for the compute dtype.
        """
        pairs = paired_leaves(updates, self.master, "bimodel.master")
        master = jtu.tree_unflatten(
            jtu.tree_structure(updates, is_leaf=is_none),
            [part if u is None else add_in_float32(part, u) for u, part in pairs],
        )
        wide_leaves, master_def = jtu.tree_flatten(master)
        _check_master_fits(master, self.policy, updated=True)
        new_leaves = [
            total if total is leaf else round_to_nearest(total, leaf.dtype)
            for total, leaf in zip(wide_leaves, jtu.tree_leaves(self.master))
        ]
        master = jtu.tree_unflatten(master_def, new_leaves)
        _warn_if_compute_overflows(master, self.policy, self.filter_spec)
        compute_only = tuple(
            None if own is None else leaf.astype(own.dtype)
            for own, leaf in zip(self._compute_only, new_leaves)
        )
        return self._replace(master, compute_only)

    def grad_target(self) -> tuple[PyTree, Callable[[PyTree], "BiModel"]]:
        """What the gradient functions differentiate: the compute copy (gradients
        of the cast leaves in the compute dtype, the memory saving), rebuilt into a
        `BiModel` with `with_compute`. The master is a constant of the loss."""
        return self.compute, self.with_compute

    def _replace(self, master: PyTree, compute_only: PyTree) -> Self:
        # Not through `__init__`: the parts are already in their dtypes, and
        # `__init__` would resolve the spec against the model again.
        return eqx.tree_at(
            lambda b: (b.master, b._compute_only),
            self,
            (master, compute_only),
            is_leaf=is_none,
        )


_MASTER_OVERFLOWS = (
    "The master weights are stored in {dtype} (the policy's parameter dtype), which "
    "cannot hold the value{s} of {leaves}: storing {it} would give inf and lose the "
    'weight{s}{when}. Keep the master in float32 (`policy="p=f32,c={dtype}"` or '
    '`"mixed_float16"`), or rescale the model.'
)


def _plural(paths: list[str]) -> dict[str, str]:
    many = len(paths) > 1
    return {
        "s": "s" if many else "",
        "it": "them" if many else "it",
        "them": "those leaves" if many else "that leaf",
        "leaves": describe_leaves(paths),
    }


def _check_master_fits(model: PyTree, policy: Policy, updated: bool = False) -> None:
    """Raises where a (concrete) weight is too large for the master dtype."""
    paths = overflowing_leaves(drop_state(model), policy.param_dtype)
    if paths:
        when = " after this update" if updated else ""
        raise ValueError(
            _MASTER_OVERFLOWS.format(
                dtype=policy.param_dtype.name, when=when, **_plural(paths)
            )
        )


def _fp8_selection(
    model: PyTree, fp8_filter: Callable[[eqx.Module], bool] | None
) -> tuple[bool, ...] | None:
    """One bool per leaf of `model`: in a module `fp8_filter` selects. `None`
    without a filter (every module)."""
    if fp8_filter is None:
        return None
    selection = in_selected_modules(model, fp8_filter)
    arrays = map(eqx.is_array, jtu.tree_leaves(model))
    if not any(s and a for s, a in zip(selection, arrays)):
        warnings.warn(
            "`fp8_filter` selects no module with arrays of this model, so no matmul "
            "of the `BiModel` runs in fp8.",
            stacklevel=user_stacklevel(),
        )
    return selection


def _all_arrays_in(picked: set[int], module: Any) -> bool:
    arrays = [leaf for leaf in jtu.tree_leaves(module) if eqx.is_array(leaf)]
    return bool(arrays) and all(id(a) in picked for a in arrays)


def _warn_if_compute_overflows(
    master: PyTree, policy: Policy, mask: PyTree[bool]
) -> None:
    """Warns where a (concrete) selected weight is too large for the compute dtype."""
    warn_if_cast_overflows(
        master,
        policy.compute_dtype,
        mask,
        cast_by="The compute copy is",
        fix=KEEP_OR_RESCALE,
        # At the user's line, past Equinox's frames that build a module.
        stacklevel=user_stacklevel() + 1,
    )


# Stands for "no update" at every leaf under a `None` of `updates`.


def _warn_if_master_is_half(policy: Policy) -> None:
    dtype = policy.param_dtype
    if not is_half_dtype(dtype):
        return
    fix = (
        "For bfloat16 weights with compensated updates, train the model itself with "
        "`optax.chain(optimizer, eqx_amp.optim.kahan_summation())` (or "
        "`stochastic_rounding(key)`) and `eqx_amp.optim.apply_updates`; or keep a "
        "float32 master."
        if dtype == jnp.bfloat16
        else 'Keep a float32 master (`policy="mixed_float16"`).'
    )
    warnings.warn(
        f"The master weights are stored in {dtype.name}: an update smaller than "
        f"about 2^-{jnp.finfo(dtype).nmant + 2} of its weight rounds away, so "
        f"training stalls once the steps are small. {fix}",
        stacklevel=user_stacklevel(),
    )

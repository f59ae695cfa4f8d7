"""Optimizer moments stored in low precision: `eqx_amp.optim.low_precision_moments`.

Adam keeps two float32 moments per weight: 8 bytes, more than the weight and its
gradient together in mixed precision. Stored in bfloat16 they cost 4 bytes, and 8-bit
blockwise-quantised about 2 (as bitsandbytes and torchao do it). The wrapped optimizer
still computes in float32: each step decodes the moments, runs the optimizer, and
encodes the new moments.

Two things keep the compressed moments honest:

- Stochastic rounding when encoding. Adam's second moment moves by 0.1% a step
    (`b2 = 0.999`), less than half a bfloat16 ulp (0.4%), so with nearest rounding it
    could never decay: once a large gradient has raised it, the step size stays small
    for good. Rounding up or down at random with the right odds keeps every moment
    unbiased.
- Second moments (non-negative: Adam's `nu`, ...) are stored as their square roots,
    which span half the decades: a block of 8-bit codes then resolves values down to
    1e-14 of its largest, where a signed code of the moment itself would flush the
    small ones to zero and blow up their steps.
- Each 8-bit block keeps its largest element aside, in bfloat16, and scales the
    others by the next largest. One huge gradient (whose second moment overflows to
    inf, as float32 Adam's does) then neither poisons its block (inf / inf) nor
    flushes the other 255 elements' moments to zero.
"""

import dataclasses
import numbers
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, Int, PRNGKeyArray, UInt32

from ._codec import (
    MOMENT_FIELDS,
    MOMENT_STORAGES,
    NONNEGATIVE_MOMENTS,
    SIGNED_MOMENTS,
    BlockStatistics,
    MomentStorage,
    QuantizedMoment,
    block_statistics,
    encode,
    encode_zeros,
)
from ._rounding import check_key, check_key_data, key_impl, raw_key_data, wrap_key
from ._transforms import check_optimizer


class LowPrecisionMomentsState(NamedTuple):
    """The state of `eqx_amp.optim.low_precision_moments(optimizer, ...)`.

    **Fields:**

    - `step`: steps so far (int32); with `key`, what each step's stochastic
        rounding is drawn from, so runs are reproducible and resume exactly.
    - `key`: the raw data of the PRNG key (`jax.random.key_data`).
    - `inner_state`: the wrapped optimizer's state, with each moment stored as a
        `QuantizedMoment`.
    """

    step: Int[Array, ""]
    key: UInt32[Array, "..."]
    inner_state: Any


def _is_moment(node: Any) -> bool:
    return isinstance(node, QuantizedMoment)


def _moment_kind(path: tuple, node: Any, by_state: dict[int, bool]) -> bool | None:
    """For a subtree `node` of the optimizer state shaped like the parameters, at
    `path`: `True` for a non-negative moment, `False` for a signed one, `None` for
    state that is not a moment. By the state it is a field of where two optimizers
    give one name different signs (`by_state`, from `_signs_by_state`), otherwise
    by the field's name."""
    if not path or not isinstance(path[-1], jtu.GetAttrKey):
        return None
    if id(node) in by_state:
        return by_state[id(node)]
    name = path[-1].name
    if name in NONNEGATIVE_MOMENTS:
        return True
    if name in SIGNED_MOMENTS:
        return False
    return None


def _signs_by_state(state: Any) -> dict[int, bool]:
    """Whether each moment whose sign its name does not give is non-negative, by
    the ids of its subtrees: Adafactor's `v` is the second moment of the weights it
    does not factor (Adan's `v` is a first moment of gradient differences), and
    Sophia's `nu` an average of Hutchinson's estimates of the Hessian's diagonal,
    which are negative where the loss curves down, and SM3's `nu` its momentum
    (Adam's `nu` squares)."""
    kinds = {
        optax.FactoredState: ("v", True),
        optax.contrib.SophiaState: ("nu", False),
        optax.ScaleBySM3State: ("nu", False),
    }

    def known(x: Any) -> bool:
        return type(x) in kinds

    signs = {}
    for s in jtu.tree_leaves(state, is_leaf=known):
        if known(s):
            field, non_negative = kinds[type(s)]
            signs[id(getattr(s, field))] = non_negative
    return signs


def _shaped_like(node: Any, params: Any) -> bool:
    """Whether `node` has the structure of `params`, with optax's `MaskedNode`
    allowed in place of any subtree (where `optax.masked` and
    `optax.multi_transform` leave out the parameters a transformation does not
    see), a leaf (an array) in place of each leaf, and `None` allowed in place of
    a leaf that is not a floating array."""
    if isinstance(node, optax.MaskedNode):
        return True
    if params is None:
        return node is None
    params_def = jtu.tree_structure(params)
    if jtu.treedef_is_leaf(params_def):
        if not eqx.is_inexact_array(params):
            # Given the whole model, a wrapped `master_weights` runs its optimizer
            # on the floating leaves only, leaving `None` where the model has an
            # integer array or a function; a plain optimizer keeps a leaf there.
            return node is None or jtu.treedef_is_leaf(jtu.tree_structure(node))
        return node is not None and jtu.treedef_is_leaf(jtu.tree_structure(node))
    node_children, node_def = _one_level(node)
    params_children, params_def = _one_level(params)
    return node_def == params_def and all(
        map(_shaped_like, node_children, params_children)
    )


def _one_level(tree: Any) -> tuple[list, Any]:
    """The children of `tree`'s root and the root's structure, children as leaves."""
    return jtu.tree_flatten(tree, is_leaf=lambda child: child is not tree)


_NO_MOMENTS = (
    "`low_precision_moments` found no moment to compress in the state of the "
    "optimizer it wraps (a {state}): the state is kept as it is, in its own dtype. "
    "It compresses the subtrees shaped like the parameters under optax's moment "
    "fields ({names}), through optax's combinators (`chain`, `masked`, "
    "`multi_transform`, `inject_hyperparams`, `MultiSteps`, `apply_if_finite`). An "
    "optimizer without moments (`optax.sgd` without momentum) gains nothing from "
    "it; one with moments under other names is not supported."
)


def _is_compressible(leaf: Any) -> bool:
    # Scalars gain nothing from compression.
    return (
        eqx.is_array(leaf)
        and jnp.issubdtype(leaf.dtype, jnp.floating)
        and leaf.ndim >= 1
    )


def low_precision_moments(
    optimizer: optax.GradientTransformation,
    storage: MomentStorage = "bfloat16",
    *,
    key: PRNGKeyArray | None = None,
    block_size: int = 256,
) -> optax.GradientTransformationExtraArgs:
    """Stores an optax optimizer's moments in bfloat16 or in 8 bits per value.

    The moments of the wrapped optimizer's state (the subtrees shaped like the
    parameters under optax's moment fields: `mu`, `nu`, `nu_max`, `trace`, `ema`,
    `sum_of_squares`, `v_row`, `v_col`, `m`, `v`, `n`, `e_g`, `e_x`) are stored
    compressed between steps; the wrapped optimizer runs in float32 on decoded
    copies, so chains and schedules work unchanged. Other per-weight state (the
    gradients `optax.MultiSteps` accumulates, schedule-free's `z`) is kept as it
    is: stored coarsely, it would move the weights. Non-negative moments (`nu`
    but Sophia's, whose Hessian estimates can be negative, and SM3's, a momentum; `nu_max`,
    `sum_of_squares`, `v_row`, `v_col`, Adafactor's `v`, `n`, `e_g`, `e_x`) are
    stored as their square roots. Encoding rounds stochastically, so the stored
    values stay unbiased however small a step's change (a square read back from its
    root is biased up by the rounding's variance: the training-state guide gives
    figures).

    - `"bfloat16"`: 2 bytes per value (float32's range, 8 significant bits).
    - `"8bit"`: 1 byte per value plus two bfloat16 numbers per block of
        `block_size` values: the block's largest element, kept aside, and the
        magnitude of the next largest, which the others are divided by before
        they are rounded to one of 255 points of a dynamic map spanning seven
        decades (as bitsandbytes' 8-bit optimizers do). A finite block decodes
        finite, and one huge or non-finite element stays in its own place. A
        block holds values about seven decades below its second largest (14 for
        second moments); gradients whose magnitudes differ more within one block
        are better served by `"bfloat16"`. Blocks run along the last axis where
        it is a multiple of `block_size` (so a moment sharded along any axis is
        encoded where it lives), else through the flattened moment. A positive
        second moment never rounds to zero.

    Adam's state then costs 4 (bfloat16) or about 2.03 (8-bit) bytes per weight
    instead of 8 between steps. Within a step the moments are decoded to float32,
    so the update's transient memory is larger than plain Adam's. With 8-bit
    storage the wrapped optimizer's update is traced twice: once for each block's
    largest values, once for the codes, so that XLA reads the stored codes twice
    instead of writing float32 moments to memory between the two (on an H100 the
    whole update with stochastic rounding moves about half the bytes of float32
    Adam's; the compile takes longer).

    **Arguments:**

    - `optimizer`: any optax optimizer, optax's combinators included (`chain`,
        `masked`, `multi_transform`, `inject_hyperparams`, `MultiSteps`,
        `apply_if_finite`), and `eqx_amp.optim.master_weights`: the two wrap each
        other in either order, and either takes the whole model at `init`. An
        optimizer whose state holds no moment warns at `init`.
    - `storage`: `"bfloat16"` or `"8bit"`.
    - `key`: the PRNG key the roundings are drawn from; `None` means
        `jax.random.key(0)`.
    - `block_size`: values per 8-bit block (256).

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is a
    `LowPrecisionMomentsState`.

    **Raises:**

    `TypeError` for an `optimizer` without `init`/`update` or a `key` that is not a
    PRNG key; `ValueError` for a batch of keys, an unknown `storage` (float16
    included: its range cannot hold second moments) or a `block_size` that is not a
    positive integer. At `init`, a `UserWarning` if the state holds no moment.

    **Example:**

    ```python
    optimizer = eqx_amp.optim.low_precision_moments(optax.adamw(1e-3), "8bit")
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    ```
    """
    check_optimizer(optimizer, "low_precision_moments")
    if storage not in MOMENT_STORAGES:
        hint = (
            " float16 cannot hold Adam's second moments (they fall below its "
            "smallest normal value, 6e-5, long before float32's); use 'bfloat16'."
            if str(storage) in ("float16", "f16", "half")
            else ""
        )
        raise ValueError(
            f"`storage` must be one of {', '.join(map(repr, MOMENT_STORAGES))}, but "
            f"got {storage!r}.{hint}"
        )
    if (
        isinstance(block_size, bool | np.bool_)
        or not isinstance(block_size, numbers.Integral)
        or block_size < 1
    ):
        raise ValueError(
            f"`block_size` must be a positive integer, but got {block_size!r}."
        )
    block_size = int(block_size)  # a NumPy integer too, held as static data
    if key is None:
        key = jax.random.key(0)
    check_key(key, "`low_precision_moments`")
    store = _MomentStore(storage, block_size, key_impl(key))
    key_data = raw_key_data(key)
    inner = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        step = jnp.zeros((), jnp.int32)
        raw_key = jnp.array(key_data, copy=True)
        inner_state = store.compress(inner.init(params), params, step, raw_key)
        return LowPrecisionMomentsState(step, raw_key, inner_state)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LowPrecisionMomentsState):
            raise TypeError(
                "The state passed to the `update` of `eqx_amp.optim."
                "low_precision_moments(...)` must be the `LowPrecisionMomentsState` "
                f"its `init` made, but got {type(state).__name__}."
            )
        check_key_data(state.key, store.impl, "The `LowPrecisionMomentsState`")
        statistics = None
        if storage == "8bit":
            statistics = store.statistics(
                _recomputed(inner, updates, state.inner_state, params, extra_args)
            )
        updates, inner_state = inner.update(
            updates, _decompress(state.inner_state), params, **extra_args
        )
        step = state.step + 1
        inner_state = store.recompress(
            state.inner_state, inner_state, step, state.key, statistics
        )
        return updates, LowPrecisionMomentsState(step, state.key, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class _MomentStore:
    """How `low_precision_moments` stores the moments of a state."""

    storage: MomentStorage
    block_size: int
    impl: Any  # the PRNG implementation of the key the roundings are drawn from

    def _keys(self, step: Array, raw_key: Array, n: int) -> Iterator[PRNGKeyArray]:
        step_key = jax.random.fold_in(wrap_key(raw_key, self.impl), step)
        return iter(jax.random.split(step_key, max(n, 1)))

    def compress(self, state: Any, params: Any, step: Array, raw_key: Array) -> Any:
        """The moments of a freshly initialised state: the subtrees shaped like the
        parameters under a moment's field name (decided from the optimizer's part
        of the path, never from the model's own field names)."""

        def shaped_like_params(node: Any) -> bool:
            return _shaped_like(node, params)

        nodes = jtu.tree_flatten_with_path(state, is_leaf=shaped_like_params)[0]
        by_state = _signs_by_state(state)
        kinds = {
            jtu.keystr(path): kind
            for path, node in nodes
            if shaped_like_params(node)
            and (kind := _moment_kind(path, node, by_state)) is not None
        }
        count = sum(
            sum(map(_is_compressible, jtu.tree_leaves(node)))
            for path, node in nodes
            if jtu.keystr(path) in kinds
        )
        if count == 0 and any(map(_is_compressible, jtu.tree_leaves(params))):
            names = ", ".join(f"`{n}`" for n in sorted(MOMENT_FIELDS))
            warnings.warn(
                _NO_MOMENTS.format(state=type(state).__name__, names=names),
                stacklevel=3,
            )
        # The moments, in order, then encoded together in one compiled program.
        moments = [
            (x, kind)
            for path, node in nodes
            if shaped_like_params(node)
            and (kind := kinds.get(jtu.keystr(path))) is not None
            for x in jtu.tree_leaves(node)
            if _is_compressible(x)
        ]
        encoded = iter(
            _encode_all(
                [x for x, _ in moments],
                tuple(kind for _, kind in moments),
                list(self._keys(step, raw_key, count))[: len(moments)],
                self.storage,
                self.block_size,
                _all_zero([x for x, _ in moments]),
            )
        )

        def one(path, node):
            if jtu.keystr(path) not in kinds or not shaped_like_params(node):
                return node
            return jtu.tree_map(
                lambda x: next(encoded) if _is_compressible(x) else x, node
            )

        return jtu.tree_map_with_path(one, state, is_leaf=shaped_like_params)

    def statistics(self, pair: tuple[Any, Any]) -> list[BlockStatistics]:
        """The 8-bit block statistics of each moment of `new`, from `(old, new)`
        (the stored state and a decoded new state), in the order of `old`'s
        moments; the moments of one weight (its `mu` and `nu`) reduced together."""
        old, new = pair
        paths_and_moments = []

        def one(path, o, n):
            if _is_moment(o):
                paths_and_moments.append((path, n, o.square_root))

        jtu.tree_map_with_path(one, old, new, is_leaf=_is_moment)
        groups: dict[Any, list[int]] = {}
        for i, (path, moment, _) in enumerate(paths_and_moments):
            groups.setdefault((_weight_of(path), moment.shape), []).append(i)
        found: list[Any] = [None] * len(paths_and_moments)
        for members in groups.values():
            stats = block_statistics(
                [paths_and_moments[i][1:] for i in members], self.block_size
            )
            for i, s in zip(members, stats):
                found[i] = s
        return found

    def recompress(
        self,
        old: Any,
        new: Any,
        step: Array,
        raw_key: Array,
        statistics: list[BlockStatistics] | None = None,
    ) -> Any:
        """`new` (decoded) stored as `old` was: the same leaves, the same forms;
        8-bit blocks with `statistics` where given (those of `statistics`)."""
        old_leaves = jtu.tree_leaves(old, is_leaf=_is_moment)
        count = sum(map(_is_moment, old_leaves))
        keys = self._keys(step, raw_key, count)
        stats = iter(statistics if statistics is not None else [None] * count)

        def one(o, n):
            if not _is_moment(o):
                return n
            return encode(
                n, self.storage, o.square_root, self.block_size, next(keys), next(stats)
            )

        return jtu.tree_map(one, old, new, is_leaf=_is_moment)


def _all_zero(moments: list[Array]) -> tuple[bool, ...]:
    """For each of `moments`, whether it is concrete and every value is +0 (an
    optimizer's initial moments): `encode_zeros` gives its encoding. One small
    compiled program for all of them, one transfer of the answers."""
    concrete = [i for i, x in enumerate(moments) if not isinstance(x, jax.core.Tracer)]
    found = [False] * len(moments)
    if concrete:
        nonzero = jax.device_get(_any_nonzero([moments[i] for i in concrete]))
        for i, n in zip(concrete, nonzero):
            found[i] = not n
    return tuple(found)


@jax.jit
def _any_nonzero(moments: list[Array]) -> list[Array]:
    # -0.0 counts: `encode` keeps its sign.
    return [jnp.any((x != 0) | jnp.signbit(x)) for x in moments]


@eqx.filter_jit
def _encode_all(
    moments: list[Array],
    square_roots: tuple[bool, ...],
    keys: list[PRNGKeyArray],
    storage: MomentStorage,
    block_size: int,
    all_zero: tuple[bool, ...],
) -> list[QuantizedMoment]:
    """The freshly initialised moments of a state, encoded in one compiled program
    (`init` usually runs outside `jit`: op by op, a 3-layer MLP's 8-bit state took
    22 s to initialise on a CPU). Moments known to be all zero (`all_zero`, as
    Adam's start) take `encode_zeros`, which compiles at once (a small GPT's 8-bit
    state: 0.5 s to initialise, 3.4 s with `encode`). The others of one shape and
    kind are stacked and encoded by one encode looped over them (`lax.map`), so the
    program grows with the model's distinct shapes rather than its layers (a
    32-layer MLP: 32 s with an encode per moment), and holds one moment's
    temporaries at a time (a batched encode held all of theirs: 3x the memory)."""
    encoded: list[Any] = [None] * len(moments)
    groups: dict[tuple, list[int]] = {}
    for i, (x, square_root) in enumerate(zip(moments, square_roots)):
        if all_zero[i]:
            encoded[i] = encode_zeros(x, storage, square_root, block_size)
        else:
            groups.setdefault((x.shape, x.dtype, square_root), []).append(i)
    for (_, _, square_root), members in groups.items():

        def one(x, key, square_root=square_root):
            return encode(x, storage, square_root, block_size, key)

        if len(members) == 1:
            (i,) = members
            encoded[i] = one(moments[i], keys[i])
            continue
        batch = jax.lax.map(
            lambda pair: one(*pair),
            (
                jnp.stack([moments[i] for i in members]),
                jnp.stack([keys[i] for i in members]),
            ),
        )
        for j, i in enumerate(members):
            encoded[i] = jtu.tree_map(lambda a, j=j: a[j], batch)
    return encoded


def _weight_of(path: tuple) -> tuple:
    """A moment's path without its moment field (`.mu`, `.nu`, ...): the same for
    every moment of one weight. (A model's own field of such a name only groups
    moments differently, which costs bytes, not correctness.)"""
    for i, key in enumerate(path):
        if isinstance(key, jtu.GetAttrKey) and key.name in MOMENT_FIELDS:
            return path[:i] + path[i + 1 :]
    return path


def _recomputed(
    inner: optax.GradientTransformationExtraArgs,
    updates: Any,
    stored: Any,
    params: Any,
    extra_args: dict,
) -> tuple[Any, Any]:
    """`(stored, new)`: the wrapped optimizer's new state, decoded, computed a second
    time from the stored state passed through an optimisation barrier.

    An 8-bit moment cannot be encoded before its blocks' statistics are known, and
    XLA fuses no reduction with the elementwise pass that consumes it: given one
    new moment, it writes the moment to memory in float32 and reads it back, 8
    bytes a value beside the 1 byte stored. Behind the barrier, XLA cannot merge
    the two computations: the statistics reduce a recomputation of the moment from
    the stored codes and the gradients, and the encoding recomputes it again, in
    the pass that writes the codes and the updates. The gradients do not go
    through the barrier: XLA may elide a rounding of theirs (a bfloat16 gradient
    used in float32, under its default `xla_allow_excess_precision`), and both
    computations must see the same values."""
    arrays, rest = eqx.partition(stored, eqx.is_array)
    stored = eqx.combine(jax.lax.optimization_barrier(arrays), rest)
    _, new = inner.update(updates, _decompress(stored), params, **extra_args)
    return stored, new


def _decompress(state: Any) -> Any:
    return jtu.tree_map(
        lambda x: x.decode() if _is_moment(x) else x, state, is_leaf=_is_moment
    )

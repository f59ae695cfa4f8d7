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

import math
import warnings
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, UInt32

from ._optimizers import check_optimizer
from ._rounding import (
    check_key,
    check_key_data,
    key_impl,
    raw_key_data,
    stochastic_round,
    wrap_key,
)


MomentStorage = Literal["bfloat16", "8bit"]
MOMENT_STORAGES: tuple[MomentStorage, ...] = ("bfloat16", "8bit")

# The fields of optax's states that hold moments: running statistics of the
# gradients, one per weight. Those never negative (second moments, sums of squares)
# are stored as square roots: Adam/AdamW/AdaBelief/RMSProp's `nu`, AMSGrad's
# `nu_max`, Adagrad's `sum_of_squares`, Adafactor's factored `v_row`/`v_col`,
# AdaDelta's `e_g`/`e_x`, Adan's `n`. Signed ones: first moments (`mu`, Adan's `m`
# and `v`), momentum's `trace`, `ema`. Other per-weight state (the gradients
# `MultiSteps` accumulates, lookahead's slow weights, schedule-free's `z`) is not a
# moment: stored coarsely, it would move the weights themselves.
NONNEGATIVE_MOMENTS = frozenset(
    {"nu", "nu_max", "sum_of_squares", "v_row", "v_col", "e_g", "e_x", "n"}
)
SIGNED_MOMENTS = frozenset({"mu", "m", "v", "trace", "ema"})
MOMENT_FIELDS = NONNEGATIVE_MOMENTS | SIGNED_MOMENTS


def _dynamic_map(signed: bool) -> np.ndarray:
    """The 8-bit dynamic quantisation map: code values in [-1, 1] (or [0, 1]),
    dense near the top of each decade and spanning seven (eight) decades.

    A code spends its bits on an exponent (a decade, 10^-e) and a linear fraction
    within it: the top decade gets the most points, each lower decade half as many,
    down to a single point. Values relative to their block's largest are what is
    encoded, so large values keep ~1% precision and small ones keep their order of
    magnitude instead of flushing to zero.
    """
    decades = 7 if signed else 8
    magnitudes = [0.0]
    for e in range(decades):
        points = 2 ** (decades - 1 - e)
        low, high = 10.0 ** -(e + 1), 10.0**-e
        magnitudes += [low + (high - low) * (k + 1) / points for k in range(points)]
    values = np.array(magnitudes, np.float32)
    if signed:
        values = np.concatenate([-values[1:], values])
    return np.sort(values)


_SIGNED_MAP = _dynamic_map(signed=True)  # 255 codes
_UNSIGNED_MAP = _dynamic_map(signed=False)  # 256 codes

# The code of each block's largest element, whose value is kept aside. The signed
# map leaves it free; the unsigned map gives up its top point (the block's other
# values are scaled to the point below it instead, which loses nothing: the next
# one down is as close as in the rest of the top decade).
OUTLIER_CODE = 255
# What each stored map value is read as: the map, and the outlier code reading 0
# (the outlier's value is put in its place).
_SIGNED_TABLE = np.append(_SIGNED_MAP, np.float32(0.0))
_UNSIGNED_TABLE = np.append(_UNSIGNED_MAP[:OUTLIER_CODE], np.float32(0.0))


class QuantizedMoment(eqx.Module):
    """One optimizer moment stored in low precision (a leaf of the wrapped state
    inside a `LowPrecisionMomentsState`).

    **Fields:**

    - `values`: bfloat16 values, or uint8 codes into the dynamic map; the moment's
        shape either way (so a sharded moment keeps its sharding).
    - `scales`: for 8-bit storage, what the map's values are multiplied by in each
        block of `block_size` consecutive elements (row-major): the magnitude of
        the block's second largest element, rounded up to bfloat16 (divided by
        the top point of the map, 0.993, for square roots); `None` for bfloat16.
    - `outliers`: for 8-bit storage, the largest element of each block (code
        255), in bfloat16; `None` for bfloat16.
    - `square_root`: whether the square root of the (non-negative) moment is stored.
    """

    values: Array
    scales: Array | None
    outliers: Array | None
    square_root: bool = eqx.field(static=True)
    block_size: int = eqx.field(static=True)

    def decode(self) -> Float[Array, "..."]:
        """The moment in float32, what the wrapped optimizer computes in."""
        if self.scales is None or self.outliers is None:
            stored = self.values.astype(jnp.float32)
        else:
            table = jnp.asarray(_UNSIGNED_TABLE if self.square_root else _SIGNED_TABLE)
            codes = _blocks(self.values, self.block_size)
            scaled = table[codes] * self.scales.astype(jnp.float32)[..., None]
            outliers = self.outliers.astype(jnp.float32)[..., None]
            blocks = jnp.where(codes == OUTLIER_CODE, outliers, scaled)
            stored = _unblock(blocks, self.values.shape)
        if not self.square_root:
            return stored
        # A finite second moment near float32's largest may come back rounded up
        # above it: it stays finite (an inf one, stored as such, stays inf).
        squared = stored * stored
        largest = float(jnp.finfo(jnp.float32).max)
        return jnp.where(jnp.isfinite(stored), jnp.minimum(squared, largest), squared)


def encode(
    moment: Array,
    storage: MomentStorage,
    square_root: bool,
    block_size: int,
    key: PRNGKeyArray,
) -> QuantizedMoment:
    """`moment` stored as `storage`, rounded stochastically."""
    x = moment.astype(jnp.float32)
    if square_root:
        # Non-negative in exact arithmetic; rounding may leave a -0.0 or a tiny
        # negative, which must not become a NaN.
        x = jnp.sqrt(jnp.maximum(x, 0.0))
    if storage == "bfloat16":
        values = stochastic_round(x, jnp.bfloat16, key)
        return QuantizedMoment(values, None, None, square_root, block_size)
    outlier_key, code_key = jax.random.split(key)
    blocks = _blocks(x, block_size)
    # The largest element (a NaN counts as largest) is kept aside, so that the
    # others are scaled by a finite value whenever they are finite.
    magnitude = jnp.where(jnp.isnan(blocks), jnp.inf, jnp.abs(blocks))
    is_outlier = _one_hot_argmax(magnitude)
    outliers = jnp.sum(jnp.where(is_outlier, blocks, 0.0), axis=-1)
    rest = jnp.where(is_outlier, 0.0, blocks)
    # The top of the map that the rest may use: the outlier's code is the
    # unsigned map's top point.
    top = float((_UNSIGNED_TABLE if square_root else _SIGNED_TABLE)[OUTLIER_CODE - 1])
    scales = _round_up_to_bfloat16(jnp.max(jnp.abs(rest), axis=-1) / top)
    # Divided by the square root twice: XLA computes `x / s` as `x * (1 / s)`,
    # and for a scale above 2^126 the reciprocal is subnormal, which CPUs and GPUs
    # flush to zero (so would the block's codes be).
    root = jnp.sqrt(scales.astype(jnp.float32))[..., None]
    root = jnp.where(root > 0, root, 1.0)
    normalised = rest / root / root
    codes = _round_to_map(normalised, not square_root, code_key)
    if square_root:
        # A second moment rounded down to zero would make its Adam step
        # mu / eps: a positive one keeps at least the smallest code (a smaller
        # step instead).
        codes = jnp.where(normalised > 0, jnp.maximum(codes, 1), codes)
    # The unsigned map's top point is the outlier's code, never a rounding's (a
    # value at the top of the rest could round up to it by a float32 ulp).
    codes = jnp.where(is_outlier, OUTLIER_CODE, jnp.minimum(codes, OUTLIER_CODE - 1))
    values = _unblock(codes.astype(jnp.uint8), moment.shape)
    outliers = stochastic_round(outliers, jnp.bfloat16, outlier_key)
    return QuantizedMoment(values, scales, outliers, square_root, block_size)


def _one_hot_argmax(x: Array) -> Array:
    """Marks the first largest element of each row of `x` (along the last axis)."""
    index = jnp.argmax(x, axis=-1, keepdims=True)
    return jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == index


def _round_up_to_bfloat16(x: Array) -> Array:
    """Non-negative `x` (float32) rounded up to bfloat16, so that the values a
    block's scale divides stay within the map; at most bfloat16's largest."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    up = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
    rounded = jax.lax.bitcast_convert_type(up, jnp.float32)
    rounded = jnp.where(jnp.isfinite(x), rounded, x)
    largest = float(jnp.finfo(jnp.bfloat16).max)
    rounded = jnp.where(jnp.isfinite(x), jnp.minimum(rounded, largest), rounded)
    return rounded.astype(jnp.bfloat16)


def _map_position(x: Array, signed: bool) -> Array:
    """Where each value of `x` (in [-1, 1], or [0, 1]) falls in the dynamic map, as
    a fractional index: the map is linear between neighbouring entries, so the
    entries just below and above are `floor` and `ceil` of it, and the fraction
    is the probability of rounding up that keeps the rounding unbiased.

    Computed from the map's layout (decade `e` holds `2**(decades - 1 - e)` evenly
    spaced points up to `10**-e`, and starts where the decade below ends), not
    searched for: a handful of elementwise operations instead of a binary search.
    """
    decades = 7 if signed else 8
    magnitude = jnp.abs(x) if signed else x
    smallest = 10.0 ** -(decades - 1)
    # The decade, from the top (e = 0 holds (0.1, 1]); the last decade's single
    # point is handled below with the segment from zero.
    safe = jnp.maximum(magnitude, smallest)
    e = jnp.clip(jnp.floor(-jnp.log10(safe)), 0, decades - 2)
    points = 2.0 ** (decades - 1 - e)
    low, high = 10.0 ** -(e + 1), 10.0**-e
    position = points + (magnitude - low) / (high - low) * points - 1
    # Below the smallest point: between zero (index 0) and it (index 1).
    position = jnp.where(magnitude <= smallest, magnitude / smallest, position)
    position = jnp.clip(position, 0, 2.0**decades - 1)
    if signed:
        middle = (len(_SIGNED_MAP) - 1) / 2
        return middle + jnp.sign(x) * position
    return position


def _round_to_map(x: Array, signed: bool, key: PRNGKeyArray) -> Array:
    """The index of the map entry just below or just above each value of `x`,
    chosen at random so that the expected entry is the value."""
    position = _map_position(x, signed)
    below = jnp.floor(position)
    up = jax.random.uniform(key, x.shape) < position - below
    return (below + up.astype(below.dtype)).astype(jnp.int32)


def _along_last_axis(shape: tuple[int, ...], block_size: int) -> bool:
    # Blocks within the last axis keep every axis of the moment, so a moment split
    # over devices along any axis is encoded where it lives. Otherwise (a last axis
    # that is not a multiple of the block: a convolution kernel's 3x3) the blocks
    # run through the flattened moment, padded at its end. An empty moment has no
    # blocks along any axis (and a reshape to `(..., -1, block_size)` of nothing
    # has no size to infer).
    return len(shape) > 0 and shape[-1] % block_size == 0 and math.prod(shape) > 0


def _blocks(x: Array, block_size: int) -> Array:
    """`x` as blocks of `block_size` values: `(*x.shape[:-1], n, block_size)`, or
    `(n, block_size)` through the flattened array."""
    if _along_last_axis(x.shape, block_size):
        return x.reshape(*x.shape[:-1], -1, block_size)
    flat = x.reshape(-1)
    padding = -flat.shape[0] % block_size
    return jnp.pad(flat, (0, padding)).reshape(-1, block_size)


def _unblock(blocks: Array, shape: tuple[int, ...]) -> Array:
    if _along_last_axis(shape, blocks.shape[-1]):
        return blocks.reshape(shape)
    return blocks.reshape(-1)[: math.prod(shape)].reshape(shape)


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


def _moment_kind(path: tuple) -> bool | None:
    """For a subtree of the optimizer state shaped like the parameters, at `path`:
    `True` for a non-negative moment, `False` for a signed one, `None` for state
    that is not a moment."""
    if not path or not isinstance(path[-1], jtu.GetAttrKey):
        return None
    name = path[-1].name
    if name in NONNEGATIVE_MOMENTS:
        return True
    if name in SIGNED_MOMENTS:
        return False
    return None


def _shaped_like(node: Any, params: Any) -> bool:
    """Whether `node` has the structure of `params`, with optax's `MaskedNode`
    allowed in place of any subtree (where `optax.masked` and
    `optax.multi_transform` leave out the parameters a transformation does not
    see) and a leaf (an array) in place of each leaf."""
    if isinstance(node, optax.MaskedNode):
        return True
    if params is None:
        return node is None
    params_def = jtu.tree_structure(params)
    if jtu.treedef_is_leaf(params_def):
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
    is: stored coarsely, it would move the weights. Non-negative moments (`nu`,
    `nu_max`, `sum_of_squares`, `v_row`, `v_col`, `n`, `e_g`, `e_x`) are stored as
    their square roots. Encoding rounds stochastically, so the moments stay
    unbiased however small a step's change.

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
    so the update's transient memory is larger than plain Adam's.

    **Arguments:**

    - `optimizer`: any optax optimizer, optax's combinators included (`chain`,
        `masked`, `multi_transform`, `inject_hyperparams`, `MultiSteps`,
        `apply_if_finite`); not an `eqx_amp.optim.master_weights`, which wraps this one
        instead. An optimizer whose state holds no moment warns at `init`.
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
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
    ):
        raise ValueError(
            f"`block_size` must be a positive integer, but got {block_size!r}."
        )
    if key is None:
        key = jax.random.key(0)
    check_key(key, "`low_precision_moments`")
    key_data, impl = raw_key_data(key), key_impl(key)
    inner = optax.with_extra_args_support(optimizer)

    def step_keys(step: Array, raw_key: Array, n: int) -> Iterator[PRNGKeyArray]:
        step_key = jax.random.fold_in(wrap_key(raw_key, impl), step)
        return iter(jax.random.split(step_key, max(n, 1)))

    def compress_moments(state: Any, params: Any, step, raw_key) -> Any:
        """The moments of a freshly initialised state: the subtrees shaped like the
        parameters under a moment's field name (decided from the optimizer's part
        of the path, never from the model's own field names)."""

        def shaped_like_params(node: Any) -> bool:
            return _shaped_like(node, params)

        nodes = jtu.tree_flatten_with_path(state, is_leaf=shaped_like_params)[0]
        kinds = {
            jtu.keystr(path): kind
            for path, node in nodes
            if shaped_like_params(node) and (kind := _moment_kind(path)) is not None
        }
        count = sum(
            sum(map(_is_compressible, jtu.tree_leaves(node)))
            for path, node in nodes
            if jtu.keystr(path) in kinds
        )
        keys = step_keys(step, raw_key, count)

        def one(path, node):
            kind = kinds.get(jtu.keystr(path))
            if kind is None or not shaped_like_params(node):
                return node
            return jtu.tree_map(
                lambda x: (
                    encode(x, storage, kind, block_size, next(keys))
                    if _is_compressible(x)
                    else x
                ),
                node,
            )

        if count == 0 and any(map(_is_compressible, jtu.tree_leaves(params))):
            names = ", ".join(f"`{n}`" for n in sorted(MOMENT_FIELDS))
            warnings.warn(
                _NO_MOMENTS.format(state=type(state).__name__, names=names),
                stacklevel=3,
            )
        return jtu.tree_map_with_path(one, state, is_leaf=shaped_like_params)

    def recompress(old: Any, new: Any, step, raw_key) -> Any:
        """`new` (decoded) stored as `old` was: the same leaves, the same forms."""
        old_leaves = jtu.tree_leaves(old, is_leaf=_is_moment)
        keys = step_keys(step, raw_key, sum(map(_is_moment, old_leaves)))
        return jtu.tree_map(
            lambda o, n: (
                encode(n, storage, o.square_root, block_size, next(keys))
                if _is_moment(o)
                else n
            ),
            old,
            new,
            is_leaf=_is_moment,
        )

    def decompress(state: Any) -> Any:
        return jtu.tree_map(
            lambda x: x.decode() if _is_moment(x) else x, state, is_leaf=_is_moment
        )

    def init_fn(params):
        step = jnp.zeros((), jnp.int32)
        raw_key = jnp.array(key_data, copy=True)
        inner_state = compress_moments(inner.init(params), params, step, raw_key)
        return LowPrecisionMomentsState(step, raw_key, inner_state)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LowPrecisionMomentsState):
            raise TypeError(
                "The state passed to the `update` of `eqx_amp.optim.low_precision_moments"
                "(...)` must be the `LowPrecisionMomentsState` its `init` made, but "
                f"got {type(state).__name__}."
            )
        check_key_data(state.key, impl, "The `LowPrecisionMomentsState`")
        updates, inner_state = inner.update(
            updates, decompress(state.inner_state), params, **extra_args
        )
        step = state.step + 1
        inner_state = recompress(state.inner_state, inner_state, step, state.key)
        return updates, LowPrecisionMomentsState(step, state.key, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

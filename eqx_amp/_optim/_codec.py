"""How one optimizer moment is stored in low precision: bfloat16, or 8 bits per value
in blocks (a dynamic map, each block's largest element kept aside), encoded with
stochastic rounding. `low_precision_moments` (in `_moments.py`) decides which parts
of an optimizer state are moments and stores them with this codec."""

import math
from collections.abc import Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from ._rounding import stochastic_round


MomentStorage = Literal["bfloat16", "8bit"]
MOMENT_STORAGES: tuple[MomentStorage, ...] = ("bfloat16", "8bit")

# The fields of optax's states that hold moments: running statistics of the
# gradients, one per weight. Those never negative (second moments, sums of squares)
# are stored as square roots: Adam/AdamW/AdaBelief/RMSProp's `nu`, AMSGrad's
# `nu_max`, Adagrad's `sum_of_squares`, Adafactor's factored `v_row`/`v_col` and
# unfactored `v` (`_moments._moment_kind` tells it from Adan's), AdaDelta's
# `e_g`/`e_x`, Adan's `n`. Signed ones: first moments (`mu`, Adan's `m` and `v`),
# momentum's `trace`, `ema`. Other per-weight state (the gradients
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
        the block's second largest finite element, rounded up to bfloat16
        (divided by the top point of the map, 0.993, for square roots); `None`
        for bfloat16.
    - `outliers`: for 8-bit storage, the largest element of each block (code
        255, which every other inf or NaN of the block takes too), in bfloat16;
        `None` for bfloat16.
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


class BlockStatistics(eqx.Module):
    """What encoding a moment in 8 bits needs to know of each block before it can
    encode any element: where its largest element is, that element, and the
    magnitude of the next largest (`block_statistics`)."""

    index: Array  # int32, the position of the largest element within its block
    outlier: Array  # float32, the largest element (signed; a NaN is the largest)
    second: Array  # float32, the largest finite magnitude of the others


def block_statistics(
    moments: Sequence[tuple[Array, bool]], block_size: int
) -> list[BlockStatistics]:
    """The statistics of each block of each `(moment, square_root)` (as `encode`
    stores it: its square root where `square_root`), all moments of one shape, in
    one pass over them.

    One reduction carries, per moment, the largest magnitude (a NaN counts as
    largest; the first of equals wins), its position and signed value, and the
    largest magnitude of the rest: two passes (an argmax, then a max of the rest)
    each read the moment again, and XLA writes a moment that is read twice to
    memory, in float32. The moments of one weight (Adam's `mu` and `nu`) go
    together: XLA otherwise fuses the computation of one into the other's
    reduction as a second output, written to memory for its own."""
    operands, inits = [], []
    for moment, square_root in moments:
        blocks = _blocks(_stored(moment, square_root), block_size)
        index = jax.lax.broadcasted_iota(jnp.int32, blocks.shape, blocks.ndim - 1)
        # Each moment is one operand (its index and second are not made from it):
        # XLA does not fuse an expensive producer (a square root) into a reduction
        # that would read it more than once.
        operands += [index, blocks, jnp.zeros_like(blocks)]
        inits += [jnp.int32(block_size), jnp.float32(0.0), jnp.float32(0.0)]

    def larger(a, b):
        out = []
        for i in range(0, len(a), 3):
            (a_index, a_value, a_second), (b_index, b_value, b_second) = (
                a[i : i + 3],
                b[i : i + 3],
            )
            a_key, b_key = (
                _ranking(a_index, a_value, block_size),
                _ranking(b_index, b_value, block_size),
            )
            a_wins = (a_key > b_key) | ((a_key == b_key) & (a_index < b_index))
            loser = jnp.abs(jnp.where(a_wins, b_value, a_value))
            # Finite only: a second inf or NaN is stored as the outlier is
            # (`encode`), so the rest keep a finite scale.
            loser = jnp.where(jnp.isfinite(loser), loser, 0.0)
            second = jnp.maximum(jnp.maximum(a_second, b_second), loser)
            out += [
                jnp.where(a_wins, a_index, b_index),
                jnp.where(a_wins, a_value, b_value),
                second,
            ]
        return tuple(out)

    axis = operands[0].ndim - 1
    reduced = jax.lax.reduce(tuple(operands), tuple(inits), larger, (axis,))
    found = []
    for i in range(0, len(reduced), 3):
        index, outlier, second = reduced[i : i + 3]
        # A -0.0 largest element (a block of zeros) is stored as +0.0, as a sum
        # of it with the block's zeros would give.
        outlier = jnp.where(outlier == 0, 0.0, outlier)
        found.append(BlockStatistics(index, outlier, second))
    return found


def _ranking(index: Array, value: Array, block_size: int) -> Array:
    """What the largest element is chosen by: the magnitude, a NaN above every
    number, and the reduction's starting point (index `block_size`) below all."""
    magnitude = jnp.where(jnp.isnan(value), jnp.inf, jnp.abs(value))
    return jnp.where(index == block_size, -1.0, magnitude)


def _stored(moment: Array, square_root: bool) -> Array:
    """What is encoded of `moment`: float32, its square root where `square_root`."""
    x = moment.astype(jnp.float32)
    if square_root:
        # Non-negative in exact arithmetic; rounding may leave a -0.0 or a tiny
        # negative, which must not become a NaN.
        x = jnp.sqrt(jnp.maximum(x, 0.0))
    return x


def encode(
    moment: Array,
    storage: MomentStorage,
    square_root: bool,
    block_size: int,
    key: PRNGKeyArray,
    statistics: BlockStatistics | None = None,
) -> QuantizedMoment:
    """`moment` stored as `storage`, rounded stochastically. For 8-bit storage,
    `statistics` are its blocks' (`block_statistics`), computed here if `None`: a
    caller that can compute them from a recomputation of `moment` saves XLA
    writing the float32 moment to memory and reading it back."""
    x = _stored(moment, square_root)
    if storage == "bfloat16":
        values = stochastic_round(x, jnp.bfloat16, key)
        return QuantizedMoment(values, None, None, square_root, block_size)
    if statistics is None:
        (statistics,) = block_statistics([(moment, square_root)], block_size)
    outlier_key, code_key = jax.random.split(key)
    blocks = _blocks(x, block_size)
    # The largest element (a NaN counts as largest) is kept aside, so that the
    # others are scaled by a finite value whenever they are finite.
    position = jax.lax.broadcasted_iota(jnp.int32, blocks.shape, blocks.ndim - 1)
    is_outlier = position == statistics.index[..., None]
    rest = jnp.where(is_outlier, 0.0, blocks)
    # The top of the map that the rest may use: the outlier's code is the
    # unsigned map's top point.
    top = float((_UNSIGNED_TABLE if square_root else _SIGNED_TABLE)[OUTLIER_CODE - 1])
    scales = _round_up_to_bfloat16(statistics.second / top)
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
    # A second inf or NaN (two gradients whose second moments overflow, in one
    # block) takes the outlier's code too, and decodes as the outlier, which is
    # then not finite either: the others keep their finite scale.
    held_aside = is_outlier | ~jnp.isfinite(blocks)
    codes = jnp.where(held_aside, OUTLIER_CODE, jnp.minimum(codes, OUTLIER_CODE - 1))
    values = _unblock(codes.astype(jnp.uint8), moment.shape)
    outliers = stochastic_round(statistics.outlier, jnp.bfloat16, outlier_key)
    return QuantizedMoment(values, scales, outliers, square_root, block_size)


def encode_zeros(
    moment: Array, storage: MomentStorage, square_root: bool, block_size: int
) -> QuantizedMoment:
    """What `encode` makes of a `moment` whose every value is +0 (an optimizer's
    initial moments), whatever the key: zero rounds to zero whatever the random
    bits, and each 8-bit block's largest element is its first (ties go to the lower
    index), so it holds the outlier code and the others the map's zero. No rounding
    work, so it compiles in a fraction of `encode`'s time. Each array is made from
    `moment`'s own zeros, not created afresh: under `jit` its sharding then follows
    the moment's, as `encode`'s does (a fresh array would be replicated)."""
    if storage == "bfloat16":
        return QuantizedMoment(
            moment.astype(jnp.bfloat16), None, None, square_root, block_size
        )
    blocks = _blocks(moment.astype(jnp.float32), block_size)
    position = jax.lax.broadcasted_iota(jnp.int32, blocks.shape, blocks.ndim - 1)
    zero = jnp.floor(_map_position(jnp.zeros((), jnp.float32), not square_root))
    codes = jnp.where(position == 0, OUTLIER_CODE, zero.astype(jnp.int32))
    codes = codes + blocks.astype(jnp.int32)  # + 0
    values = _unblock(codes.astype(jnp.uint8), moment.shape)
    scales, outliers = (blocks[..., 0].astype(jnp.bfloat16) for _ in range(2))
    return QuantizedMoment(values, scales, outliers, square_root, block_size)


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

"""Adding an update to a low-precision weight without losing it.

A bfloat16 weight has 8 significant bits, so an update smaller than half a unit in
the last place (about 2^-9 of the weight) rounds away: plain bfloat16 training
stalls once the learning rate has decayed. Two cures, both per element:

- Kahan summation: what rounding took away is kept in a compensation buffer (of the
    weight's dtype) and added back with the next update, so the weight follows the
    float32 sum to within an ulp, at the cost of a second buffer.
- Stochastic rounding: the sum is rounded up or down at random, with the
    probabilities that make the rounding unbiased, so small updates survive in
    expectation. No buffer, only a PRNG key.

Both compute in float32, which holds every bfloat16 value exactly and the
difference of two bfloat16 values close to each other exactly, so the update
returned (`new - weight`) adds back to exactly `new` in float32.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, UInt32


# What compensated weights may be stored in. float16 is refused: its range (6.5e4)
# is not float32's, so a compensated float16 weight can still overflow to inf, and
# its 11 bits leave little for compensation to do that a loss scale would not undo.
COMPENSATED_DTYPE = np.dtype(jnp.bfloat16)


def check_compensated_dtype(dtype: Any, where: str) -> None:
    """Raises unless `dtype` is one compensation is for (bfloat16) or needs none
    (float32 and wider, which are updated as they are)."""
    dtype = np.dtype(dtype)
    if dtype == COMPENSATED_DTYPE or (
        jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4
    ):
        return
    raise ValueError(
        f"{where} holds {dtype.name} weights, but compensated updates (Kahan "
        "summation, stochastic rounding) need bfloat16 weights (float32 and wider "
        "ones are updated as they are). float16 has not float32's range, so a "
        "float16 weight can still overflow: keep a float32 master for float16 "
        '(`policy="mixed_float16"`, or `eqx_amp.optim.master_weights`), or store bfloat16.'
    )


def check_key(key: Any, what: str) -> None:
    """Raises unless `key` is a PRNG key: typed (`jax.random.key`, any
    implementation) or a raw default one (`jax.random.PRNGKey`)."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(
        key.dtype, jax.dtypes.prng_key
    )
    raw_shape = jax.random.key_data(jax.random.key(0)).shape
    raw = isinstance(key, jax.Array) and key.dtype == jnp.uint32
    # A batch of keys (what `jax.random.split` returns) would only fail at the
    # first update, with JAX's message about shapes.
    if typed:
        batch = key.shape
    elif raw and key.shape[-len(raw_shape) :] == raw_shape:
        batch = key.shape[: -len(raw_shape)]
    else:
        batch = ()
    if batch:
        raise ValueError(
            f"{what} needs one PRNG key as `key`, but got a batch of keys of shape "
            f"{batch} (what `jax.random.split` returns): pass one of them, such as "
            "`keys[0]`."
        )
    raw = raw and key.shape == raw_shape
    if not (typed or raw):
        raise TypeError(
            f"{what} needs a PRNG key to draw its roundings from (reproducible: the "
            f"same key gives the same training run), such as `jax.random.key(0)`, "
            f"but got {type(key).__name__} {key!r}."
        )


def raw_key_data(key: PRNGKeyArray) -> UInt32[Array, "..."]:
    """The raw data of a PRNG key, as states store it: `eqx.tree_serialise_leaves`
    and orbax save a uint32 array like any other, not a typed key."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def key_impl(key: PRNGKeyArray) -> str | None:
    """The name of a typed key's implementation (`None`: the default), to rebuild
    the key from its raw data."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key))
    return None


def wrap_key(data: Array, impl: str | None) -> PRNGKeyArray:
    return jax.random.wrap_key_data(data, impl=impl)


def check_key_data(data: Any, impl: str | None, what: str) -> None:
    """Raises unless `data` is the raw data of a key of `impl`, as stored in a
    state (a state built by hand, or loaded into the wrong structure)."""
    expected = jax.random.key_data(jax.random.key(0, impl=impl)).shape
    if not (
        isinstance(data, jax.Array)
        and data.dtype == jnp.uint32
        and data.shape == expected
    ):
        raise TypeError(
            f"{what} holds no PRNG key to draw its roundings from (the raw uint32 "
            f"data of shape {expected} that its `init` stores), but "
            f"{type(data).__name__} {data!r}."
        )


def stochastic_round(x: Array, dtype: Any, key: PRNGKeyArray) -> Array:
    """`x` (float32) rounded to the bfloat16 `dtype` up or down at random, unbiased:
    a value a quarter of the way from one bfloat16 to the next rounds up with
    probability 1/4.

    bfloat16 is float32 without its low 16 bits, so adding 16 random bits below
    the kept ones and truncating rounds the magnitude up with exactly the right
    probability (sign and magnitude are separate in IEEE floats, so this is
    unbiased for negative values too).
    """
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> jnp.uint32(16)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    value = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(dtype)
    # A NaN's payload could carry into its sign bit: inf and NaN round as they are.
    return _held_in_range(value, x, dtype, x.astype(dtype))


def round_to_nearest(x: Array, dtype: Any) -> Array:
    """`x` rounded to the nearest value of `dtype`, a finite `x` past `dtype`'s
    largest held at the largest, as `stochastic_round` holds it: a weight whose sum
    with its update a float32 holds is never stored as inf (a bfloat16 within
    float32's range but past bfloat16's largest would round to inf). inf and NaN
    round as they are; complex values as `astype` rounds them."""
    rounded = x.astype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return rounded
    return _held_in_range(rounded, x, dtype, rounded)


def _held_in_range(rounded: Array, x: Array, dtype: Any, nonfinite: Array) -> Array:
    """`rounded` (`x` in `dtype`) with a finite `x` that rounded past `dtype`'s
    largest held at the largest, as nearest rounding within range would take it;
    `nonfinite` where `x` is inf or NaN."""
    largest = jnp.finfo(dtype).max
    return jnp.where(jnp.isfinite(x), jnp.clip(rounded, -largest, largest), nonfinite)


def kahan_add(weight: Array, update: Array, compensation: Array) -> tuple[Array, Array]:
    """`weight + update` rounded to the weight's dtype, with what the rounding lost
    carried in `compensation` (the weight's dtype) to the next step.

    Returns `(new_weight, new_compensation)`.
    """
    wide = jnp.float32
    total = update.astype(wide) + compensation.astype(wide)
    new = round_to_nearest(weight.astype(wide) + total, weight.dtype)
    lost = total - (new.astype(wide) - weight.astype(wide))
    return new, round_to_nearest(lost, compensation.dtype)


def exact_update(new: Array, weight: Array) -> Array:
    """The float32 update that takes `weight` to `new`: `new - weight`, which
    `eqx_amp.optim.apply_updates` (and `optax.apply_updates`, which adds in the wider
    dtype) adds back to exactly `new`. (Exact whenever `new` is within 2^16 of
    `weight`'s magnitude, which is every practical step; an update that takes a
    weight to below 2^-24 of itself lands on that tiny value's neighbourhood, not
    on it.)"""
    return new.astype(jnp.float32) - weight.astype(jnp.float32)

"""What `telemetry` measures of one tensor: the statistics of a cast or of a value as
a product reads it (`statistics_of`), as traced values of the step, combined over
the sites of one layer and role (`combine`) and across devices (`across`). The
pass that finds the tensors and names them is `_measure`."""

import dataclasses
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .._core._platform import with_cpu_form
from .._jaxpr import _compat as compat
from ._naming import Path


WEIGHT = "weight"
ACTIVATION = "activation"
OUTPUT_GRADIENT = "output gradient"
PARAMETER_GRADIENT = "parameter gradient"

Scalar = Float[Array, "*iterations"]


@dataclasses.dataclass(eq=False)
class Site:
    """One measured tensor of the program. Its layer may be known only when a later
    product reads it, so it is filled in then (sites hash by identity)."""

    role: str
    dtype: str
    at_cast: bool
    layer: Path | None = None
    scaling: str | None = None  # "tensorwise", "rowwise", "mxfp8", "nvfp4"


class Measured(eqx.Module):
    """The statistics of one site, as traced values: counts of values (float32, so
    that they sum across devices and scan iterations without overflowing), the
    largest magnitude, and the fp8 scale. `flushed`, `subnormal`, `saturated` and
    `nonfinite` count values of the tensor, `sampled` the values counted (all of
    them, or a CPU's sample); `any_saturated` and `any_nonfinite` (0 or 1) say
    exactly whether it holds such a value.
    Each `stack` entry is a leading axis (one entry per scan iteration), given by the
    paths of the parameters that scan iterates over (`index_position` finds where in
    the layer's path its index goes). `same_along` are the `shard_map` axes along
    which the tensor is typed as varying yet the same on every device (`pvary`)."""

    site: Site = eqx.field(static=True)
    stack: tuple[frozenset[Path], ...] = eqx.field(static=True)
    same_along: frozenset = eqx.field(static=True)
    size: Scalar
    sampled: Scalar
    amax: Scalar
    flushed: Scalar
    subnormal: Scalar
    saturated: Scalar
    nonfinite: Scalar
    any_saturated: Scalar
    any_nonfinite: Scalar
    scale: Scalar | None

    COUNTS = ("size", "sampled", "flushed", "subnormal", "saturated", "nonfinite")
    FLAGS = ("amax", "any_saturated", "any_nonfinite")  # combined by their maximum


def _rounds_to_inf(dtype: Any) -> float:
    """The smallest (float32) magnitude a cast to `dtype` does not round to a finite
    value: halfway past its largest finite value, or just past halfway where that
    value's last bit is even (e4m3fn's 448), to which the tie rounds (ties to even)."""
    largest = np.asarray(jnp.finfo(dtype).max, dtype)
    below = np.nextafter(largest, np.asarray(0, dtype))
    halfway = np.float32(float(largest) + (float(largest) - float(below)) / 2)
    last_bit = int(largest.view(f"u{largest.dtype.itemsize}")) & 1
    return float(halfway if last_bit else np.nextafter(halfway, np.float32(np.inf)))


def _magnitude_bits(x: Array) -> Array:
    """`|x|` in float32, as its int32 bit pattern. For magnitudes the integer order
    is the float order (inf above every finite value, NaN above inf), and integer
    ops read float32 subnormals as they are: a float max on the CPU flushes them to
    zero (1e-40 has an amax of 0 there)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits & np.int32(0x7FFFFFFF)


def _from_bits(bits: Array) -> Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def _amax(magnitude: Array, scale: Array | None) -> Array:
    """The largest of `magnitude` (`_magnitude_bits`; NaN if it holds a NaN), in one
    max reduction; for an fp8 cast, of the tensor before scaling (`magnitude /
    scale`), reduced to the scale's shape first so that no full-size division runs."""
    if magnitude.size == 0:
        return jnp.zeros((), jnp.float32)
    if scale is None:
        return _from_bits(jnp.max(magnitude))
    if scale.ndim == magnitude.ndim:
        axes = tuple(i for i, n in enumerate(scale.shape) if n == 1)
        largest = _from_bits(jnp.max(magnitude, axis=axes, keepdims=True))
        return _from_bits(jnp.max(_magnitude_bits(largest / scale)))
    return _from_bits(jnp.max(magnitude)) / jnp.min(scale)


# The int32 bit pattern of float32's inf: magnitudes (`_magnitude_bits`) below it
# are finite.
_INF_BITS = int(np.float32(np.inf).view(np.int32))


def _bits_of(magnitude: float) -> int:
    return int(np.float32(magnitude).view(np.int32))


def _held(
    magnitude: Array, dtype: Any, at_cast: bool, clips: bool = False
) -> list[Array]:
    """Masks of the values `magnitude` (`_magnitude_bits`) that `dtype` holds as
    subnormals and as inf or NaN; at a cast into `dtype` (`magnitude` of the values
    before it), also of those it flushes to zero and those past its largest finite
    value (saturated, or overflowed to inf: NaN in e4m3fn). A cast that `clips`
    (fp8 quantisation clips finite values to the largest first) makes inf or NaN
    of inf and NaN alone."""
    finfo = jnp.finfo(dtype)
    tiny, smallest = float(finfo.smallest_subnormal), float(finfo.smallest_normal)
    if not at_cast:
        return [
            (magnitude > 0) & (magnitude < _bits_of(smallest)),
            magnitude >= _INF_BITS,
        ]
    # Rounding to nearest, ties to even: half the smallest subnormal rounds to zero
    # (even) and half a subnormal step below the smallest normal rounds up to it.
    flushed_up_to = _bits_of(tiny / 2)
    finite = magnitude < _INF_BITS
    nonfinite_from = min(_bits_of(_rounds_to_inf(dtype)), _INF_BITS)
    return [
        (magnitude > flushed_up_to) & (magnitude < _bits_of(smallest - tiny / 2)),
        magnitude >= (_INF_BITS if clips else nonfinite_from),
        (magnitude > 0) & (magnitude <= flushed_up_to),
        finite & (magnitude > _bits_of(float(finfo.max))),
    ]


def _reduce_whole(maxima: list[Array], sums: list[Array]) -> tuple[list, list]:
    """The largest value of each of `maxima` (int32, at least 0) and the sum of each
    of `sums` (float32) over every axis, as one variadic reduction: XLA makes one
    pass of it over the tensor (a second, tiny one for a large tensor), fused with
    the kernel that writes the tensor where it can, rather than one pass per
    statistic."""
    operands = (*maxima, *sums)
    if operands[0].size == 0:
        zero_int, zero = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
        return [zero_int] * len(maxima), [zero] * len(sums)
    n = len(maxima)

    def combine_two(a, b):
        return tuple(
            jnp.maximum(x, y) if i < n else x + y for i, (x, y) in enumerate(zip(a, b))
        )

    init = (np.int32(0),) * n + (np.float32(0),) * len(sums)
    out = lax.reduce(operands, init, combine_two, tuple(range(operands[0].ndim)))
    return list(out[:n]), list(out[n:])


# On a CPU the fractions are counted in at most this many values of each tensor,
# taken at a fixed stride (all of them in a smaller tensor): there counting every
# value costs compute, not memory traffic (`benchmarks/telemetry_overhead.py`).
SAMPLE_SIZE = 4096


def _stride(shape: tuple[int, ...]) -> int:
    """The stride of a tensor's sample: at most `SAMPLE_SIZE` values of the
    flattened tensor, the stride coprime with its last axis, so that the sample
    visits every column (a stride that is a multiple of the row length would read
    one column only)."""
    size = int(np.prod(shape))
    stride = max(1, -(-size // SAMPLE_SIZE))
    last = shape[-1] if shape else 1
    while stride > 1 and np.gcd(stride, last) != 1:
        stride += 1
    return stride


def _sample(x: Array, stride: int) -> Array:
    flat = x.reshape(-1)
    if stride == 1:
        return flat
    return lax.slice(flat, (0,), ((flat.size - 1) // stride * stride + 1,), (stride,))


def _counted_whole(magnitude: Array, dtype: Any, at_cast: bool, fp8_scaled: bool):
    """`(largest magnitude or None, counted, counts)` of every value, in one pass
    (`_reduce_whole`). An fp8 cast's amax is left to `_amax`, as its quantisation
    takes it: XLA merges the two (one pass fewer on the H100 compile)."""
    maxima = [] if fp8_scaled else [magnitude]
    masks = [
        m.astype(jnp.float32) for m in _held(magnitude, dtype, at_cast, fp8_scaled)
    ]
    largest, counts = _reduce_whole(maxima, masks)
    return (None if fp8_scaled else largest[0]), float(magnitude.size), counts


def _counted_sample(magnitude: Array, dtype: Any, at_cast: bool, fp8_scaled: bool):
    """`_counted_whole` on a CPU: the amax in its own max pass, the fractions
    counted in a strided sample of at most `SAMPLE_SIZE` values."""
    sample = _sample(magnitude, _stride(magnitude.shape))
    masks = jnp.stack(_held(sample, dtype, at_cast, fp8_scaled))
    counts = list(jnp.sum(masks, axis=1, dtype=jnp.float32))
    largest = None if fp8_scaled or magnitude.size == 0 else jnp.max(magnitude)
    return largest, float(sample.size), counts


def statistics_of(
    site: Site,
    value: Array,
    source: Array | None,
    scale: Array | None,
    same_along: frozenset,
) -> Measured:
    """`value` as the program holds it (in its half or fp8 dtype); `source`, when
    `value` was cast from it, the wider value before the cast.

    One pass over the tensor counts every value (exactly) and gives its largest
    magnitude, and with them whether it holds an inf or NaN or (at a cast) values
    too large for the dtype; rowwise fp8 scales add a reduction to the scale's
    shape for the amax. A CPU counts a strided sample instead (`_counted_sample`):
    which one runs is chosen as the program is lowered."""
    f32 = jnp.float32
    value, source = lax.stop_gradient((value, source))
    # Every statistic is read from one int32 array, the float32 magnitudes' bits:
    # integer comparisons order magnitudes as floats do, and read float32
    # subnormals as they are (a CPU's float comparisons may flush them). At a cast,
    # what the cast makes of each value is known from the value before it
    # (conversions round to nearest, ties to even), so the pass reads that tensor
    # alone and XLA can fuse it into the kernel that makes it.
    magnitude = _magnitude_bits(value if source is None else source)
    at_cast, fp8_scaled = source is not None, scale is not None

    half_cast = at_cast and not fp8_scaled
    largest_finite = float(jnp.finfo(value.dtype).max)

    def form(count, sampled):
        def counted(magnitude):
            largest, n, counts = count(magnitude, value.dtype, at_cast, fp8_scaled)
            if largest is None:
                largest = jnp.zeros((), jnp.int32)
            saturated = counts[3] > 0 if half_cast else jnp.zeros((), bool)
            if sampled and half_cast:
                # A sample can miss the one value past the dtype's range: a pass of
                # its own says whether there is one.
                amax = _from_bits(largest)
                saturated = _saturates(magnitude, amax, largest_finite)
            return largest, jnp.asarray(n, f32), counts, saturated

        return counted

    largest, sampled, counts, any_saturated = with_cpu_form(
        magnitude,
        cpu=form(_counted_sample, sampled=True),
        default=form(_counted_whole, sampled=False),
    )
    amax = _amax(magnitude, scale) if fp8_scaled else _from_bits(largest)
    zero = jnp.zeros((), f32)
    subnormal, nonfinite, *at_cast_counts = counts
    flushed, saturated = at_cast_counts or (zero, zero)
    # Whether a tensor holds an inf or NaN is exact whichever values were counted:
    # the amax says.
    if half_cast:
        any_nonfinite = ~(amax < _rounds_to_inf(value.dtype))
    else:
        # fp8 casts the scaled tensor clipped to the dtype's range: only inf and NaN.
        any_nonfinite = ~jnp.isfinite(amax)
    return Measured(
        site,
        (),
        same_along,
        jnp.asarray(value.size, f32),
        sampled,
        amax,
        flushed,
        subnormal,
        saturated,
        nonfinite,
        any_saturated.astype(f32),
        any_nonfinite.astype(f32),
        None if scale is None else jnp.min(scale).astype(f32),
    )


def _saturates(magnitude: Array, amax: Array, largest: float) -> Array:
    """Whether a finite value of `magnitude` (`_magnitude_bits`) is past `largest`.
    An inf or NaN amax hides the largest finite value: only then does a second pass
    over the tensor run (`lax.cond`), to look for one."""
    limit = np.float32(largest).view(np.int32)

    def look() -> Array:
        return jnp.any((magnitude > limit) & (magnitude < _INF_BITS))

    return lax.cond(jnp.isfinite(amax), lambda: amax > largest, look)


def combine(group: list[Measured]) -> Measured:
    """One site's statistics from several measurements of it (summed counts,
    largest amax, smallest scale)."""
    first = group[0]
    fields: dict[str, Any] = {
        k: sum(getattr(m, k) for m in group) for k in Measured.COUNTS
    }
    for k in Measured.FLAGS:
        fields[k] = jnp.max(jnp.stack([getattr(m, k) for m in group]), axis=0)
    scales = [m.scale for m in group if m.scale is not None]
    scale = jnp.min(jnp.stack(scales), axis=0) if scales else None
    return dataclasses.replace(first, scale=scale, **fields)


def across(made: list, axis_names: frozenset) -> list:
    """Measurements made per device, made global: amax maxed, counts summed over
    the axes along which the tensor differs from device to device. A tensor the same
    on every device (a replicated weight) is one tensor, counted once."""

    every = tuple(axis_names)

    def reduce(m: Measured) -> Measured:
        differs = tuple(axis_names & _varying(m, axis_names))
        # The max over the other axes (of equal values) leaves them typed the same.
        fields = {
            k: lax.pmax(lax.psum(getattr(m, k), differs), every)
            for k in Measured.COUNTS
        }
        for k in Measured.FLAGS:
            fields[k] = lax.pmax(getattr(m, k), every)
        scale = None if m.scale is None else lax.pmin(m.scale, every)
        return dataclasses.replace(m, scale=scale, **fields)

    return [reduce(m) for m in made]


def _varying(m: Measured, axis_names: frozenset) -> frozenset:
    """The axes along which the measured tensor may differ, as `shard_map` types the
    values computed from it. Without those types (`check_vma=False`, `pmap`) every
    device is taken to hold a different tensor."""
    if compat.is_unchecked_manual_axis(tuple(axis_names)):
        return axis_names
    fields = [getattr(m, k) for k in (*Measured.COUNTS, *Measured.FLAGS)]
    varying = frozenset().union(*(compat.varying_axes(v) for v in fields))
    return varying - m.same_along

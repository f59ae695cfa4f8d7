"""Which products an fp8 kernel takes (shapes), and which pay for their quantisation
(an H100 or B200 estimate from the shapes, for `rule.where_it_pays()`)."""

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax import lax


# The primitives fp8 rules and filters turn into fp8 products.
FP8_PRIMITIVES = frozenset({lax.dot_general_p, lax.conv_general_dilated_p})
# fp8 GEMMs (cuBLASLt on Hopper) need every dimension to be a multiple of 16.
FP8_MULTIPLE = 16
# MXFP8: values per scale, along the contracting dimension.
BLOCK = 32
# NVFP4's block: values per e4m3 block scale along the contracting dimension.
NV_BLOCK = 16


def free_axes(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
    """The axes of an operand of `ndim` axes that a product neither contracts nor
    batches over."""
    return [i for i in range(ndim) if i not in contracting and i not in batch]


def fp8_conv_eligible(rhs_shape, params: dict) -> str | None:
    """Why a convolution with this kernel cannot run in fp8, or `None`: its input
    and output feature counts must be multiples of 16."""
    rhs_spec = params["dimension_numbers"].rhs_spec
    sizes = {
        "output features": rhs_shape[rhs_spec[0]],
        "input features": rhs_shape[rhs_spec[1]],
    }
    bad = [f"{name} {n}" for name, n in sizes.items() if n % FP8_MULTIPLE]
    if bad:
        return f"{', '.join(bad)} not a multiple of {FP8_MULTIPLE}"
    return None


def fp8_eligible(lhs_shape, rhs_shape, dims) -> str | None:
    """Why a matmul of these shapes cannot run as an fp8 GEMM, or `None` if it can:
    every dimension must be a multiple of 16."""
    (lc, rc), (lb, rb) = dims
    sizes = {
        "contracting": int(np.prod([lhs_shape[i] for i in lc], dtype=np.int64)),
        "lhs free": int(
            np.prod(
                [lhs_shape[i] for i in free_axes(len(lhs_shape), lc, lb)],
                dtype=np.int64,
            )
        ),
        "rhs free": int(
            np.prod(
                [rhs_shape[i] for i in free_axes(len(rhs_shape), rc, rb)],
                dtype=np.int64,
            )
        ),
    }
    bad = [f"{name} size {n}" for name, n in sizes.items() if n % FP8_MULTIPLE]
    if bad:
        return f"{', '.join(bad)} not a multiple of {FP8_MULTIPLE}"
    return None


@dataclasses.dataclass(frozen=True)
class _Estimate:
    """What `where_it_pays` assumes of a GPU and of one scaling's quantisation: the
    roofline of the benchmarks (`benchmarks/_gpu_hlo.py`: GEMMs at 70% of the
    dense peak, other kernels at 80% of the memory bandwidth) and a cost per
    kernel launched, fitted to a measured H100 step (7 us, `benchmarks/RESULTS.md`:
    the fp8 steps there lost on their extra kernels, not on their bytes)."""

    gpu: str
    gemms: str
    bf16_flops: float
    fp8_flops: float
    bytes_per_s: float
    # Bytes moved per value quantised, and kernels launched per product, for its
    # two operands and its output gradient.
    bytes_per_value: float
    kernels: int
    kernel_s: float = 7e-6


# An amax pass (2 bytes read a value) and a quantise pass (2 read, 1 written)
# over each of the three tensors.
_TENSORWISE = _Estimate(
    "an H100", "fp8 GEMMs", 0.7 * 989e12, 0.7 * 1979e12, 0.8 * 3.35e12, 5, 6
)
_ESTIMATES = {
    "tensorwise": _TENSORWISE,
    # Each tensor quantised along both of its axes, as MXFP8 below (without its
    # block scales): the H100 compile shows that form.
    "rowwise": dataclasses.replace(_TENSORWISE, bytes_per_value=3 * 2 + 2, kernels=9),
    # Each tensor is quantised along both of the axes its products contract: an
    # amax pass along one, a quantise pass along it (which XLA fuses with the
    # other's amax) and a quantise pass along the other: 3 reads of 2 bytes, 2
    # writes of a byte and a scale per 32 values.
    "mxfp8": _Estimate(
        "a B200",
        "MXFP8 GEMMs",
        0.7 * 2250e12,
        0.7 * 4500e12,
        0.8 * 8e12,
        3 * 2 + 2 * (1 + 1 / 32),
        9,
    ),
}


def fp8_cost_reason(scaling: str, lhs_shape, rhs_shape, dims) -> str | None:
    """Why a matmul of these shapes should stay out of fp8 under `scaling` (its fp8
    GEMMs would save less time than quantising costs: tensorwise and rowwise on an
    H100's roofline, MXFP8 on a B200's), or `None`.

    Saved: the forward product and the two backward ones, each 2·B·M·N·K FLOPs,
    at fp8's rate instead of bfloat16's. Cost: the quantisation of both operands
    and of the output gradient (`_ESTIMATES`), and its kernels' launches. An
    operand shared by several products (a weight quantised once per call, the
    input of q, k and v) is counted for each, so the estimate errs towards
    bfloat16."""
    estimate = _ESTIMATES[scaling]
    (lc, rc), (lb, rb) = dims

    def size(shape, axes):
        return int(np.prod([shape[i] for i in axes], dtype=np.int64))

    batch, contracting = size(lhs_shape, lb), size(lhs_shape, lc)
    m = size(lhs_shape, free_axes(len(lhs_shape), lc, lb))
    n = size(rhs_shape, free_axes(len(rhs_shape), rc, rb))
    flops = 2.0 * batch * m * n * contracting
    saved = 3 * flops * (1 / estimate.bf16_flops - 1 / estimate.fp8_flops)
    quantised = batch * (m * contracting + n * contracting + m * n)
    cost = (
        estimate.bytes_per_value * quantised / estimate.bytes_per_s
        + estimate.kernels * estimate.kernel_s
    )
    if saved > cost:
        return None
    return (
        f"too small to gain: its {estimate.gemms} would save {saved * 1e6:.3g} us on "
        f"{estimate.gpu}, quantising costs {cost * 1e6:.3g} us (`where_it_pays`)"
    )


def block_scaled_eligible(
    lhs_shape, rhs_shape, dims, block: int = BLOCK, format: str = "MXFP8"
) -> str | None:
    """Why a matmul of these shapes cannot run as a block-scaled GEMM of `format`
    with blocks of `block` values, or `None` if it can: its contracting size must
    be a multiple of the block (the backward products' contracting sizes, the
    forward's free ones, are padded)."""
    (lc, _), _ = dims
    contracting = int(np.prod([lhs_shape[i] for i in lc], dtype=np.int64))
    if contracting % block:
        return (
            f"contracting size {contracting} not a multiple of the {format} block "
            f"size {block}"
        )
    return None


def ineligible(scaling: str, lhs_shape, rhs_shape, dims) -> str | None:
    """Why no GEMM of `scaling` takes a matmul of these shapes; None if one does."""
    if scaling == "mxfp8":
        return block_scaled_eligible(lhs_shape, rhs_shape, dims)
    if scaling in ("nvfp4", "nvfp4_training"):
        return block_scaled_eligible(lhs_shape, rhs_shape, dims, NV_BLOCK, "NVFP4")
    return fp8_eligible(lhs_shape, rhs_shape, dims)

"""Delayed fp8 scaling: the scales of a call's tensorwise fp8 products handed in (from
the amaxes of earlier steps), the amaxes of this call's tensors handed out.

Within `delayed_scales(supply)`, each tensorwise fp8 matmul takes its scales from
`supply` instead of the amax of the tensor it quantises: an activation (the operand
that is not a weight) one scale per distinct array (products reading the same array
share its fp8 form), each product's output gradient one scale, and, if `supply`
holds weight scales, each weight quantised once per call one scale. The amax of each
tensor is computed in the pass that quantises it (XLA makes the two one fusion: the
tensor is read once), and comes out as the cotangent of the scale that quantised it
(Flax's `fp8_ops` and Transformer Engine hand amaxes out the same way): differentiate
the call with respect to the scales to read this step's amaxes. Slots are taken in
program order, so the same program takes the same slots at every trace; a supply
without scales (`DelayedScales.counting()`) hands out ones and counts the slots.

A measurement prototype (the benchmarks' `filter_amp_fp8_delayed`); no public name
reaches it, and `benchmarks/RESULTS.md` ("Delayed scaling, measured") says why. Only
tensorwise matmuls traced unbatched take delayed scales (the wrapper outside any
`jax.vmap`: a batched one is refused); convolutions, rowwise and MXFP8 products keep
their own scaling.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ._products import fp8_matmul_delayed, known_fp8
from ._scaling import E4M3, quantize_and_amax


class DelayedScales:
    """The scales of one call's fp8 products (float32 scalars, each a power of two),
    by kind: `activations`, `gradients` and `weights` (None: weights keep current
    scaling). Lists of None count the slots instead (`counting()`)."""

    def __init__(
        self,
        activations: list | None,
        gradients: list | None,
        weights: list | None = None,
        count_weights: bool = False,
    ):
        self.activations, self.gradients, self.weights = activations, gradients, weights
        self.count_weights = count_weights
        self.taken = {"activations": 0, "gradients": 0, "weights": 0}
        # id(array) -> (array, fp8 values, scale): an activation quantised already.
        self._quantized: dict[int, tuple[Array, Array, Array]] = {}
        # id(weight) -> (weight, scale, amax): a weight quantised with a given scale
        # whose amax no product has handed out yet.
        self._pending: dict[int, tuple[Array, Array, Array]] = {}

    @classmethod
    def counting(cls, weights: bool = False) -> "DelayedScales":
        return cls(None, None, None, count_weights=weights)

    @property
    def delays_weights(self) -> bool:
        return self.weights is not None or self.count_weights

    def _take(self, kind: str) -> Array:
        index = self.taken[kind]
        self.taken[kind] += 1
        scales = getattr(self, kind)
        if scales is None:
            return jnp.ones((), jnp.float32)
        if index >= len(scales):
            raise ValueError(
                f"The delayed fp8 scales hold {len(scales)} {kind[:-1]} scales, but "
                f"the program has more fp8 products: initialise the state from the "
                f"same program."
            )
        return jnp.asarray(scales[index], jnp.float32)

    def activation(self, x: Array) -> tuple[Array, Array, tuple]:
        """`x`'s fp8 values, their scale (shaped to broadcast against `x`) and what to
        hand out: `((scale,), (amax,))` the first time `x` is read, else `((), ())`."""
        entry = self._quantized.get(id(x))
        if entry is not None and entry[0] is x:
            return entry[1], entry[2], ((), ())
        scale = self._take("activations")
        quantized, amax = quantize_and_amax(x, scale, E4M3)
        shaped = jnp.reshape(lax.stop_gradient(scale), (1,) * x.ndim)
        self._quantized[id(x)] = (x, quantized, shaped)
        return quantized, shaped, ((scale,), (amax,))

    def gradient(self) -> Array:
        return self._take("gradients")

    def weight_scale(self) -> Array:
        return self._take("weights")

    def weight_quantized(self, weight: Array, scale: Array, amax: Array) -> None:
        self._pending[id(weight)] = (weight, scale, amax)

    def weight_amax(self, weight: Any) -> tuple:
        """What the first product reading `weight` hands out: its scale and amax."""
        entry = self._pending.get(id(weight))
        if entry is None or entry[0] is not weight:
            return (), ()
        del self._pending[id(weight)]
        return (entry[1],), (entry[2],)


_supply: contextvars.ContextVar[DelayedScales | None] = contextvars.ContextVar(
    "eqx_amp_fp8_delayed", default=None
)


@contextlib.contextmanager
def delayed_scales(supply: DelayedScales) -> Iterator[DelayedScales]:
    token = _supply.set(supply)
    try:
        yield supply
    finally:
        _supply.reset(token)


def current_supply() -> DelayedScales | None:
    return _supply.get()


def delayed_matmul(
    supply: DelayedScales,
    lhs: Array,
    rhs: Array,
    dims: Any,
    out_dtype: Any,
    lhs_dtype: Any,
    rhs_dtype: Any,
    grad_dtype: Any,
) -> Array:
    """A tensorwise fp8 matmul whose scales come from `supply`: each operand
    quantised once per call (a weight by `quantize_weights_once`, any other array
    at its first product), the output gradient with a scale of its own."""
    forms, scales, amaxes = [], [], []
    for x in (lhs, rhs):
        known = known_fp8(x)
        if known is None:
            quantized, scale, (handed, amax) = supply.activation(x)
            known = (quantized, scale)
        else:
            handed, amax = supply.weight_amax(x)
        forms.append(known)
        scales += handed
        amaxes += amax
    matmul = fp8_matmul_delayed(dims, out_dtype, lhs_dtype, rhs_dtype, grad_dtype)
    delayed = (supply.gradient(), tuple(scales), tuple(amaxes))
    return matmul(lhs, rhs, tuple(forms), delayed)

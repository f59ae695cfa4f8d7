"""Delayed fp8 scaling: tensorwise fp8 products quantise with scales learnt from the
amaxes of earlier steps, kept as state, instead of reducing each tensor before
quantising it (Transformer Engine's default recipe; Flax's `fp8_ops`).

The state (`DelayedScaling`) holds one slot per tensor a call quantises: each
activation an fp8 product reads (products reading one array share its fp8 form and
slot), each product's output gradient, and, with `weights=True`, each weight.
Slots are taken in program order while tracing, so the same program takes the same
slots at every trace.

This step's observations come out as the gradient of the state's `received` arrays:
each slot receives a one-hot vector over the scale that this step's amax asks for
(bin `k + 128` for a scale of `2**k`; the last bin for an amax of zero), taken in
the pass that quantises the tensor. One-hot, not the amax itself, because the
gradient of a value read many times is a sum: a product inside a `lax.scan` body
runs once per iteration, a replicated state under `shard_map` or `pmap` is read
once per device, and eqx_amp's loss scaling divides gradients by the loss scale.
A sum of one-hot vectors still says which bins were hit, and the largest amax is
the hit bin of the smallest scale. The scales are powers of two from the amax
(`scale_from_amax`), so the bin loses nothing.
"""

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from .._core._loss_scale_in_effect import loss_scale_in_effect
from .._jaxpr import _compat as compat
from .._jaxpr._evaluate import inlining_calls
from ._products import FP8_SCOPE, fp8_matmul_delayed, known_fp8, varying_over
from ._scaling import (
    E4M3,
    MAX_SCALE,
    finite_amax,
    power_of_two_at_most,
    quantize_with,
    scale_from_amax,
)


BINS = 256
_OFFSET = 128  # bin of the scale 2**k: k + _OFFSET
_ZERO_BIN = BINS - 1  # an all-zero (or all non-finite) tensor
_NONE = 127  # a history entry without an observation: above every exponent
_LOWEST = -126  # the smallest scale exponent: its inverse is float32's largest binade
# With `scales_in_gemm`, the bound on activations' and weights' scale exponents
# (`DelayedScaling`'s docstring says why).
_OPERAND_LIMIT = 63
_MARGIN_LIMIT = 16


def observation(amax: Array, dtype: np.dtype) -> Float[Array, " 256"]:
    """The one-hot vector of bin counts an `amax` hands out: the bin of the scale
    it asks for in `dtype`, or the zero bin."""
    scale = scale_from_amax(amax, dtype)
    exponent = (lax.bitcast_convert_type(scale, jnp.int32) >> 23) - 127
    index = jnp.where(amax > 0, exponent + _OFFSET, _ZERO_BIN)
    return (lax.iota(jnp.int32, BINS) == index).astype(jnp.float32)


def _power_of_two(exponent: Array) -> Array:
    """`2.0 ** exponent` in float32, for an int32 exponent in [-126, 127]."""
    return lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


class DelayedScaling(eqx.Module):
    """Delayed fp8 scaling for the tensorwise fp8 products of one loss: each
    tensor is quantised with a scale from the largest amax of its last
    `history` steps, and this step's amax is taken in the same pass (no reduction
    before the quantisation). Make one with `DelayedScaling.init`; run the loss
    under `eqx_amp.fp8.delayed(scaling)`, differentiate it with respect to the
    scaling too, and hand that gradient to `update`.

    ```python
    def loss_fn(model, x, y):
        amp = eqx_amp.filter_amp(eqx.filter_vmap(model), fp8=eqx_amp.fp8.TENSORWISE)
        return cross_entropy(amp(x), y)

    scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)

    @eqx.filter_jit
    def step(model, opt_state, scaling, x, y):
        def scaled_loss(diff, x, y):
            model, scaling = diff
            with eqx_amp.fp8.delayed(scaling):
                return loss_fn(model, x, y)

        loss, (grads, observed) = eqx.filter_value_and_grad(scaled_loss)(
            (model, scaling), x, y
        )
        scaling = scaling.update(observed)
        ...
    ```

    A scale is stale by design: a tensor whose amax grows past the largest of its
    history saturates at the fp8 format's largest value for that step (`margin`
    halves every scale `margin` times, to leave room). A step that observes nothing
    in a slot keeps its scale; a slot never observed has a scale of 1.

    With `scales_in_gemm=True` a GPU's forward fp8 GEMM applies the two scales
    itself and takes a residual added to its product (cuBLASLt's C operand), as a
    bfloat16 GEMM does: faster where the product's readers are kernels XLA cannot
    fuse with (cuDNN's flash attention, a gated MLP, the residual stream), slower
    where its unscaling pass had also done a materialised attention's layout
    changes and a norm's reductions (the performance guide has the figures). Its
    activations' and weights' scales stay within 2**±63 then, so that the GEMM's
    float32 factor is a normal number: an operand saturates past an amax of
    448 * 2**63 (4e21).
    """

    history: Int[Array, "slots history"]
    received: tuple[Float[Array, " 256"], ...]
    kinds: tuple[str, ...] = eqx.field(static=True)
    # Each slot's sizes: its product's contracting sizes (a weight: its shape).
    sizes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    margin: int = eqx.field(static=True)
    weights: bool = eqx.field(static=True)
    scales_in_gemm: bool = eqx.field(static=True, default=False)

    @classmethod
    def init(
        cls,
        fn: Callable[..., Any],
        *args: Any,
        history: int = 16,
        weights: bool = True,
        margin: int = 0,
        has_aux: bool = False,
        calibrate: bool = True,
        scales_in_gemm: bool = False,
        **kwargs: Any,
    ) -> "DelayedScaling":
        """The delayed scaling of `fn(*args, **kwargs)` (a scalar loss, or
        `(loss, aux)` with `has_aux`), its slots counted by tracing `fn` and its
        history started from one run of it with current scaling (one forward and
        backward pass on these arguments), so the first step's scales are those
        arguments' own (`calibrate=False` skips that run: every scale starts at 1,
        as Transformer Engine's do). With `weights=False` weights keep current
        scaling; `scales_in_gemm=True` (weights delayed too) has the forward GEMMs
        apply the scales (above).

        ```python
        scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y, history=16)
        ```
        """
        if not callable(fn):
            raise TypeError(f"`DelayedScaling.init` takes a function, got {fn!r}.")
        for name, value, least in (("history", history, 1), ("margin", margin, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"`{name}` must be an integer, got {value!r}.")
            if value < least:
                raise ValueError(f"`{name}` must be at least {least}, got {value}.")
        if margin > _MARGIN_LIMIT:
            raise ValueError(
                f"`margin` must be at most {_MARGIN_LIMIT}, got {margin}: each step "
                "of margin halves the scales, and e4m3 spans 17 binades, so a larger "
                "one rounds every value to zero."
            )
        for name, value in (
            ("weights", weights),
            ("calibrate", calibrate),
            ("scales_in_gemm", scales_in_gemm),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {value!r}.")

        if scales_in_gemm and not weights:
            raise ValueError(
                "`scales_in_gemm=True` needs `weights=True`: a GEMM applies scales "
                "within 2**±63 only, which the weights' current scales are not."
            )
        counting = _Supply(None, weights=weights)
        with _using(counting):
            eqx.filter_eval_shape(fn, *args, **kwargs)
        if not counting.kinds:
            raise ValueError(
                "`DelayedScaling.init`: the function runs no tensorwise fp8 matmul "
                "(delayed scales reach `TENSORWISE` products of `filter_amp`, "
                "`BiModel` and `autocast`, traced outside any `jax.vmap`), so "
                "there is nothing to scale."
            )
        state = cls(
            history=jnp.full((len(counting.kinds), int(history)), _NONE, jnp.int32),
            received=tuple(jnp.zeros(BINS, jnp.float32) for _ in counting.kinds),
            kinds=tuple(counting.kinds),
            sizes=tuple(counting.sizes),
            margin=int(margin),
            weights=weights,
            scales_in_gemm=scales_in_gemm,
        )

        if not calibrate:
            return state

        @eqx.filter_jit
        @eqx.filter_grad
        def observe(state, args, kwargs):
            with _using(_Supply(state, weights=weights, current=True)):
                out = fn(*args, **kwargs)
            return out[0] if has_aux else out

        observed = observe(state, args, kwargs)
        seen = [bool(jnp.any(r != 0)) for r in observed.received]
        if not any(seen):
            raise ValueError(_NOTHING_OBSERVED)
        if not all(seen):
            unseen = [i for i, s in enumerate(seen) if not s]
            warnings.warn(_UNSEEN.format(slots=unseen), stacklevel=2)
        return state.update(observed)

    def exponents(self) -> Int[Array, " slots"]:
        """Each slot's scale as a power of two: the exponent of the largest amax's
        scale in the history (0 where there is none), less `margin`."""
        exponent = jnp.min(self.history, axis=1)
        exponent = jnp.where(exponent == _NONE, 0, exponent - self.margin)
        exponent = jnp.maximum(exponent, _LOWEST)
        if not self.scales_in_gemm:
            return exponent
        operand = np.array([kind != "gradient" for kind in self.kinds], dtype=bool)
        bounded = jnp.clip(exponent, -_OPERAND_LIMIT, _OPERAND_LIMIT)
        return jnp.where(operand, bounded, exponent)

    def scales(self) -> Float[Array, " slots"]:
        """Each slot's float32 scale (`kinds` says what each slot quantises)."""
        return _power_of_two(self.exponents())

    def update(
        self, observed: "DelayedScaling", axis_name: Any = None
    ) -> "DelayedScaling":
        """This scaling with this step's observations (`observed`: the gradient of
        the loss with respect to this scaling) pushed into each slot's history.
        Under `pmap` or `shard_map`, `axis_name` combines the devices'
        observations, so that every device keeps the same scales.

        ```python
        scaling = scaling.update(observed)
        ```
        """
        if not isinstance(observed, DelayedScaling) or (
            observed.kinds,
            observed.sizes,
        ) != (self.kinds, self.sizes):
            raise TypeError(
                "`DelayedScaling.update` takes the gradient of the loss with "
                "respect to this scaling (a `DelayedScaling` with the same slots), "
                f"got {type(observed).__name__}."
            )
        if not self.kinds:
            return self
        counts = jnp.stack([jnp.asarray(r, jnp.float32) for r in observed.received])
        if axis_name is not None:
            counts = lax.psum(counts, axis_name)
        # NaN counts (a skipped step's gradients) hit no bin. A slot that observed
        # nothing, or only zeros, keeps its history as it was: its scale stays, and
        # no entry of it ages out.
        hit = counts[:, :_ZERO_BIN] > 0
        newest = jnp.argmax(hit, axis=1).astype(jnp.int32) - jnp.int32(_OFFSET)
        shifted = jnp.concatenate([newest[:, None], self.history[:, :-1]], axis=1)
        history = jnp.where(hit.any(axis=1)[:, None], shifted, self.history)
        received = tuple(jnp.zeros(BINS, jnp.float32) for _ in self.kinds)
        return eqx.tree_at(lambda s: (s.history, s.received), self, (history, received))


_NOTHING_OBSERVED = (
    "`DelayedScaling.init`: the run of the function observed none of its fp8 "
    "tensors. Either no product ran in fp8 on these arguments (an empty batch, or "
    "sizes an fp8 GEMM does not take: multiples of 16), or a `jax.jit` (or "
    "`eqx.filter_jit`, or a jitted `shard_map`) around the function reused the "
    "trace made while the slots were counted, in which no scaling was in effect: "
    "pass `init` the function without that `jit` (`init` compiles it itself)."
)
_DIFFERENT_PROGRAM = (
    "This program's fp8 products differ from the ones its `DelayedScaling` was "
    "initialised from ({detail}). Initialise it from the same function with "
    "arguments of the same shapes: a batch size that is not a multiple of 16 can "
    "take a product out of fp8."
)
_UNSEEN = (
    "`DelayedScaling.init`: the slots {slots} observed no tensor in the run on "
    "these arguments (a product in a `lax.cond` branch not taken, an empty batch, "
    "an inner `jax.jit` reusing a trace made without the scaling, or a product "
    "whose output gets no gradient, such as one under `jax.lax.stop_gradient`: "
    "observations leave as gradients); they keep a scale of 1 until a step "
    "observes them. Run products that get no gradient outside `delayed`."
)
_NOT_TRACED = (
    "`eqx_amp.fp8.delayed`: a product ran on concrete arrays, outside any trace. A "
    "`DelayedScaling` with weight slots (`weights=True`) quantises each weight once "
    "per traced call: run the step under `jax.jit` (or `eqx.filter_jit`, or inside "
    "`jax.grad`)."
)
_NOT_DIFFERENTIATED = (
    "`eqx_amp.fp8.delayed`: a product is differentiated but the `DelayedScaling` "
    "given to `delayed` is not, so this step's observations (its gradient) are "
    "lost and the scales never move. Differentiate the loss with respect to the "
    "scaling too, and enter `delayed` with that differentiated scaling, inside the "
    "function differentiated: `eqx.filter_value_and_grad(scaled_loss)((model, "
    "scaling), ...)`."
)


class _Supply:
    """What one trace of a call under a scaling hands out, slot by slot: each
    tensor's scale (None: current scaling) and its receiver. Without a state it
    counts the slots (scales of 1)."""

    def __init__(
        self, state: DelayedScaling | None, weights: bool, current: bool = False
    ):
        self.state, self.delays_weights, self.current = state, weights, current
        self.kinds: list[str] = []
        self.sizes: list[tuple[int, ...]] = []
        # Every scale as one vector: XLA computes them (and the inverses the
        # products' unscaling reads) in one kernel, not one per product.
        self._scales = None
        factor = loss_scale_in_effect()
        self.unit = jnp.ones((), jnp.float32) if factor is None else factor
        if state is not None and state.kinds:
            scales = _power_of_two(state.exponents())
            if factor is not None:
                # Output gradients' scales are kept in units of the unscaled loss:
                # a loss scale that changes does not make them stale.
                is_gradient = np.array([k == "gradient" for k in state.kinds])
                # A power of two, so that scaling stays exact under any loss scale.
                in_range = jnp.clip(scales / factor, 2.0**_LOWEST, MAX_SCALE)
                scales = jnp.where(is_gradient, power_of_two_at_most(in_range), scales)
            self._scales = lax.stop_gradient(scales)
        # (id(array), id(trace)) -> (array, trace, fp8 values, scale): an activation
        # quantised already in that trace. An array a loop body closes over is the
        # same object inside it and after it, but values made inside are the body's.
        self._quantized: dict[tuple[int, int], tuple[Any, Any, Array, Array]] = {}
        # id(fp8 values) -> (fp8 values, receiver, amax): a weight's, whose amax no
        # product has handed out yet.
        self._pending: dict[int, tuple[Array, Array, Array]] = {}
        # id(fp8 values) -> fp8 values quantised with a scale within 2**±63.
        self._bounded: dict[int, Array] = {}
        self._warned = False

    def take(self, kind: str, sizes: tuple[int, ...]) -> tuple[Array | None, Array]:
        index = len(self.kinds)
        self.kinds.append(kind)
        self.sizes.append(tuple(sizes))
        if self.state is None:
            return jnp.ones((), jnp.float32), jnp.zeros(BINS, jnp.float32)
        state = self.state
        if index >= len(state.kinds) or (state.kinds[index], state.sizes[index]) != (
            kind,
            tuple(sizes),
        ):
            held = (
                "none"
                if index >= len(state.kinds)
                else f"{state.kinds[index]} of sizes {state.sizes[index]}"
            )
            raise ValueError(
                _DIFFERENT_PROGRAM.format(
                    detail=f"its slot {index} holds {held}; the program quantises "
                    f"{kind} of sizes {tuple(sizes)} there"
                )
            )
        receiver = self.state.received[index]
        if self.current:
            return None, receiver
        assert self._scales is not None
        return self._scales[index], receiver

    def activation(
        self, x: Array, sizes: tuple[int, ...]
    ) -> tuple[Array, Array, tuple]:
        """`x`'s fp8 values, their scale (shaped to broadcast against `x`) and what
        to hand out: `((receiver,), (amax,))` the first time `x` is read (by a
        product contracting `sizes`)."""
        trace = compat.current_trace()
        entry = self._quantized.get((id(x), id(trace)))
        if entry is not None and entry[0] is x and entry[1] is trace:
            return entry[2], entry[3], ((), ())
        scale, receiver = self.take("activation", sizes)
        values = lax.stop_gradient(x)
        # Under the fp8 scope, as the products' own quantisations: `telemetry`
        # reads the cast there with the scale it multiplies by.
        with jax.named_scope(FP8_SCOPE):
            amax = finite_amax(values, tuple(range(x.ndim))).reshape(())
            if scale is None:
                scale = scale_from_amax(amax, E4M3)
            quantized = quantize_with(values, scale, E4M3)
        self._note_bound(quantized)
        shaped = jnp.reshape(scale, (1,) * x.ndim)
        self._quantized[(id(x), id(trace))] = (x, trace, quantized, shaped)
        return quantized, shaped, ((receiver,), (amax,))

    def weight(
        self, weight: Array, amax: Array, quantize: Callable[[Array], Array]
    ) -> tuple[Array, Array]:
        """`weight`'s fp8 values: `quantize(scale)` with its slot's scale (of
        amax `amax` under current scaling). The first product reading those
        values hands the amax out (a cast of the weight carries them too)."""
        scale, receiver = self.take("weight", weight.shape)
        scale = lax.stop_gradient(
            scale_from_amax(amax, E4M3) if scale is None else scale
        )
        quantized = quantize(scale)
        self._pending[id(quantized)] = (quantized, receiver, amax)
        self._note_bound(quantized)
        return quantized, scale

    def check_differentiated(self, lhs: Array, rhs: Array, receiver: Array) -> None:
        """Warns (once) where a product is differentiated and its receivers are
        not: the scaling's gradient, which carries the observations, is not asked
        for."""
        if self.state is None or self._warned:
            return
        product = compat.is_differentiated(lhs) or compat.is_differentiated(rhs)
        if product and not compat.is_differentiated(receiver):
            self._warned = True
            warnings.warn(_NOT_DIFFERENTIATED, stacklevel=5)

    def _note_bound(self, quantized: Array) -> None:
        # Current scaling (`init`'s run) takes scales from the amax, unbounded.
        state = self.state
        if state is not None and state.scales_in_gemm and not self.current:
            self._bounded[id(quantized)] = quantized

    def scale_is_bounded(self, quantized: Array) -> bool:
        """Whether `quantized` is fp8 values this supply made with a scale within
        2**±63."""
        return self._bounded.get(id(quantized)) is quantized

    def weight_observation(self, quantized: Array) -> tuple:
        entry = self._pending.get(id(quantized))
        if entry is None or entry[0] is not quantized:
            return (), ()
        del self._pending[id(quantized)]
        return (entry[1],), (entry[2],)


_supply: contextvars.ContextVar[_Supply | None] = contextvars.ContextVar(
    "eqx_amp_fp8_delayed", default=None
)


@contextlib.contextmanager
def _using(supply: _Supply) -> Iterator[_Supply]:
    # A `jit` inside the program is inlined: its body, traced as a program of its
    # own, would hold the scales and receivers of this trace as constants.
    token = _supply.set(supply)
    try:
        with inlining_calls():
            yield supply
    finally:
        _supply.reset(token)


@contextlib.contextmanager
def delayed(scaling: DelayedScaling) -> Iterator[None]:
    """Within it, the tensorwise fp8 matmuls traced (of `filter_amp`, `BiModel`
    and `autocast`, outside any `jax.vmap`) take their scales from `scaling`, and
    hand this step's observations out as the gradient of `scaling`: enter it inside
    the function differentiated, with the scaling differentiated (a differentiated
    product under a scaling that is not warns that its observations are lost).

    ```python
    def scaled_loss(diff, x, y):
        model, scaling = diff
        with eqx_amp.fp8.delayed(scaling):
            return loss_fn(model, x, y)

    grad_fn = eqx.filter_value_and_grad(scaled_loss)
    loss, (grads, observed) = grad_fn((model, scaling), x, y)
    ```
    """
    if not isinstance(scaling, DelayedScaling):
        raise TypeError(
            "`eqx_amp.fp8.delayed` takes a `DelayedScaling` (made by "
            f"`DelayedScaling.init`), got {type(scaling).__name__}."
        )
    if _supply.get() is not None:
        raise ValueError(
            "`eqx_amp.fp8.delayed` is in effect already (an outer `delayed`, or the "
            "run of `DelayedScaling.init`, which applies its own): enter it once, "
            "around the loss, and give `DelayedScaling.init` the loss without it."
        )
    supply = _Supply(scaling, weights=scaling.weights)
    with _using(supply):
        yield
    if len(supply.kinds) < len(scaling.kinds):
        raise ValueError(
            _DIFFERENT_PROGRAM.format(
                detail=f"it holds {len(scaling.kinds)} slots; the program quantised "
                f"{len(supply.kinds)} tensors"
            )
        )


def current_supply() -> _Supply | None:
    return _supply.get()


def delayed_matmul(
    supply: _Supply,
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
    at its first product), the output gradient with a slot of its own."""
    if supply.delays_weights and not (compat.is_traced(lhs) or compat.is_traced(rhs)):
        # Weights are quantised once per traced call (`quantize_weights_once`); a
        # concrete one would take an activation's slot.
        raise ValueError(_NOT_TRACED)
    forms, receivers, amaxes = [], [], []
    contracting = tuple(lhs.shape[a] for a in dims[0][0])
    for x in (lhs, rhs):
        known = known_fp8(x)
        if known is None:
            quantized, scale, (handed, amax) = supply.activation(x, contracting)
            known = (quantized, scale)
        else:
            handed, amax = supply.weight_observation(known[0])
        forms.append(known)
        receivers += handed
        amaxes += amax
    g_scale, g_receiver = supply.take("gradient", contracting)
    supply.check_differentiated(lhs, rhs, g_receiver)
    bounded = all(supply.scale_is_bounded(values) for values, _ in forms)
    matmul = fp8_matmul_delayed(
        dims, out_dtype, lhs_dtype, rhs_dtype, grad_dtype, observation, bounded
    )
    # Under `shard_map` an observation varies as the tensor observed does; so must
    # its receiver (whose gradient JAX then sums over the devices).
    receivers = [
        varying_over(r, compat.varying_axes(a)) for r, a in zip(receivers, amaxes)
    ]
    varying = compat.varying_axes(lhs) | compat.varying_axes(rhs)
    g_receiver = varying_over(g_receiver, varying)
    handed_out = (g_receiver, 1.0 / supply.unit, tuple(receivers), tuple(amaxes))
    return matmul(lhs, rhs, tuple(forms), g_scale, handed_out)

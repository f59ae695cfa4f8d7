"""Under `jax.jit` with sharded arrays (GSPMD), the partitioner sums a weight gradient
across devices right where it is made: on the output of the matmul that computes it.
So the reduction dtype is the dtype that matmul emits, and choosing it means binding
the matmul so that its transpose for the weight emits `Policy.reduce_dtype`
(`bind_reducing_gradients`; `ReduceInHook` does it for every matmul that reads a
parameter)."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from .._core._cast import is_floating_array, widest_dtype
from .._core._platform import CPU_SUMS_HALF_PRODUCTS_IN_HALF, with_cpu_form
from .._core._wrapper import warn_once
from .._jaxpr import _compat as compat
from .._jaxpr._evaluate import batched_like, evaluate
from .._jaxpr._hook import Evaluate, Frame, Hook, Origin, cast_to
from .._jaxpr._outer_vmap import batched_after_tracing


# Ops on a parameter whose transpose sums over the data (the batch, the sequence):
# under GSPMD that sum is where the gradient is reduced across devices. Matmuls
# contract over the data; a lookup's transpose scatter-adds into the table; a
# broadcast's transpose sums over the new axes.
_SUMMING_OPS = frozenset(
    {
        lax.dot_general_p,
        lax.conv_general_dilated_p,
        lax.gather_p,
        lax.broadcast_in_dim_p,
    }
)
# The transposes' summing ops, run in the reduce dtype: matmuls by their
# `preferred_element_type` (operands stay in the compute dtype), sums by their
# inputs' dtype.
_MATMULS = frozenset({lax.dot_general_p, lax.conv_general_dilated_p})
_SUMS = frozenset({lax.reduce_sum_p, lax.scatter_add_p})
_F32 = np.dtype(np.float32)


class _SumIn(Hook):
    """Runs a pullback with its sums in `dtype`: matmuls emit it (accumulating in
    float32), reductions and scatter-adds read it; ops that then meet two dtypes
    promote."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype

    def equation(self, eqn, invals, origins, frame, evaluate: Evaluate) -> list:
        if eqn.primitive in _MATMULS:
            params = dict(eqn.params, preferred_element_type=self.dtype)
            # A CPU reads operands of the dtype it emits (its runtime cannot run
            # every mixed-dtype dot); where it may sum a product that emits half in
            # half, that dtype is float32, rounded to the reduce dtype once.
            cpu_dtype = _F32 if CPU_SUMS_HALF_PRODUCTS_IN_HALF else self.dtype
            cpu = dict(params, preferred_element_type=cpu_dtype)

            def on_cpu(*vals):
                out = evaluate(cast_to(list(vals), [cpu_dtype] * len(vals)), cpu)
                return cast_to(out, [self.dtype] * len(out))

            return with_cpu_form(
                *invals, cpu=on_cpu, default=lambda *vals: evaluate(list(vals), params)
            )
        dtypes = {v.dtype for v in invals if is_floating_array(v)}
        if eqn.primitive in _SUMS:
            target = widest_dtype([self.dtype, *dtypes])
        elif len(dtypes) > 1:
            target = widest_dtype(dtypes)
        else:
            return evaluate(invals)
        assert target is not None  # promoted from one dtype or more
        return evaluate(cast_to(invals, [target] * len(invals)), dict(eqn.params))


def _pullback(
    bind: Callable, operands: Sequence[Any], index: int, cotangent: Any, sum_in=None
) -> Any:
    """The cotangent of `operands[index]` for `bind(*operands)`, computed by JAX's
    own transpose; with `sum_in`, its sums run in that dtype."""

    def of_operand(operand):
        return bind(*operands[:index], operand, *operands[index + 1 :])

    def pullback(cotangent):
        return jax.vjp(of_operand, operands[index])[1](cotangent)[0]

    if sum_in is None:
        return pullback(cotangent)
    closed = jax.make_jaxpr(pullback)(cotangent)
    return evaluate(closed, [cotangent], _SumIn(sum_in))[0][0]


def reduced_operands(
    eqn: Any, invals: Sequence[Any], origins: Sequence[Origin]
) -> frozenset[int]:
    """The operands of `eqn` whose gradient it sums over the data: floating operands
    not computed from data (parameters, and the arrays a function closes over,
    which reach the program as constants) of a summing op, of an op that broadcasts
    them (a bias of shape `(1, n)` added to `(batch, n)`), or of any op that meets
    data batched by `jax.vmap` (its transpose sums over the batch)."""
    if eqn.primitive.multiple_results:
        return frozenset()
    weights = frozenset(
        i
        for i, (value, origin) in enumerate(zip(invals, origins))
        if origin is not Origin.DATA and is_floating_array(value)
    )
    if not weights:
        return frozenset()
    if eqn.primitive in _SUMMING_OPS:
        return weights
    if Origin.DATA not in origins:
        return frozenset()
    out_shape = eqn.outvars[0].aval.shape
    broadcast = any(eqn.invars[i].aval.shape != out_shape for i in weights)
    if broadcast or any(map(compat.is_batched, invals)):
        return weights
    return frozenset()


def bind_reducing_gradients(
    eqn: Any,
    invals: Sequence[Any],
    weights: frozenset[int],
    reduce_dtype: np.dtype,
    params: dict | None = None,
) -> list:
    """Binds the first-order `eqn` on `invals`, with a derivative rule in which the
    gradients of the operands in `weights` are summed in `reduce_dtype` (so that
    GSPMD reduces them across devices in it) before they are returned in their
    operand's dtype. The other gradients are JAX's own."""
    params = compat.bind_params(eqn) if params is None else params

    def bind(*operands):
        return compat.bind(eqn, list(operands), params)[0]

    op = _summing_gradients_in(bind, weights, reduce_dtype)
    if any(map(compat.is_batched, invals)):
        # An Equinox model is vmapped over the batch: the sum over it must stay
        # inside the derivative rule, in the reduce dtype.
        origins = [
            Origin.PARAMS if i in weights else Origin.DATA for i in range(len(invals))
        ]
        op = batched_like(bind, op, ReduceInHook(reduce_dtype), origins)
    return [op(*invals)]


def _summing_gradients_in(
    bind: Callable, weights: frozenset[int], reduce_dtype: np.dtype
) -> Callable:
    @jax.custom_vjp
    def op(*operands):
        return bind(*operands)

    def forward(*operands):
        return bind(*operands), operands

    def backward(operands, cotangent):
        grads = []
        for i, operand in enumerate(operands):
            if not is_floating_array(operand):
                grads.append(None)
                continue
            sum_in = reduce_dtype if i in weights else None
            grad = _pullback(bind, operands, i, cotangent, sum_in)
            grads.append(grad.astype(operand.dtype))
        return tuple(grads)

    op.defvjp(forward, backward)
    return op


_BATCHED_AFTER_TRACING = (
    "A `Policy.reduce_dtype` is set, and this `{name}` runs under a `jax.vmap` applied "
    "outside `filter_amp`/`autocast`: JAX batches its body after eqx_amp has traced "
    "it, so the parameter gradients inside are computed per example and then summed "
    "(right, but with the batch's times the work and memory). Apply the wrapper "
    "outside the vmap instead: `eqx_amp.filter_amp(eqx.filter_vmap(model))(x)` or "
    "`eqx_amp.autocast(eqx.filter_vmap(model))(x)`."
)


def warn_if_batched_after_tracing(eqn: Any, invals: Sequence[Any], origins) -> None:
    """Says when the derivative rules inside a higher-order primitive would be
    batched per example by a `jax.vmap` outside."""
    if batched_after_tracing(eqn, invals, origins):
        warn_once(_BATCHED_AFTER_TRACING.format(name=eqn.primitive))


class ReduceInHook(Hook):
    """Runs a program unchanged, except that the ops summing a parameter's gradient
    over the data sum it in `reduce_dtype` (`filter_amp` and `BiModel` with a
    `Policy.reduce_dtype` other than the compute dtype)."""

    def __init__(self, reduce_dtype: np.dtype):
        self.reduce_dtype = reduce_dtype

    def equation(self, eqn, invals, origins, frame: Frame, evaluate: Evaluate):
        warn_if_batched_after_tracing(eqn, invals, origins)
        weights = reduced_operands(eqn, invals, origins)
        if not weights:
            return evaluate(invals)
        return bind_reducing_gradients(eqn, invals, weights, self.reduce_dtype)

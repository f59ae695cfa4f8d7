"""The pass behind `telemetry`: a hook that measures, as extra traced values of the
step, each tensor that mixed precision narrows (at its cast) or that a product reads
or writes in half precision or fp8 (as it arrives), and names it by the layer whose
product it belongs to.

Names and roles are found at trace time from the program's variables: a parameter
leaf's path flows along whatever is computed from it alone; a product is named by
its parameter operand; a cast's output waits ("pending") for the product that reads
it; a product's data operand is marked as the layer's activation, so that the
backward product reading it is that layer's parameter gradient. Tensors left
unnamed at the end (the cast of the updated master weights, ...) are not reported.
"""

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .._core._cast import is_floating_dtype
from .._core._wrapper import warn_once
from .._fp8 import (
    FP8_SCOPE,
    MXFP8_SCOPE,
    NVFP4_SCALES_SCOPE,
    NVFP4_SCOPE,
    is_block_product,
)
from .._jaxpr import _compat as compat
from .._jaxpr._hook import MATMUL_PRIMITIVES, Frame, Hook, Origin, is_higher_order
from ._naming import Naming, unique
from ._statistics import (
    ACTIVATION,
    OUTPUT_GRADIENT,
    PARAMETER_GRADIENT,
    WEIGHT,
    Measured,
    Site,
    across,
    statistics_of,
)


def _is_narrow(dtype: Any) -> bool:
    return is_floating_dtype(dtype) and jnp.finfo(dtype).bits < 32


def _vars(atoms: Iterable[Any]) -> list:
    return [a for a in atoms if not isinstance(a, compat.Literal)]


class Measure(Hook):
    """The telemetry hook: one per jaxpr, sharing the `Naming` of the program."""

    makes_values = True

    def __init__(self, naming: Naming):
        self.naming = naming
        self.records: list[Measured] = []
        self.scale: Array | None = None  # the last fp8 scale multiplied in
        self.scaled: Any = None  # and the variable it scaled
        self.scaled_value: Array | None = None  # and the product

    def enter_jaxpr(self, frame: Frame) -> "Measure":
        return Measure(self.naming)

    def made(self) -> list:
        return self.records

    def adopt(self, made: list, eqn: Any) -> None:
        if eqn.primitive is compat.scan_p:
            num_consts, num_carry = compat.scan_counts(eqn.params)
            xs = eqn.invars[num_consts + num_carry :]
            scanned = frozenset(self.naming.paths.get(v) for v in xs) - {None}
            made = [dataclasses.replace(m, stack=(scanned, *m.stack)) for m in made]
        self.records += made

    def across(self, made: list, axis_names: frozenset) -> list:
        return across(made, axis_names)

    def equation(self, eqn, invals, origins, frame, evaluate):
        naming = self.naming
        naming.into_bodies(eqn)
        outs = evaluate(invals)
        recomputed = frame.transposed and compat.REMATERIALISED_SCOPE in frame.scopes
        if _one_product(eqn):
            # One product, as the `cond` over its platforms' forms: its operands
            # and output are outside the branches, where they are measured.
            naming.out_of_bodies(eqn)
            operands = slice(1, 3)  # after the platform index, before the scales
            invars, origins = eqn.invars[operands], origins[operands]
            if recomputed:
                self._recomputed_product(invars, origins, eqn.outvars)
            else:
                ins = invals[operands]
                self._product(invars, ins, origins, eqn.outvars, outs, frame)
            return outs
        if is_higher_order(eqn):
            naming.out_of_bodies(eqn)
            if eqn.primitive in (compat.while_p, compat.cond_p) and _holds_products(
                eqn
            ):
                warn_once(_NOT_MEASURED.format(name=eqn.primitive))
            return outs
        naming.flow(eqn, origins, recomputed, transposed=frame.transposed)
        naming.replicate(eqn, invals)
        if recomputed:
            self._recomputed(eqn, invals, origins, frame)
            return outs
        naming.remember(eqn)
        in_fp8 = FP8_SCOPE in frame.scopes
        if eqn.primitive in MATMUL_PRIMITIVES:
            self._product(eqn.invars, invals, origins, eqn.outvars, outs, frame)
        elif (
            eqn.primitive is lax.convert_element_type_p
            and _narrows(eqn)
            and NVFP4_SCALES_SCOPE not in frame.scopes
        ):
            self._cast(eqn, invals[0], outs[0], origins[0], frame, in_fp8)
        elif in_fp8 and eqn.primitive is lax.mul_p:
            self._maybe_scale(eqn, invals, outs[0])
        return outs

    def _record(self, site, var, value, source=None, scale=None) -> None:
        same_along = self.naming.replicated.get(var, frozenset())
        self.records.append(statistics_of(site, value, source, scale, same_along))

    def _cast(self, eqn, source, value, origin, frame, in_fp8) -> None:
        naming, invar, outvar = self.naming, eqn.invars[0], eqn.outvars[0]
        dtype = str(value.dtype)
        scale = self.scale if in_fp8 and jnp.finfo(value.dtype).bits <= 8 else None
        # The fp8 values are the scaled tensor's, one to one: the layer that reads
        # them reads it, and its other quantisations.
        scaled = None if scale is None else self.scaled
        if origin == Origin.PARAMS:
            # In the backward pass too: a weight quantised again for a backward
            # product (rowwise and MXFP8 products quantise along each product's
            # contracting axis), as a forward input is.
            layer, role = naming.layer_of(invar), WEIGHT
        elif frame.transposed and scaled in naming.feeds:
            layer, role = naming.feeds[scaled], ACTIVATION
        elif frame.transposed:
            layer = naming.grads.get(invar)
            role = OUTPUT_GRADIENT if layer is None else PARAMETER_GRADIENT
        else:
            layer, role = None, ACTIVATION
        site = Site(role, dtype, True, layer, _scaling(scale, frame))
        if site.scaling == "nvfp4":
            # Its block scales are rounded up: a value past 6 is float32's
            # rounding of the product, clipped before the grid, not a saturation.
            largest = float(jnp.finfo(value.dtype).max)
            source = jnp.clip(self.scaled_value, -largest, largest)
        elif (
            site.scaling in ("tensorwise", "rowwise") and self.scaled_value is not None
        ):
            # Read before the quantisation clips it: a scale that trails its tensor
            # (delayed scaling) saturates values, and they are counted.
            source = self.scaled_value
        self._record(site, invar, value, source, scale)
        self.scale = self.scaled = self.scaled_value = None
        naming.measured.add(outvar)
        if scaled is not None:
            naming.source[outvar] = scaled
        if layer is None:
            # Keep the sites of earlier casts it came from (a gradient cast to fp8,
            # then to bfloat16), which wait for the same product.
            naming.pending[outvar] = naming.pending.get(outvar, frozenset()) | {site}

    def _product(self, invars, invals, origins, outvars, outs, frame) -> None:
        """A product reading `invars` (its two operands) and making `outvars`."""
        naming = self.naming
        weights = [v for v, o in zip(invars, origins) if o == Origin.PARAMS]
        layer = unique(naming.layer_of(v) for v in _vars(weights))
        if layer is None and frame.transposed:
            layer = unique(map(naming.input_of, _vars(invars)))
        for var, value, origin in zip(invars, invals, origins):
            if isinstance(var, compat.Literal):
                continue
            for site in naming.pending.get(var, ()):
                if site.layer is None:
                    site.layer = layer
            if var in naming.measured or layer is None:
                continue
            if origin == Origin.PARAMS:
                role = WEIGHT
            elif not frame.transposed:
                role = ACTIVATION
            elif var in naming.feeds:
                continue  # the forward activation, measured in the forward pass
            else:
                role = OUTPUT_GRADIENT
            naming.measured.add(var)
            if _is_narrow(value.dtype):
                self._record(Site(role, str(value.dtype), False, layer), var, value)
        if layer is None:
            return
        if not frame.transposed:
            for var, origin in zip(invars, origins):
                if origin != Origin.PARAMS and not isinstance(var, compat.Literal):
                    naming.mark_input(var, layer)
        elif not _vars(weights):
            (out,) = outvars
            naming.grads[out] = layer
            # A tensorwise or rowwise fp8 product's output is still scaled: it is
            # measured at its cast. A block-scaled one's is not.
            scaled = FP8_SCOPE in frame.scopes and MXFP8_SCOPE not in frame.scopes
            if _is_narrow(outs[0].dtype) and not scaled:
                site = Site(PARAMETER_GRADIENT, str(outs[0].dtype), False, layer)
                self._record(site, out, outs[0])
                naming.measured.add(out)

    def _recomputed(self, eqn, invals, origins, frame) -> None:
        """An equation of the forward pass that `jax.checkpoint` runs again inside
        the backward pass: what it computes was measured when the forward pass
        computed it, and measuring it again would count it twice (a recomputed cast
        of an activation as an output gradient). Its results are named as the
        forward's, or, where the forward equation is not found (a recomputation
        that makes what the forward pass did not: an MXFP8 product's residuals), as
        a forward product names its operands and after the tensor a cast quantises
        or a layout copies."""
        naming = self.naming
        naming.measured.update(eqn.outvars)
        # Which tensor fp8 values are quantised from, as in the forward pass: the
        # backward products' operands that only the recomputation makes (an MXFP8
        # product's residuals, quantised along other axes) are its layer's input.
        quantised_from = None
        if FP8_SCOPE in frame.scopes and eqn.primitive is lax.mul_p:
            self._maybe_scale(eqn, invals)
        elif eqn.primitive is lax.convert_element_type_p and _narrows(eqn):
            quantised_from = self.scaled
            self.scale = self.scaled = self.scaled_value = None
        if naming.recompute(eqn):
            return
        (out, *_), ins = eqn.outvars, _vars(eqn.invars)
        if quantised_from is not None:
            naming.source[out] = quantised_from
            layer = naming.input_of(quantised_from)
        elif eqn.primitive in _RELAID and len(ins) == 1:
            layer = naming.feeds.get(ins[0])  # the same values, laid out anew
        else:
            layer = None
        if layer is not None:
            naming.feeds[out] = layer
        if eqn.primitive in MATMUL_PRIMITIVES:
            self._recomputed_product(eqn.invars, origins, eqn.outvars)

    def _recomputed_product(self, invars, origins, outvars) -> None:
        """A recomputed product names its operands as the forward one did."""
        naming = self.naming
        naming.measured.update(outvars)
        weights = [v for v, o in zip(invars, origins) if o == Origin.PARAMS]
        layer = unique(naming.layer_of(v) for v in _vars(weights))
        for var, origin in zip(invars, origins):
            if isinstance(var, compat.Literal):
                continue
            naming.measured.add(var)
            if layer is not None and origin != Origin.PARAMS:
                naming.mark_input(var, layer)

    def _maybe_scale(self, eqn, invals, out: Array | None = None) -> None:
        """fp8 quantisation multiplies a tensor by its float32 scale (smaller,
        broadcast) right before the cast (`eqx_amp._fp8._quantize`); NVFP4's
        rounds the product `out` to the e2m1 grid before its cast, which is then
        exact, so its statistics are read from `out`."""
        a, b = invals
        if (
            getattr(a, "dtype", None) != jnp.float32
            or getattr(b, "dtype", None) != jnp.float32
        ):
            return
        if np.size(a) != np.size(b):
            tensor, self.scale = (1, a) if np.size(a) < np.size(b) else (0, b)
            scaled = eqn.invars[tensor]
            self.scaled = None if isinstance(scaled, compat.Literal) else scaled
            self.scaled_value = out


def _scaling(scale: Array | None, frame: Frame) -> str | None:
    """How an fp8 (or fp4) cast was scaled, from the scale multiplied in before it:
    per block (the quantisation of an MXFP8 product or gathered weight runs in
    `MXFP8_SCOPE`, of an NVFP4 forward product in `NVFP4_SCOPE`), per row, or one
    scale for the tensor."""
    if scale is None:
        return None
    if NVFP4_SCOPE in frame.scopes:
        return "nvfp4"
    if MXFP8_SCOPE in frame.scopes:
        return "mxfp8"
    return "rowwise" if np.size(scale) > 1 else "tensorwise"


# Equations that lay one array's values out anew (no value computed from another).
_RELAID = frozenset(
    {lax.transpose_p, lax.reshape_p, lax.squeeze_p, lax.broadcast_in_dim_p}
)


_NOT_MEASURED = (
    "`telemetry` does not measure inside `lax.while_loop` and `lax.cond`, and this "
    "`{name}` holds matmuls or convolutions (a gradient function with "
    "`redo_on_nan > 0` runs the whole gradient in a `while_loop`): the tensors "
    "inside are missing from the `Telemetry`. Collect on a step that runs its "
    "products outside them (`redo_on_nan=0` on the measured steps)."
)


def _one_product(eqn: Any) -> bool:
    """Whether `eqn` is one product written as a `cond` over the platforms' forms
    (`with_cpu_form`: an MXFP8 product, or an fp8 backward product or a reduce
    dtype's pullback that a CPU emits in float32), reading `(index, lhs, rhs,
    ...)`: one branch runs, chosen as the program is lowered, and it makes the
    product, not a choice of data that `telemetry` cannot follow."""
    if eqn.primitive is not compat.cond_p or not compat.branch_platforms(eqn.params):
        return False
    if is_block_product(eqn):
        return True

    def products(body: Any) -> int:
        return sum(
            e.primitive in MATMUL_PRIMITIVES
            or (is_higher_order(e) and any(map(products, compat.sub_jaxprs(e.params))))
            for e in compat.open_jaxpr(body)[0].eqns
        )

    return all(products(branch) == 1 for branch in eqn.params["branches"])


def _holds_products(eqn: Any) -> bool:
    """Whether a higher-order equation's bodies hold a matmul or a convolution."""
    return any(
        e.primitive in MATMUL_PRIMITIVES or (is_higher_order(e) and _holds_products(e))
        for body in compat.sub_jaxprs(eqn.params)
        for e in compat.open_jaxpr(body)[0].eqns
    )


def _narrows(eqn: Any) -> bool:
    """A cast from a floating dtype to a narrower one (half precision or fp8)."""
    before, after = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    return (
        is_floating_dtype(before)
        and _is_narrow(after)
        and jnp.finfo(after).bits < jnp.finfo(before).bits
    )

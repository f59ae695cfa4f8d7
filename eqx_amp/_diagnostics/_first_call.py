"""The coverage warning `filter_amp` gives on the first traced call of a model
under a policy (registered by `eqx_amp/__init__`, switched by `check_coverage`).

The call is traced once, to a jaxpr; the jaxpr's matmuls are read from its
equations, and the jaxpr is evaluated in place of a second trace of the model. Only
where less than half of the FLOPs may read the compute dtype is it evaluated under
`precision_report`'s census, which finds the cause and the fix."""

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu

from .._core._cast import is_half_dtype
from .._core._wrapper import user_stacklevel
from .._filter_amp._first_call import register_coverage_check
from .._jaxpr import _compat as compat
from .._jaxpr._hook import MATMUL_PRIMITIVES
from ._coverage import coverage_advice
from ._report import counted_run, dead_equations, matmul_flops


class CoverageWarning(UserWarning):
    """Less than half of a mixed-precision model's matmul FLOPs run in the compute
    dtype. Said once per model class and policy; silence it with

    ```python
    warnings.filterwarnings("ignore", category=eqx_amp.diagnostics.CoverageWarning)
    ```

    or skip the check itself with `eqx_amp.diagnostics.check_coverage(False)`."""


# A trace cannot read what the call itself reads on concrete values (Python control
# flow on an eager `jax.grad`'s primal): such a call is left unchecked.
_CANNOT_CHECK = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


class _FirstCallCheck:
    def run_checked(self, wrapper: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
        tree = (fn, args, kwargs)
        try:
            closed, out_struct, out_static = eqx.filter_make_jaxpr(_call)(*tree)
        except _CANNOT_CHECK:
            return fn(*args, **kwargs)
        leaves = jtu.tree_leaves(eqx.filter(tree, eqx.is_array))
        outs = None
        try:
            if _may_be_low(closed):
                outs, report = counted_run(closed, tree, leaves)
                advice = coverage_advice(report, wrapper)
                if advice:
                    warnings.warn(advice, CoverageWarning, stacklevel=user_stacklevel())
        except compat.UnsupportedJaxError:
            pass  # a jax whose internals the census does not know: the call works
        if outs is None:  # the common case, at the cost of binding the equations
            jaxpr, consts = compat.open_jaxpr(closed)
            outs = jax.core.eval_jaxpr(jaxpr, consts, *leaves)
        # An output the program made from literals alone comes back a NumPy value.
        outs = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in outs]
        dynamic = jtu.tree_unflatten(jtu.tree_structure(out_struct), outs)
        return eqx.combine(dynamic, out_static)


def _may_be_low(closed: Any) -> bool:
    """Whether less than half of the matmul FLOPs that run (scan bodies times their
    length) read only half-precision operands, from the equations' types: a count
    that never finds more low FLOPs than the census, which then decides."""
    dead = dead_equations(closed)
    flops = [0, 0]  # low, all

    def visit(jaxpr: Any, repeats: int) -> None:
        for eqn in compat.open_jaxpr(jaxpr)[0].eqns:
            if id(eqn) in dead:
                continue
            if eqn.primitive in MATMUL_PRIMITIVES:
                n = matmul_flops(eqn) * repeats
                flops[0] += n * all(is_half_dtype(a.aval.dtype) for a in eqn.invars[:2])
                flops[1] += n
            length = eqn.params["length"] if eqn.primitive is compat.scan_p else 1
            for sub in compat.sub_jaxprs(eqn.params):
                visit(sub, repeats * length)

    visit(closed, 1)
    return flops[0] < 0.5 * flops[1]


def check_coverage(enabled: bool = True) -> None:
    """Turns the coverage warning of `filter_amp` on (the default) or off. When on,
    the first traced call of each model class under each policy is checked once
    (and checked again after this is called); when off, no call is.

    ```python
    eqx_amp.diagnostics.check_coverage(False)  # no check, no `CoverageWarning`
    ```
    """
    register_coverage_check(_FirstCallCheck() if enabled else None)

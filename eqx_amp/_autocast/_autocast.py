"""`autocast`: op-level mixed precision for any JAX function."""

import functools as ft
import sys
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar, cast, overload

import equinox as eqx

from .._core._cast import overflows_by_dtype, warn_of_overflow
from .._core._describe import is_module
from .._core._policy import Policy, get_policy, resolve_policy
from .._core._wrapper import FunctionWrapper, check_callable, user_stacklevel
from .._fp8 import holding_fp8_values
from .._jaxpr._evaluate import evaluate_function
from ._hook import AutocastHook
from ._rules import RuleTable


_P = ParamSpec("_P")
_T = TypeVar("_T")
_sentinel: Any = object()


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


class AutocastWrapper(FunctionWrapper[_P, _T]):
    """What `autocast(fn)` returns: called as `fn` is, with its parameters and
    result type."""

    fn: Callable[_P, _T]
    # `None`: the default policy where the call is traced (`eqx_amp.using_policy`).
    policy: Policy | None = eqx.field(static=True)
    rules: RuleTable = eqx.field(static=True)
    # With `policy=None`: the weights too large for each dtype but the one in force
    # where `autocast` was applied (warned about there); said where the policy is
    # read.
    weight_overflows: tuple = eqx.field(static=True, default=())

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        policy = resolve_policy(self.policy)
        warn_of_overflow(
            dict(self.weight_overflows).get(policy.compute_dtype.name, ()),
            policy.compute_dtype,
            cast_by=_RUNS_MATMULS_IN,
            fix=_KEEP_OPS_OR_RESCALE,
            stacklevel=user_stacklevel() + 1,  # warned one call down
        )
        if self.rules.uses_fp8 and policy.compute_dtype.itemsize < 2:
            raise ValueError(
                f"`eqx_amp.fp8.TENSORWISE` quantises matmul operands from the compute dtype and "
                f"returns products in it, so the compute dtype must be bfloat16, "
                f"float16 or wider, but the policy is {policy}. Keep the policy's "
                "compute dtype at bfloat16 and ask for fp8 with the rule."
            )
        hook = AutocastHook(self.rules, policy.compute_dtype, policy.reduce_dtype)
        # The arrays of Equinox modules (`fn` itself, or arguments) and Flax NNX
        # parameters are parameters: they follow the activations they meet.
        # The weights quantised once per call are held for its products only.
        with holding_fp8_values():
            return evaluate_function(
                _call,
                (self.fn, args, kwargs),
                hook,
                params_are=_holds_params,
                prepare=hook.quantize_weights if self.rules.uses_fp8 else None,
            )


def _holds_params(node: Any) -> bool:
    """Equinox modules, and Flax NNX's `nnx.Param` variables (in the `State` that
    `nnx.split` returns). Other NNX variables (`BatchStat`, RNG state) are state, not
    parameters: data, like `eqx.nn.State`. Flax is never imported here: if the
    program passes NNX variables, it has imported Flax already."""
    if isinstance(node, eqx.Module):
        return True
    param = getattr(sys.modules.get("flax.nnx"), "Param", None)
    return param is not None and isinstance(node, param)


@overload
def autocast(
    fn: Callable[_P, _T],
    *,
    policy: Policy | str | None = None,
    rules: Mapping[Any, Any] | None = None,
) -> AutocastWrapper[_P, _T]: ...


@overload
def autocast(
    *,
    policy: Policy | str | None = None,
    rules: Mapping[Any, Any] | None = None,
) -> Callable[[Callable[_P, _T]], AutocastWrapper[_P, _T]]: ...


def autocast(
    fn: Callable = _sentinel,
    *,
    policy: Policy | str | None = None,
    rules: Mapping[Any, Any] | None = None,
) -> Any:
    """Runs `fn` with op-level mixed precision, like `torch.autocast`.

    `fn` is traced to a jaxpr, which is re-evaluated op by op: each primitive's
    floating inputs are cast by its rule (matmuls and convolutions to the compute
    dtype, numerically touchy ops to float32, elementwise ops to their widest input
    dtype; see `DEFAULT_RULES`), and everything else runs on the dtypes that reach
    it. The interpreter recurses into every higher-order primitive (`jit`,
    `custom_jvp`, `custom_vjp`, `scan`, `while`, `cond`, `checkpoint`, `shard_map`),
    so nothing in a real model escapes it. Loop carries keep their dtypes, explicit
    casts the traced program holds are honoured (a cast to float32 of a value
    traced as float32 holds none: use `eqx_amp.full_precision()` there), custom
    derivative rules stay in use, and the outputs have the dtypes `fn` returns
    without autocast. Equinox's norm layers compute in float32; LayerNorm, RMSNorm
    and GroupNorm hand back the dtype their input arrived in, as they do when
    called on it directly.

    **Arguments:**

    - `fn`: any callable: a function, an `eqx.Module`, a bound method.
    - `policy`: a `Policy` or policy string whose compute dtype the `LOW` ops use;
        `None` means `default_policy()` where the call is traced (set it once with
        `eqx_amp.using_policy`).
    - `rules`: a mapping from JAX primitives (`jax.lax.exp_p`) or `jax.named_scope`
        names to `eqx_amp.LOW`, `FULL`, `PROMOTE`, `KEEP`, `eqx_amp.fp8.TENSORWISE`, `ROWWISE` or a
        callable `rule(compute_dtype, original_dtypes, *invals, **params) ->
        (invals, params)` (jaxamp's signature), merged over `DEFAULT_RULES`. The
        innermost matching named scope wins over primitive rules; ops no rule covers
        are not cast. `{jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE}` runs matmuls in fp8
        with current scaling (`eqx_amp.fp8.dot_general`), those whose shapes an fp8
        GEMM cannot take in the compute dtype (`precision_report` says which, and
        why).

    **Returns:**

    An `AutocastWrapper`: called as `fn` is, with its parameters and result type
    (a type checker sees no attribute of a wrapped model on it). It is itself an
    `eqx.Module`: it works under `jax.jit`, `eqx.filter_jit`, `jax.grad`,
    `eqx.filter_value_and_grad` and `jax.vmap`.

    **Example:**

    ```python
    model = eqx.nn.MLP(784, 10, 256, 2, key=jax.random.key(0))
    forward = eqx_amp.autocast(eqx.filter_vmap(model), rules={"attention": eqx_amp.FULL})
    logits = forward(images)          # matmuls in bf16, float32 logits
    loss, grads = eqx.filter_value_and_grad(eqx_amp.autocast(loss_fn))(model, x, y)
    ```
    """
    if fn is _sentinel:
        return ft.partial(autocast, policy=policy, rules=rules)
    check_callable(fn, "autocast")
    if policy is not None:
        policy = get_policy(policy)
    overflows: tuple = ()
    # Not `isinstance`: the checker would narrow `fn` to a Module it no longer
    # knows to be callable.
    if is_module(fn):
        # Matmuls read the weights in the compute dtype. With no policy, the one in
        # force now is checked here, and the call checks the one in force there.
        now = resolve_policy(policy).compute_dtype
        by_dtype = dict(overflows_by_dtype(fn, None))
        warn_of_overflow(
            by_dtype.pop(now.name, ()),
            now,
            cast_by=_RUNS_MATMULS_IN,
            fix=_KEEP_OPS_OR_RESCALE,
            stacklevel=3,
        )
        if policy is None:
            overflows = tuple(by_dtype.items())
    wrapper = AutocastWrapper(fn, policy, RuleTable(rules), weight_overflows=overflows)
    # Not `eqx.module_update_wrapper`'s return type, `Callable[_P, _T]`: the wrapper
    # itself, with its type.
    return cast(AutocastWrapper, eqx.module_update_wrapper(wrapper))


_RUNS_MATMULS_IN = "`autocast` runs matmuls in"
_KEEP_OPS_OR_RESCALE = (
    "Keep those ops in float32 with a rule (`rules={scope: eqx_amp.FULL}`), use "
    "bfloat16 (float32's range), or rescale the model."
)

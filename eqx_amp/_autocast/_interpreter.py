"""Re-evaluates a jaxpr equation by equation, casting each op's inputs by its rule.

Values flow through the program in whatever dtype their op produced (a bfloat16
matmul output stays bfloat16 until a rule says otherwise), except at three kinds of
boundaries, which keep the dtypes of the original program so that everything JAX
checks about them stays true:

- loop carries of `scan` and `while`, and the outputs of `cond` branches;
- the inputs and outputs of `custom_jvp` / `custom_vjp` functions, whose
  derivative rules were written for those dtypes (the rules themselves are
  re-evaluated under autocast, so the forward pass follows the rules under
  differentiation too);
- the outputs of the whole function.

Higher-order primitives are rebuilt through their public APIs (`jax.jit`,
`jax.checkpoint`, `lax.scan`, `lax.while_loop`, `lax.switch`, `jax.shard_map`) with
bodies that recurse into this interpreter, carrying the enclosing named scopes down.
"""

import dataclasses
import functools as ft
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from .._cast import is_floating_array
from . import _jax_compat as compat
from ._rules import RuleTable


@dataclasses.dataclass(frozen=True)
class Context:
    rules: RuleTable
    compute_dtype: np.dtype
    scopes: tuple[str, ...] = ()

    def inside(self, scopes: tuple[str, ...]) -> "Context":
        return dataclasses.replace(self, scopes=self.scopes + scopes)


def cast_to(values: Sequence[Any], dtypes: Sequence[np.dtype]) -> list[Any]:
    """Casts floating values back to the given dtypes."""
    return [
        lax.convert_element_type(v, d)
        if is_floating_array(v) and jnp.issubdtype(d, jnp.floating) and v.dtype != d
        else v
        for v, d in zip(values, dtypes)
    ]


def _dtypes(atoms: Sequence[Any]) -> list[np.dtype]:
    return [a.aval.dtype for a in atoms]


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: Context) -> list:
    env: dict[Any, Any] = {}

    def read(atom):
        return atom.val if isinstance(atom, compat.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        eqn_ctx = ctx.inside(compat.scope_names(eqn))
        with compat.equation_context(eqn):
            outvals = _eval_equation(eqn, invals, eqn_ctx)
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        env.update(zip(eqn.outvars, outvals))
    return [read(v) for v in jaxpr.outvars]


def eval_closed(closed: Any, args: Sequence[Any], ctx: Context) -> list:
    jaxpr, consts = compat.open_jaxpr(closed)
    return eval_jaxpr(jaxpr, consts, args, ctx)


def interpret_call(fn: Callable, args: Sequence[Any], ctx: Context) -> Any:
    """Traces `fn(*args)` and re-evaluates it under the rules. Non-array arguments
    and outputs pass through statically; array outputs come back in the dtypes `fn`
    returns without autocast."""
    dynamic, static = eqx.partition(list(args), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    static_out = []

    def flat_fn(*leaves):
        out = fn(*eqx.combine(jtu.tree_unflatten(treedef, leaves), static))
        dynamic_out, static_part = eqx.partition(out, eqx.is_array)
        static_out.append(static_part)
        return dynamic_out

    closed, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
    flat_shapes, out_treedef = jtu.tree_flatten(out_shapes)
    outs = eval_closed(closed, leaves, ctx)
    outs = cast_to(outs, [s.dtype for s in flat_shapes])
    return eqx.combine(jtu.tree_unflatten(out_treedef, outs), static_out[0])


#
# First-order primitives.
#


def _eval_equation(eqn: Any, invals: list, ctx: Context) -> Any:
    handler = _HIGHER_ORDER.get(eqn.primitive.name)
    if handler is not None:
        return handler(eqn, invals, ctx)
    if compat.has_sub_jaxprs(eqn.params) and "update_jaxpr" not in eqn.params:
        _warn_unknown_higher_order(eqn.primitive.name)
        invals = cast_to(invals, _dtypes(eqn.invars))
        return eqn.primitive.bind(*invals, **compat.bind_params(eqn))

    original = _dtypes(eqn.invars)
    rule = ctx.rules.lookup(eqn.primitive, ctx.scopes)
    params = dict(eqn.params)
    if rule is not None:
        invals, params = rule(ctx.compute_dtype, original, *invals, **params)
        invals = list(invals)
    else:
        invals = _agree_if_they_did(invals, original)
    params = _fix_dtype_params(eqn, invals, params)
    return eqn.primitive.bind(*invals, **params)


def _floating_positions(values: Sequence[Any]) -> list[int]:
    return [i for i, v in enumerate(values) if is_floating_array(v)]


def _agree_if_they_did(invals: list, original: list[np.dtype]) -> list:
    """An op no rule covers runs on the dtypes that reach it, but where its floating
    operands had one dtype in the original program (as lax requires of most
    multi-operand ops), they are promoted to agree again."""
    positions = _floating_positions(invals)
    if len(positions) < 2 or len({original[i] for i in positions}) != 1:
        return invals
    current = {invals[i].dtype for i in positions}
    if len(current) == 1:
        return invals
    with jax.numpy_dtype_promotion("standard"):
        widest = jnp.result_type(*current)
    return [
        lax.convert_element_type(v, widest) if i in positions else v
        for i, v in enumerate(invals)
    ]


def _fix_dtype_params(eqn: Any, invals: list, params: dict) -> dict:
    original = _dtypes(eqn.invars)
    floating_in = [v.dtype for v in invals if is_floating_array(v)]
    if not floating_in:
        return params
    with jax.numpy_dtype_promotion("standard"):
        widest = jnp.dtype(jnp.result_type(*floating_in))
    preferred = params.get("preferred_element_type")
    if preferred is not None and jnp.issubdtype(preferred, jnp.floating):
        original_floating = [d for d in original if jnp.issubdtype(d, jnp.floating)]
        with jax.numpy_dtype_promotion("standard"):
            original_widest = jnp.result_type(*original_floating) if original_floating else None
        # Only the default accumulation type follows the inputs; one the user asked
        # for explicitly (bf16 x bf16 -> f32, say) is honoured.
        if original_widest is not None and jnp.dtype(preferred) == original_widest:
            params = dict(params, preferred_element_type=widest)
    if "update_jaxpr" in params and floating_in:
        params = compat.retype_update_jaxpr(params, invals[0].dtype)
    return params


@ft.cache
def _warn_unknown_higher_order(name: str) -> None:
    warnings.warn(
        f"eqx_amp.autocast does not know the higher-order primitive `{name}`; it is "
        "run unchanged, at the dtypes it was traced with, and the ops inside it are "
        "not cast.",
        stacklevel=4,
    )


#
# Higher-order primitives.
#


def _call_inline(eqn, invals, ctx):
    jaxpr = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
    return eval_closed(jaxpr, invals, ctx)


def _jit(eqn, invals, ctx):
    closed = eqn.params["jaxpr"]

    def body(*args):
        return eval_closed(closed, args, ctx)

    body.__name__ = eqn.params.get("name", "jit")
    jitted = jax.jit(
        body,
        inline=eqn.params.get("inline", False),
        keep_unused=eqn.params.get("keep_unused", False),
    )
    return jitted(*invals)


def _checkpoint(eqn, invals, ctx):
    jaxpr = eqn.params["jaxpr"]

    def body(*args):
        return eval_closed(jaxpr, args, ctx)

    return jax.checkpoint(
        body,
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"),
    )(*invals)


def _scan(eqn, invals, ctx):
    p = compat.scan_params(eqn.params)
    num_consts, num_carry = p["num_consts"], p["num_carry"]
    consts = invals[:num_consts]
    carry_dtypes = _dtypes(eqn.invars[num_consts : num_consts + num_carry])
    init = cast_to(invals[num_consts : num_consts + num_carry], carry_dtypes)
    xs = invals[num_consts + num_carry :]

    def body(carry, x):
        outs = eval_closed(p["jaxpr"], [*consts, *carry, *x], ctx)
        return cast_to(outs[:num_carry], carry_dtypes), outs[num_carry:]

    carry, ys = lax.scan(
        body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


def _while(eqn, invals, ctx):
    cond_nconsts = eqn.params["cond_nconsts"]
    body_nconsts = eqn.params["body_nconsts"]
    cond_consts = invals[:cond_nconsts]
    body_consts = invals[cond_nconsts : cond_nconsts + body_nconsts]
    carry_vars = eqn.invars[cond_nconsts + body_nconsts :]
    carry_dtypes = _dtypes(carry_vars)
    init = cast_to(invals[cond_nconsts + body_nconsts :], carry_dtypes)

    def cond_fun(carry):
        return eval_closed(eqn.params["cond_jaxpr"], [*cond_consts, *carry], ctx)[0]

    def body_fun(carry):
        outs = eval_closed(eqn.params["body_jaxpr"], [*body_consts, *carry], ctx)
        return cast_to(outs, carry_dtypes)

    return lax.while_loop(cond_fun, body_fun, init)


def _cond(eqn, invals, ctx):
    index, *operands = invals
    out_dtypes = _dtypes(eqn.outvars)

    def branch(closed, *ops):
        return cast_to(eval_closed(closed, ops, ctx), out_dtypes)

    branches = [ft.partial(branch, b) for b in eqn.params["branches"]]
    return lax.switch(index, branches, *operands)


def _shard_map(eqn, invals, ctx):
    jaxpr = eqn.params["jaxpr"]

    def body(*args):
        return tuple(eval_closed(jaxpr, args, ctx))

    return list(jax.shard_map(body, **compat.shard_map_params(eqn.params))(*invals))


def _custom_jvp(eqn, invals, ctx):
    params = compat.bind_params(eqn)
    fun, jvp = params.pop("subfuns")
    call_jaxpr = eqn.params["call_jaxpr"]
    out_dtypes = [a.dtype for a in call_jaxpr.out_avals]

    def new_fun(*args):
        return cast_to(eval_closed(call_jaxpr, args, ctx), out_dtypes)

    def new_jvp(*primals_and_tangents):
        if not all(eqx.is_array(x) for x in primals_and_tangents):
            # Symbolic zeros reach the rule as objects, not arrays: run it as written.
            return compat.call_wrapped(jvp, *primals_and_tangents)
        return interpret_call(
            ft.partial(compat.call_wrapped, jvp), primals_and_tangents, ctx
        )

    invals = cast_to(invals, _dtypes(eqn.invars))
    return eqn.primitive.bind(
        *invals,
        subfuns=(compat.wrap_like(new_fun, fun), compat.wrap_like(new_jvp, jvp)),
        **params,
    )


def _custom_vjp(eqn, invals, ctx):
    params = compat.bind_params(eqn)
    fun, fwd, bwd = params.pop("subfuns")
    call_jaxpr = eqn.params["call_jaxpr"]
    out_dtypes = [a.dtype for a in call_jaxpr.out_avals]

    def new_fun(*args):
        return cast_to(eval_closed(call_jaxpr, args, ctx), out_dtypes)

    def new_fwd(*args):
        # The residuals come back in the dtypes the user's forward rule gives them,
        # so their backward rule sees exactly what it was written for.
        return interpret_call(ft.partial(compat.call_wrapped, fwd), args, ctx)

    invals = cast_to(invals, _dtypes(eqn.invars))
    return eqn.primitive.bind(
        *invals,
        subfuns=(compat.wrap_like(new_fun, fun), compat.wrap_like(new_fwd, fwd), bwd),
        **params,
    )


_HIGHER_ORDER: dict[str, Callable] = {
    "jit": _jit,
    "pjit": _jit,
    "closed_call": _call_inline,
    "core_call": _call_inline,
    "checkpoint": _checkpoint,
    "remat2": _checkpoint,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "shard_map": _shard_map,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
}

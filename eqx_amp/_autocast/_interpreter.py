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

from .._cast import is_floating_array, widest_dtype
from . import _jax_compat as compat
from ._rules import (
    LAYERS_RETURNING_INPUT_DTYPE,
    BuiltinRule,
    RuleTable,
    promotion_dtypes,
)


@dataclasses.dataclass(frozen=True)
class Context:
    rules: RuleTable
    compute_dtype: np.dtype
    scopes: tuple[str, ...] = ()
    # Inside a backward pass that `fn` itself takes (`autocast(jax.grad(f))`).
    transposed: bool = False

    def inside(self, scopes: tuple[str, ...], transposed: bool = False) -> "Context":
        return dataclasses.replace(
            self, scopes=self.scopes + scopes, transposed=self.transposed or transposed
        )


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


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: Context,
    weak: Sequence[bool] | None = None,
) -> tuple[list, list[bool]]:
    """Evaluates `jaxpr` under the rules. `weak` marks the arguments that are
    parameters (weakly typed: they follow the activations they meet); constants and
    literals are weak too. Returns the outputs and which of them are weak."""
    env: dict[Any, Any] = {}
    weak_env: dict[Any, bool] = {}
    casts = _CastCache()

    def read(atom):
        return atom.val if isinstance(atom, compat.Literal) else env[atom]

    def is_weak(atom):
        return isinstance(atom, compat.Literal) or weak_env[atom]

    env.update(zip(jaxpr.constvars, consts))
    weak_env.update((v, True) for v in jaxpr.constvars)
    env.update(zip(jaxpr.invars, args))
    weak_env.update(
        zip(jaxpr.invars, weak if weak is not None else [False] * len(args))
    )
    layer_calls = _LayerCalls(ctx)
    for eqn in jaxpr.eqns:
        in_weak = [is_weak(v) for v in eqn.invars]
        eqn_ctx = ctx.inside(compat.scope_names(eqn), compat.is_transposed(eqn))
        call = layer_calls.call_of(eqn, eqn_ctx)
        invals = layer_calls.read(
            eqn.invars, [read(v) for v in eqn.invars], in_weak, call, casts
        )
        with compat.equation_context(eqn):
            outvals, out_weak = _eval_equation(eqn, invals, in_weak, eqn_ctx, casts)
        layer_calls.made(eqn.outvars, call)
        env.update(zip(eqn.outvars, outvals))
        weak_env.update(zip(eqn.outvars, out_weak))
    return [read(v) for v in jaxpr.outvars], [is_weak(v) for v in jaxpr.outvars]


def eval_closed(
    closed: Any, args: Sequence[Any], ctx: Context, weak: Sequence[bool] | None = None
) -> tuple[list, list[bool]]:
    jaxpr, consts = compat.open_jaxpr(closed)
    return eval_jaxpr(jaxpr, consts, args, ctx, weak)


def _module_leaves(tree: Any) -> list[bool]:
    """For each array leaf of `tree`, whether it belongs to an `eqx.Module`: the
    parameters, as opposed to the data."""
    flags = []
    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    for node in jtu.tree_leaves(tree, is_leaf=is_module):
        flags += [is_module(node)] * len(jtu.tree_leaves(node))
    return flags


def interpret_call(
    fn: Callable, args: Sequence[Any], ctx: Context, *, modules_are_weak: bool = False
) -> Any:
    """Traces `fn(*args)` and re-evaluates it under the rules. Non-array arguments
    and outputs pass through statically; array outputs come back in the dtypes `fn`
    returns without autocast. With `modules_are_weak`, the arrays of Equinox modules
    among `args` are treated as parameters."""
    dynamic, static = eqx.partition(list(args), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    weak = _module_leaves(dynamic) if modules_are_weak else None
    static_out = []

    def flat_fn(*leaves):
        out = fn(*eqx.combine(jtu.tree_unflatten(treedef, leaves), static))
        dynamic_out, static_part = eqx.partition(out, eqx.is_array)
        static_out.append(static_part)
        return dynamic_out

    closed, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
    flat_shapes, out_treedef = jtu.tree_flatten(out_shapes)
    outs, _ = eval_closed(closed, leaves, ctx, weak)
    outs = cast_to(outs, [s.dtype for s in flat_shapes])
    return eqx.combine(jtu.tree_unflatten(out_treedef, outs), static_out[0])


class _LayerCall:
    """One call of a layer that hands back its input's dtype: the dtypes of the data
    that entered it."""

    def __init__(self):
        self.entered: list[np.dtype] = []

    def return_dtype(self) -> np.dtype | None:
        return widest_dtype(self.entered)


# Marks an equation that neither belongs to a layer call nor reads one's outputs as
# an outsider: a backward-pass equation, which must see the forward values as the
# layer computed them.
_UNINVOLVED: Any = object()


class _LayerCalls:
    """Restores the `out.astype(orig_dtype)` with which Equinox's LayerNorm, RMSNorm
    and GroupNorm end. In the traced float32 program that cast is the identity, so
    it is not in the jaxpr; without it a norm computed in float32 under its `FULL`
    scope would hand float32 to the ops after it (a ReLU would then save float32
    activations where the same model cast by hand saves bfloat16).

    A run of equations under one such scope is one call of the layer. A value made
    in a call and read by a forward-pass equation outside it is cast to the dtype of
    the data that entered the call, as the layer itself does when given that data.
    Parameters do not count as entering data (they are weak), and a call that no
    data entered returns what it computed."""

    def __init__(self, ctx: Context):
        self._active = not ctx.transposed and not any(
            scope in LAYERS_RETURNING_INPUT_DTYPE for scope in ctx.scopes
        )
        self._open: tuple[tuple[str, ...], _LayerCall] | None = None
        self._made_in: dict[Any, _LayerCall] = {}

    def call_of(self, eqn: Any, eqn_ctx: Context) -> _LayerCall | None:
        """The layer call `eqn` belongs to, `None` outside any, or `_UNINVOLVED`."""
        if not self._active or eqn_ctx.transposed:
            self._open = None
            return _UNINVOLVED
        scopes = compat.scope_names(eqn)
        for depth, scope in enumerate(scopes):
            if scope in LAYERS_RETURNING_INPUT_DTYPE:
                key = scopes[: depth + 1]
                if self._open is None or self._open[0] != key:
                    self._open = (key, _LayerCall())
                return self._open[1]
        self._open = None
        return None

    def read(
        self,
        atoms: Sequence[Any],
        values: list,
        weak: Sequence[bool],
        call: _LayerCall | None,
        cast: Callable,
    ) -> list:
        if call is _UNINVOLVED:
            return values
        out = []
        for atom, value, is_weak in zip(atoms, values, weak):
            made_in = (
                None if isinstance(atom, compat.Literal) else self._made_in.get(atom)
            )
            if made_in is not None and made_in is not call:
                value = cast(value, made_in.return_dtype())
            if (
                call is not None
                and made_in is not call
                and not is_weak
                and is_floating_array(value)
            ):
                call.entered.append(value.dtype)
            out.append(value)
        return out

    def made(self, atoms: Sequence[Any], call: _LayerCall | None) -> None:
        if call is not None and call is not _UNINVOLVED:
            self._made_in.update((atom, call) for atom in atoms)


#
# First-order primitives.
#


class _CastCache:
    """One cast per (value, dtype) per jaxpr: a LayerNorm output read by the q, k and
    v projections is converted once, not three times (each copy would otherwise be
    a separate value saved for the backward pass)."""

    def __init__(self):
        self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}

    def __call__(self, value: Any, dtype: np.dtype | None) -> Any:
        if dtype is None or not is_floating_array(value) or value.dtype == dtype:
            return value
        if isinstance(value, (np.ndarray, np.generic)):
            # A literal: cast now, so it stays a constant rather than becoming a
            # traced value (which the backward pass might save).
            return np.asarray(value).astype(dtype)
        key = (id(value), jnp.dtype(dtype))
        if key not in self._casts:
            # The source is kept alive with its cast, so its id cannot be reused.
            self._casts[key] = (value, lax.convert_element_type(value, dtype))
        return self._casts[key][1]


def _eval_equation(
    eqn: Any, invals: list, in_weak: list[bool], ctx: Context, casts: _CastCache
):
    handler = _HIGHER_ORDER.get(eqn.primitive.name)
    if handler is not None:
        outs, out_weak = handler(eqn, invals, in_weak, ctx)
        return list(outs), list(out_weak)
    if compat.has_sub_jaxprs(eqn.params) and "update_jaxpr" not in eqn.params:
        _warn_unknown_higher_order(eqn.primitive.name)
        invals = cast_to(invals, _dtypes(eqn.invars))
        outs = eqn.primitive.bind(*invals, **compat.bind_params(eqn))
        outs = outs if eqn.primitive.multiple_results else [outs]
        return list(outs), [False] * len(outs)

    original = _dtypes(eqn.invars)
    rule = ctx.rules.lookup(eqn.primitive, ctx.scopes)
    params = dict(eqn.params)
    if rule is None:
        invals = _agree_if_they_did(invals, original, in_weak)
    elif isinstance(rule, BuiltinRule):
        invals = rule.cast(ctx.compute_dtype, original, invals, in_weak, casts)
    else:
        invals, params = rule(ctx.compute_dtype, original, *invals, **params)
        invals = list(invals)
    params = _fix_dtype_params(eqn, invals, params)
    outs = eqn.primitive.bind(*invals, **params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    # Anything computed from data is data: only ops on parameters and constants
    # alone give weak results.
    return list(outs), [all(in_weak)] * len(outs)


def _floating_positions(values: Sequence[Any]) -> list[int]:
    return [i for i, v in enumerate(values) if is_floating_array(v)]


def _agree_if_they_did(
    invals: list, original: list[np.dtype], weak: list[bool]
) -> list:
    """An op no rule covers runs on the dtypes that reach it, but where its floating
    operands had one dtype in the original program (as lax requires of most
    multi-operand ops), they are promoted to agree again."""
    positions = _floating_positions(invals)
    if len(positions) < 2 or len({original[i] for i in positions}) != 1:
        return invals
    if len({invals[i].dtype for i in positions}) == 1:
        return invals
    target = widest_dtype(promotion_dtypes(invals, weak))
    return [
        lax.convert_element_type(v, target) if i in positions else v
        for i, v in enumerate(invals)
    ]


def _fix_dtype_params(eqn: Any, invals: list, params: dict) -> dict:
    original = _dtypes(eqn.invars)
    floating_in = [v.dtype for v in invals if is_floating_array(v)]
    if not floating_in:
        return params
    widest = widest_dtype(floating_in)
    preferred = params.get("preferred_element_type")
    if preferred is not None and jnp.issubdtype(preferred, jnp.floating):
        original_widest = widest_dtype(
            d for d in original if jnp.issubdtype(d, jnp.floating)
        )
        # Only the default accumulation type follows the inputs; one the user asked
        # for explicitly (bf16 x bf16 -> f32, say) is honoured.
        if original_widest is not None and jnp.dtype(preferred) == original_widest:
            params = dict(params, preferred_element_type=widest)
    if "update_jaxpr" in params:
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
# Higher-order primitives. Each takes the equation, its inputs and which of them
# are weak, and returns its outputs and which of those are weak.
#


def _strong(values: Sequence[Any]) -> list[bool]:
    return [False] * len(values)


def _call_inline(eqn, invals, in_weak, ctx):
    jaxpr = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
    return eval_closed(jaxpr, invals, ctx, in_weak)


def _traced_body(jaxpr, ctx, in_weak):
    """A body for a public transformation (`jax.jit`, `jax.checkpoint`,
    `jax.shard_map`) that evaluates `jaxpr` under the rules and records which
    outputs are weak (plain bools, known at trace time)."""
    out_weak: list[bool] = []

    def body(*args):
        outs, weak = eval_closed(jaxpr, args, ctx, in_weak)
        out_weak[:] = weak
        return outs

    return body, out_weak


def _jit(eqn, invals, in_weak, ctx):
    body, out_weak = _traced_body(eqn.params["jaxpr"], ctx, in_weak)
    body.__name__ = eqn.params.get("name", "jit")
    jitted = jax.jit(
        body,
        inline=eqn.params.get("inline", False),
        keep_unused=eqn.params.get("keep_unused", False),
    )
    return jitted(*invals), out_weak


def _checkpoint(eqn, invals, in_weak, ctx):
    body, out_weak = _traced_body(eqn.params["jaxpr"], ctx, in_weak)
    outs = jax.checkpoint(
        body,
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"),
    )(*invals)
    return outs, out_weak


def _shard_map(eqn, invals, in_weak, ctx):
    body, out_weak = _traced_body(eqn.params["jaxpr"], ctx, in_weak)
    outs = jax.shard_map(
        lambda *args: tuple(body(*args)), **compat.shard_map_params(eqn.params)
    )(*invals)
    return list(outs), out_weak


def _scan(eqn, invals, in_weak, ctx):
    p = compat.scan_params(eqn.params)
    num_consts, num_carry = p["num_consts"], p["num_carry"]
    consts = invals[:num_consts]
    carry_dtypes = _dtypes(eqn.invars[num_consts : num_consts + num_carry])
    init = cast_to(invals[num_consts : num_consts + num_carry], carry_dtypes)
    xs = invals[num_consts + num_carry :]
    # Carries are treated as data: their weakness could change between iterations.
    body_weak = [
        *in_weak[:num_consts],
        *[False] * num_carry,
        *in_weak[num_consts + num_carry :],
    ]
    ys_weak: list[bool] = []

    def body(carry, x):
        outs, weak = eval_closed(p["jaxpr"], [*consts, *carry, *x], ctx, body_weak)
        ys_weak[:] = weak[num_carry:]
        return cast_to(outs[:num_carry], carry_dtypes), outs[num_carry:]

    carry, ys = lax.scan(
        body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys], [*_strong(carry), *ys_weak]


def _while(eqn, invals, in_weak, ctx):
    cond_nconsts = eqn.params["cond_nconsts"]
    body_nconsts = eqn.params["body_nconsts"]
    cond_consts = invals[:cond_nconsts]
    body_consts = invals[cond_nconsts : cond_nconsts + body_nconsts]
    carry_vars = eqn.invars[cond_nconsts + body_nconsts :]
    carry_dtypes = _dtypes(carry_vars)
    init = cast_to(invals[cond_nconsts + body_nconsts :], carry_dtypes)
    cond_weak = [*in_weak[:cond_nconsts], *_strong(carry_vars)]
    body_weak = [
        *in_weak[cond_nconsts : cond_nconsts + body_nconsts],
        *_strong(carry_vars),
    ]

    def cond_fun(carry):
        return eval_closed(
            eqn.params["cond_jaxpr"], [*cond_consts, *carry], ctx, cond_weak
        )[0][0]

    def body_fun(carry):
        outs, _ = eval_closed(
            eqn.params["body_jaxpr"], [*body_consts, *carry], ctx, body_weak
        )
        return cast_to(outs, carry_dtypes)

    outs = lax.while_loop(cond_fun, body_fun, init)
    return outs, _strong(outs)


def _cond(eqn, invals, in_weak, ctx):
    index, *operands = invals
    out_dtypes = _dtypes(eqn.outvars)

    def branch(closed, *ops):
        outs, _ = eval_closed(closed, ops, ctx, in_weak[1:])
        return cast_to(outs, out_dtypes)

    branches = [ft.partial(branch, b) for b in eqn.params["branches"]]
    outs = lax.switch(index, branches, *operands)
    return outs, _strong(outs)


def _custom_jvp(eqn, invals, in_weak, ctx):
    params = compat.bind_params(eqn)
    fun, jvp = params.pop("subfuns")
    call_jaxpr = eqn.params["call_jaxpr"]
    original = _dtypes(eqn.invars)
    out_weak = [all(in_weak)] * len(eqn.outvars)
    if params.get("symbolic_zeros"):
        # Such rules receive zeros as objects and cannot be re-traced at other
        # dtypes: call them at the dtypes they were written for.
        return _custom_jvp_at_traced_dtypes(
            eqn, invals, ctx, params, fun, jvp
        ), out_weak

    def new_fun(*args):
        return eval_closed(call_jaxpr, args, ctx, in_weak)[0]

    def new_jvp(*primals_and_tangents):
        # The user's rule is traced at the dtypes it was written for and then
        # re-evaluated under the rules at the dtypes that arrive, so values flow
        # through (a bfloat16 activation stays bfloat16 through `jax.nn.relu`) and
        # the forward pass follows the rules under differentiation too.
        n = len(primals_and_tangents) // 2
        written_for = [
            jax.ShapeDtypeStruct(x.shape, d if is_floating_array(x) else x.dtype)
            for x, d in zip(primals_and_tangents, original + original)
        ]
        rule = jax.make_jaxpr(ft.partial(compat.call_wrapped, jvp))(*written_for)
        outs, _ = eval_closed(rule, primals_and_tangents, ctx)
        primal_dtypes = [
            s.dtype for s in jax.eval_shape(new_fun, *primals_and_tangents[:n])
        ]
        half = len(outs) // 2
        return cast_to(outs[:half], primal_dtypes) + cast_to(outs[half:], primal_dtypes)

    outs = eqn.primitive.bind(
        *invals,
        subfuns=(compat.wrap_like(new_fun, fun), compat.wrap_like(new_jvp, jvp)),
        **params,
    )
    return outs, out_weak


def _custom_jvp_at_traced_dtypes(eqn, invals, ctx, params, fun, jvp):
    call_jaxpr = eqn.params["call_jaxpr"]
    out_dtypes = [a.dtype for a in call_jaxpr.out_avals]

    def new_fun(*args):
        return cast_to(eval_closed(call_jaxpr, args, ctx)[0], out_dtypes)

    return eqn.primitive.bind(
        *cast_to(invals, _dtypes(eqn.invars)),
        subfuns=(compat.wrap_like(new_fun, fun), jvp),
        **params,
    )


def _custom_vjp(eqn, invals, in_weak, ctx):
    params = compat.bind_params(eqn)
    fun, fwd, bwd = params.pop("subfuns")
    call_jaxpr = eqn.params["call_jaxpr"]
    out_dtypes = [a.dtype for a in call_jaxpr.out_avals]

    def new_fun(*args):
        return cast_to(eval_closed(call_jaxpr, args, ctx)[0], out_dtypes)

    def new_fwd(*args):
        # The residuals come back in the dtypes the user's forward rule gives them,
        # so their backward rule sees exactly what it was written for.
        return interpret_call(ft.partial(compat.call_wrapped, fwd), args, ctx)

    outs = eqn.primitive.bind(
        *cast_to(invals, _dtypes(eqn.invars)),
        subfuns=(compat.wrap_like(new_fun, fun), compat.wrap_like(new_fwd, fwd), bwd),
        **params,
    )
    return outs, [all(in_weak)] * len(outs)


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

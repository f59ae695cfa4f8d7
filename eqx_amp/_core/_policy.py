"""Mixed-precision policies: which dtype parameters, computation and outputs use."""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._cast import (
    ACCEPTED_DTYPE_WORDS,
    DTYPE_ALIASES,
    cast_tree,
    floating_dtype,
    half_dtype,
)


_KEY_ALIASES = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
    "r": "reduce",
    "reduce": "reduce",
}
_KERAS_POLICIES = ("mixed_bfloat16", "mixed_float16")
_ACCEPTED_KEYS = ", ".join(repr(k) for k in _KEY_ALIASES)
_GRAMMAR = (
    "A policy string is either one dtype word (all three dtypes the same), "
    f"one of {', '.join(repr(k) for k in _KERAS_POLICIES)}, or comma-separated "
    "`key=dtype` pairs such as 'params=float32,compute=bfloat16,output=float32' "
    "(and optionally 'reduce=float32', the gradient-reduction dtype) "
    f"(keys: {_ACCEPTED_KEYS}; dtype words: {ACCEPTED_DTYPE_WORDS}, or any "
    "floating dtype name JAX knows, such as 'float8_e4m3fn')."
)


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
    """The dtypes of a mixed-precision scheme: parameters are stored in
    `param_dtype`, computation runs in `compute_dtype`, results are returned in
    `output_dtype`, and the gradients of parameters are accumulated and reduced
    across devices in `reduce_dtype`.

    A `Policy` is an immutable, hashable value (not a pytree), so it can be a static
    argument of `jax.jit` or a static field of an `eqx.Module`.

    **Arguments:**

    - `param_dtype`, `compute_dtype`, `output_dtype`: floating dtypes, in any
        spelling (`jnp.bfloat16`, `np.float32`, `"bf16"`, ...).
    - `reduce_dtype`: the dtype the weight-gradient matmuls accumulate and emit in,
        and so the dtype in which data-parallel and FSDP gradients are summed across
        devices (PyTorch FSDP's `reduce_dtype`). `None` (the default) is the compute
        dtype: what a hand-cast model does, with half the bytes on the wire.
        `float32` sums in float32 and rounds once: choose it for float16 (scaled
        float16 gradients summed over many devices can overflow) or when summing
        bfloat16 over many devices loses too much precision. It must be the compute
        dtype or wider.

    **Example:**

    ```python
    policy = eqx_amp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    assert policy == eqx_amp.get_policy("p=f32,c=bf16,o=f32")
    x16 = policy.cast_to_compute(jnp.ones(3))  # bfloat16
    fsdp = policy.with_reduce_dtype(jnp.float32)  # str: "...,reduce=float32"
    ```
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    reduce_dtype: np.dtype

    def __init__(
        self,
        param_dtype: Any,
        compute_dtype: Any,
        output_dtype: Any,
        reduce_dtype: Any = None,
    ):
        param = floating_dtype(param_dtype, "param_dtype")
        compute = floating_dtype(compute_dtype, "compute_dtype")
        output = floating_dtype(output_dtype, "output_dtype")
        reduce = (
            compute
            if reduce_dtype is None
            else floating_dtype(reduce_dtype, "reduce_dtype")
        )
        if not _holds(reduce, compute):
            raise ValueError(
                f"`reduce_dtype` must be the compute dtype ({compute.name}) or a wider "
                f"floating dtype such as float32, but got {reduce.name}: gradients "
                "are computed in the compute dtype, and reducing them in a narrower "
                "one would lose what the matmuls kept."
            )
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "output_dtype", output)
        object.__setattr__(self, "reduce_dtype", reduce)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Casts the floating arrays of `tree` to `param_dtype`."""
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Casts the floating arrays of `tree` to `compute_dtype`."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Casts the floating arrays of `tree` to `output_dtype`."""
        return cast_tree(tree, self.output_dtype)

    def with_param_dtype(self, dtype: Any) -> "Policy":
        """A copy of this policy with another `param_dtype`."""
        return Policy(dtype, self.compute_dtype, self.output_dtype, self._own_reduce)

    def with_compute_dtype(self, dtype: Any) -> "Policy":
        """A copy of this policy with another `compute_dtype` (a `reduce_dtype` that
        was the compute dtype follows it)."""
        return Policy(self.param_dtype, dtype, self.output_dtype, self._own_reduce)

    def with_output_dtype(self, dtype: Any) -> "Policy":
        """A copy of this policy with another `output_dtype`."""
        return Policy(self.param_dtype, self.compute_dtype, dtype, self._own_reduce)

    def with_reduce_dtype(self, dtype: Any) -> "Policy":
        """A copy of this policy with another `reduce_dtype` (`None`: the compute
        dtype)."""
        return Policy(self.param_dtype, self.compute_dtype, self.output_dtype, dtype)

    @property
    def _own_reduce(self) -> np.dtype | None:
        """The reduce dtype where it was chosen apart from the compute dtype."""
        return None if self.reduce_dtype == self.compute_dtype else self.reduce_dtype

    def __str__(self) -> str:
        reduce = "" if self._own_reduce is None else f",reduce={self.reduce_dtype.name}"
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}{reduce}"
        )

    def __repr__(self) -> str:
        reduce = (
            ""
            if self._own_reduce is None
            else f", reduce_dtype={self.reduce_dtype.name}"
        )
        return (
            f"Policy(param_dtype={self.param_dtype.name}, "
            f"compute_dtype={self.compute_dtype.name}, "
            f"output_dtype={self.output_dtype.name}{reduce})"
        )


def _holds(wide: np.dtype, narrow: np.dtype) -> bool:
    """Whether every value of `narrow` is a value of `wide`."""
    if wide == narrow:
        return True
    wide_info, narrow_info = jnp.finfo(wide), jnp.finfo(narrow)
    return (
        wide_info.nmant >= narrow_info.nmant
        and wide_info.maxexp >= narrow_info.maxexp
        and wide_info.minexp <= narrow_info.minexp
    )


def get_policy(policy: str | Policy) -> Policy:
    """Parses a policy string in the grammar of `jmp.get_policy`, plus the Keras
    names `"mixed_bfloat16"` and `"mixed_float16"`.

    **Arguments:**

    - `policy`: a string such as `"params=float32,compute=bfloat16,output=float32"`
        (short keys `p`, `c`, `o`; short dtype names `f32`, `bf16`, `f16`, `half`,
        `full`, ...; `reduce=`/`r=` sets `Policy.reduce_dtype`), a single dtype word (`"bfloat16"`: all three dtypes the same),
        or a `Policy` (returned unchanged). Missing keys default as in jmp: params
        float32, compute follows params, output follows compute. `"half"` is the
        platform's half dtype (see `default_policy`).

    **Returns:**

    A `Policy`. `get_policy(str(p)) == p` for every policy `p`.

    **Raises:**

    `ValueError` naming the part of the string it could not read, and the accepted
    words.

    **Example:**

    ```python
    policy = eqx_amp.get_policy("p=f32,c=bf16,o=f32")
    policy.compute_dtype  # dtype(bfloat16)
    eqx_amp.get_policy("mixed_float16").compute_dtype  # dtype(float16)
    ```
    """
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(
            f"`policy` must be a string or an `eqx_amp.Policy`, not "
            f"{_describe_non_policy(policy)}. {_GRAMMAR}"
        )
    text = policy.strip().lower()
    if text == "mixed_bfloat16":
        return Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    if text == "mixed_float16":
        return Policy(jnp.float32, jnp.float16, jnp.float32)
    if "=" not in text:
        dtype = _parse_word(text, policy, what="policy")
        return Policy(dtype, dtype, dtype)

    dtypes: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, word = (s.strip() for s in part.partition("="))
        if not sep or not key or not word:
            raise ValueError(
                f"Could not read {part.strip()!r} in policy {policy!r}: expected "
                f"`key=dtype`. {_GRAMMAR}"
            )
        if key not in _KEY_ALIASES:
            raise ValueError(
                f"Unknown key {key!r} in policy {policy!r}; accepted keys are "
                f"{_ACCEPTED_KEYS}. {_GRAMMAR}"
            )
        canonical = _KEY_ALIASES[key]
        if canonical in dtypes:
            raise ValueError(f"Key {key!r} is given twice in policy {policy!r}.")
        dtypes[canonical] = _parse_word(word, policy, what="dtype")
    param = dtypes.get("params", jnp.dtype(jnp.float32))
    compute = dtypes.get("compute", param)
    output = dtypes.get("output", compute)
    return Policy(param, compute, output, dtypes.get("reduce"))


def _describe_non_policy(value: Any) -> str:
    """A dtype given for a policy is named with the string that means it."""
    if value is not None and not isinstance(value, (bool, int, float)):
        try:
            name = jnp.dtype(value).name
        except TypeError:
            pass
        else:
            return f"the dtype {name} (the policy string {name!r} means that dtype throughout)"
    return type(value).__name__


def _parse_word(word: str, policy: str, what: str) -> np.dtype:
    try:
        return floating_dtype(word, "policy")
    except ValueError as error:
        reason = str(error)
    try:
        dtype = jnp.dtype(DTYPE_ALIASES.get(word, word))
    except TypeError:
        if what == "policy":
            raise ValueError(f"Unknown policy {policy!r}. {_GRAMMAR}") from None
        raise ValueError(
            f"Unknown dtype {word!r} in policy {policy!r}. {_GRAMMAR}"
        ) from None
    if jnp.issubdtype(dtype, jnp.floating):  # unsigned, or not held by JAX
        raise ValueError(f"{word!r} in policy {policy!r}: {reason}") from None
    raise ValueError(
        f"{word!r} in policy {policy!r} is {dtype.name}, not a real floating dtype: "
        "mixed precision only changes floating arrays. Use float16, bfloat16, "
        "float32, float64 or a float8 type."
    )


# The innermost policy `using_policy` has set (`None` outside every block), per
# thread. A JAX user context, not a plain context variable: it is read where a call
# is traced, so it must be part of the key under which `jax.jit` and
# `eqx.filter_jit` cache their traces, or a step traced outside a block would run
# its old dtypes inside it (and one traced inside would keep the block's dtypes
# after it). JAX's own scoped settings that change a program are in that key too.
_SCOPED_POLICY = jax.make_user_context(None)


def default_policy() -> Policy:
    """The policy used wherever `policy=None` is accepted: the innermost
    `eqx_amp.using_policy(...)` in force, or else parameters and outputs in float32
    and computation in the platform's half dtype (bfloat16 on TPUs, CPUs and GPUs of
    compute capability 8.0 and up, float16 on older GPUs).

    **Example:**

    ```python
    eqx_amp.default_policy()
    # Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
    ```
    """
    scoped = _SCOPED_POLICY.value
    if scoped is not None:
        return scoped
    return Policy(jnp.float32, half_dtype(), jnp.float32)


@contextlib.contextmanager
def using_policy(policy: "str | Policy") -> Iterator[Policy]:
    """Sets the default policy inside a `with` block, for every `filter_amp`,
    `autocast` and `BiModel` given no `policy=`. It is read where their calls are
    traced (`filter_amp` and `autocast`) or where they are built (`BiModel`), and
    it is part of the cache key of `jax.jit` and `eqx.filter_jit`: a step jitted
    before the block is traced again inside it, and again after it. An explicit
    `policy=` still wins. Blocks nest, and the setting is per thread.

    **Arguments:**

    - `policy`: a `Policy` or a policy string.

    **Example:**

    ```python
    with eqx_amp.using_policy("mixed_float16"):
        loss, grads = step(model, x, y)  # every filter_amp(...) inside: float16
    ```
    """
    resolved = get_policy(policy)
    with _SCOPED_POLICY(resolved):
        yield resolved


def resolve_policy(policy: "str | Policy | None") -> Policy:
    """`None` means the default policy; strings are parsed."""
    if policy is None:
        return default_policy()
    return get_policy(policy)

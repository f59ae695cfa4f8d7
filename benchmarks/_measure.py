"""What is measured, and how.

- `lower_and_compile`: the step is `jax.jit` of a function of the state's arrays
  (static parts closed over), lowered (trace + lower, timed) and compiled (timed).
- `memory`: `compiled.memory_analysis()`: temp + argument + output bytes (no
  buffer donation, so the sum is well defined on every backend).
- `hlo_stats`: counts in the HLO text. `program` is the HLO the step hands to XLA
  (`lowered.as_text(dialect="hlo")`): what the step asks for, backend-independent.
  `compiled` is XLA's optimised HLO (`compiled.as_text()`): what runs. Counted:
  instructions (lines with ` = `), `convert`s, and `dot`/`convolution` ops, with
  how many of them take a half-precision (bf16/f16) operand. (XLA's CPU backend
  upcasts half matmuls to float32, so on a CPU the compiled count of half matmuls
  is 0 for every variant; the program count shows what was asked for.) Also a
  `signature` of the instructions, to tell when two variants compiled the same
  program.
- `saved_residuals`: the forward values kept for the backward pass, independent of
  the backend: `jax.vjp(loss_of, diff_args)` under `jax.eval_shape`, and the leaves
  of the returned VJP function, which are exactly its residuals (the differentiated
  arguments themselves are among them where the backward pass needs them). Bytes
  are summed per dtype.
"""

import collections
import hashlib
import re
import time
from collections.abc import Callable

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree


HALF_TYPES = ("bf16", "f16")

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?\s*([a-z][a-z0-9]*)[\[\s,)]"
)
_CONVERT_OF = re.compile(r"\sconvert\((?:[^)%]*%)?([\w.\-]+)\)")
_MATMUL = re.compile(r"=\s*[^=]*?\s(dot|convolution)\(([^)]*)\)")


def jittable(step: Callable, state: PyTree) -> tuple[Callable, PyTree]:
    """`step` as a function of the state's arrays, and those arrays."""
    dynamic, static = eqx.partition(state, eqx.is_array)

    def flat_step(dynamic, batch):
        new_state, loss = step(eqx.combine(dynamic, static), batch)
        return eqx.filter(new_state, eqx.is_array), loss

    return flat_step, dynamic


def lower_and_compile(step: Callable, state: PyTree, batch) -> dict:
    """Traces, lowers and compiles `step`; returns the timings and the stages."""
    start = time.perf_counter()
    flat_step, dynamic = jittable(step, state)
    lowered = jax.jit(flat_step).lower(dynamic, batch)
    lowered_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    return {
        "trace_lower_s": lowered_s,
        "compile_s": compile_s,
        "lowered": lowered,
        "compiled": compiled,
        "dynamic": dynamic,
        "static_state": state,
    }


def memory(compiled) -> dict:
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report
        return {}
    fields = ("temp", "argument", "output", "alias", "generated_code")
    out = {f"{f}_bytes": int(getattr(stats, f"{f}_size_in_bytes", 0)) for f in fields}
    out["total_bytes"] = out["temp_bytes"] + out["argument_bytes"] + out["output_bytes"]
    return out


def hlo_stats(text: str) -> dict:
    lines = [line for line in text.splitlines() if " = " in line]
    types, converted_from = {}, {}
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m:
            types[m.group(1)] = m.group(2)
            source = _CONVERT_OF.search(line)
            if source:
                converted_from[m.group(1)] = source.group(1)
    matmuls = half_matmuls = fp8_matmuls = 0
    for line in lines:
        m = _MATMUL.search(line)
        if not m:
            continue
        matmuls += 1
        operands = [o.strip().split()[-1].lstrip("%") for o in m.group(2).split(",")]
        inline = re.findall(r"\b(bf16|f16|f32|f64|f8\w*)\[", m.group(2))
        dtypes = inline or [types.get(o, "?") for o in operands]
        if any(d in HALF_TYPES for d in dtypes):
            half_matmuls += 1
        # fp8 operands, or fp8 values read as wider ones (XLA rewrites either into
        # an fp8 GEMM).
        sources = [types.get(converted_from.get(o, ""), "") for o in operands]
        if all(d.startswith("f8") for d in dtypes) or (
            sources and all(d.startswith("f8") for d in sources)
        ):
            fp8_matmuls += 1
    return {
        "instructions": len(lines),
        "converts": sum(" convert(" in line for line in lines),
        "matmuls": matmuls,
        "half_matmuls": half_matmuls,
        "fp8_matmuls": fp8_matmuls,
        "signature": program_signature(lines),
    }


_SHAPED_OP = re.compile(r"=\s*(\S+)\s+([a-z][a-z0-9\-]*)\(")


def program_signature(lines: list[str]) -> str:
    """A hash of the program's instructions as (result shape, opcode) pairs, names
    and source metadata left out: two variants with the same signature compiled the
    same program, so their compile and step times differ only by noise."""
    shaped_ops = collections.Counter()
    for line in lines:
        m = _SHAPED_OP.search(line)
        if m:
            shaped_ops[m.groups()] += 1
    return hashlib.sha1(repr(sorted(shaped_ops.items())).encode()).hexdigest()[:16]


def saved_residuals(loss_of: Callable, diff_args: PyTree) -> dict:
    def residuals(args):
        _, vjp_fn = jax.vjp(loss_of, args)
        return vjp_fn

    shapes = jax.tree_util.tree_leaves(jax.eval_shape(residuals, diff_args))
    by_dtype = collections.Counter()
    for s in shapes:
        by_dtype[str(np.dtype(s.dtype))] += (
            int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        )
    return {
        "bytes": sum(by_dtype.values()),
        "count": len(shapes),
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
    }


def residual_table(loss_of: Callable, diff_args: PyTree) -> collections.Counter:
    """Saved residual bytes by (dtype and shape, what produced them): JAX's private
    `saved_residuals`, used by `--explain` only (empty if it is unavailable)."""
    try:
        from jax._src.ad_checkpoint import saved_residuals as _saved
    except ImportError:
        return collections.Counter()
    table = collections.Counter()
    for aval, where in _saved(loss_of, diff_args):
        nbytes = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        where = re.sub(r"\S*site-packages/", "", where)
        where = re.sub(r"from (\S*?):(\d+):\d+", r"at \1:\2", where)
        table[(aval.str_short(), where)] += nbytes
    return table


def time_steps(compiled, dynamic, batches) -> tuple[PyTree, list, list]:
    """Runs the compiled step once per batch; returns the new state, the step times
    (seconds, each to `block_until_ready`) and the losses."""
    times, losses = [], []
    for batch in batches:
        start = time.perf_counter()
        dynamic, loss = compiled(dynamic, batch)
        jax.block_until_ready((dynamic, loss))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return dynamic, times, losses

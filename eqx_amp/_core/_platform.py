"""Programs with a CPU form: XLA's CPU runtime cannot run every mixed-dtype dot
(bfloat16 x bfloat16 -> float32, once its passes fold transposes into it), so
such a product takes float32 operands holding the same values there."""

from collections.abc import Callable
from typing import Any

import jax
from jax import lax


# The scope of a CPU form: `precision_report` describes the program accelerators
# run and does not count what runs under it.
CPU_FORM_SCOPE = "eqx_amp.cpu_form"


def with_cpu_form(
    *args: Any, cpu: Callable, default: Callable, **platforms: Callable
) -> Any:
    """`cpu(*args)` in a program lowered for a CPU, the function named for its
    platform (`cuda=...`) or `default(*args)` elsewhere: chosen as the program is
    lowered, so a CPU can compile a program for a GPU."""
    return lax.platform_dependent(
        *args,
        cpu=jax.named_scope(CPU_FORM_SCOPE)(cpu),
        default=default,
        **platforms,
    )

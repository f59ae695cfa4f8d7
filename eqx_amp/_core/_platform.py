"""Programs with a CPU form: XLA's CPU runtime cannot run every mixed-dtype dot
(bfloat16 x bfloat16 -> float32, once its passes fold transposes into it), so
such a product takes float32 operands holding the same values there."""

import re
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


def _cpu_sums_half_products_in_half(version: str) -> bool:
    major, minor = (int(n) for n in re.findall(r"\d+", version)[:2])
    return (major, minor) >= (0, 11)


# XLA's CPU runtime in newer jax (checked: 0.12; not 0.10) may sum a product that
# emits bfloat16 in bfloat16 when its operands are made in the same program: a
# weight gradient of 16 examples came out up to 20% off. Products that must sum in
# float32 (the fp8 backward products, the reduce dtype's pullbacks) ask a CPU for
# float32 and round once there. Under GSPMD that moves a CPU's gradient reductions
# to float32 (the reduction sits on the product's output); accelerators, which sum
# in float32 whatever they emit, are unchanged.
CPU_SUMS_HALF_PRODUCTS_IN_HALF = _cpu_sums_half_products_in_half(jax.__version__)

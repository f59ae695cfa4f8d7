import os


# The suite times nothing, and most of its time is XLA compiling small programs: on
# the CPU, LLVM's optimisations are half of that, and the MLIR fusion emitters a
# third of the rest (a tiny program: 30 ms -> 14 ms); neither changes the HLO the
# tests read. Set before JAX starts a backend; subprocesses inherit it.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_use_fusion_emitters=false",
    ]
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402


# Silent float16 + float32 upcasts are exactly the bug class a mixed-precision
# library must not have, so every test runs with strict promotion.
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Implicit rank promotion hides shape bugs; Equinox's own tests forbid it too.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(0), 1000))
    return lambda: next(keys)

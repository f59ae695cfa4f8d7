import os
import subprocess
import sys


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA takes `flag` (an unknown one aborts the process):
    asked once, of a child interpreter; pytest-xdist's workers inherit the answer."""
    variable = "EQX_AMP_TESTS_XLA_KNOWS_" + flag.strip("-").split("=")[0].upper()
    if variable not in os.environ:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1) + 1"],
            env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
        )
        os.environ[variable] = str(int(probe.returncode == 0))
    return os.environ[variable] == "1"


# The suite times nothing, and most of its time is XLA compiling small programs: on
# the CPU, LLVM's optimisations are half of that, and the MLIR fusion emitters a
# third of the rest (a tiny program: 30 ms -> 14 ms; newer XLA has no switch for
# them); neither changes the HLO the tests read. Set before JAX starts a backend;
# subprocesses inherit it.
_FASTER_COMPILES = [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
]
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *filter(_xla_knows, _FASTER_COMPILES)]
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

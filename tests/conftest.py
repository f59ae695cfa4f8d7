import atexit
import os
import shutil
import subprocess
import sys
import tempfile


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
# them); neither changes the HLO the tests read. XLA also splits each program's
# machine code into parts compiled side by side, which on the suite's two cores,
# busy with a worker each, only adds work (the fp8 and telemetry modules: 86 s ->
# 75 s). Set before JAX starts a backend; subprocesses inherit it.
_FASTER_COMPILES = [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
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

# Many tests compile the same small programs (the same models under the same
# policies); a compilation cache private to this process and this run compiles each
# once. Private, because JAX writes its entries without a lock, and made empty
# here, so that a run never reads what another run (or another jax) compiled. Not
# through the environment: subprocesses a test starts keep to themselves.
if os.environ.get("JAX_COMPILATION_CACHE_DIR") is None:
    _compilation_cache = tempfile.mkdtemp(prefix="eqx_amp_tests_xla_")
    atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(0), 1000))
    return lambda: next(keys)


def pytest_configure(config):
    # Under `-n` without a `--dist` of the caller's, idle workers take the tests
    # queued for a busy one (`worksteal`): with `load`, the fast tier's longest
    # tests ended the run on one worker while the other waited.
    explicit = any(a.startswith("--dist") for a in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "worksteal"

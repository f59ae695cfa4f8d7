import jax
import jax.random as jr
import pytest


# Silent float16 + float32 upcasts are exactly the bug class a mixed-precision
# library must not have, so every test runs with strict promotion.
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Implicit rank promotion hides shape bugs; Equinox's own tests forbid it too.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(0), 1000))
    return lambda: next(keys)

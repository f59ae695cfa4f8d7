"""Op-level autocast: a jaxpr interpreter that recurses into every higher-order
primitive. `_jax_compat.py` holds every private JAX API it needs."""

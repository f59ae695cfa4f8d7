"""The one jaxpr layer: `_compat.py` holds every private or version-sensitive JAX
name, `_evaluate.py` the evaluator that `autocast` and the diagnostics hook into."""

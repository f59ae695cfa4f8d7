"""Optimizer-state precision as optax transformations (master weights,
compensated bfloat16 updates, low-precision moments), and the rounding recipes
they and BiModel share."""

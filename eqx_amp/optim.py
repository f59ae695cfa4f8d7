"""Optimizer-state precision, as optax `GradientTransformation`s: a float32 master copy
of half-precision weights kept in the optimizer state, compensated bfloat16 updates,
and low-precision optimizer moments; and the state types of these and of
`eqx_amp.loss_scaling`.

```python
optim = optax.chain(optax.adamw(1e-3), eqx_amp.optim.kahan_summation())
updates, opt_state = optim.update(grads, opt_state, params)
params = eqx_amp.optim.apply_updates(params, updates)  # each sum rounded once
```
"""

from ._loss_scaling._short_form import LossScalingState as LossScalingState
from ._optim._moments import LowPrecisionMomentsState as LowPrecisionMomentsState
from ._optim._moments import QuantizedMoment as QuantizedMoment
from ._optim._moments import low_precision_moments as low_precision_moments
from ._optim._transforms import KahanSummationState as KahanSummationState
from ._optim._transforms import MasterWeightsState as MasterWeightsState
from ._optim._transforms import StochasticRoundingState as StochasticRoundingState
from ._optim._transforms import kahan_summation as kahan_summation
from ._optim._transforms import master_weights as master_weights
from ._optim._transforms import stochastic_rounding as stochastic_rounding
from ._optim._updates import apply_updates as apply_updates

"""Multi-device helpers. `gather_params` is FSDP under `jax.shard_map`: parameter
shards are cast to the compute dtype before they are all-gathered, and their
gradients are reduce-scattered in the policy's reduce dtype.

```python
params = eqx_amp.sharding.gather_params(shards, "data", specs=specs)
```

Agreeing on a step across devices is an option of the gradient functions
(`axis_name=`, `average=`), and the gradient-reduction dtype one of the policy
(`Policy.with_reduce_dtype`).
"""

from ._sharding import gather_params as gather_params

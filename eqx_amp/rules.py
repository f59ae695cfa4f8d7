"""The rules of `eqx_amp.autocast`: what each primitive (or `jax.named_scope`) runs in.

```python
rules = {jax.lax.exp_p: eqx_amp.rules.LOW, "attention": eqx_amp.rules.FULL}
logits = eqx_amp.autocast(model, rules=rules)(x)
```

`LOW` casts floating inputs to the compute dtype, `FULL` up to float32, `PROMOTE` to
the widest floating input, `AS_TRACED` back to the dtypes the original program had.
`DEFAULT_RULES` is the table user rules are merged over. The fp8 rules live in
`eqx_amp.fp8`.
"""

from ._autocast._rules import AS_TRACED as AS_TRACED
from ._autocast._rules import DEFAULT_RULES as DEFAULT_RULES
from ._autocast._rules import FULL as FULL
from ._autocast._rules import LOW as LOW
from ._autocast._rules import PROMOTE as PROMOTE

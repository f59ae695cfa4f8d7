"""Command-line tools, run with `python -m`. `eqx_amp.tools.launch_local` starts a
program as N local processes of JAX's multi-process runtime, to try a multi-host
script on one machine:

```bash
python -m eqx_amp.tools.launch_local 2 --cpu-devices 4 -- python examples/fsdp.py --multi-host
```
"""

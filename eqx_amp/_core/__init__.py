"""The ground floor: policies, casting, filter specs and the wrapper base.

Imports nothing else of eqx_amp."""

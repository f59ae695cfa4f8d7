"""Passes over the jaxpr that report: what ran in which dtype, which op
produced the first inf or NaN, what a call-boundary policy leaves wide."""

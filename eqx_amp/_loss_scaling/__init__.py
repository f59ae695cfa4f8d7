"""Loss scaling: the jmp-semantics scales, the one scaled-gradient core, and
its short form (the loss scale kept in the optimizer state)."""

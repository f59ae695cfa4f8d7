"""Op-level autocast: a hook over the jaxpr evaluator that casts each op by its rule."""

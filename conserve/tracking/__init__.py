"""conserve.tracking: the tracker, the drift assembly, metrics, breakers (see shared/spec/layout.md)."""

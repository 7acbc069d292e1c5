"""conserve.analysis: numerical analysis of laws (discover; later verify, counting, continuity)."""

"""Multi-turn environments: deterministic replies to a model's turns, replayed by the verifier."""

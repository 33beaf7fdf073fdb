"""rollflow stages: rollout, scoring, flatten, train, metrics (one module each)."""

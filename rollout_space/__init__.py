"""rollout_space."""

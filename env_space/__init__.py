"""env_space."""

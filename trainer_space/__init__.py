"""trainer_space."""

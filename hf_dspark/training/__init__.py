"""Training: target regeneration data, target features, losses, trainer."""

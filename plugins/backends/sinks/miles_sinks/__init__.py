"""Miles metric sinks for Weights & Biases and MLflow (see :mod:`miles_sinks.plugin`)."""

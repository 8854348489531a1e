"""Data sources (grain random-access sources) for the tasks hax-jax trains on."""

"""Models: residual blocks over per-layer mixer kinds, and the language model."""

"""ktx: multi-task training for JAX/Flax in the style of T5X."""

__version__ = "0.1.0"

"""meshtrain: train PyTorch models on an N-dimensional device mesh, and plan what a layout costs."""

__version__ = "0.1.0"

"""The llama family: ``spec.py`` (torch-free) and ``model.py``."""

"""The gpt family: ``spec.py`` (torch-free) and ``model.py``."""

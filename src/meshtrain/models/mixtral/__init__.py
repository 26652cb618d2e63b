"""The Mixtral family: ``spec.py`` (torch-free) and ``model.py``."""

"""The Qwen3 (dense) family: ``spec.py`` (torch-free) and ``model.py``."""

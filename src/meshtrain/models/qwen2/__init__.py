"""The Qwen2 / Qwen2.5 family: ``spec.py`` (torch-free) and ``model.py``."""

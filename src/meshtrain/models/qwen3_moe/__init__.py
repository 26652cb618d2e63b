"""The Qwen3-MoE family: ``spec.py`` (torch-free) and ``model.py``."""

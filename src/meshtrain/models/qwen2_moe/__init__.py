"""The Qwen2-MoE family: ``spec.py`` (torch-free) and ``model.py``."""

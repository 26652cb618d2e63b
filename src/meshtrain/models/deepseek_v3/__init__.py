"""The DeepSeek-V3 family: ``spec.py`` (torch-free) and ``model.py``."""

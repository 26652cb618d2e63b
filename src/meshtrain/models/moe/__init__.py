"""Mixture-of-experts MLPs, a feature the MoE families share: ``spec.py`` (torch-free: keys, checks, counts,
Hugging Face names of the experts) and ``layer.py`` (the router, the experts, the load-balancing loss)."""

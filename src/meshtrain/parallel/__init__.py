"""Parallel strategies, each ``apply_<x>(model, mesh, cfg) -> model`` in its own file."""

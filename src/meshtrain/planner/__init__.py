"""Planner: memory, step time, MFU and total time of a layout, before launch."""

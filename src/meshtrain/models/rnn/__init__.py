"""The rnn family: ``spec.py`` (torch-free) and ``model.py``."""

"""Models: decoder-only GPT (``gpt.py``)."""

"""Corpus, tokenizer and the resumable sharded sampler."""

"""Tokenizers and prompt sources."""

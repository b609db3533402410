"""Tokenizers: HF tokenizer.json, the byte tokenizer of built-in models, and the serving wrapper."""

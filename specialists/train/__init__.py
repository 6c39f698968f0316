"""Corpora, tokenizer, chat data, backbone and MTP training."""

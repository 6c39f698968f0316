"""Specialists: models, drafters, chat template, training."""

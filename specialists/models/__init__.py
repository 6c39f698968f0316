"""Inference and training model code: configs, the MTP drafter, checkpoint I/O."""

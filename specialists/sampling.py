"""Sampling parameters, re-exported for the serving side: they live in spec/sampling.py (acceptance,
one layer down, needs them)."""

from spec.sampling import SamplingParams, filtered_probs

__all__ = ["SamplingParams", "filtered_probs"]

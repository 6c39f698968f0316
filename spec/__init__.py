"""Speculation, independent of any one model: draft -> verify -> accept -> commit/rollback."""

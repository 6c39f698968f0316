"""Ops: a torch reference each, GPU kernels beside."""

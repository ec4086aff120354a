"""Triton kernels of the backend (importing this package imports triton)."""

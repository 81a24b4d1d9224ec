"""Benchmarks (``make bench-kernels``); speed is measured here, never asserted by tests."""

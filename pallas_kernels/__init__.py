"""Pallas kernels (fused optimizer step, ...) with a CPU interpret path for tests."""

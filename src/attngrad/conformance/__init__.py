"""Correctness: the float64 reference, the harness of `attngrad check`, the verifier of `attngrad verify`."""

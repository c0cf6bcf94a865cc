"""Correctness, from the bottom: the float64 reference, the cases, the error rule, the higher derivatives,
the harness of `attngrad check` and the verifier of `attngrad verify` (reference, cases, rule,
derivatives, check, verify)."""

"""Correctness, from the bottom: the float64 reference, the cases, the error rule, the higher derivatives,
the harness of `attngrad check` and the verifier of `attngrad verify` (reference, cases, rule,
derivatives, check, verify); for FlexAttention calls the dense reference, the scenarios and the
score function's rounding analysis (flex_reference, flex_cases, score_rounding)."""

"""The fused strategy: its C++ CPU kernels (``csrc/``), their build and load, the launcher."""

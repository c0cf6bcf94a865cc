"""The triton strategy: its launchers, the Triton kernels, their tiles per GPU, their offline compile."""

"""Measurements behind the commands: speed, memory, the machine, the kernel compile report.

The tools (`TOOLS`), each behind one command, compute rows and never import one
another; `attngrad.cli` formats their rows.

    bench_step      ``bench``: forward, backward and forward+backward time of each
                    strategy beside SDPA's MATH and FLASH_ATTENTION backends
    bench_hvp       ``bench --order 2``: a Hessian-vector product's time and peak
                    memory, and torch.func.jvp against the forward, beside SDPA's MATH
    bench_features  ``bench --features``: forward+backward time with dropout, packed
                    segments, softcap and sinks over the same call without
    ledger          ``ledger``: bytes saved for backward (predicted and measured) and
                    peak memory; with ``--order 2`` what a double backward keeps
    kernel_report   ``kernels``: registers, spills and shared memory of every triton
                    kernel configuration, compiled for a GPU without one

What they share lives in the other modules, below them:

    paths    each PyTorch baseline named once (``pytorch-math``, ``sdpa-math``,
             ``sdpa-flash``), `path_fn` to run any path, the Hessian-vector product
    timing   interleaved rounds, their spreads, the timed passes
    memory   saved tensors and peak bytes as measured, and how bytes are written
    machine  the processor and its measured matmul rate
"""

TOOLS = ("bench_step", "bench_hvp", "bench_features", "ledger", "kernel_report")

"""The machine attngrad runs on, as far as its builds and figures need to name it."""

from __future__ import annotations

import platform

import torch

__all__ = ["processor_name"]


def processor_name(device: torch.device | None = None) -> str:
    """The GPU's name for a CUDA ``device``; else the CPU model from /proc/cpuinfo
    (Linux) or `platform` elsewhere."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: platform knows less, but something
    return platform.processor() or platform.machine() or "unknown CPU"

"""Measurements behind the commands: speed, memory, the machine, the kernel compile report."""

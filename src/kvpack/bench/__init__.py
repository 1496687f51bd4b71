"""Benchmarks that print numbers: ``decode`` (attention kernels against SDPA and dequantize-then-SDPA, with
the machine's measured memory bandwidth), ``membw`` (the bandwidth probe) and ``generate`` (end to end).

Nothing is imported here: each module loads its heavy parts when run.
"""

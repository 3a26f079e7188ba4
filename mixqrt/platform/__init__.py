"""What the machine is and how to use it: the ISA tier (isa), CPU topology and affinity, and the
process's performance counters (perf). The bottom layer with errors, limits and the kernels."""

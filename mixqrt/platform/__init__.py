"""What the machine is and how to use it: the ISA tier (isa), CPU topology and affinity, and the
process's performance counters (perf), and files read from a model folder confined to it
(files). The bottom layer with errors, limits and the kernels."""

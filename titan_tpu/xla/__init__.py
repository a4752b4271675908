"""The readers of what XLA made of a program: one captured program compiled and XLA's numbers of it
(numbers.py: memory by kind, the peak, cost analysis, the collectives it kept, the Pallas kernels),
and XLA's own dump read (dump.py: the optimized HLO, buffer assignment, the values alive at the
peak, the compile's stages). `titan-tpu compile`, the recipe table and the TorchTPU comparison
(tools/) read through these; they import graph/ and below only."""

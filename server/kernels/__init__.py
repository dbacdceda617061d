"""CPU kernels: which paths a machine runs (probed by running them), the C++ ops and their
build, the weight-only and activation-quantized linears."""

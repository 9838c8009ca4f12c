"""Fused CUDA kernels (Triton), each beside its pure-torch reference."""

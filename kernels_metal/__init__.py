"""Fused Metal kernels (mx.fast.metal_kernel), each beside its pure-MLX reference."""

"""C kernels for the torch backend on a CPU, compiled on first use with the system's C compiler
(``build.py``) and called through ctypes; each sits beside the pure-torch reference it replaces
and is validated against it (tests/backends/torch/test_cpu_kernels.py)."""

"""The MLX backend. On Linux, MLX is pointed at a system OpenBLAS before anything imports mlx.core
(backends/mlx/blas.py): the BLAS bundled with MLX's Linux wheel is the slow reference one."""
from localctx.backends.mlx.blas import use_system_openblas

use_system_openblas()

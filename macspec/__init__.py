"""macspec: speculative decoding for MLX, on one Mac or several."""

from .blas import ensure_fast_blas

# Before anything imports mlx: see blas.py.
ensure_fast_blas()

__version__ = "0.1.0"

"""Tensor parallelism: peer bootstrap, handshake, rank-0 step plans, liveness."""

"""KV caches: per-sequence trimmable caches, the batched cache, the prefix-cache index."""

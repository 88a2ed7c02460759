"""A Llama-style decoder whose KV cache is sharded along the sequence (`model`), and its
checkpoints (`checkpoint`). Uses `core` (and `perf` for timing)."""

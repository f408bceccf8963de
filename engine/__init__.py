"""The inference engine: configuration, scheduling, KV cache, model execution and public API."""

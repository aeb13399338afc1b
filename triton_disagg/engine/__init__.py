"""The numpy reference engine: model forward, paged KV cache, sampling, continuous batching."""

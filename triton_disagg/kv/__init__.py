"""KV cache: the paged block pool and the exchange between context and generation."""

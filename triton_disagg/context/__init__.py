"""The context role: prefill a batch and hand its KV over."""

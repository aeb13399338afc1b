"""Library logic behind the Triton models in model_repo/ (unit-testable without a server)."""

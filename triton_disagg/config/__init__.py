"""disagg_config.yaml -> typed config, and each role's rendered settings."""

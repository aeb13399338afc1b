"""Triton model repository templates (package data): one folder per model, each with a
``config.pbtxt`` holding ``${placeholders}`` and a thin ``1/model.py``. Rendered per role
by :mod:`triton_disagg.triton.render`; nothing here is imported."""

"""Checkpoint -> engine directory builders (installed as ``triton_disagg.builders``)."""

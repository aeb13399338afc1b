"""Render a role's model repository and start tritonserver (installed as ``triton_disagg.launch``)."""

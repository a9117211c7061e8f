"""lmkit.lite: compression (AWQ int4 weights, KV cache calibration) and evaluation. Work in progress:
see the project's issues."""

"""Core math: number formats, quantization args and presets, the canonical
calibration layout, range-to-qparams rules, and (fake) quantization.

Pure functions of tensors; nothing here keeps state. The public names are
re-exported from `quantobs`.
"""

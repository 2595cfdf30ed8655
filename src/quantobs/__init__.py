"""quantobs: quantization observers on one vectorized core."""

"""Parity checks of a bundle against the PyTorch reference, and the TensorRT lint (`dspark-export check`)."""

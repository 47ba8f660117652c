"""Test support shipped with the package: an in-process emulation of the CUDA runtime and TensorRT engines."""

"""Torch-free DSpark runtime: load a bundle and decode with ONNX Runtime (CPU)."""
from dspark.runtime.api import Runtime
from dspark.runtime.decoder import Decoder, RequestResult

__all__ = ["Runtime", "Decoder", "RequestResult"]

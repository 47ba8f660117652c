"""Torch-free DSpark runtime: load a bundle and decode with ONNX Runtime (CPU) or a registered GPU backend."""
from dspark.runtime.api import Runtime, Stream
from dspark.runtime.backend import Backend, register_backend
from dspark.runtime.decoder import Decoder
from dspark.runtime.observers import ConfidenceLog, RoundObserver, StepTimer, TapsLog
from dspark.runtime.results import RequestResult
from dspark.runtime.options import DecodeOptions
from dspark.runtime.scheduler import VerifyPolicy

__all__ = ["Runtime", "Stream", "Decoder", "RequestResult", "DecodeOptions", "VerifyPolicy", "Backend",
           "register_backend", "RoundObserver", "StepTimer", "ConfidenceLog", "TapsLog"]

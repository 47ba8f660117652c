"""The Python API of the runtime: load a bundle, then generate or stream. Imports neither torch nor transformers."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.runtime.decoder import Decoder, RequestResult
from dspark.tokenizer import ChatTokenizer

Prompt = str | Sequence[int]


class Runtime:
    """A loaded bundle. `generate` decodes a batch; `stream` yields text as rounds commit tokens."""

    def __init__(self, bundle: str | Path, backend="onnxruntime", threads: int | None = None,
                 cuda_graphs: bool = False):
        """backend: "onnxruntime" (CPU) or "tensorrt" (the bundle's engines from `dspark-export build`, driven
        through cuda-python with device-resident caches; `cuda_graphs` replays each engine launch as a CUDA graph),
        or a backend object already made for this bundle (e.g. a StreamingBackend sharing loaded engines)."""
        self.folder = Path(bundle)
        self.manifest = Manifest.read(self.folder)
        self.tokenizer = ChatTokenizer(self.folder)
        if not isinstance(backend, str):
            self.backend = backend
        elif backend == "onnxruntime":
            from dspark.runtime.ort_backend import OrtBackend

            self.backend = OrtBackend(self.folder, self.manifest, threads)
        elif backend == "tensorrt":
            from dspark.trt.stream import StreamingBackend

            self.backend = StreamingBackend(self.folder, self.manifest, cuda_graphs=cuda_graphs)
        else:
            raise DSparkError(f"unknown backend {backend!r} (available: onnxruntime, tensorrt)")

    def encode(self, prompt: Prompt) -> list[int]:
        """Text goes through the chat template; a list of ids is used as is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_chat(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.manifest.target["vocab_size"]
        if any(not 0 <= t < vocab for t in ids):
            raise DSparkError(f"token ids must lie in 0..{vocab - 1}")
        return ids

    def decoder(self, prompts: Sequence[Prompt], max_new_tokens: int = 128, temperature: float = 0.0,
                seed: int = 0, threshold: float = 0.0, ar: bool = False, batch_size: int | None = None,
                record_taps: bool = False, record_confidence: bool = False, policy=None) -> Decoder:
        """Requests beyond `batch_size` wait in a queue and take the first slot that frees up."""
        return Decoder(self.backend, self.manifest, [self.encode(p) for p in prompts], max_new_tokens,
                       temperature=temperature, seed=seed, threshold=threshold, ar=ar, batch_size=batch_size,
                       record_taps=record_taps, record_confidence=record_confidence, policy=policy)

    def generate(self, prompts: Sequence[Prompt], **kw) -> list[RequestResult]:
        dec = self.decoder(prompts, **kw)
        for _ in dec:
            pass
        return dec.results

    def stream(self, prompt: Prompt, **kw) -> Iterator[str]:
        """Yields decoded text pieces of one request as they are committed."""
        for _, piece in self.stream_many([prompt], **kw):
            yield piece

    def stream_many(self, prompts: Sequence[Prompt], **kw) -> Iterator[tuple[int, str]]:
        """Per-request streams of a concurrent batch: yields (request index, text piece) as rounds commit."""
        dec = self.decoder(prompts, **kw)
        self.last = dec
        ids: list[list[int]] = [[] for _ in prompts]
        shown = [""] * len(prompts)
        for event in dec:
            i = event.request
            ids[i] += event.token_ids
            text = self.tokenizer.decode(ids[i])
            if text.startswith(shown[i]) and not text.endswith("\ufffd"):
                piece, shown[i] = text[len(shown[i]):], text
                if piece:
                    yield i, piece

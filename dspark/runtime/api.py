"""The Python API of the runtime: load a bundle, then generate or stream. Imports neither torch nor transformers.

    from dspark.runtime import DecodeOptions, Runtime

    with Runtime("bundle/") as rt:
        results = rt.generate(["Hello!"], DecodeOptions(max_new_tokens=64, policy="schedule+gate"))
        print(results[0].text)
        stream = rt.stream("Tell me a story", DecodeOptions(max_new_tokens=64))
        for piece in stream:
            print(piece, end="")
        print(stream.result.tau, stream.times.rounds)
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.runtime.backend import Backend, create_backend
from dspark.runtime.decoder import Decoder, RequestResult, StepTimes
from dspark.runtime.options import DecodeOptions
from dspark.tokenizer import ChatTokenizer, IncrementalDetokenizer

Prompt = str | Sequence[int]


class Stream:
    """Text pieces of a decode as rounds commit them: (request index, piece) pairs, or plain pieces for a single
    prompt. Once exhausted, `results` (and `result`, the first) and `times` hold what the decode measured."""

    def __init__(self, decoder: Decoder, tokenizer: ChatTokenizer, single: bool):
        self.decoder = decoder
        self._detokenizers = [IncrementalDetokenizer(tokenizer) for _ in decoder.prompts]
        self._single = single

    def __iter__(self) -> Iterator:
        for event in self.decoder:
            piece = self._detokenizers[event.request].add(event.token_ids)
            if piece:
                yield piece if self._single else (event.request, piece)

    @property
    def results(self) -> list[RequestResult]:
        return self.decoder.results

    @property
    def result(self) -> RequestResult:
        return self.decoder.results[0]

    @property
    def times(self) -> StepTimes:
        return self.decoder.times


class Runtime:
    """A loaded bundle. `generate` decodes a batch; `stream` yields text as rounds commit tokens."""

    def __init__(self, bundle: str | Path, backend: str | Backend = "onnxruntime", threads: int | None = None,
                 cuda_graphs: bool = False):
        """backend: a registered backend's name ("onnxruntime" on CPU; "tensorrt": the bundle's engines from
        `dspark-export build`, driven through cuda-python with device-resident caches, where `cuda_graphs` replays
        each engine launch as a CUDA graph), or a Backend object already made for this bundle."""
        self.folder = Path(bundle)
        self.manifest = Manifest.read(self.folder)
        self.tokenizer = ChatTokenizer(self.folder)
        if isinstance(backend, Backend):
            self.backend = backend
        else:
            self.backend = create_backend(backend, self.folder, self.manifest, threads=threads,
                                          cuda_graphs=cuda_graphs)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.backend.close()

    def encode(self, prompt: Prompt) -> list[int]:
        """Text goes through the chat template; a list of ids is used as is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_chat(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.manifest.target["vocab_size"]
        if any(not 0 <= t < vocab for t in ids):
            raise DSparkError(f"token ids must lie in 0..{vocab - 1}")
        return ids

    def decoder(self, prompts: Sequence[Prompt], options: DecodeOptions = DecodeOptions()) -> Decoder:
        """Requests beyond `options.batch_size` wait in a queue and take the first slot that frees up."""
        return Decoder(self.backend, self.manifest, [self.encode(p) for p in prompts], options)

    def generate(self, prompts: Sequence[Prompt], options: DecodeOptions = DecodeOptions()) -> list[RequestResult]:
        """Decode to the end; each result carries its token ids and `text`."""
        dec = self.decoder(prompts, options)
        for _ in dec:
            pass
        for res in dec.results:
            res.text = self.tokenizer.decode(res.token_ids)
        return dec.results

    def stream(self, prompt: Prompt, options: DecodeOptions = DecodeOptions()) -> Stream:
        """Iterate for text pieces of one request as they are committed; then read `.result` and `.times`."""
        return Stream(self.decoder([prompt], options), self.tokenizer, single=True)

    def stream_many(self, prompts: Sequence[Prompt], options: DecodeOptions = DecodeOptions()) -> Stream:
        """Per-request streams of a concurrent batch: iterate for (request index, text piece) as rounds commit."""
        return Stream(self.decoder(prompts, options), self.tokenizer, single=False)

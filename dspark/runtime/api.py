"""The Python API of the runtime: load a bundle, then generate or stream. Imports neither torch nor transformers.

    from dspark.runtime import DecodeOptions, Runtime

    with Runtime("bundle/") as rt:
        results = rt.generate(["Hello!"], DecodeOptions(max_tokens=64, policy="schedule+gate"))
        print(results[0].text)
        stream = rt.stream("Tell me a story", DecodeOptions(max_tokens=64))
        for piece in stream:
            print(piece, end="")
        print(stream.result.tau, stream.times.rounds)
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from typing import Iterator, Sequence

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.runtime.backend import Backend, create_backend
from dspark.runtime.decoder import Decoder
from dspark.runtime.results import RequestResult, StepTimes
from dspark.runtime.gate import GateMemory
from dspark.runtime.grammar import GrammarTokenizer
from dspark.runtime.observers import RoundObserver
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
                 cuda_graphs: bool = False, weights: str | None = None, spin: bool | None = None):
        """backend: a registered backend's name ("onnxruntime" on CPU; "tensorrt": the bundle's engines from
        `dspark-export build`, driven through cuda-python with device-resident caches, where `cuda_graphs` replays
        each engine launch as a CUDA graph), or a Backend object already made for this bundle. weights (ONNX
        Runtime): "packed" (fp32 copies, fastest), "mapped" (used from the bundle file at their stored precision,
        for bundles larger than memory) or "auto" (the default: packed when it fits). spin (ONNX Runtime): True
        makes the threads spin between kernels while a graph runs instead of sleeping (faster in a process that has
        the cores to itself, as `dspark serve` does; slower where other busy threads share them)."""
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise DSparkError(f"threads must be a positive integer (or None for all cores), not {threads!r}")
        if not isinstance(bundle, (str, os.PathLike)):
            raise DSparkError(f"bundle must be a folder path, not {type(bundle).__name__}")
        self.folder = Path(bundle)
        self.threads = threads
        self.manifest = Manifest.read_checked(self.folder)  # a damaged graph or weights file never decodes
        self.tokenizer = ChatTokenizer(self.folder, confined=True)
        self.gates = GateMemory()  # what the draft gate learned (costs, survival, back-off) outlives one decode
        self._grammars: GrammarTokenizer | None = None
        if isinstance(backend, Backend):
            self.backend = backend
        else:
            self.backend = create_backend(backend, self.folder, self.manifest, threads=threads,
                                          cuda_graphs=cuda_graphs, weights=weights, spin=spin)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.backend.close()

    @property
    def grammars(self) -> GrammarTokenizer:
        """What compiles structured-output grammars for this bundle's tokenizer (built on first use):
        `rt.grammars.json_schema(schema)` for DecodeOptions(grammar=) and RequestOptions(grammar=)."""
        if self._grammars is None:
            self._grammars = GrammarTokenizer(self.tokenizer.file("tokenizer.json"),
                                              self.manifest.target["vocab_size"], list(self.manifest.stop_token_ids))
        return self._grammars

    def encode(self, prompt: Prompt) -> list[int]:
        """Text goes through the chat template; a list of ids is used as is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_chat(prompt)
        if isinstance(prompt, (bytes, bytearray, memoryview)) or not isinstance(prompt, Sequence | np.ndarray):
            raise DSparkError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}")
        vocab = self.manifest.target["vocab_size"]
        for t in prompt:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                raise DSparkError(f"token id {t!r} is not an integer in 0..{vocab - 1}")
        return [int(t) for t in prompt]

    def _encode_all(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence | np.ndarray):
            raise DSparkError(f"prompts must be a list of prompts, not {type(prompts).__name__} (for one prompt: "
                              f"[prompt] or Runtime.stream)")
        return [self.encode(p) for p in prompts]

    def decoder(self, prompts: Sequence[Prompt], options: DecodeOptions = DecodeOptions(),
                observers: Sequence[RoundObserver] = ()) -> Decoder:
        """Requests beyond `options.batch_size` wait in a queue and take the first slot that frees up. `observers`
        see every prefill and round (dspark.runtime.observers: TapsLog, ConfidenceLog, StepTimer)."""
        if not isinstance(options, DecodeOptions):
            raise DSparkError(f"options must be DecodeOptions, not {type(options).__name__}")
        if any(not isinstance(o, RoundObserver) for o in observers):
            raise DSparkError("observers must be dspark.runtime.observers.RoundObserver objects")
        return Decoder(self.backend, self.manifest, self._encode_all(prompts), options, gates=self.gates,
                       observers=tuple(observers))

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

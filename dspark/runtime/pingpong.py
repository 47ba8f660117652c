"""Micro-batches in ping-pong: the requests are split over backend lanes, each decoded by its own Decoder in its
own thread. A lane blocks (releasing the GIL) while it waits for its results; meanwhile the other lane's host work,
copies and engines proceed, so on a GPU one micro-batch's transfers and host steps hide behind the other's engines.

Backends offer lanes with `lanes(n)` (dspark.trt.backend.TrtBackend: own streams, execution contexts and
buffers on the shared engines; a backend without lanes refuses n > 1). Tokens do not depend on the split: noise
is keyed by the global request index.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from dspark.errors import DSparkError
from dspark.runtime.decoder import Decoder
from dspark.runtime.results import RequestResult
from dspark.runtime.options import DecodeOptions


@dataclass
class PingPongRun:
    results: list[RequestResult]
    seconds: float
    lanes: int

    @property
    def tokens_per_s(self) -> float:
        return sum(len(r.token_ids) for r in self.results) / self.seconds if self.seconds > 0 else 0.0


def generate_pingpong(runtime, prompts, micro_batches: int = 2,
                      options: DecodeOptions = DecodeOptions()) -> PingPongRun:
    """Decode `prompts` as `micro_batches` interleaved micro-batches (requests i, i + m, i + 2m, ... in lane i)."""
    if micro_batches < 1:
        raise DSparkError("micro_batches must be at least 1")
    encoded = [runtime.encode(p) for p in prompts]
    parts = [list(range(i, len(encoded), micro_batches)) for i in range(micro_batches)]
    parts = [p for p in parts if p]
    backends = runtime.backend.lanes(len(parts))
    decoders = [Decoder(b, runtime.manifest, [encoded[i] for i in part], options, request_ids=part)
                for b, part in zip(backends, parts)]
    errors: list[BaseException] = []

    def drive(dec: Decoder) -> None:
        try:
            for _ in dec:
                pass
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=drive, args=(d,), daemon=True) for d in decoders[1:]]
    for t in threads:
        t.start()
    drive(decoders[0])
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    results: list[RequestResult | None] = [None] * len(encoded)
    for dec, part in zip(decoders, parts):
        for i, res in zip(part, dec.results):
            results[i] = res
    return PingPongRun(results=results, seconds=seconds, lanes=len(parts))

"""What one `dspark serve` process holds: the loaded bundle, the engine, the metrics, and whether it is ready."""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dspark.acceptance import recorded_position1
from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.runtime.api import Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.serve.chat import ChatRenderer
from dspark.serve.metrics import Metrics


@dataclass(frozen=True)
class ServeConfig:
    bundle: Path
    model_name: str
    aliases: tuple[str, ...] = ()  # other model ids requests may send (e.g. the bundle folder's name)
    engine: EngineOptions = EngineOptions()
    backend: str = "onnxruntime"
    threads: int | None = None
    weights: str | None = "auto"  # ONNX Runtime: packed, mapped or auto (dspark.runtime.ort_backend); None otherwise
    spin: bool = True  # ONNX Runtime's threads spin between kernels while a graph runs (Runtime's spin)
    grace: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    max_body_bytes: int = 1 << 20
    request_timeout: float = 30.0  # seconds a client has for a request's headers, and again for its body (408)
    max_connections: int = 1024  # open connections at most (uvicorn answers 503 beyond)


@dataclass
class ServerState:
    config: ServeConfig
    runtime: Runtime | None = None
    engine: Engine | None = None
    chat: ChatRenderer | None = None
    load_error: str | None = None
    draining: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    metrics: Metrics = field(init=False)

    def __post_init__(self):
        bundle = self.config.bundle
        self.metrics = Metrics(Manifest.read(bundle).block_size, self.config.model_name,  # refuses a bad bundle
                               recorded_position1(bundle),
                               warn=lambda line: print(f"dspark serve: {line}", file=sys.stderr, flush=True))

    def load(self, say: Callable[[str], None] = lambda line: None) -> None:
        """Load the bundle, start the engine (`say` gets what it chose and why) and warm it up (the server answers
        /health 503 until then)."""
        try:
            self.runtime = Runtime(self.config.bundle, backend=self.config.backend, threads=self.config.threads,
                                   weights=self.config.weights,
                                   spin=self.config.spin if self.config.backend == "onnxruntime" else None)
            if self.draining:  # SIGTERM while loading: start nothing more (close() frees what is loaded)
                return
            self.chat = ChatRenderer(self.runtime.tokenizer)
            self.engine = Engine(self.runtime, self.config.engine, observer=self.metrics).start()
            self.metrics.slots.set(self.engine.batch)
            say(self.engine.choice.summary())
            if self.draining:
                return
            self.engine.warm_up(self.chat.encode([{"role": "user", "content": "Hello"}]))
            self.metrics.ready.set(1)
            self.ready.set()
        except DSparkError as e:
            self.load_error = str(e)
            raise

    def drain(self) -> None:
        """SIGTERM: refuse new requests, give in-flight ones `grace` seconds, cancel the rest."""
        self.draining = True
        self.metrics.ready.set(0)
        if self.engine is not None:
            self.engine.close(self.config.grace)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close(0)
        if self.runtime is not None:
            self.runtime.close()

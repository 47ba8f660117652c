"""The bundle manifest: what the exporter writes and what every runtime checks at load time (torch-free)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dspark.errors import DSparkError
from dspark.files import read_json

FORMAT = "dspark-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPHS = ("verifier", "draft", "heads")


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: list[int | str]  # ints are fixed, strings name dynamic axes


@dataclass
class GraphSpec:
    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    sha256: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> "GraphSpec":
        return cls(file=d["file"], inputs=[TensorSpec(**t) for t in d["inputs"]],
                   outputs=[TensorSpec(**t) for t in d["outputs"]], sha256=d.get("sha256", ""))


@dataclass
class Manifest:
    target: dict[str, Any]  # family, hidden_size, num_layers, num_kv_heads, head_dim, vocab_size
    draft: dict[str, Any]  # num_layers, num_kv_heads, head_dim, block_size, target_layer_ids, mask_token_id, ...
    max_context: int
    stop_token_ids: list[int]
    graphs: dict[str, GraphSpec]
    sources: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)  # sts_temperatures, sps_table
    precision: str = "fp32"
    quantized: dict[str, Any] = field(default_factory=dict)  # graph -> record of dspark.export.quantize
    tensorrt: dict[str, Any] = field(default_factory=dict)  # engines, plugin, profiles of dspark-export build
    tools: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def block_size(self) -> int:
        return int(self.draft["block_size"])

    @property
    def sts_temperatures(self) -> list[float]:
        return list(self.calibration.get("sts_temperatures") or [1.0] * self.block_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def write(self, folder: Path) -> None:
        """Write folder/manifest.json atomically (a temporary file renamed into place, never written through)."""
        tmp = Path(folder) / (MANIFEST + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, Path(folder) / MANIFEST)

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        folder = Path(folder)
        path = folder / MANIFEST
        if not folder.is_dir():
            raise DSparkError(f"bundle {folder} not found (run `dspark-export onnx` first)")
        if not path.exists():
            raise DSparkError(f"{folder} is not a dspark bundle: no {MANIFEST}")
        raw = read_json(path)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DSparkError(f"{path} is not a dspark manifest (format={raw.get('format') if isinstance(raw, dict) else None!r})")
        if raw.get("format_version") != FORMAT_VERSION:
            raise DSparkError(f"bundle format version {raw.get('format_version')} is not supported by this dspark "
                              f"(reads version {FORMAT_VERSION}); re-export the bundle")
        try:
            raw["graphs"] = {k: GraphSpec.from_dict(v) for k, v in raw["graphs"].items()}
            man = cls(**raw)
        except (KeyError, TypeError) as e:
            raise DSparkError(f"{path} is missing or has malformed fields ({e})") from None
        missing = [g for g in GRAPHS if g not in man.graphs]
        if missing:
            raise DSparkError(f"{path} lists no {', '.join(missing)} graph")
        for name, spec in man.graphs.items():
            if not (folder / spec.file).exists():
                raise DSparkError(f"bundle {folder} is incomplete: {spec.file} ({name} graph) is missing")
        return man


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()

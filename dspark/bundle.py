"""The bundle manifest: what the exporter writes and what every runtime checks at load time (torch-free)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from dspark.errors import DSparkError
from dspark.files import read_json, write_text_atomic
from dspark.integrity import check_file, data_records, sha256_file
from dspark.schema import Fields, contained, is_int

FORMAT = "dspark-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.data"  # the weights every graph refers to by offset (ONNX external data), each stored once
GRAPHS = ("verifier", "draft", "heads")
OPTIONAL_GRAPHS = ("verifier_fused", "heads_greedy")  # ONNX Runtime's own twins (dspark-export fuse)


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
    quantized: dict[str, Any] = field(default_factory=dict)  # graph -> record of dspark.export.quantize.bundle
    tensorrt: dict[str, Any] = field(default_factory=dict)  # engines, plugin, profiles of dspark-export build
    tools: dict[str, str] = field(default_factory=dict)
    data_files: dict[str, Any] = field(default_factory=dict)  # name -> {bytes, sha256}: recorded by write()
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def block_size(self) -> int:
        return int(self.draft["block_size"])

    @property
    def sts_temperatures(self) -> list[float]:
        return list(self.calibration.get("sts_temperatures") or [1.0] * self.block_size)

    def quantized_activations(self, graph: str) -> bool:
        """Whether the layers of `graph` (all but its vocabulary-sized head) run MatMulNBits that round their
        activations (accuracy_level 2-4: fp16, bf16, int8), which turns a kernel's last-bit differences between
        steps of different sizes into different results. Bundles quantized before dspark recorded it: False."""
        record = self.quantized.get(graph)
        levels = record.get("layer_accuracy_levels") if isinstance(record, dict) else None
        return isinstance(levels, list) and any(is_int(v) and v >= 2 for v in levels)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def write(self, folder: Path) -> None:
        """Write folder/manifest.json atomically (a temporary file renamed into place, never written through),
        with the size and sha256 of the data files the graphs read."""
        self.data_files = data_records(Path(folder), self.data_names())
        write_text_atomic(Path(folder) / MANIFEST, self.to_json())

    def data_names(self) -> list[str]:
        return [WEIGHTS, *sorted({f"{spec.file}.data" for spec in self.graphs.values()})]

    def check_files(self, folder: Path, full: bool = False) -> None:
        """Every graph (those loaded only when used included) and every recorded data file is what this manifest
        says; full: hash everything again instead of trusting the hashes of file versions already checked."""
        for name, spec in self.graphs.items():
            check_file(self.path(folder, spec.file), f"{spec.file} ({name} graph)", spec.sha256, full=full)
        for name, record in self.data_files.items():
            check_file(self.path(folder, name), name, record["sha256"], record["bytes"], full=full)

    @staticmethod
    def path(folder: Path, name: str) -> Path:
        """folder/name for a file name a manifest gives; DSparkError if it resolves outside the bundle folder
        (`../x`, an absolute path, a link leading out). Every reader of a manifest path goes through here."""
        return contained(Path(folder), name, "bundle")

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
            raise DSparkError(f"bundle format version {raw.get('format_version')!r} is not supported by this dspark "
                              f"(reads version {FORMAT_VERSION}); re-export the bundle")
        validate_manifest(raw, folder, f"{path}")
        raw = dict(raw)
        for key in ("sources", "calibration", "quantized", "tensorrt", "tools"):  # null: as if absent
            raw[key] = raw.get(key) or {}
        raw["graphs"] = {k: GraphSpec.from_dict(v) for k, v in raw["graphs"].items()}
        man = cls(**{k: v for k, v in raw.items() if k in _FIELDS})
        for name, spec in man.graphs.items():
            if not cls.path(folder, spec.file).exists():
                raise DSparkError(f"bundle {folder} is incomplete: {spec.file} ({name} graph) is missing")
        return man

    def own_files(self) -> set[str]:
        """Top-level names this bundle consists of (what `--force` may replace)."""
        names = {MANIFEST, WEIGHTS, "check", "engines", "calibration.json", "reliability.png"} | set(TOKENIZER_FILES)
        for spec in self.graphs.values():
            names |= {spec.file, f"{spec.file}.data"}
        for engine in (self.tensorrt.get("engines") or {}).values():
            names.add(Path(engine["file"]).parts[0])
        return names


_FIELDS = {f.name for f in fields(Manifest)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model")


def is_bundle(folder: Path) -> Manifest | None:
    """The manifest if folder is provably a dspark bundle (its manifest parses as ours), else None."""
    try:
        return Manifest.read(folder)
    except DSparkError:
        return None


def validate_manifest(raw: dict, folder: Path, where: str) -> None:
    """The manifest schema: types, ranges and the relations between fields; DSparkError naming the first problem."""
    top = Fields(raw, where)
    target = top.obj("target")
    target.string("family")
    vocab = target.integer("vocab_size", 1)
    for key in ("hidden_size", "num_layers", "num_kv_heads", "head_dim"):
        target.integer(key, 1)
    draft = top.obj("draft")
    for key in ("num_layers", "num_kv_heads", "head_dim", "hidden_size"):
        draft.integer(key, 1, default=1)
    block = draft.integer("block_size", 1, 1024)
    draft.int_list("target_layer_ids", -1, target.raw["num_layers"] - 1)
    draft.integer("mask_token_id", 0, vocab - 1)
    draft.integer("markov_rank", 0, default=0)
    draft.boolean("confidence_head", default=False)
    if draft.has("draft_vocab"):
        draft.integer("draft_vocab", 1, vocab)
    top.integer("max_context", 2, 1 << 24)
    top.int_list("stop_token_ids", 0, vocab - 1)
    graphs = top.obj("graphs")
    for name in GRAPHS:
        _validate_graph(graphs.obj(name), folder)
    for name in OPTIONAL_GRAPHS:
        if name in graphs.raw:
            if not isinstance(graphs.raw[name], dict):
                graphs.fail(name, f"must be a graph record, not {graphs.raw[name]!r:.40}")
            _validate_graph(graphs.obj(name), folder)
    for name in sorted(set(graphs.raw) - set(GRAPHS) - set(OPTIONAL_GRAPHS)):
        graphs.fail(name, f"is not a graph of a bundle ({', '.join(GRAPHS + OPTIONAL_GRAPHS)})")
    blocks = {t.get("shape", [None, None])[1] for t in graphs.raw["heads"]["outputs"]
              if t.get("name") in ("draft_tokens", "survival") and len(t.get("shape", [])) == 2}
    if blocks - {block}:
        draft.fail("block_size", f"is {block}, but the heads graph drafts {sorted(blocks, key=str)[0]} tokens")
    calibration = top.obj("calibration", default={})
    if calibration.has("sts_temperatures"):
        temps = calibration.number_list("sts_temperatures", positive=True)
        if len(temps) != block:
            calibration.fail("sts_temperatures", f"has {len(temps)} entries, block_size is {block}")
    if calibration.has("sps_table"):
        calibration.number_list("sps_table", positive=True)
    for key in ("sources", "quantized", "tools"):
        top.obj(key, default={})
    files = top.obj("data_files", default={})
    for name in files.raw:
        contained(folder, name)
        record = files.obj(name)
        record.integer("bytes", 0)
        record.string("sha256")
    top.string("precision", default="fp32")
    _validate_tensorrt(top.obj("tensorrt", default={}), folder)


def _validate_graph(graph: Fields, folder: Path) -> None:
    contained(folder, graph.string("file"))
    graph.string("sha256", default="")
    for side in ("inputs", "outputs"):
        tensors = graph.get(side)
        if not isinstance(tensors, list) or not tensors:
            graph.fail(side, f"must be a non-empty list of tensors, not {tensors!r:.60}")
        for i, t in enumerate(tensors):
            tensor = Fields(t, f"{graph.where}.{side}[{i}]")
            tensor.string("name")
            tensor.string("dtype", choices=DTYPES)
            shape = tensor.get("shape")
            if not isinstance(shape, list) or not all(isinstance(d, str) or (is_int(d) and d >= 0) for d in shape):
                tensor.fail("shape", f"must list sizes >= 0 and axis names, not {shape!r:.60}")
            if set(t) - {"name", "dtype", "shape"}:
                tensor.fail(sorted(set(t) - {"name", "dtype", "shape"})[0], "is not a tensor field")


def _validate_tensorrt(section: Fields, folder: Path) -> None:
    if not section.raw:
        return
    section.integer("max_context", 2)
    section.integer("max_batch", 1)
    if section.has("plugin") and section.obj("plugin").has("library"):  # none: the Python registration
        contained(folder, section.obj("plugin").string("library"))
    engines = section.obj("engines", default={})
    for name in engines.raw:
        contained(folder, engines.obj(name).string("file"))


DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")


def check_reference(folder: Path) -> None:
    """Validate a bundle's check/ data (what `dspark-export check` reads) before it is used: expected.json with
    its token lists, and .npz files that numpy reads without pickles."""
    check = Path(folder) / "check"
    path = check / "expected.json"
    if not path.exists() and not path.is_symlink():
        return
    for item in (check, *check.rglob("*")):  # no link may lead the check out of the bundle
        contained(Path(folder), str(item.relative_to(folder)))
    expected = Fields(read_json(path), str(path))
    expected.integer("max_new_tokens", 1)
    for key in ("prompt_ids", "reference_dspark", "reference_ar"):
        expected.int_list(key, 0)
    for npz in sorted(check.glob("*.npz")):
        try:
            with np.load(npz, allow_pickle=False) as data:
                _ = data.files
        except Exception as e:  # zipfile/ValueError/OSError: numpy raises many types for a damaged file
            raise DSparkError(f"{npz} is not readable reference data ({type(e).__name__}); re-export the "
                              f"bundle") from None

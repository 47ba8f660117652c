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
from dspark.kv_layout import kv_output_names, layer_geometry, validate_kv_groups
from dspark.schema import Fields, contained, is_int

MAX_BLOCK = 1024  # the largest draft block a manifest may declare (and a fixed policy may verify)

FORMAT = "dspark-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.data"  # the weights every graph refers to by offset (ONNX external data), each stored once
GRAPHS = ("verifier", "draft", "heads")
# ONNX Runtime's own twins (dspark-export fuse); the sampler of rounds with sampling parameters (bundles before it
# lack it, and refuse those parameters)
OPTIONAL_GRAPHS = ("verifier_fused", "heads_greedy", "sampler")


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
    target: dict[str, Any]  # family, hidden_size, num_layers, num_kv_heads, head_dim, vocab_size (kv_groups: kv_layout)
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
    def tap_features(self) -> int:
        """Target features per position the verifier hands the draft (its `taps` output; checked at read)."""
        return int(next(t for t in self.graphs["verifier"].outputs if t.name == "taps").shape[-1])

    @property
    def sts_temperatures(self) -> list[float]:
        return list(self.calibration.get("sts_temperatures") or [1.0] * self.block_size)

    def acceptance_prior(self) -> list[float] | None:
        """For a drafter without a confidence head: its acceptance per block position (conditional on the
        positions before), from `dspark calibrate` (calibration.acceptance_prior), else as its drafter claims
        (draft.expected_acceptance; positions it does not claim: 0, never verified). None with a confidence head,
        or without either: every draft then counts as surviving."""
        if self.draft.get("confidence_head"):
            return None
        prior = self.calibration.get("acceptance_prior")
        if prior is None:
            prior = (self.draft.get("expected_acceptance") or {}).get("accept_at")
        if prior is None:
            return None
        return [float(a) for a in prior][:self.block_size] + [0.0] * max(0, self.block_size - len(prior))

    def quantized_activations(self, graph: str) -> bool:
        """Whether the layers of `graph` (all but its vocabulary-sized head) run MatMulNBits that round their
        activations (accuracy_level 2-4: fp16, bf16, int8), which turns a kernel's last-bit differences between
        steps of different sizes into different results. Bundles quantized before dspark recorded it: False."""
        record = self.quantized.get(graph)
        levels = record.get("layer_accuracy_levels") if isinstance(record, dict) else None
        return isinstance(levels, list) and any(is_int(v) and v >= 2 for v in levels)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def write(self, folder: Path, data_unchanged: bool = False) -> None:
        """Write folder/manifest.json atomically (a temporary file renamed into place, never written through),
        with the size and sha256 of the data files the graphs read (data_unchanged: those recorded by this
        manifest's last write to folder, not hashed again)."""
        if not data_unchanged:
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
    def read_checked(cls, folder: Path, full: bool = False) -> "Manifest":
        """The manifest, once every graph and data file it records is what it records (check_files): whatever
        reads the graphs or rewrites the bundle starts here, so a damaged, cut or foreign file is named in one
        line before anything parses it or builds on it."""
        manifest = cls.read(folder)
        manifest.check_files(Path(folder), full=full)
        return manifest

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
        if not is_int(raw.get("format_version")) or raw.get("format_version") != FORMAT_VERSION:
            raise DSparkError(f"bundle format version {raw.get('format_version')!r} is not supported by this dspark "
                              f"(reads version {FORMAT_VERSION}); re-export the bundle")
        validate_manifest(raw, folder, f"{path}")
        raw = dict(raw)
        for key in ("sources", "calibration", "quantized", "tensorrt", "tools", "data_files"):  # null: as if absent
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
    validate_kv_groups(target, target.raw["num_layers"])
    block = _validate_draft(top.obj("draft"), vocab, target.raw["num_layers"])
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
    _validate_sizes(raw, where)
    calibration = top.obj("calibration", default={})
    if calibration.has("sts_temperatures"):
        temps = calibration.number_list("sts_temperatures", positive=True)
        if len(temps) != block:
            calibration.fail("sts_temperatures", f"has {len(temps)} entries, block_size is {block}")
    if calibration.has("sps_table"):
        calibration.number_list("sps_table", positive=True)
    if calibration.has("acceptance_prior"):
        prior = calibration.number_list("acceptance_prior")
        if len(prior) != block or any(not 0.0 <= a <= 1.0 for a in prior):
            calibration.fail("acceptance_prior", f"must hold {block} acceptances in [0, 1], one per block position")
    for key in ("sources", "tools"):
        top.obj(key, default={})
    quantized = top.obj("quantized", default={})
    for name in quantized.raw:  # what dspark-export quantize recorded per graph (read by check, demo, the runtime)
        record = quantized.obj(name)
        if record.has("bits"):
            record.integer("bits", 1, 32)
        if record.has("layer_accuracy_levels"):
            record.int_list("layer_accuracy_levels", 0, 4)
        if record.has("gguf_blocks"):
            blocks = record.obj("gguf_blocks")
            if blocks.has("formats"):
                blocks.obj("formats")
    files = top.obj("data_files", default={})
    for name in files.raw:
        contained(folder, name)
        record = files.obj(name)
        record.integer("bytes", 0)
        record.string("sha256")
    top.string("precision", default="fp32", choices=PRECISIONS)
    _validate_tensorrt(top.obj("tensorrt", default={}), folder)


def _validate_draft(draft: Fields, vocab: int, target_layers: int) -> int:
    """The manifest's draft section; returns its block size."""
    for key in ("num_layers", "num_kv_heads", "head_dim", "hidden_size"):  # the draft's cache and hidden sizes
        draft.integer(key, 1)
    block = draft.integer("block_size", 1, MAX_BLOCK)
    draft.int_list("target_layer_ids", -1, target_layers - 1)
    draft.integer("mask_token_id", 0, vocab - 1)
    draft.integer("markov_rank", 0, default=0)
    draft.boolean("confidence_head", default=False)
    if draft.has("draft_vocab"):
        draft.integer("draft_vocab", 1, vocab)
    if draft.has("expected_acceptance"):
        check_expected_acceptance(draft.obj("expected_acceptance"), block)
    return block


def _size_checks(graphs: dict, where: str):
    """The checks _validate_sizes makes of the graph records: (tensors, size, caches)."""
    def tensors(graph: str, side: str) -> dict[str, list]:
        return {t["name"]: t["shape"] for t in graphs[graph][side]}

    def size(graph: str, side: str, name: str, axis: int, want, what: str) -> None:
        shape = tensors(graph, side).get(name)
        noun = side[:-1]
        if shape is None:
            raise DSparkError(f"{where}: graphs.{graph} has no {noun} {name!r}: the manifest does not describe a "
                              f"dspark bundle's {graph} graph; re-export the bundle")
        got = shape[axis] if -len(shape) <= axis < len(shape) else None
        if got != want:
            shown = "no such axis" if got is None else (f"the axis {got!r} of any size" if isinstance(got, str)
                                                          else got)
            raise DSparkError(f"{where}: {what} is {want}, but graphs.{graph} {noun} {name} has {shown} at axis "
                              f"{axis} (shape {shape}): the manifest and its graphs disagree; re-export the bundle")

    def caches(graph: str, side: str, prefix: str, sizes: dict, what: str) -> None:
        names = [n for n in tensors(graph, side) if n.startswith(f"{prefix}.")]
        layers = sizes["num_layers"]
        if len(names) != 2 * layers or names != [f"{prefix}.{i}.{k}" for i in range(layers) for k in ("key", "value")]:
            raise DSparkError(f"{where}: {what}.num_layers is {layers}, but graphs.{graph} has {len(names)} {prefix}.* "
                              f"cache {side} (2 per layer): the manifest and its graphs disagree; re-export the bundle")
        for name, (heads, dim) in zip(names, [g for g in layer_geometry(sizes) for _ in range(2)]):
            size(graph, side, name, 1, heads, f"{what}.num_kv_heads{' (kv_groups)' if 'kv_groups' in sizes else ''}")
            size(graph, side, name, 3, dim, f"{what}.head_dim{' (kv_groups)' if 'kv_groups' in sizes else ''}")

    return tensors, size, caches


def _validate_sizes(raw: dict, where: str) -> None:
    """Every size of the manifest a runtime sizes buffers or feeds by (layers, KV heads, head dims, vocabulary,
    block size, hidden sizes, taps) against the shapes its graph records declare, and those records against each
    other where one graph feeds another: a manifest that lies about a size is refused here, in one line, instead of
    decoding differently or failing at the first graph call. (The graph files are checked against these records
    when they are loaded: dspark.runtime.ort_backend, dspark.trt.backend.)"""
    target, draft, graphs = raw["target"], raw["draft"], raw["graphs"]
    block = draft["block_size"]
    tensors, size, caches = _size_checks(graphs, where)
    vocab, hidden = target["vocab_size"], draft["hidden_size"]
    for name in ("verifier", "verifier_fused"):
        if name in graphs:
            caches(name, "inputs", "past", target, "target")
            size(name, "inputs", "draft_probs", 2, vocab, "target.vocab_size")
    if "verifier_fused" in graphs:
        caches("verifier_fused", "outputs", "present", target, "target")
    caches("draft", "inputs", "draft_past", draft, "draft")
    missing = [n for n in kv_output_names(target) if n not in tensors("verifier", "outputs")]
    if missing:
        raise DSparkError(f"{where}: graphs.verifier has no output {missing[0]!r} (one new_kv output per target "
                          f"KV group): the manifest and its graphs disagree; re-export the bundle")
    size("draft", "outputs", "hidden", 1, block, "draft.block_size")
    size("draft", "outputs", "hidden", 2, hidden, "draft.hidden_size")
    taps = tensors("verifier", "outputs").get("taps")
    if taps is None or len(taps) != 3 or not is_int(taps[2]):
        raise DSparkError(f"{where}: graphs.verifier output taps must be [batch, positions, features] with a fixed "
                          f"number of features, not {taps}; re-export the bundle")
    size("draft", "inputs", "ctx_features", 2, taps[2], "the verifier's taps (features per position)")
    if len(draft["target_layer_ids"]) * target["hidden_size"] != taps[2]:
        raise DSparkError(f"{where}: draft.target_layer_ids names {len(draft['target_layer_ids'])} layers of "
                          f"target.hidden_size {target['hidden_size']}, but graphs.verifier output taps has {taps[2]} "
                          f"features per position: the manifest and its graphs disagree; re-export the bundle")
    for name in ("heads", "heads_greedy"):
        if name not in graphs:
            continue
        size(name, "inputs", "hidden", 1, block, "draft.block_size")
        size(name, "inputs", "hidden", 2, hidden, "draft.hidden_size")
        size(name, "inputs", "conf_temperatures", 0, block, "draft.block_size")
        for output in ("draft_tokens", "survival"):
            size(name, "outputs", output, 1, block, "draft.block_size")
    size("heads", "outputs", "draft_probs", 1, block, "draft.block_size")
    size("heads", "outputs", "draft_probs", 2, vocab, "target.vocab_size")


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


PRECISIONS = ("fp32", "fp16", "bf16")  # stored precision of the weight matrices (dspark.models.tensors)
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")


def check_expected_acceptance(claim: Fields, block: int) -> None:
    """A drafter's claimed acceptance (`expected_acceptance` in its config and the manifest's draft section):
    `accept_at`, one acceptance in [0, 1] per block position at most, and how it was measured."""
    values = claim.number_list("accept_at")
    if not 1 <= len(values) <= block or any(not 0.0 <= v <= 1.0 for v in values):
        claim.fail("accept_at", f"must hold 1..{block} acceptances in [0, 1]")
    claim.string("measured", default="")


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

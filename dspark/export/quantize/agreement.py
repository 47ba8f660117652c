"""Top-1 agreement of a quantized verifier with the verifier it was quantized from.

The fp32 bundle decodes a few prompts greedily (autoregressive, its own text); then both verifier graphs score
prompt + continuation in one teacher-forced pass each, with the LM head's output (the logits) added as a graph
output, and the argmax at every continuation position is compared. The graphs are read from their bundle folders
as they are (external data resolved by ONNX Runtime from the folder), so no weight is copied for this.

In bounded memory: one verifier is loaded at a time, and a reference whose weights would not fit widened to fp32
(a Qwen3-4B bf16 verifier is 16 GB as fp32) is run with them mapped from its files, as `dspark run --weights
mapped` does; the text is then the quantized bundle's own greedy continuation (decoding the mapped reference token
by token would take seconds a token), which the record says (`text_from`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from dspark.bundle import Manifest
from dspark.export.quantize.nbits_graph import vocab_matmul_output
from dspark.export.quantize.weight_stream import load_skeleton
from dspark.kv_layout import layer_geometry
from dspark.prompts import default_prompts_path, read_prompts
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.ort_backend import session_options, weights_mode


@dataclass
class Agreement:
    prompts: int
    positions: int  # continuation positions compared
    top1: float  # fraction of positions where both argmaxes agree
    first_difference: list[int | None]  # per prompt: the first continuation position that differs
    max_tokens: int
    text_from: str = "reference"  # whose greedy continuation was scored: "reference" or "quantized"

    def as_dict(self) -> dict:
        return asdict(self)


def spread(rows: list, count: int) -> list:
    """`count` rows spread evenly over the list (prompt files are grouped by domain)."""
    if count >= len(rows):
        return list(rows)
    return [rows[i * len(rows) // count] for i in range(count)]


class LogitsGraph:
    """A verifier graph of a bundle folder with its logits as an extra output, run teacher-forced at batch 1."""

    def __init__(self, folder: Path, manifest: Manifest, logits: str, threads: int | None = None,
                 weights: str = "packed"):
        spec = manifest.graphs["verifier"]
        model = load_skeleton(Manifest.path(folder, spec.file))
        graph = model.graph
        value = next(v for node in graph for v in node.outputs if v.name == logits)
        value.type = ir.TensorType(ir.DataType.FLOAT)
        if value not in graph.outputs:  # (a verifier since the sampler gives its logits itself)
            graph.outputs.append(value)
        options = session_options(threads, weights)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        proto = ir.to_proto(model).SerializeToString()
        self.session = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
        self.output, self.manifest = logits, manifest

    def logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids), vocab]: the logits after every position of `ids` (one prefill)."""
        t, m = len(ids), self.manifest.target
        empty = [np.zeros((1, heads, 1, dim), np.float32) for heads, dim in layer_geometry(m)]  # (per KV group)
        feeds = {"tokens": np.array([ids], np.int64), "past_mask": np.zeros((1, 1), np.int64),
                 "logit_index": np.arange(t, dtype=np.int64)[None], "verify_len": np.zeros(1, np.int64),
                 "temperature": np.zeros(1, np.float32), "accept_noise": np.ones((1, t), np.float32),
                 "sample_noise": np.ones(1, np.float32),
                 "draft_probs": np.zeros((1, 1, m["vocab_size"]), np.float32)}
        feeds.update({f"past.{i}.{kind}": empty[i] for i in range(m["num_layers"]) for kind in ("key", "value")})
        return self.session.run([self.output], feeds)[0][0]


def logits_name(folder: Path) -> str:
    """The logits tensor of an fp32 bundle's verifier (a verifier quantized from it keeps the name)."""
    manifest = Manifest.read(folder)
    graph = load_skeleton(Manifest.path(folder, manifest.graphs["verifier"].file))
    return vocab_matmul_output(graph, manifest.target["vocab_size"])


def measure_agreement(reference: Path, quantized: Path, prompts: int = 6, max_tokens: int = 32,
                      prompt_file: Path | None = None, threads: int | None = None) -> Agreement:
    """Top-1 agreement of quantized/verifier.onnx with reference/verifier.onnx (both bundle folders)."""
    manifest = Manifest.read(reference)
    logits = logits_name(reference)
    rows = spread(read_prompts(prompt_file or default_prompts_path()), prompts)
    mode = weights_mode(reference, manifest)  # mapped: the reference's weights would not fit widened
    text_from = reference if mode == "packed" else quantized
    # (the quantized bundle packed: mapped, its MatMulNBits would run unpacked, seconds a token at 4B; and auto
    # counts this process's freed memory, which its sessions reuse, as taken)
    with Runtime(text_from, threads=threads, weights="packed") as rt:
        encoded = [rt.encode(r["prompt"]) for r in rows]
        room = manifest.max_context - max_tokens - 1
        encoded = [ids[-room:] for ids in encoded]
        seqs = [ids + out.token_ids for ids, out in
                zip(encoded, rt.generate(encoded, DecodeOptions(max_tokens=max_tokens, policy="ar")))]
    spans = [slice(len(ids) - 1, len(seq) - 1) for ids, seq in zip(encoded, seqs)]  # next token: a continuation's
    top1 = []
    for folder in (reference, quantized):  # one verifier in memory at a time
        graph = LogitsGraph(folder, Manifest.read(folder), logits, threads, mode if folder == reference else "packed")
        top1.append([graph.logits(seq)[span].argmax(-1) for seq, span in zip(seqs, spans)])
        del graph
    agree = total = 0
    firsts: list[int | None] = []
    for want, got in zip(*top1):
        same = want == got
        agree += int(same.sum())
        total += len(same)
        firsts.append(int(np.argmin(same)) if not same.all() else None)
    return Agreement(len(rows), total, agree / max(total, 1), firsts, max_tokens,
                     "reference" if text_from == reference else "quantized")

"""The fused verifier as a bundle's file: which attention it is built with, written next to the portable verifier
(sharing its data files) and entered in the manifest."""
from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from dspark.bundle import GraphSpec, Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.export.quantize.weight_stream import load_skeleton
from dspark.export.twins.fused_lanes import fused_spec
from dspark.export.twins.graph_copy import write_own_data
from dspark.export.twins.ort_fused import LANES, fuse_verifier
from dspark.export.twins.row_attention import RowAttentionVerifier
from dspark.files import normal_mode

FUSED_FILE = "verifier_fused.onnx"
SPS_KEYS = ("sps_table", "sps_measurements", "sps_context", "sps_backend")  # a verifier's measured step costs
ATTENTIONS = ("rows", "gqa")


def default_attention(manifest: Manifest) -> str:
    """"rows" (dspark.export.twins.row_attention) for a verifier whose activations are quantized: the one graph
    that runs every step shape of several requests at once and still gives each request its batch-1 tokens; "gqa"
    (GroupQueryAttention, one lane) for fp32 activations, whose one-position steps of several requests it runs
    in one call, and whose cost does not grow with the cache's width."""
    return "rows" if manifest.quantized_activations("verifier") else "gqa"


def add_fused_verifier(folder: Path, manifest: Manifest, attention: str | None = None,
                       lanes: int = 1) -> GraphSpec:
    """Write the fused twin of folder's verifier next to it (sharing its data files) and enter it in `manifest`
    (the caller writes the manifest). The verifier is read as a skeleton: no weight is loaded.

    attention: "rows" or "gqa" (None: default_attention); lanes: a "gqa" graph's requests per step
    (dspark.export.twins.fused_lanes; up to LANES)."""
    attention = attention or default_attention(manifest)
    if attention not in ATTENTIONS or not 1 <= lanes <= LANES or (attention == "rows" and lanes != 1):
        raise DSparkError(f"fused verifier: no {attention!r} attention with {lanes} lanes")
    spec = manifest.graphs["verifier"]
    path = Manifest.path(folder, spec.file)
    portable = load_skeleton(path)
    t = manifest.target
    taps = list(manifest.draft["target_layer_ids"])
    if attention == "rows":
        model = RowAttentionVerifier(portable, t, path.parent, 1).build(taps)
    else:
        model = fuse_verifier(portable, t, taps, path.parent, lanes)
    for name in (FUSED_FILE, f"{FUSED_FILE}.data"):
        (folder / name).unlink(missing_ok=True)  # may be a hard link into another copy of the bundle
    write_own_data(model, folder, f"{FUSED_FILE}.data")  # its new (concatenated) weights, mostly
    ir.save(model, folder / FUSED_FILE)
    for name in (FUSED_FILE, f"{FUSED_FILE}.data"):
        if (folder / name).exists():
            normal_mode(folder / name)
    fused = fused_spec(spec, FUSED_FILE, t["num_layers"], t["num_kv_heads"], t["head_dim"], lanes)
    fused.sha256 = sha256_file(folder / FUSED_FILE)
    manifest.graphs["verifier_fused"] = fused
    return fused


def forget_step_costs(manifest: Manifest) -> None:
    """Drop the SPS table: the verifier steps it measured are not the ones the bundle takes any more."""
    for key in SPS_KEYS:
        manifest.calibration.pop(key, None)

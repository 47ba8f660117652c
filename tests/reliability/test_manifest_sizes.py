"""Every size of a manifest that the runtime sizes buffers or feeds by is checked against the shapes its graph
records declare when the bundle is read (issue 42, re-audit): a manifest that lies about a size is refused in one
line naming the field, before any session is made, instead of decoding differently or failing at a graph call."""
import json

import pytest

from dspark.bundle import Manifest
from dspark.errors import DSparkError


def edit(bundle, change) -> None:
    path = bundle / "manifest.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def put(*keys_and_value):
    *keys, value = keys_and_value

    def change(raw):
        node = raw
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return change


def drop(*keys):
    def change(raw):
        node = raw
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]
    return change


def shape(graph, side, name, axis, value):
    def change(raw):
        for tensor in raw["graphs"][graph][side]:
            if tensor["name"] == name:
                tensor["shape"][axis] = value
    return change


@pytest.mark.parametrize("change, says", [
    (put("target", "num_layers", 3), "target.num_layers is 3"),
    (put("target", "num_kv_heads", 1), "target.num_kv_heads is 1"),
    (put("target", "head_dim", 4), "target.head_dim is 4"),
    (put("target", "vocab_size", 7), "target.vocab_size is 7"),
    (put("target", "vocab_size", 10 ** 30), "target.vocab_size is 1000000000000000000000000000000"),
    (put("target", "hidden_size", 16), "target.hidden_size 16"),
    (put("draft", "num_layers", 2), "draft.num_layers is 2"),
    (put("draft", "num_kv_heads", 4), "draft.num_kv_heads is 4"),
    (put("draft", "head_dim", 16), "draft.head_dim is 16"),
    (put("draft", "hidden_size", 64), "draft.hidden_size is 64"),
    (put("draft", "target_layer_ids", [-1, 0]), "draft.target_layer_ids names 2 layers"),
    (drop("draft", "num_layers"), "draft.num_layers is missing"),
    (drop("draft", "num_kv_heads"), "draft.num_kv_heads is missing"),
    (drop("draft", "hidden_size"), "draft.hidden_size is missing"),
    (shape("verifier", "outputs", "taps", 2, "features"), "fixed number of features"),
    (shape("verifier", "inputs", "draft_probs", 2, 7), "target.vocab_size is 6"),
    (shape("heads", "outputs", "draft_probs", 2, "vocab"), "target.vocab_size is 6"),
    (shape("heads", "inputs", "conf_temperatures", 0, 4), "draft.block_size is 3"),
    (shape("draft", "outputs", "hidden", 1, 2), "draft.block_size is 3"),
    (shape("draft", "inputs", "ctx_features", 2, 33), "the verifier's taps"),
    (shape("draft", "inputs", "draft_past.0.key", 3, "d"), "draft.head_dim is 8"),
    (lambda raw: raw["graphs"]["verifier"]["inputs"].pop(), "target.num_layers is 2"),
    (lambda raw: raw["graphs"]["heads"]["outputs"].pop(1), "has no output 'draft_probs'"),
])
def test_a_size_the_graph_records_contradict_is_refused_when_the_bundle_is_read(bundle, change, says):
    Manifest.read(bundle)  # the bundle as exported reads
    edit(bundle, change)
    with pytest.raises(DSparkError) as refused:
        Manifest.read(bundle)
    message = str(refused.value)
    assert says in message and "\n" not in message, message


def test_the_fused_and_greedy_twins_are_held_to_the_same_sizes(bundle):
    raw = json.loads((bundle / "manifest.json").read_text())
    twins = [name for name in ("verifier_fused", "heads_greedy") if name in raw["graphs"]]
    assert twins, "the tiny bundle has ONNX Runtime's twins"
    for name in twins:
        side, tensor = ("outputs", "present.0.key") if name == "verifier_fused" else ("inputs", "hidden")
        axis = 1 if name == "verifier_fused" else 2
        edit(bundle, shape(name, side, tensor, axis, 99))
        with pytest.raises(DSparkError, match=f"graphs.{name}"):
            Manifest.read(bundle)
        edit(bundle, lambda r: r.update(graphs={**r["graphs"], name: raw["graphs"][name]}))


def test_the_graph_files_declare_what_their_records_say(bundle):
    """The manifest's fixed sizes hold in the graph files themselves: ONNX Runtime refuses a record that fixes a
    size the file leaves open or fixes otherwise (the records are checked against the files when they load)."""
    from dspark.runtime import Runtime

    with Runtime(bundle, threads=1):
        pass
    edit(bundle, shape("heads", "inputs", "threshold", 0, 5))  # a dynamic batch axis recorded as fixed
    with pytest.raises(DSparkError, match="heads.onnx does not match the manifest: threshold"):
        Runtime(bundle, threads=1)


def test_null_sections_read_as_absent(bundle):
    """data_files: null crashed check_files (AttributeError, reported as an internal error); like the other
    optional sections it now reads as absent."""
    for key in ("data_files", "quantized", "tools"):
        edit(bundle, put(key, None))
        manifest = Manifest.read(bundle)
        assert getattr(manifest, key) == {}
        manifest.check_files(bundle)

"""8-bit draft-side quantization of a bundle: recorded, refused where it is meaningless, and lossless (the
verifier's quantization: test_quantize_verifier.py)."""
import shutil

import numpy as np
import onnx
import pytest

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.export.check.parity import check_bundle
from dspark.export.quantize.bundle import quantize_graph
from dspark.runtime import DecodeOptions, Runtime
from support.stats import chi_square_pvalue, exact_joint
from test_bundle_tiny import PROMPT, SAMPLES, V, prompts


def sample_paths(bundle, samples: int, seed: int):
    """`samples` requests of 3 sampled tokens after PROMPT, in batches of 1000 (one batch of thousands is much
    slower); (the complete 3-token paths, every result)."""
    results = Runtime(bundle).generate([PROMPT] * samples, DecodeOptions(max_tokens=3, temperature=1.0,
                                                                         seed=seed, batch_size=1000))
    return [tuple(r.token_ids) for r in results if len(r.token_ids) == 3], results


@pytest.fixture(scope="module")
def quantized(tiny_bundle_v6, tmp_path_factory):
    hf, target, drafter, path = tiny_bundle_v6
    q = tmp_path_factory.mktemp("quant") / "bundle"
    shutil.copytree(path, q, copy_function=shutil.copy2)
    rec = quantize_graph(q, "heads", min_elements=0)
    return hf, path, q, rec


def test_heads_become_matmulnbits_and_the_manifest_says_so(quantized):
    _, original, q, rec = quantized
    ops = {n.op_type for n in onnx.load(str(q / "heads.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and rec["matmuls"]
    man = Manifest.read(q)
    assert man.quantized["heads"]["bits"] == 8
    assert man.graphs["heads"].sha256 != Manifest.read(original).graphs["heads"].sha256
    assert not Manifest.read(original).quantized  # the source bundle is untouched


def test_quantized_heads_keep_greedy_output_and_check_passes(quantized):
    _, original, q, _ = quantized
    ps = prompts(8, seed=5)
    want = [r.token_ids for r in Runtime(original).generate(ps, DecodeOptions(max_tokens=20, policy="ar"))]
    got = Runtime(q).generate(ps, DecodeOptions(max_tokens=20))
    assert [r.token_ids for r in got] == want
    rep = check_bundle(q)
    assert rep.passed
    assert all(r.tolerance.startswith("report only") for r in rep.rows if r.graph == "heads")
    assert any(r.tolerance != "exact" and not r.tolerance.startswith("report") for r in rep.rows
               if r.graph == "verifier")


def test_quantized_heads_sampling_is_lossless(quantized):
    hf, _, q, _ = quantized
    expected = exact_joint(hf, PROMPT, 3, V)
    stop = set(Runtime(q).manifest.stop_token_ids)
    keep = {k: p for k, p in expected.items() if not stop.intersection(k[:2])}
    samples, results = sample_paths(q, SAMPLES, 77)
    assert len(samples) > 0.5 * SAMPLES
    assert chi_square_pvalue(samples, keep) > 1e-3
    assert np.mean([a for r in results for a in r.accepted]) > 0.1


def test_quantize_refuses_unknown_graphs_twice_and_other_bits(quantized, tmp_path):
    _, original, q, _ = quantized
    with pytest.raises(DSparkError, match="not a graph"):
        quantize_graph(q, "lm_head")
    with pytest.raises(DSparkError, match="already quantized"):
        quantize_graph(q, "heads", min_elements=0)
    with pytest.raises(DSparkError, match="8-bit"):
        quantize_graph(original, "heads", bits=4)
    with pytest.raises(DSparkError, match="4 or 8"):
        quantize_graph(original, "draft", bits=3)
    with pytest.raises(DSparkError, match="no MatMul"):
        quantize_graph(original, "heads", min_elements=1 << 40)
    with pytest.raises(DSparkError, match="not found"):
        quantize_graph(tmp_path / "nothing", "heads")


def test_quantize_a_bundle_copied_with_hard_links(tiny_bundle_v6, tmp_path):
    """A bundle copied with hard links (cp -al): quantize reads the linked files and replaces them instead of
    writing into them, so the original bundle the links point to is untouched."""
    import os

    from dspark.bundle import sha256_file

    src = tmp_path / "src"
    shutil.copytree(tiny_bundle_v6[3], src)
    model = onnx.load(str(src / "heads.onnx"))
    onnx.save(model, str(src / "heads.onnx"), save_as_external_data=True, location="heads.onnx.data",
              size_threshold=0)
    man = Manifest.read(src)
    man.graphs["heads"].sha256 = sha256_file(src / "heads.onnx")
    man.write(src)
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in src.rglob("*"):
        (linked / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        if f.is_file():
            os.link(f, linked / f.relative_to(src))
    before = {f.name: sha256_file(f) for f in src.iterdir() if f.is_file()}
    quantize_graph(linked, "heads", min_elements=0)
    assert "heads" in Manifest.read(linked).quantized
    assert {f.name: sha256_file(f) for f in src.iterdir() if f.is_file()} == before
    assert Runtime(linked).generate([[1, 2, 3]], DecodeOptions(max_tokens=4))[0].token_ids


def test_the_shared_weights_file_keeps_only_what_graphs_read(tiny_bundle_v6, tmp_path):
    """After quantizing, compacting weights.data drops the weights no graph reads: the decode is unchanged, the
    graphs' new offsets are right, and a bundle hard-linked to the copy is left as it was."""
    import os

    from dspark.bundle import WEIGHTS, sha256_file
    from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle
    from dspark.export.quantize.weight_stream import compact

    q = tmp_path / "q"
    shutil.copytree(tiny_bundle_v6[3], q)
    quantize_bundle(q, ["draft"], QuantizeOptions(bits=8, min_elements=0))  # the verifier still reads the file
    want = Runtime(q).generate([PROMPT], DecodeOptions(max_tokens=8))[0].token_ids
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in q.iterdir():
        if f.is_file():
            os.link(f, linked / f.name)
    before = {f.name: sha256_file(f) for f in q.iterdir() if f.is_file()}
    manifest = Manifest.read(linked)
    graphs = {g: linked / spec.file for g, spec in manifest.graphs.items()}
    size = (linked / WEIGHTS).stat().st_size
    assert compact(linked, graphs, WEIGHTS, slack=1 << 40) == 0  # under the slack: nothing rewritten
    dropped = compact(linked, graphs, WEIGHTS, slack=0)
    assert 0 < dropped < size and (linked / WEIGHTS).stat().st_size == size - dropped
    for g, path in graphs.items():
        manifest.graphs[g].sha256 = sha256_file(path)
    manifest.write(linked)
    assert Runtime(linked).generate([PROMPT], DecodeOptions(max_tokens=8))[0].token_ids == want
    assert {f.name: sha256_file(f) for f in q.iterdir() if f.is_file()} == before


def test_quantized_graphs_still_share_the_vocabulary_matrix(tmp_path):
    """The vocabulary matrix every graph reads is stored once: quantizing the verifier and the draft backbone
    leaves their embeddings reading it from weights.data (no copy in their new data files), and decoding equals
    the quantized bundle's own AR."""
    from dspark.bundle import WEIGHTS
    from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle
    from support.tiny import tiny_bundle

    vocab = 1024  # (a vocabulary matrix big enough to be stored as external data)
    q = tiny_bundle(tmp_path / "q", family="llama", vocab=vocab, layers=2, block_size=3, seed=3)[3]
    quantize_bundle(q, ["verifier", "draft"], QuantizeOptions(bits=4, block_size=16, min_elements=0,
                                                              agreement_prompts=0))
    manifest = Manifest.read_checked(q)
    vocab_sized = {}
    for graph in ("verifier", "draft", "heads"):
        model = onnx.load(str(q / manifest.graphs[graph].file), load_external_data=False)
        for t in model.graph.initializer:
            where = {e.key: e.value for e in t.external_data}
            if vocab in t.dims and t.data_location == onnx.TensorProto.EXTERNAL and len(t.dims) == 2:
                vocab_sized.setdefault(graph, []).append((where["location"], where.get("offset")))
    assert vocab_sized["draft"] and {loc for loc, _ in vocab_sized["draft"]} == {WEIGHTS}
    assert (WEIGHTS, vocab_sized["draft"][0][1]) in vocab_sized["verifier"]  # the same bytes
    rt = Runtime(q)
    ar = rt.generate([PROMPT], DecodeOptions(max_tokens=12, policy="ar"))[0].token_ids
    assert rt.generate([PROMPT], DecodeOptions(max_tokens=12))[0].token_ids == ar

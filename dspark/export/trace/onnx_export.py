"""`dspark-export onnx`: trace the three graphs with torch.onnx (dynamo) and write a self-describing bundle."""
from __future__ import annotations

import datetime
import importlib.metadata as md
import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from dspark import __version__
from dspark.bundle import GraphSpec, Manifest, TensorSpec, is_bundle, sha256_file
from dspark.errors import DSparkError
from dspark.export.check.parity import record_check_data
from dspark.export.graphs import (DRAFT_INPUTS, DRAFT_OUTPUTS, HEADS_INPUTS, HEADS_OUTPUTS, SAMPLER_INPUTS,
                                  SAMPLER_OUTPUTS, VERIFIER_INPUTS, VERIFIER_OUTPUTS, DraftGraph, HeadsGraph,
                                  SamplerGraph, VerifierGraph, past_names, sampler_example_args, target_kv_groups,
                                  verifier_outputs)
from dspark.export.stamp import LayerStack, inline_layers, layer_function, stamped
from dspark.export.trace.naming import name_nodes
from dspark.export.trace.passes import optimize_graph
from dspark.export.trace.progress import Background, Progress
from dspark.export.trace.weight_passes import bind_weights, fold_transposes_lazily, place_weights, store_low_precision
from dspark.export.trace.weights import WeightStore, module_values, traced_on_meta
from dspark.export.twins.ort_graphs import add_twins
from dspark.files import Temporary, replace_folder
from dspark.models.draft_vocab import read_ranking, shortlist
from dspark.models.pair import Pair
from dspark.models.tensors import PRECISIONS, LazyWeights
from dspark.ops.confidence_truncate.onnx_function import attach_functions
from dspark.resolve import resolve_draft
from dspark.tokenizer import ChatTokenizer


@dataclass
class GraphExample:
    module: torch.nn.Module
    args: tuple  # the named inputs, then (for graphs with a cache) one list of per-layer cache tensors
    names: tuple[str, ...]  # names of every flat input, cache tensors included
    outputs: tuple[str, ...]
    dims: dict[str, dict[int, str]]  # input name -> {axis: dynamic axis name}
    stack: LayerStack | list[LayerStack] | None = None  # identical layers (of each kind) traced once and stamped

    @property
    def has_past(self) -> bool:
        return isinstance(self.args[-1], list)

    @property
    def flat_args(self) -> list[torch.Tensor]:
        return list(self.args[:-1]) + list(self.args[-1]) if self.has_past else list(self.args)


def _dims(ex: GraphExample):
    cache: dict[str, torch.export.Dim] = {}

    def dim(name: str):
        if name not in cache:
            cache[name] = torch.export.Dim(name, min=1, max=1 << 20)
        return cache[name]

    spec = [{a: dim(n) for a, n in (ex.dims.get(name) or {}).items()} or None for name in ex.names]
    if not ex.has_past:
        return tuple(spec)
    n_fixed = len(ex.args) - 1
    return tuple(spec[:n_fixed]) + (spec[n_fixed:],)


def verifier_example(pair: Pair) -> GraphExample:
    t = pair.target.cfg
    b, seq, cap, rows, drows = 2, 5, 9, 3, 2
    g = torch.Generator().manual_seed(0)
    past = [torch.randn(b, t.kv_heads_of(i // 2), cap, t.head_dim_of(i // 2), generator=g)
            for i in range(2 * t.num_layers)]
    args = (
        torch.randint(0, t.vocab_size, (b, seq), generator=g),
        torch.tensor([[1] * 4 + [0] * 5, [1] * 2 + [0] * 7]),
        torch.tensor([[0, 1, 2], [0, 1, 1]]),
        torch.tensor([2, 1]),
        torch.tensor([0.0, 1.0]),
        torch.rand(b, rows, generator=g),
        torch.rand(b, generator=g),
        torch.softmax(torch.randn(b, drows, t.vocab_size, generator=g), -1),
        past,
    )
    names = VERIFIER_INPUTS + past_names("past", t.num_layers)
    dims = {"tokens": {0: "batch", 1: "seq"}, "past_mask": {0: "batch", 1: "capacity"},
            "logit_index": {0: "batch", 1: "rows"}, "verify_len": {0: "batch"}, "temperature": {0: "batch"},
            "accept_noise": {0: "batch", 1: "rows"}, "sample_noise": {0: "batch"},
            "draft_probs": {0: "batch", 1: "draft_rows"}}
    dims.update({n: {0: "batch", 2: "capacity"} for n in past_names("past", t.num_layers)})
    graph = VerifierGraph(pair.target)
    if not t.uniform:
        return GraphExample(graph, args, names, verifier_outputs(t), dims, kind_stacks(pair.target))
    # layer_step(x, cos, sin, k_past, v_past, past_mask, new_mask)
    stack = LayerStack(pair.target, pair.target.layers,
                       ({0: "batch", 1: "seq"}, {0: "batch", 2: "seq"}, {0: "batch", 2: "seq"},
                        {0: "batch", 2: "capacity"}, {0: "batch", 2: "capacity"}, {0: "batch", 4: "capacity"},
                        {3: "seq", 4: "seq"}), kv_len_input=0, kv_heads=t.num_kv_heads, head_dim=t.head_dim)
    return GraphExample(graph, args, names, VERIFIER_OUTPUTS, dims, stack)


def kind_stacks(target) -> list[LayerStack]:
    """One stack per kind of layer of a Gemma-4 target, each traced once: a sliding layer's past mask depends on the
    query position ([B, 1, 1, T, cap]), a full layer's does not ([B, 1, 1, 1, cap])."""
    t, stacks = target.cfg, []
    for kind in dict.fromkeys(t.layer_types):
        ids = [i for i, k in enumerate(t.layer_types) if k == kind]
        sliding = t.is_sliding(ids[0])
        past_mask = {0: "batch", 3: "seq", 4: "capacity"} if sliding else {0: "batch", 4: "capacity"}
        stacks.append(LayerStack(target, torch.nn.ModuleList([target.layers[i] for i in ids]),
                                 ({0: "batch", 1: "seq"}, {0: "batch", 2: "seq"}, {0: "batch", 2: "seq"},
                                  {0: "batch", 2: "capacity"}, {0: "batch", 2: "capacity"}, past_mask,
                                  {3: "seq", 4: "seq"}), kv_len_input=0, kv_heads=t.kv_heads_of(ids[0]),
                                 head_dim=t.head_dim_of(ids[0]), op=f"Layer_{kind}"))
    return stacks


def draft_example(pair: Pair) -> GraphExample:
    c = pair.drafter.cfg
    b, ctx, cap = 2, 3, 9
    g = torch.Generator().manual_seed(1)
    past = [torch.randn(b, c.num_kv_heads, cap, c.head_dim, generator=g) for _ in range(2 * c.num_layers)]
    args = (
        torch.randn(b, ctx, c.num_taps * c.hidden_size, generator=g),
        torch.tensor([3, 2]),
        torch.tensor([5, 7]) % c.vocab_size,
        torch.tensor([[1] * 4 + [0] * 5, [1] * 3 + [0] * 6]),
        past,
    )
    names = DRAFT_INPUTS + past_names("draft_past", c.num_layers)
    dims = {"ctx_features": {0: "batch", 1: "ctx"}, "ctx_count": {0: "batch"}, "anchor": {0: "batch"},
            "past_mask": {0: "batch", 1: "capacity"}}
    dims.update({n: {0: "batch", 2: "capacity"} for n in past_names("draft_past", c.num_layers)})
    # layer_step(x, ctx, ctx_cos, ctx_sin, blk_cos, blk_sin, past_mask, ctx_mask, blk_mask, k_past, v_past)
    stack = LayerStack(pair.drafter, pair.drafter.layers,
                       ({0: "batch"}, {0: "batch", 1: "ctx"}, {0: "batch", 2: "ctx"}, {0: "batch", 2: "ctx"},
                        {0: "batch"}, {0: "batch"}, {0: "batch", 4: "capacity"}, {0: "batch", 4: "ctx"}, {},
                        {0: "batch", 2: "capacity"}, {0: "batch", 2: "capacity"}),
                       kv_len_input=1, kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    return GraphExample(DraftGraph(pair.drafter), args, names, DRAFT_OUTPUTS, dims, stack)


def heads_example(pair: Pair) -> GraphExample:
    c = pair.drafter.cfg
    b, bk = 2, c.block_size
    g = torch.Generator().manual_seed(2)
    args = (
        torch.randn(b, bk, c.hidden_size, generator=g),
        torch.tensor([5, 7]) % c.vocab_size,
        torch.tensor([0.0, 1.0]),
        torch.rand(b, bk, generator=g),
        torch.tensor(c.sts_temperatures, dtype=torch.float32),
        torch.tensor([0.0, 0.5]),
        torch.tensor([50.0, 40.0, 30.0, 20.0, 10.0]),
        torch.tensor([3]),
        torch.tensor([True, True]),
        torch.tensor([0]),
        torch.tensor([1]),
    )
    dims = {"hidden": {0: "batch"}, "anchor": {0: "batch"}, "temperature": {0: "batch"},
            "draft_noise": {0: "batch"}, "conf_temperatures": {}, "threshold": {0: "batch"}, "sps": {0: "sps"},
            "budget": {}, "active": {0: "batch"}, "mode": {}, "layout": {}}
    return GraphExample(HeadsGraph(pair.drafter), args, HEADS_INPUTS, HEADS_OUTPUTS, dims)


def sampler_example(pair: Pair) -> GraphExample:
    args, dims = sampler_example_args(pair.target.cfg.vocab_size)
    return GraphExample(SamplerGraph(), args, SAMPLER_INPUTS, SAMPLER_OUTPUTS, dims)


def _spec_of(value, name: str, axes: dict[int, str]) -> TensorSpec:
    shape = [axes.get(i, int(s)) for i, s in enumerate(value.shape)]
    return TensorSpec(name=name, dtype=str(np.dtype(str(value.dtype).replace("torch.", ""))), shape=shape)


def _on_meta(args):
    return [_on_meta(a) for a in args] if isinstance(args, (list, tuple)) else args.to("meta")


def export_graph(ex: GraphExample, path: Path, store: WeightStore | None = None, lazy: LazyWeights | None = None,
                 precision: str = "fp32", stamp: bool = True) -> GraphSpec:
    """Trace one graph on the meta device (with `stamp`, its identical layers as one traced layer stamped once per
    layer), bind its weights (read when written), attach the dspark function bodies, store the weights in `store`
    (by default, a data file of this graph's own), name the nodes by where they belong (naming) and save the graph
    file."""
    if store is None:
        with WeightStore(path.parent, f"{path.name}.data") as own:
            return export_graph(ex, path, own, lazy, precision, stamp)
    module = ex.module.eval()
    values = module_values(module, lazy)
    stacks = [s for s in (ex.stack if isinstance(ex.stack, list) else [ex.stack] if ex.stack else [])
              if stamp and s.stampable()]
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with traced_on_meta(module), torch.no_grad(), warnings.catch_warnings(), stamped(stacks):
        warnings.simplefilter("ignore")
        args = tuple(_on_meta(a) for a in ex.args)
        outs = module(*args)
        prog = torch.onnx.export(module, args, dynamo=True, input_names=list(ex.names),
                                 output_names=list(ex.outputs), dynamic_shapes=_dims(ex), optimize=False,
                                 verbose=False, report=False)
        layers = [layer_function(s) for s in stacks]
    model = prog.model
    if layers:
        inline_layers(model, layers)
    bind_weights(model, values)
    attach_functions(model)
    embeddings = frozenset(identity for name, (identity, _) in values.items() if name.endswith("embed_tokens.weight"))
    fold_transposes_lazily(model, keep=embeddings)
    optimize_graph(model)
    store_low_precision(model, precision)
    place_weights(model, store)
    name_nodes(model, path.stem)
    ir.save(model, str(path))
    out_axes = _output_axes(ex)
    return GraphSpec(
        file=path.name,
        inputs=[_spec_of(a, n, ex.dims.get(n) or {}) for a, n in zip(ex.flat_args, ex.names)],
        outputs=[_spec_of(o, n, out_axes.get(n, {})) for o, n in zip(outs, ex.outputs)],
    )


def _output_axes(ex: GraphExample) -> dict[str, dict[int, str]]:
    if isinstance(ex.module, VerifierGraph):
        kv = {name: {2: "batch", 4: "seq"} for name in ex.outputs if name.startswith("new_kv")}
        return {"accepted": {0: "batch"}, "next_token": {0: "batch"}, "taps": {0: "batch", 1: "seq"},
                "logits": {0: "batch", 1: "rows"}, **kv}
    if isinstance(ex.module, DraftGraph):
        return {"hidden": {0: "batch"}, "new_draft_kv": {2: "batch", 4: "ctx"}}
    return {n: {0: "batch", 1: "rows"} if n in ("probs", "logprobs") else {0: "batch"} for n in ex.outputs}


def _tool_versions() -> dict[str, str]:

    out = {"dspark": __version__}
    for pkg in ("torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _source(path: Path, name: str) -> dict:
    if path.is_file():
        return {"name": name, "file": str(path), "sha256": sha256_file(path)}
    files = {p.name: sha256_file(p) for p in sorted(path.glob("*.safetensors")) + [path / "config.json"]
             if p.exists()}
    return {"name": name, "folder": str(path), "sha256": files}


def pair_sources(pair: Pair) -> dict:
    """What the bundle was made from, with the checkpoints' digests."""
    sources = {"target": _source(pair.loaded.source_file, pair.loaded.source)}
    if pair.draft_source.startswith("random"):
        sources["draft"] = {"name": pair.draft_source, "note": "untrained random drafter"}
    else:
        sources["draft"] = _source(resolve_draft(pair.draft_source), pair.draft_source)
    return sources


def target_section(t) -> dict:
    """The manifest's target section; a target whose layers differ in KV geometry (Gemma-4) adds its KV groups
    (dspark.kv_layout: num_kv_heads / head_dim are then the first layer's), the layer types and the window."""
    out = {"family": t.family, "hidden_size": t.hidden_size, "num_layers": t.num_layers,
           "num_kv_heads": t.kv_heads_of(0), "head_dim": t.head_dim_of(0), "vocab_size": t.vocab_size}
    if not t.uniform:
        out.update(kv_groups=[g.to_dict() for g in target_kv_groups(t)], layer_types=list(t.layer_types),
                   sliding_window=t.sliding_window, final_logit_softcapping=t.final_logit_softcapping)
    return out


def build_manifest(pair: Pair, specs: dict[str, GraphSpec], max_context: int, stop_ids: tuple[int, ...],
                   precision: str = "fp32", sources: dict | None = None) -> Manifest:
    t, c = pair.target.cfg, pair.drafter.cfg
    return Manifest(
        target=target_section(t),
        draft={"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
               "hidden_size": c.hidden_size, "block_size": c.block_size, "target_layer_ids": list(c.target_layer_ids),
               "mask_token_id": c.mask_token_id, "markov_rank": c.markov_rank,
               "markov_head_type": c.markov_head_type if c.markov_rank else None,
               "confidence_head": c.enable_confidence_head,
               "draft_vocab": None if pair.drafter.draft_ids is None else int(pair.drafter.draft_ids.numel()),
               **({"expected_acceptance": c.extra["expected_acceptance"]} if "expected_acceptance" in c.extra
                  else {})},
        max_context=max_context,
        stop_token_ids=list(stop_ids),
        graphs=specs,
        sources=sources if sources is not None else pair_sources(pair),
        calibration={"sts_temperatures": list(c.sts_temperatures), "sps_table": None},
        precision=precision,
        tools=_tool_versions(),
    )


def export_bundle(pair: Pair, output: Path, max_context: int = 2048, force: bool = False,
                  quiet: bool = False, progress: Progress | None = None, check_data: bool = True,
                  draft_vocab: int | None = None, ranking: list[int] | None = None, precision: str = "fp32") -> Path:
    """Write the bundle into a temporary folder beside `output`, then move it into place.

    With check_data, the bundle also gets check/ (real graph inputs with the PyTorch outputs on them and reference
    greedy tokens) for `dspark-export check`. With draft_vocab, the heads draft from that many tokens: the stop
    tokens, then `ranking` (default: the draft checkpoint's draft_vocab.json), then by id. `precision` is the
    stored precision of weight matrices (the graphs compute in fp32); "auto" is the target checkpoint's own, so a
    bf16 checkpoint is never doubled into fp32 on disk."""
    if precision == "auto":
        precision = getattr(pair.loaded, "precision", "fp32")
    if precision not in PRECISIONS:
        raise DSparkError(f"unknown precision {precision!r} (choose from auto, {', '.join(PRECISIONS)})")
    output = Path(output)
    check_replaceable(output, force)
    progress = progress or Progress(7 if check_data else 6, quiet)
    staging = Temporary(output)
    tmp = staging.path
    sources = Background(lambda: pair_sources(pair))
    try:
        for f in pair.loaded.tokenizer_files():
            if f.name != "config.json":
                shutil.copyfile(f, tmp / f.name)
        stop_ids = ChatTokenizer(tmp).stop_ids
        if draft_vocab is not None:
            pair.set_draft_vocab(_draft_ids(pair, draft_vocab, ranking, stop_ids))
        specs = {}
        with WeightStore(tmp) as store:
            for name, example in (("verifier", verifier_example), ("draft", draft_example),
                                  ("heads", heads_example), ("sampler", sampler_example)):
                with progress.step(f"exporting {name}.onnx"):
                    specs[name] = export_graph(example(pair), tmp / f"{name}.onnx", store,
                                               getattr(pair.loaded, "lazy", None), precision)
        with progress.step("writing manifest"):
            for spec in specs.values():
                spec.sha256 = sha256_file(tmp / spec.file)
            manifest = build_manifest(pair, specs, max_context, stop_ids, precision, sources.result())
            manifest.tools["exported"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            add_twins(tmp, manifest)  # ONNX Runtime's own: fused verifier, greedy heads
            manifest.write(tmp)  # with the size and sha256 of weights.data and the graphs' own data
        if check_data:
            with progress.step("recording reference data for `dspark-export check`"):
                record_check_data(pair, tmp)
        check_replaceable(output, force)  # still true now that the new bundle is ready?
        replace_folder(staging, output)
    except BaseException:
        staging.remove()
        raise
    return output


def check_draft_vocab(draft: str, draft_vocab: int | None) -> None:
    """--draft-vocab needs the drafter's token ranking, which a random drafter has not."""
    if draft_vocab is not None and draft.split(":")[0] == "random":
        raise DSparkError("--draft-vocab needs a token ranking, and a random drafter has none: give a trained "
                          "drafter (its draft_vocab.json), or drop --draft-vocab")


def draft_ids_for(pair: Pair, size: int, stop_ids: tuple[int, ...]):
    """The draft vocabulary an export with --draft-vocab SIZE chose (the checkpoint's own ranking), or the one a
    reduced-vocabulary drafter brings (its d2t map)."""
    if pair.drafter.fixed_vocab and size == pair.drafter.cfg.draft_vocab_size:
        return pair.drafter.draft_ids
    return _draft_ids(pair, size, None, stop_ids)


def _draft_ids(pair: Pair, size: int, ranking: list[int] | None, stop_ids: tuple[int, ...]):
    if pair.drafter.fixed_vocab:
        raise DSparkError(f"this drafter drafts from its own {pair.drafter.cfg.draft_vocab_size}-token vocabulary "
                          f"(its d2t map): drop --draft-vocab")
    vocab = pair.drafter.cfg.vocab_size
    if ranking is None:
        if pair.draft_source.startswith("random"):
            raise DSparkError("--draft-vocab needs a token ranking, and a random drafter has none")

        ranking = read_ranking(resolve_draft(pair.draft_source), vocab)
    return shortlist(ranking, size, vocab, stop_ids)


def check_replaceable(output: Path, force: bool) -> None:
    """Refuse an existing output unless --force and it is empty or provably a dspark bundle holding nothing but
    bundle files (so a folder of the user's that merely holds a manifest.json is never deleted)."""
    if not output.exists() and not output.is_symlink():
        return
    if not force:
        raise DSparkError(f"{output} exists; pass --force to replace it")
    if output.is_symlink() or not output.is_dir():
        raise DSparkError(f"{output} exists and is not a folder; refusing to replace it")
    entries = sorted(p.name for p in output.iterdir())
    if not entries:
        return
    manifest = is_bundle(output)
    if manifest is None:
        raise DSparkError(f"{output} exists and is not a dspark bundle; refusing to replace it (choose another "
                          f"--output)")
    foreign = [name for name in entries if name not in manifest.own_files()]
    if foreign:
        more = f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else ""
        raise DSparkError(f"{output} is a dspark bundle but also holds {', '.join(foreign[:3])}{more}, which "
                          f"--force would delete; move them out first")

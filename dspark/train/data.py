"""Training data: the target's own responses to prompts, generated with the fastest generator the project has
(the ONNX Runtime bundle decoding autoregressively with continuous batching), cached and resumable."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.files import parse_json, read_text
from dspark.prompts import read_prompts
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.observers import TapsLog
from dspark.tokenizer import ChatTokenizer


def interleave_domains(rows: list[dict]) -> list[int]:
    """Row indices cycling over domains (math, chat, code, ...) so any prefix of the order is balanced."""
    by_domain: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_domain.setdefault(r.get("domain", "all"), []).append(i)
    queues = list(by_domain.values())
    order: list[int] = []
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return order


def save_shared(path: Path, array: np.ndarray) -> None:
    """Write a file of a data cache that other runs may be writing at the same moment (the DSpark run and its
    DFlash ablation share one): each writer has its own temporary file, and whichever rename lands last leaves
    the same content."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_responses(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(read_text(path).split("\n"), 1):
        try:
            out.append(parse_json(line, f"{path}:{i}", dict))
        except DSparkError:  # a line cut by an interrupted run: ignore it, it is regenerated
            continue
    return out


def generate_responses(bundle: Path, rows: list[dict], out_path: Path, max_tokens: int = 256,
                       batch_size: int = 16, limit: int | None = None, threads: int | None = None,
                       progress=None) -> list[dict]:
    """Greedy target responses for `rows` (chat template applied), appended to out_path as they finish, with the
    target's tap features of every processed position saved as fp16 in out_path.parent/taps/<index>.npy (the
    verifier computes them anyway, so training needs no target forward pass beyond the last tapped layer).

    Prompts already in out_path are skipped, so a killed run continues where it stopped."""
    done = {r["index"] for r in read_responses(out_path)}
    order = [i for i in interleave_domains(rows) if i not in done]
    if limit is not None:
        order = order[:max(0, limit - len(done))]
    if not order:
        return read_responses(out_path)
    rt = Runtime(bundle, threads=threads)
    prompts = [rows[i]["prompt"] for i in order]
    taps = TapsLog()
    dec = rt.decoder(prompts, DecodeOptions(max_tokens=max_tokens, policy="ar", batch_size=batch_size),
                     observers=[taps])
    taps_dir = out_path.parent / "taps"
    taps_dir.mkdir(parents=True, exist_ok=True)
    t0, tokens = time.perf_counter(), 0
    with open(out_path, "a") as f:
        for event in dec:
            if not event.done:
                continue
            res = dec.results[event.request]
            i = order[event.request]
            np.save(taps_dir / f"{i}.npy", taps.take(event.request))
            f.write(json.dumps({"index": i, "domain": rows[i].get("domain"), "prompt_ids": res.prompt_ids,
                                "response_ids": res.token_ids, "stopped": res.stopped,
                                "tap_ids": rt.manifest.draft["target_layer_ids"]}) + "\n")
            f.flush()
            tokens += len(res.token_ids)
            if progress is not None:
                progress(1, tokens / max(time.perf_counter() - t0, 1e-9))
    return read_responses(out_path)


def import_responses(src: Path, out_path: Path, rows: list[dict], encode_chat) -> int:
    """Merge responses generated elsewhere (e.g. on a GPU machine by generate_responses_torch with taps=False) into
    the cache at out_path; prompts already there keep their own. Each one must be the answer to the same prompt
    of the same prompts file with the same tokenizer. Returns how many were added (their taps: compute_taps)."""
    done = {r["index"] for r in read_responses(out_path)}
    incoming = [parse_json(line, f"responses file {src}:{i}")
                for i, line in enumerate(read_text(src, f"responses file {src}").splitlines(), 1) if line.strip()]
    added = []
    for r in incoming:
        if not isinstance(r, dict) or not {"index", "prompt_ids", "response_ids", "tap_ids"} <= r.keys():
            raise DSparkError(f"{src} is not a dspark responses file (index, prompt_ids, response_ids, tap_ids)")
        i = r["index"]
        if not isinstance(i, int) or not 0 <= i < len(rows) or r["prompt_ids"] != encode_chat(rows[i]["prompt"]):
            raise DSparkError(f"{src}: response {i} does not answer prompt {i} of this prompts file with this "
                              f"target's tokenizer; import responses generated from the same prompts and target")
        if i not in done:
            done.add(i)
            added.append(r)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a") as f:
        for r in added:
            f.write(json.dumps(r) + "\n")
    return len(added)


def compute_taps(bundle: Path, out_path: Path, rows: list[dict], limit: int | None = None, batch_size: int = 16,
                 chunk: int = 64, threads: int | None = None, progress=None) -> int:
    """Tap features for cached responses that have none (imported ones): the bundle's verifier runs over
    prompt + response in prefill, which is what generation would have recorded. Only the first `limit` responses
    in domain-interleaved prompt order are considered. Saved a chunk at a time, so a killed run keeps its work."""
    taps_dir = out_path.parent / "taps"
    by_index = {r["index"]: r for r in read_responses(out_path)}
    order = [i for i in interleave_domains(rows) if i in by_index][:limit]
    todo = [i for i in order if not (taps_dir / f"{i}.npy").exists()]
    if not todo:
        return 0
    taps_dir.mkdir(parents=True, exist_ok=True)
    rt = Runtime(bundle, threads=threads)
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        seqs = [by_index[i]["prompt_ids"] + by_index[i]["response_ids"][:-1] for i in part]
        taps = TapsLog()
        for _ in rt.decoder(seqs, DecodeOptions(max_tokens=1, policy="ar", batch_size=batch_size),
                            observers=[taps]):
            pass
        for k, (i, seq) in enumerate(zip(part, seqs)):
            save_shared(taps_dir / f"{i}.npy", taps.take(k)[:len(seq)])
            tokens += len(seq)
        if progress is not None:
            progress(len(part), tokens / max(time.perf_counter() - t0, 1e-9))
    return len(todo)


def check_prompts(rows: list[dict], dev_path: Path | None) -> None:
    """Refuse to train on the benchmark prompts."""
    if dev_path is None or not dev_path.exists():
        return
    dev = {row["prompt"] for row in read_prompts(dev_path)}
    overlap = sum(r["prompt"] in dev for r in rows)
    if overlap:
        raise DSparkError(f"{overlap} training prompts are dev prompts; never train on the benchmark set")


def generate_responses_torch(loaded, rows: list[dict], out_path: Path, tap_ids: tuple[int, ...],
                             max_tokens: int = 256, batch_size: int = 64, limit: int | None = None,
                             device: str = "cuda", progress=None, taps: bool = True) -> list[dict]:
    """The same cache as generate_responses, produced with HF generate on a GPU (batched, greedy), then one
    forward pass per finished response for the taps (HF hidden_states[l + 1]). For machines with CUDA.
    taps=False writes the responses alone (their taps are computed where training runs: see compute_taps)."""
    tok = ChatTokenizer(loaded.folder)
    stop = set(tok.stop_ids)
    done = {r["index"] for r in read_responses(out_path)}
    order = [i for i in interleave_domains(rows) if i not in done]
    if limit is not None:
        order = order[:max(0, limit - len(done))]
    model = loaded.hf_model.to(device)
    taps_dir = out_path.parent / "taps"
    taps_dir.mkdir(parents=True, exist_ok=True)
    pad = next(iter(stop), 0)
    t0, tokens_out = time.perf_counter(), 0
    with open(out_path, "a") as f, torch.no_grad():
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            prompts = [tok.encode_chat(rows[i]["prompt"]) for i in chunk]
            width = max(map(len, prompts))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(prompts):  # left padding for generation
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=sorted(stop) or None)
            for j, i in enumerate(chunk):
                gen = out[j, width:].tolist()
                cut = next((k for k, t in enumerate(gen) if t in stop), None)
                response = gen[:cut + 1] if cut is not None else gen
                if taps:
                    seq = torch.tensor([prompts[j] + response[:-1]], device=device)
                    hs = model(seq, output_hidden_states=True).hidden_states
                    feats = torch.cat([hs[layer + 1][0] for layer in tap_ids], dim=-1)
                    np.save(taps_dir / f"{i}.npy", feats.to(torch.float16).cpu().numpy())
                f.write(json.dumps({"index": i, "domain": rows[i].get("domain"), "prompt_ids": prompts[j],
                                    "response_ids": response, "stopped": cut is not None,
                                    "tap_ids": list(tap_ids)}) + "\n")
                tokens_out += len(response)
                if progress is not None:
                    progress(1, tokens_out / max(time.perf_counter() - t0, 1e-9))
            f.flush()
    return read_responses(out_path)

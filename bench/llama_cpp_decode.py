"""llama.cpp on a GGUF file through llama-cpp-python's low-level API: greedy autoregressive decoding of `batch`
sequences in one context (one llama_decode per step, a token per sequence), and the cost of one step of k
positions of one sequence (what a DSpark verify step of k drafts would cost llama.cpp's kernels).

Build llama-cpp-python from its sdist for this CPU (GGML_NATIVE=OFF with the CPU's instruction sets named: AVX2,
FMA, F16C, and AVX-512 with VNNI/BF16 where it has them; AMX off). Times exclude the prefill, as dspark's decode
rates in bench/ do.
"""
from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import numpy as np


class LlamaCpp:
    """One model and one context of `seqs` sequences of up to `context` positions each."""

    def __init__(self, gguf: Path, seqs: int, context: int, threads: int = 2):
        import llama_cpp as L

        self.L = L
        self._quiet = L.llama_log_callback(lambda level, text, user_data: None)  # kept: C holds the pointer
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))  # llama.cpp's load log runs to thousands of lines
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = seqs * context, 512, 512
        cparams.n_seq_max, cparams.n_threads, cparams.n_threads_batch = seqs, threads, threads
        self.ctx = L.llama_init_from_model(self.model, cparams)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(512, 0, seqs)
        self.seqs = seqs

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise SystemExit("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.vocab,)).argmax())

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        last = []
        for s, prompt in enumerate(prompts):
            self._decode([(t, p, s, p == len(prompt) - 1) for p, t in enumerate(prompt)])
            last.append(self._argmax(len(prompt) - 1))
        return last

    def greedy(self, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], float]:
        """Greedy continuations of len(prompts) <= seqs sequences decoded together; (tokens, decode seconds)."""
        nxt = self._prefill(prompts)
        out = [[t] for t in nxt]
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            self._decode([(out[s][-1], pos[s], s, True) for s in range(len(prompts))])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
                pos[s] += 1
        return out, time.perf_counter() - t0

    def step_ms(self, prompt: list[int], past: int, positions: list[int], reps: int) -> dict[int, float]:
        """Median ms of one llama_decode of k positions of one sequence after `past` positions, for each k (the
        k rows all want logits, as a verify step's do); the cache is cut back to `past` after each."""
        L = self.L
        history = (prompt * (past // max(len(prompt), 1) + 1))[:past]
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        for start in range(0, past, 256):
            chunk = history[start:start + 256]
            self._decode([(t, start + i, 0, False) for i, t in enumerate(chunk)])
        times: dict[int, list[float]] = {k: [] for k in positions}
        for _ in range(reps):
            for k in positions:
                t0 = time.perf_counter()
                self._decode([(history[i % past], past + i, 0, True) for i in range(k)])
                times[k].append(1e3 * (time.perf_counter() - t0))
                L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), 0, past, -1)
        return {k: round(statistics.median(v), 2) for k, v in times.items()}


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="llama.cpp's cost of one step of k positions of a GGUF model (ms)")
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--past", type=int, default=200, help="positions already in the cache")
    ap.add_argument("--positions", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    llama = LlamaCpp(args.gguf, 1, args.past + 64)
    try:
        steps = llama.step_ms([1, 2, 3, 4], args.past, [int(k) for k in args.positions.split(",")], args.reps)
    finally:
        llama.close()
    print(json.dumps(steps))


if __name__ == "__main__":
    main()

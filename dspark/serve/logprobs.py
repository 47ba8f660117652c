"""Token log-probabilities (dspark.runtime.logprobs) in the shapes OpenAI's two endpoints give them: chat's
`logprobs.content` entries and the completions endpoint's token / token_logprobs / top_logprobs / text_offset lists."""
from __future__ import annotations

from dspark.runtime.logprobs import TokenLogprob
from dspark.tokenizer import ChatTokenizer

FLOOR = -9999.0  # what a token filtered out (-inf, not JSON) is reported as, as vLLM does


class LogprobText:
    """Writes a request's logprobs for one endpoint; `offset` carries the completions endpoint's text_offset from
    one stream chunk to the next."""

    def __init__(self, tokenizer: ChatTokenizer, chat: bool):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, 0

    def body(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _token(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def one(token: int, logprob: float) -> dict:
            text, raw = self._token(token)
            return {"token": text, "logprob": max(logprob, FLOOR), "bytes": list(raw)}
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self._token(e.token)[0])
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        # the chosen token is always among top_logprobs (so there may be k + 1 of them)
        top = [{**{self._token(t)[0]: max(lp, FLOOR) for t, lp in e.top}, text: max(e.logprob, FLOOR)}
               for e, text in zip(entries, tokens)]
        return {"tokens": tokens, "token_logprobs": [max(e.logprob, FLOOR) for e in entries], "top_logprobs": top,
                "text_offset": offsets}

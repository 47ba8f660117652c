"""`dspark run` and `dspark serve` draw the context line at the same place: prompt + max_tokens <= the context."""
import json
import subprocess
import sys

import httpx

PROMPT = "w1 w2"  # greedy w2 w2 ...: no stop token, so the largest request runs to the context's last position


def dspark_run(bundle, max_tokens: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "run", str(bundle),
                           "--prompt", PROMPT, "--max-tokens", str(max_tokens), "--threads", "1", "--json"],
                          capture_output=True, text=True, timeout=300)


def chat(server, max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def test_the_largest_max_tokens_is_the_same_for_run_and_serve(tiny_bundle_v6, runtime, server):
    prompt_len = len(runtime.encode(PROMPT))  # what `dspark run --prompt` decodes, and a chat of one user message
    largest = runtime.manifest.max_context - prompt_len

    ran = dspark_run(tiny_bundle_v6[3], largest)
    assert ran.returncode == 0, ran.stderr
    served = chat(server, largest)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == prompt_len
    assert served.json()["choices"][0]["message"]["content"] == json.loads(ran.stdout)["text"]

    refused = dspark_run(tiny_bundle_v6[3], largest + 1)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1 and "Traceback" not in refused.stderr
    assert "max context" in errors[0]
    too_many = chat(server, largest + 1)
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"at most {largest}" in error["message"]

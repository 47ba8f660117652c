"""An export killed with SIGKILL or SIGTERM at several points leaves no output; SIGTERM cleans up at once (exit
143), and the next export removes what a SIGKILL left (its lock is free), never a live process's temporaries."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dspark.files import Temporary, remove_stale_temporaries

STEP = re.compile(r"\[(\d+)/\d+\]")


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def export(target: Path, output: Path, kill_at_step: int | None = None, sig: int = signal.SIGKILL,
           timeout: float = 600) -> tuple[int, str]:
    """Run `dspark-export onnx` in its own process; with kill_at_step, send `sig` once it reports that step."""
    cmd = [sys.executable, "-c", "from dspark.cli import export_cli; export_cli()", "onnx", "--target", str(target),
           "--draft", "random:1", "--output", str(output), "--no-check", "--max-context", "32"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    seen: list[str] = []
    reached = threading.Event()

    def read():
        for chunk in iter(lambda: proc.stderr.read(1), ""):
            seen.append(chunk)
            if kill_at_step is not None and not reached.is_set():
                steps = [int(m) for m in STEP.findall("".join(seen[-400:]))]
                if steps and max(steps) >= kill_at_step:
                    reached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if kill_at_step is not None:
        deadline = time.monotonic() + timeout
        while not reached.wait(0.05) and proc.poll() is None and time.monotonic() < deadline:
            pass
        assert reached.is_set(), "".join(seen)
        time.sleep(0.2)  # inside the step (the heads step takes a few seconds; leave most of it to the signal)
        proc.send_signal(sig)
    code = proc.wait(timeout)
    reader.join(5)
    return code, "".join(seen)


def test_killed_exports_leave_nothing_and_the_next_export_cleans_up(hf_target, tmp_path):
    """Four exports to one output, killed while tracing the verifier, heads, draft and verifier graphs: each leaves
    no output; SIGTERM exits 143 without its temporary, and each export starts by removing what a SIGKILLed one
    left (so nothing is left at the end)."""
    out = tmp_path / "bundle"
    for step, sig in ((2, signal.SIGKILL), (4, signal.SIGTERM), (3, signal.SIGKILL), (2, signal.SIGTERM)):
        before = temporaries(tmp_path)
        code, err = export(hf_target, out, kill_at_step=step, sig=sig)
        assert not out.exists(), err
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL, err
            assert len(temporaries(tmp_path)) == 2, "a SIGKILL cannot clean up: its temporary (+ lock) waits"
        else:
            assert code == 143, err
            assert err.strip().splitlines()[-1] == "terminated" and "Traceback" not in err, err
            assert before and temporaries(tmp_path) == [], "the dead export's temporary went, and its own too"


def test_a_live_process_temporary_is_never_removed(tmp_path):
    dest = tmp_path / "bundle"
    live = Temporary(dest)  # holds its lock, as a running export does
    (live.path / "verifier.onnx").write_bytes(b"half written")
    assert remove_stale_temporaries(dest) == []
    assert (live.path / "verifier.onnx").exists()
    os.close(live.lock_fd)  # the owner dies without cleaning up (its lock is released by the kernel)
    live.lock_fd = None
    assert remove_stale_temporaries(dest) == [live.path]
    assert temporaries(tmp_path) == []

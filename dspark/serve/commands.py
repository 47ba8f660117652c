"""The `dspark serve` and `dspark-export triton` commands (dspark.cli adds them to its groups). Importing this
module imports click only: the server (FastAPI, uvicorn) and the runtime load inside the commands."""
from __future__ import annotations

from pathlib import Path

import click

from dspark.cli.options import WEIGHTS_OPTION, ort_only, ort_weights

POLICY_HELP = ("The engine's verify policy: all, fixed:N, static:T, schedule, topk, or ar (each but ar also +gate); "
               "auto (the default): schedule+gate when the bundle has an SPS table, else ar.")
BATCH_HELP = ("Requests decoding at once (batch slots); auto (the default): 16 on a CPU, fewer where their caches "
              "would not fit in half the memory available.")


class Slots(click.ParamType):
    """A batch size: 'auto' (None) or 1..256."""
    name = "auto|1..256"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            if 1 <= int(value) <= 256:
                return int(value)
        self.fail(f"{value!r} is neither 'auto' nor a whole number from 1 to 256", param, ctx)


SLOTS = Slots()


def engine_policy(policy: str, gate: bool):
    """The --policy/--gate pair as EngineOptions takes it: None for auto."""
    from dspark.runtime import VerifyPolicy

    if policy == "auto":
        if gate:
            raise click.BadParameter("--gate adds the gate to a policy you name (auto already has it when it "
                                     "drafts)", param_hint="--gate")
        return None
    return VerifyPolicy.parse(f"{policy}+gate" if gate and not policy.endswith("+gate") else policy)


@click.command("serve")
@click.argument("bundle", required=False, type=click.Path(path_type=Path))
@click.option("--demo", is_flag=True, help="Serve the bundle `dspark demo` made, as the model "
              "smollm2-135m-dspark.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--batch-size", default="auto", show_default=True, type=SLOTS, help=BATCH_HELP)
@click.option("--policy", default="auto", show_default=True, help=POLICY_HELP)
@click.option("--gate", is_flag=True, help="Add the draft gate to the --policy named (skip drafting when it cannot "
              "pay; the auto policy has it when it drafts).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0, 100000),
              help="Requests waiting for a slot at most; beyond that the server answers 429.")
@click.option("--max-context", type=click.IntRange(16, 1 << 20),
              help="Positions each slot's caches hold (default: the bundle's max context).")
@click.option("--model-name", help="The model id clients send (default: the bundle folder's name; with --demo "
              "smollm2-135m-dspark). The folder's name is accepted too.")
@click.option("--grace", default=30.0, show_default=True, type=click.FloatRange(0, 3600),
              help="Seconds in-flight requests get to finish on SIGTERM before they are cancelled.")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Open connections at most; beyond them the server answers 503.")
@click.option("--request-timeout", default=30.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds a client has to send a request's headers, and again its body; beyond, 408 and the "
              "connection closes.")
@click.option("--threads", type=click.IntRange(1, 256), help="ONNX Runtime intra-op threads (default: all cores).")
@click.option("--no-spin", is_flag=True, help="ONNX Runtime: threads sleep between a step's kernels instead of "
              "spinning (slower; for cores shared with other work).")
@click.option("--backend", default="onnxruntime", show_default=True, type=click.Choice(["onnxruntime", "tensorrt"]))
@WEIGHTS_OPTION
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="One line per HTTP request on stderr (at --log-level info).")
def serve_cmd(bundle, demo, host, port, batch_size, policy, gate, max_queue, max_context, model_name, grace,
              max_connections, request_timeout, threads, no_spin, backend, weights, log_level, access_log):
    """Serve BUNDLE (or, with --demo, the bundle `dspark demo` made) over an OpenAI-compatible HTTP API
    (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) with an always-on continuous-batching
    engine. Requests decode greedily (temperature 0, as `dspark run`) unless they send a temperature."""
    from dspark.lazy import optional_import
    from dspark.runtime.engine import EngineOptions

    optional_import("uvicorn", "dspark serve needs the serve extra: pip install -e '.[serve]'")
    optional_import("fastapi", "dspark serve needs the serve extra: pip install -e '.[serve]'")
    from dspark.serve.names import served
    from dspark.serve.server import ServeConfig, serve

    ort_only(backend, threads=threads is not None, no_spin=no_spin)
    parsed = engine_policy(policy, gate)
    target = served(bundle, demo, model_name)
    config = ServeConfig(bundle=target.bundle, model_name=target.model_name, aliases=target.aliases,
                         engine=EngineOptions(batch_size=batch_size, policy=parsed, max_queue=max_queue,
                                              max_context=max_context),
                         backend=backend, threads=threads, weights=ort_weights(backend, weights),
                         spin=not no_spin, grace=grace, max_connections=max_connections,
                         request_timeout=request_timeout)
    serve(config, host, port, log_level, access_log)


@click.command("triton")
@click.argument("bundle", required=False, type=click.Path(path_type=Path))
@click.option("--demo", is_flag=True, help="The bundle `dspark demo` made (instead of BUNDLE).")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path), help="Model repository to write.")
@click.option("--model-name", default="dspark", show_default=True, help="The model's name in the repository.")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Model instances (each loads the bundle and runs its own engine).")
@click.option("--batch-size", default="auto", show_default=True, type=SLOTS,
              help="Batch slots of each instance's engine; " + BATCH_HELP.split("; ", 1)[1])
@click.option("--policy", default="auto", show_default=True, help=POLICY_HELP)
@click.option("--copy-bundle", is_flag=True, help="Copy the bundle into the repository (default: reference it).")
@click.option("--python-env", type=click.Path(path_type=Path),
              help="EXECUTION_ENV_PATH: the environment (a venv folder) with dspark installed, for the Python "
                   "backend stub (default: this interpreter's environment).")
@click.option("--max-context", type=click.IntRange(16, 1 << 20),
              help="Positions each slot's caches hold (default: the bundle's max context).")
@click.option("--force", is_flag=True, help="Replace an existing model folder.")
def triton_cmd(bundle, demo, output, model_name, instances, batch_size, policy, copy_bundle, python_env,
               max_context, force):
    """Write a Triton Inference Server model repository (Python backend, decoupled: tokens stream) serving
    BUNDLE with the dspark runtime."""
    from dspark.serve.names import served
    from dspark.serve.triton import TritonModel, write_repository

    bundle = served(bundle, demo, None).bundle

    model = TritonModel(bundle=bundle, name=model_name, instances=instances, batch_size=batch_size,
                        policy=policy, copy_bundle=copy_bundle, python_env=python_env, max_context=max_context)
    folder = write_repository(model, output, force=force)
    click.echo(f"wrote {folder}")

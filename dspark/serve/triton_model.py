"""The Triton Inference Server model of `dspark-export triton` (copied into the repository as 1/model.py).

Python backend, decoupled transaction policy: each request gets one response per committed text piece and a
final empty response flagged COMPLETE_FINAL. Every model instance loads the bundle and runs its own always-on
engine (dspark.runtime.engine); requests from Triton join its queue, so requests of one instance share its
batch slots. Runs inside Triton's Python backend stub (EXECUTION_ENV_PATH: an environment with dspark).

Inputs: text_input (a prompt, through the chat template) or prompt_ids (token ids, as they are); optional
max_tokens, temperature, seed, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty and
logit_bias_ids / logit_bias_values (dspark.runtime.sampling). Outputs: text_output (a piece), token_ids (the piece's
ids), finish_reason.
"""
import sys
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.errors import DSparkError
from dspark.files import parse_json
from dspark.runtime.api import Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_request import Delta, RequestOptions
from dspark.runtime.sampling import SamplingParams


def parameters(model_config: str) -> dict[str, str]:
    """The model's parameters from Triton's model_config JSON (config.pbtxt as Triton parsed it): a repository
    edited by hand gets one line naming what is wrong, not a traceback in Triton's log."""
    config = parse_json(model_config, "the Triton model configuration", dict)
    raw = config.get("parameters") or {}
    if not isinstance(raw, dict):
        raise DSparkError("config.pbtxt: parameters must be a map of names to {string_value: ...}")
    params = {}
    for key, value in raw.items():
        if not isinstance(value, dict) or not isinstance(value.get("string_value"), str):
            raise DSparkError(f"config.pbtxt: parameter {key!r} has no string_value")
        params[key] = value["string_value"]
    if not params.get("bundle"):
        raise DSparkError("config.pbtxt: the parameter 'bundle' (the bundle folder) is missing")
    return params


def _count(params: dict[str, str], key: str, default, lo: int = 1):
    """A whole-number parameter (absent or empty: `default`)."""
    text = params.get(key, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < lo:
        raise DSparkError(f"config.pbtxt: parameter {key!r} is {text!r:.40}, not a whole number >= {lo}")
    return int(text)


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


def _sampling(request) -> SamplingParams:
    """top_k, top_p, min_p, the penalties (scalars) and logit_bias_ids / logit_bias_values (two lists)."""
    ids = pb_utils.get_input_tensor_by_name(request, "logit_bias_ids")
    values = pb_utils.get_input_tensor_by_name(request, "logit_bias_values")
    ids = [] if ids is None else [int(x) for x in ids.as_numpy().reshape(-1)]
    values = [] if values is None else [float(x) for x in values.as_numpy().reshape(-1)]
    if len(ids) != len(values):
        raise DSparkError(f"logit_bias_ids has {len(ids)} entries and logit_bias_values {len(values)}: give one "
                          f"value per id")
    return SamplingParams(top_k=int(_scalar(request, "top_k", 0)), top_p=float(_scalar(request, "top_p", 1.0)),
                          min_p=float(_scalar(request, "min_p", 0.0)),
                          repetition_penalty=float(_scalar(request, "repetition_penalty", 1.0)),
                          presence_penalty=float(_scalar(request, "presence_penalty", 0.0)),
                          frequency_penalty=float(_scalar(request, "frequency_penalty", 0.0)),
                          logit_bias=dict(zip(ids, values)))


def _response(text: str, token_ids: list, finish_reason: str):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("token_ids", np.array(token_ids, dtype=np.int64)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_))])


class TritonPythonModel:
    def initialize(self, args):
        params = parameters(args["model_config"])
        bundle = Path(params["bundle"])
        if not bundle.is_absolute():
            bundle = Path(args["model_repository"]) / args["model_version"] / bundle
        self.runtime = Runtime(bundle, threads=_count(params, "threads", None))
        slots = params.get("batch_size", "auto")
        options = EngineOptions(batch_size=None if slots == "auto" else _count(params, "batch_size", None),
                                policy=params.get("policy"), max_queue=_count(params, "max_queue", 64, lo=0),
                                max_context=_count(params, "max_context", None))
        self.engine = Engine(self.runtime, options).start()
        print(f"dspark model {args['model_name']}: {self.engine.choice.summary()}", file=sys.stderr, flush=True)
        self.runtime.backend.prepare(self.engine.batch)  # loaded before Triton says the model is ready
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                ids = self._prompt_ids(request)
                options = RequestOptions(max_tokens=int(_scalar(request, "max_tokens", 64)),
                                         temperature=float(_scalar(request, "temperature", 0.0)),
                                         seed=int(_scalar(request, "seed", 0)), sampling=_sampling(request))
                self.engine.submit(ids, options, sink=self._sink(sender))
            except Exception as e:  # bad input: one error response, then the stream ends
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _prompt_ids(self, request) -> list:
        ids = pb_utils.get_input_tensor_by_name(request, "prompt_ids")
        if ids is not None:
            return self.runtime.encode([int(x) for x in ids.as_numpy().reshape(-1)])
        text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
        return self.runtime.encode(text.decode("utf-8") if isinstance(text, bytes) else str(text))

    def _sink(self, sender):
        def send(delta: Delta) -> None:
            with self.lock:
                if delta.finish_reason in ("cancelled", "error"):
                    error = pb_utils.TritonError(delta.error or "the request was cancelled")
                    sender.send(pb_utils.InferenceResponse(error=error),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
                if delta.text or delta.token_ids:
                    sender.send(_response(delta.text, delta.token_ids, delta.finish_reason or ""))
                if delta.finish_reason:
                    sender.send(_response("", [], delta.finish_reason),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return send

    def finalize(self):
        self.engine.close(grace=5)
        self.runtime.close()

"""`dspark-export triton`: a Triton Inference Server model repository serving a bundle with the dspark runtime.

    REPO/NAME/config.pbtxt      Python backend, decoupled (tokens stream), instance group, parameters
    REPO/NAME/1/model.py        dspark.serve.triton_model
    REPO/NAME/1/bundle/         the bundle, with --copy-bundle (else config.pbtxt names its absolute path)
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.files import atomic_folder
from dspark.runtime.scheduler import VerifyPolicy

TEMPLATE = Path(__file__).with_name("triton_model.py")
MARK = "# written by dspark-export triton"  # first line of config.pbtxt: what --force may replace

INPUTS = [("text_input", "TYPE_STRING", "[ 1 ]"), ("prompt_ids", "TYPE_INT64", "[ -1 ]"),
          ("max_tokens", "TYPE_INT32", "[ 1 ]"), ("temperature", "TYPE_FP32", "[ 1 ]"),
          ("seed", "TYPE_INT64", "[ 1 ]"), ("top_k", "TYPE_INT32", "[ 1 ]"), ("top_p", "TYPE_FP32", "[ 1 ]"),
          ("min_p", "TYPE_FP32", "[ 1 ]"), ("repetition_penalty", "TYPE_FP32", "[ 1 ]"),
          ("presence_penalty", "TYPE_FP32", "[ 1 ]"), ("frequency_penalty", "TYPE_FP32", "[ 1 ]"),
          ("logit_bias_ids", "TYPE_INT64", "[ -1 ]"), ("logit_bias_values", "TYPE_FP32", "[ -1 ]")]
OUTPUTS = [("text_output", "TYPE_STRING", "[ 1 ]"), ("token_ids", "TYPE_INT64", "[ -1 ]"),
           ("finish_reason", "TYPE_STRING", "[ 1 ]")]


@dataclass(frozen=True)
class TritonModel:
    bundle: Path
    name: str = "dspark"
    instances: int = 1
    batch_size: int | None = None  # None: chosen when the model loads (dspark.runtime.engine_choice)
    policy: str | None = None  # None or "auto": chosen when the model loads
    copy_bundle: bool = False
    python_env: Path | None = None  # EXECUTION_ENV_PATH; None: this interpreter's environment
    threads: int | None = None
    max_context: int | None = None  # positions each slot's caches hold (None: the bundle's max context)

    def parameters(self) -> dict[str, str]:
        params = {"bundle": "bundle" if self.copy_bundle else str(Path(self.bundle).resolve()),
                  "batch_size": str(self.batch_size or "auto"), "policy": _policy_text(self.policy),
                  "EXECUTION_ENV_PATH": str(Path(self.python_env or sys.prefix).resolve())}
        for name in ("threads", "max_context"):
            if getattr(self, name):
                params[name] = str(getattr(self, name))
        return params


def _policy_text(policy: str | None) -> str:
    return "auto" if policy in (None, "auto") else str(VerifyPolicy.parse(policy))  # a bad one refused here


def _quoted(text: str) -> str:
    """A protobuf text-format string literal: quotes, backslashes and control characters escaped, so a bundle
    path or model name can never end the string and add fields of its own."""
    escaped = "".join(f"\\{ch}" if ch in '"\\' else ch if ch.isprintable()
                      else "".join(f"\\{b:03o}" for b in ch.encode()) for ch in text)
    return f'"{escaped}"'


def config_pbtxt(model: TritonModel) -> str:
    def tensor(name, kind, dims, optional):
        extra = " optional: true" if optional else ""
        return f"  {{ name: \"{name}\" data_type: {kind} dims: {dims}{extra} }}"

    inputs = ",\n".join(tensor(n, k, d, True) for n, k, d in INPUTS)
    outputs = ",\n".join(tensor(n, k, d, False) for n, k, d in OUTPUTS)
    params = "\n".join(f"parameters: {{ key: {_quoted(k)} value: {{ string_value: {_quoted(v)} }} }}"
                       for k, v in model.parameters().items())
    return (f"{MARK}\nname: {_quoted(model.name)}\nbackend: \"python\"\nmax_batch_size: 0\n"
            f"model_transaction_policy {{ decoupled: true }}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [ {{ count: {model.instances} kind: KIND_CPU }} ]\n{params}\n")


def write_repository(model: TritonModel, repository: Path, force: bool = False) -> Path:
    """Write REPO/NAME (replacing it with force); other models in the repository are left alone."""
    Manifest.read(Path(model.bundle))  # a bundle, or one line saying why not
    if not model.name.replace("-", "").replace("_", "").isalnum():
        raise DSparkError(f"model name {model.name!r}: use letters, digits, '-' and '_'")
    if Path(repository).exists() and not Path(repository).is_dir():
        raise DSparkError(f"--output {repository} is a file, not a model repository folder")
    env = model.python_env
    if env is not None and not (Path(env).is_dir() or (Path(env).is_file() and Path(env).name.endswith(".tar.gz"))):
        raise DSparkError(f"--python-env {env} is not a folder (an environment with dspark installed) nor a .tar.gz "
                          f"of one")
    folder = Path(repository) / model.name
    if folder.exists() or folder.is_symlink():
        if not force:
            raise DSparkError(f"{folder} exists; pass --force to replace it")
        _check_ours(folder)
    bundle_files = _bundle_files(Path(model.bundle)) if model.copy_bundle else []
    Path(repository).mkdir(parents=True, exist_ok=True)
    with atomic_folder(folder) as tmp:
        version = tmp / "1"
        version.mkdir()
        shutil.copyfile(TEMPLATE, version / "model.py")
        for rel in bundle_files:
            (version / "bundle" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(model.bundle) / rel, version / "bundle" / rel)
        (tmp / "config.pbtxt").write_text(config_pbtxt(model))
    return folder


def _check_ours(folder: Path) -> None:
    """--force replaces only a model folder this command wrote: config.pbtxt with its mark, 1/model.py, and
    optionally 1/bundle/; anything else there is the user's and stops it."""
    config = folder / "config.pbtxt"
    ours = (folder.is_dir() and not folder.is_symlink() and config.is_file()
            and config.read_text(errors="replace").startswith(MARK)
            and {p.name for p in folder.iterdir()} <= {"config.pbtxt", "1"}
            and {p.name for p in (folder / "1").iterdir()} <= {"model.py", "bundle", "__pycache__"})
    if not ours:
        raise DSparkError(f"{folder} was not written by dspark-export triton (or holds other files); refusing to "
                          f"replace it: choose another --name or move it away")


def _bundle_files(bundle: Path) -> list[Path]:
    """The bundle's own files, relative to it, for --copy-bundle; a link that leaves the bundle is refused rather
    than copied into the repository."""
    root = bundle.resolve()
    names = Manifest.read(bundle).own_files()
    files = [p for name in sorted(names) if (bundle / name).exists()
             for p in ([bundle / name] if (bundle / name).is_file() else sorted((bundle / name).rglob("*")))]
    outside = [p for p in files if not p.resolve().is_relative_to(root)]
    if outside:
        raise DSparkError(f"{outside[0]} links outside the bundle ({outside[0].resolve()}); --copy-bundle copies "
                          f"only the bundle's own files: copy the file in, or leave out --copy-bundle")
    return [p.relative_to(bundle) for p in files if p.is_file()]


def python_backend_dir(site_packages: Path, into: Path) -> Path:
    """A --backend-directory for the tritonserver of the nvidia-pytriton wheel installed in `site_packages`: its
    python/ holds the wheel's Python backend, utilities and the stub for this interpreter's version."""
    wheel = site_packages / "pytriton" / "tritonserver"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    backend = into / "python"
    backend.mkdir(parents=True)
    for f in (wheel / "backends/python/libtriton_python.so", wheel / "backends/python/triton_python_backend_utils.py",
              wheel / f"python_backend_stubs/{python}/triton_python_backend_stub"):
        shutil.copy(f, backend)
    return into

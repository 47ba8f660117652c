"""The two TensorRT flavors, importing them (optional dependencies), and which Python API a build uses (pure
logic, tested against version strings without TensorRT).

TensorRT 10: networks are explicit-batch by default (the EXPLICIT_BATCH flag is deprecated), precision is chosen
with builder flags (FP16/BF16) on a weakly typed network, or the network is strongly typed.
TensorRT 11: networks are strongly typed (the precision comes from the ONNX tensor types), the FP16/BF16 builder
flags are gone, so fp16/bf16 engines are built from graphs whose tensors were cast beforehand.
TensorRT for RTX 1.x (module tensorrt_rtx): strongly typed like 11 (only the STRONGLY_TYPED creation flag, no
FP16/BF16 builder flags), no timing cache (its calls are no-ops), ahead-of-time builds on any machine (no GPU
needed) for compute-capability targets, specialized on the user's GPU at the first run (the JIT step, whose
results a runtime cache keeps).
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType

from dspark.errors import DSparkError
from dspark.lazy import optional_import
from dspark.trt import rtx_libs

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Flavor:
    name: str
    module: str
    majors: tuple[int, ...]
    hint: str
    runs_on: str  # the GPUs its engines run on

    @property
    def supported(self) -> str:
        return ", ".join(f"{major}.x" for major in self.majors)


FLAVORS = {
    "tensorrt": Flavor("tensorrt", "tensorrt", (10, 11), "install TensorRT 10 or 11 for your CUDA version",
                       "the GPU model they were built on (any NVIDIA GPU TensorRT supports; with "
                       "--version-compatible, later TensorRT runtimes too)"),
    "rtx": Flavor("rtx", "tensorrt_rtx", (1,), "pip install tensorrt-rtx-cu13",
                  "NVIDIA GPUs of the compute capabilities built for: Turing SM75, Ampere SM80/SM86 (A100, RTX 30), "
                  "Ada SM89 (RTX 40, L4, L40), Blackwell SM120/SM121 (RTX 50, RTX PRO, DGX Spark); not Hopper "
                  "(SM90: H100, H200), which TensorRT for RTX has no target for"),
}
TENSORRT_HINT = FLAVORS["tensorrt"].hint
# TensorRT for RTX's ComputeCapability members, by the name users give (`--compute-capability 89`)
RTX_TARGETS = {"75": "SM75", "80": "SM80", "86": "SM86", "89": "SM89", "120": "SM120", "121": "SM121"}
# the GPUs of each RTX target, for saying where engines built for some of them run
RTX_GPUS = {"SM75": "Turing SM75 (RTX 20, T4)", "SM80": "Ampere SM80 (A100)", "SM86": "Ampere SM86 (RTX 30)",
            "SM89": "Ada SM89 (RTX 40, L4, L40)", "SM120": "Blackwell SM120 (RTX 50, RTX PRO)",
            "SM121": "Blackwell SM121 (DGX Spark)"}


def runs_on(flavor: Flavor, targets: list[str]) -> str:
    """Where engines run: for TensorRT for RTX, the GPUs of the targets they were built for (not every target)."""
    if flavor.name != "rtx" or not targets:
        return flavor.runs_on
    named = [RTX_GPUS.get(str(t).rsplit(".", 1)[-1], str(t)) for t in targets]
    return f"NVIDIA GPUs of the compute capabilities built for: {', '.join(named)}; not Hopper (SM90: H100, H200)"


def available_flavors() -> list[str]:
    """The flavors whose Python module is installed, TensorRT first."""
    return [name for name, flavor in FLAVORS.items() if importlib.util.find_spec(flavor.module) is not None]


def resolve_flavor(flavor: str | None) -> Flavor:
    if flavor is None:
        found = available_flavors()
        if not found:
            raise DSparkError(f"neither TensorRT nor TensorRT for RTX is installed ({TENSORRT_HINT}, or "
                              f"{FLAVORS['rtx'].hint})")
        flavor = found[0]
    if flavor not in FLAVORS:
        raise DSparkError(f"unknown TensorRT flavor {flavor!r} (choose from {', '.join(FLAVORS)})")
    return FLAVORS[flavor]


def import_tensorrt(flavor: str | None = "tensorrt") -> ModuleType:
    """The flavor's module (None: whichever is installed, TensorRT first), or one DSparkError line: also when the
    package is there but cannot load its libraries."""
    chosen = resolve_flavor(flavor)
    if chosen.name == "rtx":
        if "tensorrt_rtx_libs" in sys.modules and not rtx_libs.preloaded():
            raise DSparkError("tensorrt_rtx was imported before dspark prepared its libraries (its plugin fallback "
                              "would abort the process); import dspark.trt first")
        rtx_libs.preload()
    try:
        return optional_import(chosen.module, chosen.hint)
    except DSparkError:
        raise
    except Exception as e:  # e.g. the pip package failing to find or fetch libnvinfer
        first = str(e).splitlines()[0][:120] if str(e) else ""
        raise DSparkError(f"{chosen.module} is not usable here ({type(e).__name__}: {first}); {chosen.hint}") from None


def flavor_of(trt: ModuleType) -> Flavor:
    return FLAVORS["rtx"] if trt.__name__.split(".")[0] == "tensorrt_rtx" else FLAVORS["tensorrt"]


@dataclass(frozen=True)
class TrtApi:
    major: int
    minor: int
    flavor: str = "tensorrt"

    @classmethod
    def parse(cls, version: str, flavor: str = "tensorrt") -> TrtApi:
        chosen = resolve_flavor(flavor)
        try:
            major, minor = (int(x) for x in version.split(".")[:2])
        except ValueError:
            raise DSparkError(f"cannot read the {chosen.module} version {version!r}") from None
        if major not in chosen.majors:
            raise DSparkError(f"{chosen.module} {version} is not supported (supported: {chosen.supported})")
        return cls(major, minor, chosen.name)

    @property
    def strongly_typed_only(self) -> bool:
        return self.flavor == "rtx" or self.major >= 11

    @property
    def timing_cache(self) -> bool:
        return self.flavor != "rtx"

    @property
    def aot_targets(self) -> bool:
        """Whether engines are built for compute-capability targets rather than for the GPU of this machine."""
        return self.flavor == "rtx"

    def plan(self, precision: str) -> dict:
        """What the builder must do for `precision`: network creation flags, builder flags, and whether the ONNX
        graph needs the cast pass first."""
        if precision not in PRECISIONS:
            raise DSparkError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
        if self.strongly_typed_only:
            return {"network_flags": ["STRONGLY_TYPED"], "builder_flags": [], "cast_graph": precision != "fp32"}
        flags = {"fp16": ["FP16"], "bf16": ["BF16"], "fp32": []}[precision]
        return {"network_flags": [], "builder_flags": flags, "cast_graph": False}

    @property
    def plugin_api(self) -> str:
        return "IPluginV3"  # V2 plugins are deprecated in 10 and removed in 11


def compute_targets(names: list[str] | tuple[str, ...]) -> list[str]:
    """TensorRT for RTX ComputeCapability member names for `--compute-capability` values (75, 8.6, sm89, SM120)."""
    out = []
    for raw in names:
        key = str(raw).lower().removeprefix("sm").removeprefix("_").replace(".", "")
        if key == "90":
            raise DSparkError("compute capability 9.0 (Hopper: H100, H200) is not a TensorRT for RTX target; build "
                              "with --flavor tensorrt for those GPUs")
        if key not in RTX_TARGETS:
            raise DSparkError(f"unknown compute capability {raw!r} for TensorRT for RTX (choose from "
                              f"{', '.join(RTX_TARGETS)})")
        out.append(RTX_TARGETS[key])
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


def engines_runnable(section: dict, compute_capability: str | None) -> Verdict:
    """Whether engines recorded in a manifest's `tensorrt` section run on a GPU of this compute capability
    ("8.9"; None: no GPU)."""
    if compute_capability is None:
        return Verdict(False, "no CUDA GPU on this machine")
    key = compute_capability.replace(".", "")
    if section.get("flavor") == "rtx":
        targets = section.get("targets", [])
        if RTX_TARGETS.get(key) in targets:
            return Verdict(True, f"compute capability {compute_capability} is one of the targets "
                                 f"({', '.join(targets)})")
        why = " (Hopper has no TensorRT for RTX target; build with --flavor tensorrt)" if key == "90" else ""
        return Verdict(False, f"compute capability {compute_capability} is not among the engines' targets "
                              f"({', '.join(targets)}){why}")
    built_on = section.get("device", {}).get("compute_capability")
    if built_on is None:
        return Verdict(True, "the build recorded no device; loading the engines will tell")
    if built_on != compute_capability:
        return Verdict(False, f"built on compute capability {built_on}, this GPU is {compute_capability} (TensorRT "
                              f"engines are specific to the GPU model: rebuild here)")
    return Verdict(True, f"built on this compute capability ({built_on})")

"""Which bundle `dspark serve` serves and under which model ids: BUNDLE, or `--demo` for the bundle `dspark demo`
made (served as the stable id `smollm2-135m-dspark`, whatever its cache folder's digest). The bundle folder's name
is always accepted too, so a client may send either."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark.errors import DSparkError


@dataclass(frozen=True)
class Served:
    bundle: Path
    model_name: str  # the id /v1/models lists and responses carry
    aliases: tuple[str, ...] = ()  # other ids requests may send


def demo_bundle() -> Path:
    """The bundle `dspark demo` converted into the cache: its default (`--weights gguf`), else its fp32 one, else
    one an older dspark made (8-bit heads, fp32 verifier)."""
    from dspark.demo import demo_bundle_path

    for weights in ("gguf", "fp32", "q8"):
        if (demo_bundle_path(weights) / "manifest.json").exists():
            return demo_bundle_path(weights)
    raise DSparkError(f"no demo bundle in {demo_bundle_path('gguf').parent} yet: run `dspark demo` first (it converts "
                      f"one, a few minutes once), or give the BUNDLE to serve")


def served(bundle: Path | None, demo: bool, model_name: str | None) -> Served:
    """The bundle and model ids of `dspark serve [BUNDLE] [--demo] [--model-name NAME]`."""
    if demo and bundle is not None:
        raise DSparkError("give either BUNDLE or --demo, not both")
    if bundle is None and not demo:
        raise DSparkError("give the BUNDLE to serve, or --demo for the bundle `dspark demo` made")
    if demo:
        from dspark.demo import DEMO_DRAFT

        bundle, default = demo_bundle(), DEMO_DRAFT
    else:
        default = Path(bundle).resolve().name
    name = model_name or default
    folder = Path(bundle).resolve().name
    return Served(Path(bundle), name, tuple(n for n in dict.fromkeys((default, folder)) if n != name))

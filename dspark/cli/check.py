"""`dspark-export check`: ONNX Runtime against the PyTorch reference, greedy token equality, the acceptance-collapse
alarm and, optionally, the TensorRT lint (added to `dspark-export` by dspark/cli/main.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dspark.cli.options import WEIGHTS_OPTION


@click.command("check")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--trt-lint", is_flag=True, help="Also lint every graph against TensorRT 10's ONNX operator support.")
@click.option("--lint-only", is_flag=True, help="Only the TensorRT lint (no ONNX Runtime runs).")
@click.option("--no-acceptance", is_flag=True, help="Skip the acceptance measurement (the collapse alarm: the "
              "package's 12 prompts x 64 tokens, every draft verified).")
@WEIGHTS_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_cmd(bundle, trt_lint, lint_only, no_acceptance, weights, as_json):
    """Per-graph parity of ONNX Runtime vs PyTorch, greedy token equality (records check/ data if missing), and
    the drafter's acceptance on prompts shipped in the package: it fails when the acceptance is implausibly low
    for a trained drafter (a drafter read with the wrong convention still decodes exactly, only slowly)."""
    from dataclasses import asdict

    if lint_only:
        from dspark.bundle import Manifest
        from dspark.export.check.trt_lint import lint_bundle

        findings = [asdict(f) for f in lint_bundle(bundle, Manifest.read_checked(bundle))]
        if as_json:
            click.echo(json.dumps({"bundle": str(bundle), "trt_lint": findings, "passed": not findings}))
        else:
            for f in findings:
                click.echo(f"{f['graph']}: {f['op']} ({f['node']}): {f['problem']}")
            click.echo("TensorRT lint: " + ("clean" if not findings else f"{len(findings)} problem(s)"))
        sys.exit(0 if not findings else 1)
    from dspark.export.check.lazy_record import record_missing
    from dspark.export.check.parity import check_bundle, format_report

    record_missing(bundle, say=lambda m: click.echo(m, err=True))
    rep = check_bundle(bundle, trt_lint=trt_lint, weights=weights, acceptance=not no_acceptance)
    if rep.verdict is not None:
        from dspark import acceptance

        acceptance.write(bundle, rep.verdict)
    click.echo(json.dumps(rep.to_dict(), indent=2) if as_json else format_report(rep))
    sys.exit(0 if rep.passed else 1)

"""Command-line options that several commands share."""
import click

WEIGHTS_OPTION = click.option(
    "--weights", default="auto", show_default=True, type=click.Choice(["auto", "packed", "mapped"]),
    help="ONNX Runtime: packed = fp32 copies of the weights at load (fastest); mapped = used from the bundle file at "
         "their stored precision (for bundles whose fp32 copy does not fit in memory; slower steps); auto = packed "
         "when it fits.")

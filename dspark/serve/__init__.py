"""`dspark serve` (OpenAI-compatible HTTP on the always-on engine, Prometheus metrics) and the Triton model
repository writer. Only dspark.serve.commands is imported by dspark.cli; the rest needs the serve extra."""

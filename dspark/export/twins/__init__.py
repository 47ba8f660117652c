"""ONNX Runtime's own twin graphs of a bundle (fused verifier, greedy heads), rewritten from its portable ones."""

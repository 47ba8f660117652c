"""Tracing the three graphs with torch.onnx and writing the bundle (`dspark-export onnx`)."""

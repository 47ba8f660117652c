"""dspark::ConfidenceTruncate: numpy reference, ONNX function body, torch op (kernel: ../confidence_truncate.cu)."""

"""The bundle's custom operators, each specified once in numpy and realized for every place it runs.

- confidence_truncate/: dspark::ConfidenceTruncate (how many drafts each request verifies: static threshold,
  Algorithm 1, top-K): `reference` (the numpy specification the torch-free runtime also imports), `onnx_function`
  (the ONNX function body ONNX Runtime runs), `torch_op` (the op as traced into heads.onnx).
- scatter_rows/: the GPU runtime's row scatter of new K/V entries and target features (`reference`).
- confidence_truncate.cu, scatter_rows.cu: the CUDA kernels, built into one library by `kernels`.
- trt_plugin/: the C++ IPluginV3 wrapping the ConfidenceTruncate kernel for TensorRT.
"""

"""TensorRT build and GPU runtime. Everything importing tensorrt or cuda-python is import-guarded; the pure
logic (profiles, version gates, buffer planning) has no GPU dependency and is unit-tested everywhere."""

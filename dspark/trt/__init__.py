"""The TensorRT side of dspark: engine builds (build, profiles, versions), the GPU backend of dspark.runtime
(backend, engine, state, memory, cuda) and the GPU checks of `dspark doctor`. tensorrt and cuda-python are imported
on first use, so every module imports without them; profiles and version gates are pure logic, unit-tested
everywhere."""

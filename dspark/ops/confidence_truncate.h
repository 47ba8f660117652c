// Host entry points of the dspark::ConfidenceTruncate CUDA kernel (see confidence_truncate.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// Shared memory the kernel needs for a [batch, block] survival tensor.
size_t dspark_confidence_truncate_smem(int batch, int block);

// Launches the kernel on `stream`; every pointer is device memory (mode, layout: one int64 each, read by the
// kernel). Returns 0 on success, 1 bad sizes, 2 batch too large for one block, 3 launch error.
int dspark_confidence_truncate(const float* survival, const float* threshold, const float* sps, int n_sps,
                               const int64_t* budget, const uint8_t* active, const int64_t* mode,
                               const int64_t* layout, int batch, int block, int64_t* verify_len,
                               uint8_t* verify_mask, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

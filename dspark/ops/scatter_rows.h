// Host entry point of the row-scatter kernel the GPU runtime uses to append new K/V entries and target
// features to device-resident caches (see scatter_rows.cu and dspark/ops/scatter_rows/reference.py).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// src [planes, src_batch, heads, src_rows, width] f32 -> dst [planes, dst_batch, heads, dst_rows, width] f32:
// for each entry e < n_entries, rows [0, count[e]) of source batch row src_index[e] are written to rows
// [offset[e], offset[e] + count[e]) of destination batch row dst_index[e], for every plane and head.
// Index arrays are device int64. Returns 0 on success, 1 bad sizes, 3 launch error.
int dspark_scatter_rows(const float* src, float* dst, int planes, int src_batch, int heads, int src_rows,
                        int dst_batch, int dst_rows, int width, const int64_t* src_index, const int64_t* dst_index,
                        const int64_t* offset, const int64_t* count, int n_entries, int max_count,
                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif

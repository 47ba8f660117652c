// Row scatter for device-resident caches: one launch appends every request's new K/V entries (or target
// features) after its valid prefix, so a decode step needs no per-layer or per-request copies.
// Grid: x = width chunks, y = row within the entry (< max_count), z = entry * planes * heads.
// Rows beyond an entry's count and destination rows outside [0, dst_rows) are skipped, never written.
#include <cstdint>
#include <cuda_runtime.h>

#include "scatter_rows.h"

namespace {

__global__ void scatter_rows_kernel(const float* __restrict__ src, float* __restrict__ dst, int planes,
                                    int src_batch, int heads, int src_rows, int dst_batch, int dst_rows, int width,
                                    const int64_t* __restrict__ src_index, const int64_t* __restrict__ dst_index,
                                    const int64_t* __restrict__ offset, const int64_t* __restrict__ count) {
  const int row = blockIdx.y;
  const int z = blockIdx.z;
  const int head = z % heads;
  const int plane = (z / heads) % planes;
  const int entry = z / (heads * planes);
  const int64_t n = count[entry];
  if (row >= n || row >= src_rows) return;
  const int64_t s = src_index[entry], d = dst_index[entry], at = offset[entry] + row;
  if (s < 0 || s >= src_batch || d < 0 || d >= dst_batch || at < 0 || at >= dst_rows) return;
  const float* from = src + ((((int64_t)plane * src_batch + s) * heads + head) * src_rows + row) * width;
  float* to = dst + ((((int64_t)plane * dst_batch + d) * heads + head) * dst_rows + at) * width;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) to[i] = from[i];
}

}  // namespace

extern "C" int dspark_scatter_rows(const float* src, float* dst, int planes, int src_batch, int heads,
                                   int src_rows, int dst_batch, int dst_rows, int width, const int64_t* src_index,
                                   const int64_t* dst_index, const int64_t* offset, const int64_t* count,
                                   int n_entries, int max_count, cudaStream_t stream) {
  if (planes < 1 || src_batch < 1 || heads < 1 || src_rows < 1 || dst_batch < 1 || dst_rows < 1 || width < 1 ||
      n_entries < 0 || max_count < 0)
    return 1;
  if (n_entries == 0 || max_count == 0) return 0;
  const long long z = (long long)n_entries * planes * heads;
  if (z > 65535 || max_count > 65535) return 1;
  const int threads = width >= 256 ? 256 : ((width + 31) / 32) * 32;
  const int chunks = (width + threads - 1) / threads;
  dim3 grid(chunks, max_count < src_rows ? max_count : src_rows, (unsigned)z);
  scatter_rows_kernel<<<grid, threads, 0, stream>>>(src, dst, planes, src_batch, heads, src_rows, dst_batch,
                                                    dst_rows, width, src_index, dst_index, offset, count);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

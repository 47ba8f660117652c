// dspark::ConfidenceTruncate as a CUDA kernel (what the TensorRT plugin launches).
//
// Same contract as dspark/plugins/truncate_ref.py:
//   survival [B, Bk] f32, threshold [B] f32, sps [N] f32, budget [1] i64, active [B] bool (u8),
//   mode [1] i64 (0 static, 1 Algorithm 1 with early stop, 2 top-K), layout [1] i64 (0 flat, 1 padded)
//   -> verify_len [B] i64, verify_mask [B, Bk] bool (u8)
// mode and layout stay on the device (read by the kernel), so a launch never syncs and is CUDA-graph capturable.
// One thread block does the whole batch: B * Bk candidates are ranked in shared memory (ties: smaller flat
// index j * B + r first, as the reference), then one thread walks the ranked list with the reference's float32
// arithmetic (tau_i = R + cumsum(a)_i), so all three implementations make identical decisions.
#include <cstdint>
#include <cuda_runtime.h>

#include "confidence_truncate.h"

namespace {

__global__ void confidence_truncate_kernel(const float* __restrict__ survival, const float* __restrict__ threshold,
                                           const float* __restrict__ sps, int n_sps,
                                           const int64_t* __restrict__ budget, const uint8_t* __restrict__ active,
                                           const int64_t* __restrict__ mode_ptr, const int64_t* __restrict__ layout_ptr,
                                           int batch, int block,
                                           int64_t* __restrict__ verify_len, uint8_t* __restrict__ verify_mask) {
  extern __shared__ unsigned char smem[];
  const int m = batch * block;
  const int mode = static_cast<int>(mode_ptr[0]);
  const int layout = static_cast<int>(layout_ptr[0]);
  float* value = reinterpret_cast<float*>(smem);          // [m] candidate survival (0 = not a candidate)
  int* order = reinterpret_cast<int*>(value + m);         // [m] flat index by rank
  int* lengths = order + m;                               // [batch]

  for (int i = threadIdx.x; i < batch; i += blockDim.x) lengths[i] = 0;
  for (int i = threadIdx.x; i < m; i += blockDim.x) {
    const int r = i % batch, j = i / batch;
    value[i] = active[r] ? survival[r * block + j] : 0.0f;
  }
  __syncthreads();

  if (mode == 0) {
    for (int r = threadIdx.x; r < batch; r += blockDim.x) {
      int len = 0;
      if (active[r]) {
        while (len < block && survival[r * block + len] >= threshold[r]) ++len;
      }
      lengths[r] = len;
    }
  } else {
    for (int i = threadIdx.x; i < m; i += blockDim.x) {  // rank = how many candidates come before i
      const float v = value[i];
      int rank = 0;
      for (int k = 0; k < m; ++k) {
        const float w = value[k];
        rank += (w > v) || (w == v && k < i);
      }
      order[rank] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int n_live = 0;
      for (int r = 0; r < batch; ++r) n_live += active[r] ? 1 : 0;
      if (mode == 2) {
        const int64_t k_budget = budget[0];
        for (int i = 0; i < m && i < k_budget; ++i) {
          const int idx = order[i];
          if (!(value[idx] > 0.0f)) break;
          lengths[idx % batch] = idx / batch + 1;
        }
      } else if (n_live > 0) {
        const float base_sps = sps[(n_live < n_sps ? n_live : n_sps) - 1];
        float best = static_cast<float>(n_live) * base_sps;
        float cumsum = 0.0f;
        int widest = 0;
        for (int i = 0; i < m; ++i) {
          const int idx = order[i];
          const float a = value[idx];
          if (!(a > 0.0f)) break;
          const int j = idx / batch;
          cumsum += a;
          widest = widest > j + 1 ? widest : j + 1;
          const int n = layout == 0 ? n_live + i + 1 : n_live * (1 + widest);
          if (n > n_sps) break;
          const float theta = (static_cast<float>(n_live) + cumsum) * sps[n - 1];
          if (!(theta > best)) break;  // the first non-improvement ends the search (keeps it lossless)
          best = theta;
          lengths[idx % batch] = j + 1;
        }
      }
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < batch; r += blockDim.x) verify_len[r] = lengths[r];
  for (int i = threadIdx.x; i < m; i += blockDim.x) {
    const int r = i / block, j = i % block;
    verify_mask[i] = j < lengths[r] ? 1 : 0;
  }
}

}  // namespace

extern "C" size_t dspark_confidence_truncate_smem(int batch, int block) {
  const size_t m = static_cast<size_t>(batch) * block;
  return m * sizeof(float) + m * sizeof(int) + static_cast<size_t>(batch) * sizeof(int);
}

extern "C" int dspark_confidence_truncate(const float* survival, const float* threshold, const float* sps,
                                          int n_sps, const int64_t* budget, const uint8_t* active,
                                          const int64_t* mode, const int64_t* layout, int batch, int block,
                                          int64_t* verify_len, uint8_t* verify_mask, cudaStream_t stream) {
  if (batch <= 0 || block <= 0 || n_sps <= 0) return 1;
  const size_t smem = dspark_confidence_truncate_smem(batch, block);
  if (smem > 48 * 1024) return 2;  // one block holds the batch: up to ~6000 candidates
  const int threads = batch * block < 256 ? 128 : 256;
  confidence_truncate_kernel<<<1, threads, smem, stream>>>(survival, threshold, sps, n_sps, budget, active, mode,
                                                           layout, batch, block, verify_len, verify_mask);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

// dspark::ConfidenceTruncate as a CUDA kernel (what the TensorRT plugin launches).
//
// Same contract as dspark/ops/confidence_truncate/reference.py:
//   survival [B, Bk] f32, threshold [B] f32, sps [N] f32, budget [1] i64, active [B] bool (u8),
//   mode [1] i64 (0 static, 1 Algorithm 1 with early stop, 2 top-K), layout [1] i64 (0 flat, 1 padded)
//   -> verify_len [B] i64, verify_mask [B, Bk] bool (u8)
// mode and layout stay on the device (read by the kernel), so a launch never syncs and is CUDA-graph capturable.
// One thread block does the whole batch: the B * Bk candidates are sorted in shared memory by a bitonic network
// (survival descending, ties: smaller flat index j * B + r first, as the reference). Top-K then admits the first K
// in parallel; Algorithm 1 is walked by one thread with the reference's float32 arithmetic
// (tau_i = R + cumsum(a)_i), so all three implementations make identical decisions.
#include <cstdint>
#include <cuda_runtime.h>

#include "confidence_truncate.h"

namespace {

constexpr int kMaxThreads = 1024;

__host__ __device__ int sort_size(int m) {  // the bitonic network's width: the next power of two
  int p = 1;
  while (p < m) p <<= 1;
  return p;
}

// a ranks before b: larger survival first, then the smaller flat index (candidates of one request in position order)
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

__global__ void confidence_truncate_kernel(const float* __restrict__ survival, const float* __restrict__ threshold,
                                           const float* __restrict__ sps, int n_sps,
                                           const int64_t* __restrict__ budget, const uint8_t* __restrict__ active,
                                           const int64_t* __restrict__ mode_ptr, const int64_t* __restrict__ layout_ptr,
                                           int batch, int block,
                                           int64_t* __restrict__ verify_len, uint8_t* __restrict__ verify_mask) {
  extern __shared__ unsigned char smem[];
  const int m = batch * block;
  const int p = sort_size(m);
  const int mode = static_cast<int>(mode_ptr[0]);
  const int layout = static_cast<int>(layout_ptr[0]);
  float* value = reinterpret_cast<float*>(smem);  // [p] survival by rank (0: not a candidate, -1: padding)
  int* index = reinterpret_cast<int*>(value + p);  // [p] flat index j * B + r by rank
  int* lengths = index + p;                        // [batch]

  for (int r = threadIdx.x; r < batch; r += blockDim.x) lengths[r] = 0;
  if (mode == 0) {
    __syncthreads();
    for (int r = threadIdx.x; r < batch; r += blockDim.x) {
      int len = 0;
      if (active[r]) {
        while (len < block && survival[r * block + len] >= threshold[r]) ++len;
      }
      lengths[r] = len;
    }
  } else {
    for (int i = threadIdx.x; i < p; i += blockDim.x) {
      const int r = i % batch, j = i / batch;
      value[i] = i >= m ? -1.0f : active[r] ? survival[r * block + j] : 0.0f;
      index[i] = i;
    }
    __syncthreads();
    for (int k = 2; k <= p; k <<= 1) {  // bitonic sort into rank order
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int t = threadIdx.x; t < p / 2; t += blockDim.x) {
          const int a = 2 * t - (t & (j - 1)), b = a + j;
          const bool forward = (a & k) == 0;  // this run ends in rank order, the other in reverse
          const float va = value[a], vb = value[b];
          const int ia = index[a], ib = index[b];
          if (before(vb, ib, va, ia) == forward) {
            value[a] = vb, value[b] = va;
            index[a] = ib, index[b] = ia;
          }
        }
        __syncthreads();
      }
    }
    if (mode == 2) {  // the first K candidates; a request's admitted positions form a prefix, so the longest wins
      const int64_t k_budget = budget[0];
      const int admit = k_budget < m ? static_cast<int>(k_budget) : m;
      for (int i = threadIdx.x; i < admit; i += blockDim.x) {
        if (value[i] > 0.0f) atomicMax(&lengths[index[i] % batch], index[i] / batch + 1);
      }
    } else if (threadIdx.x == 0) {
      int n_live = 0;
      for (int r = 0; r < batch; ++r) n_live += active[r] ? 1 : 0;
      if (n_live > 0) {
        const float base_sps = sps[(n_live < n_sps ? n_live : n_sps) - 1];
        float best = static_cast<float>(n_live) * base_sps;
        float cumsum = 0.0f;
        int widest = 0;
        for (int i = 0; i < m; ++i) {
          const float a = value[i];
          if (!(a > 0.0f)) break;
          const int j = index[i] / batch;
          cumsum += a;
          widest = widest > j + 1 ? widest : j + 1;
          const int n = layout == 0 ? n_live + i + 1 : n_live * (1 + widest);
          if (n > n_sps) break;
          const float theta = (static_cast<float>(n_live) + cumsum) * sps[n - 1];
          if (!(theta > best)) break;  // the first non-improvement ends the search (keeps it lossless)
          best = theta;
          lengths[index[i] % batch] = j + 1;
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
  const size_t p = static_cast<size_t>(sort_size(batch * block));
  return p * (sizeof(float) + sizeof(int)) + static_cast<size_t>(batch) * sizeof(int);
}

extern "C" int dspark_confidence_truncate(const float* survival, const float* threshold, const float* sps,
                                          int n_sps, const int64_t* budget, const uint8_t* active,
                                          const int64_t* mode, const int64_t* layout, int batch, int block,
                                          int64_t* verify_len, uint8_t* verify_mask, cudaStream_t stream) {
  if (batch <= 0 || block <= 0 || n_sps <= 0) return 1;
  const size_t smem = dspark_confidence_truncate_smem(batch, block);
  if (smem > 48 * 1024) return 2;  // one block holds the batch: up to 4096 candidates
  const int half = sort_size(batch * block) / 2;
  const int threads = half < 128 ? 128 : half > kMaxThreads ? kMaxThreads : half;
  confidence_truncate_kernel<<<1, threads, smem, stream>>>(survival, threshold, sps, n_sps, budget, active, mode,
                                                           layout, batch, block, verify_len, verify_mask);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

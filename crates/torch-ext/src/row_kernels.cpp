// Row kernels over fp32 logits [rows, vocab], one thread block per row, compiled at run time with
// NVRTC (see cuda_rt.h) and launched on libtorch's current stream (graph-capturable):
//
// * vt_sample_rows: next-token sampling without top-k/top-p. Greedy: the first maximal logit.
//   Else the inverse CDF in vocabulary order at u * total (the first token whose cumulative
//   exp(x/T - max) exceeds it), which is what the torch sampler computes: one pass over the row
//   for the max and 16 segment masses, one over the segment the target falls in for 16 sub-segment
//   masses, and a walk of one sub-segment, instead of a softmax, a cumsum and several comparisons
//   over [rows, vocab] tensors (136 us for 512 x 151936 on an H200, was 259 us with a one-warp
//   walk of the whole segment). Also writes the token's log-probability under log_softmax(x / T).
// * vt_token_stats: per row, log_softmax(x/T)[target], logsumexp(x/T), E_p[x/T] and the entropy
//   logsumexp - E_p[x/T], in one pass (an online max / sum / weighted sum).
// * vt_token_stats_grad: the gradient of g_lp * log_prob + g_ent * entropy with respect to the
//   raw logits, (g_lp (onehot - p) - g_ent p (x/T - E)) / T, written in the caller's dtype; the
//   LM head's backward GEMMs then take it straight.
//
// Every extern "C" function reports C++ exceptions as a heap string freed with vt_free_error.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "ext_util.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#ifdef VERL_WITH_CUDA
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "cuda_rt.h"
#endif

#define VT_ROW_PARAMS_DEF                                                                 \
  struct VtRowParams {                                                                    \
    const float* logits;      /* [R, V] */                                                \
    const long long* targets; /* [R] (stats, grad) */                                     \
    const float* uniforms;    /* [R] (sample; null: greedy) */                            \
    long long* tokens;        /* [R] (sample out) */                                      \
    float* out_lp;            /* [R] (sample: nullable; stats) */                         \
    float* out_ent;           /* [R] (stats; nullable) */                                 \
    float* lse;               /* [R] (stats out, grad in) */                              \
    float* mean;              /* [R] E_p[x/T] (stats out, grad in) */                     \
    const float* g_lp;        /* [R] (grad) */                                            \
    const float* g_ent;       /* [R] (grad; nullable) */                                  \
    void* grad;               /* [R, V] (grad out) */                                     \
    long long vocab;                                                                      \
    float temperature;                                                                    \
    int grad_dtype;           /* 0 fp32, 1 bf16, 2 fp16 */                                \
  };

#define VT_ROPE_PARAMS_DEF                                                                \
  struct VtRopeParams {                                                                   \
    const void* x;   /* [B, H, T, D], strides below (elements) */                         \
    void* out;       /* [B, H, T, D], strides ob.. (elements) */                          \
    const void* cos; /* [B, T, D] contiguous */                                           \
    const void* sin; /* [B, T, D] contiguous */                                           \
    long long b, h, t, d;                                                                 \
    long long sb, sh, st, sd;                                                             \
    long long ob, oh, ot, od;                                                             \
    int dtype;       /* 0 fp32, 1 bf16, 2 fp16 */                                         \
    int bwd;         /* 1: the vector-Jacobian product (transpose of the rotation) */     \
    int small;       /* 1: every index and offset fits in 32 bits */                      \
    int x2;          /* 1: two pairs per thread, 32-bit loads (16-bit, unit D strides) */ \
  };

#define VT_SWIGLU_PARAMS_DEF                                                              \
  struct VtSwigluParams {                                                                 \
    const void* x;   /* [R, I] gate rows, row stride `stride` (elements) */               \
    const void* up;  /* [R, I] up rows, row stride `ustride` */                           \
    void* out;       /* [R, I] contiguous */                                              \
    long long rows, inter, stride, ustride;                                               \
    int dtype;       /* 0 fp32, 1 bf16, 2 fp16 */                                         \
    int vec;         /* 1: 8 elements per thread through 16-byte loads (16-bit dtypes) */ \
  };

#define VT_SWIGLU_BWD_PARAMS_DEF                                                          \
  struct VtSwigluBwdParams {                                                              \
    const void* go;  /* [R, I] gradient of silu(gate) * up, contiguous */                 \
    const void* g;   /* [R, I] gate, contiguous */                                        \
    const void* u;   /* [R, I] up, contiguous */                                          \
    void* dg;        /* [R, I] out, contiguous */                                         \
    void* du;        /* [R, I] out, contiguous */                                         \
    long long n;     /* R * I */                                                          \
    int dtype;       /* 0 fp32, 1 bf16, 2 fp16 */                                         \
    int vec;         /* 1: 8 elements per thread through 16-byte loads (16-bit dtypes) */ \
  };

#define VT_ROPE_STORE_PARAMS_DEF                                                          \
  struct VtRopeStoreParams {                                                              \
    const void* q;        /* [S, H, D], strides below (elements), unit along D */         \
    const void* k;        /* [S, KVH, D] */                                               \
    const void* v;        /* [S, KVH, D] */                                               \
    const void* cos;      /* [S, D] contiguous */                                         \
    const void* sin;      /* [S, D] contiguous */                                         \
    const long long* slots; /* [S] cache rows of the new keys/values */                   \
    void* q_out;          /* [S, H, D] contiguous */                                      \
    void* k_cache;        /* [rows, KVH, D] contiguous */                                 \
    void* v_cache;        /* [rows, KVH, D] contiguous */                                 \
    long long sq_s, sq_h, sk_s, sk_h, sv_s, sv_h;                                         \
    long long s, h, kvh, d;                                                               \
    int dtype;            /* 0 fp32, 1 bf16, 2 fp16 */                                    \
    int x2;               /* 1: two pairs per thread, 32-bit accesses (see vt_rope_store) */ \
  };

#define VT_ADD_NORM_PARAMS_DEF                                                            \
  struct VtAddNormParams {                                                                \
    const void* x;      /* [R, H] contiguous */                                           \
    const void* delta;  /* [R, H] contiguous, or null (a plain RMSNorm) */                \
    const void* weight; /* [H] */                                                         \
    void* sum;          /* [R, H] x + delta (with delta) */                               \
    void* out;          /* [R, H] the normalised, scaled rows */                          \
    long long rows;                                                                       \
    int hidden;                                                                           \
    int dtype;          /* 0 fp32, 1 bf16, 2 fp16 */                                      \
    int vec;            /* 1: 8 elements per 16-byte access (16-bit dtypes) */            \
    float eps;                                                                            \
  };

#define VT_ADD_NORM_BWD_PARAMS_DEF                                                        \
  struct VtAddNormBwdParams {                                                             \
    const void* dy;     /* [R, H] gradient of the normalised rows, contiguous */          \
    const void* gs;     /* [R, H] gradient arriving at the sum itself, or null */         \
    const void* h;      /* [R, H] the rows that were normalised, contiguous */            \
    const void* weight; /* [H] */                                                         \
    void* dx;           /* [R, H] out: the gradient of the rows (of x and of delta) */    \
    float* dw_part;     /* [gridDim.x, H] out: each block's share of the weight grad */   \
    long long rows;                                                                       \
    int hidden;                                                                           \
    int dtype;          /* 1 bf16, 2 fp16 (16-byte accesses only) */                      \
    float eps;                                                                            \
  };

#define VT_ROWS_SUM_PARAMS_DEF                                                            \
  struct VtRowsSumParams {                                                                \
    const void* g;              /* [M, C] contiguous */                                   \
    const long long* offsets;   /* [N + 1]: row n sums g rows sources[offsets[n]..] */    \
    const long long* sources;   /* [M] */                                                 \
    void* out;                  /* [N, C] contiguous */                                   \
    long long rows, cols;                                                                 \
    int dtype;                  /* 0 fp32, 1 bf16, 2 fp16 */                              \
    int vec;                    /* 1: 8 elements per 16-byte access (16-bit dtypes) */    \
  };

#define VT_AXPY_PARAMS_DEF                                                                \
  struct VtAxpyParams {                                                                   \
    const float* x;             /* [n] fp32, contiguous */                                \
    const float* s;             /* one fp32 on the device */                              \
    void* out;                  /* [n] contiguous, added into */                          \
    long long n;                                                                          \
    int dtype;                  /* out: 0 fp32, 1 bf16, 2 fp16 */                         \
    int vec;                    /* 1: 8 elements per access (16-bit out) */               \
  };

#define VT_COLS_SUM_PARAMS_DEF                                                            \
  struct VtColsSumParams {                                                                \
    const float* x;             /* [rows, cols] fp32, contiguous */                       \
    void* out;                  /* [cols] contiguous */                                   \
    long long rows;                                                                       \
    int cols;                                                                             \
    int dtype;                  /* out: 0 fp32, 1 bf16, 2 fp16 */                         \
    int accumulate;             /* 1: out += the sums, else out = the sums */             \
  };

#define VT_ROW_STR_(...) #__VA_ARGS__
#define VT_ROW_STR(...) VT_ROW_STR_(__VA_ARGS__)

namespace vt_lt {
// lt_gemm.cpp: d = alpha * a^T b + beta * d through cuBLASLt, (alpha, beta) read on the device;
// false where it cannot run (the caller computes it otherwise).
bool grad_into(const at::Tensor& d, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& alpha_beta);
}  // namespace vt_lt

namespace {

const char* const kRowSource = R"VTROW(
#define THREADS 512
#define WARPS (THREADS / 32)

__device__ __forceinline__ float vt_neg_inf() { return __int_as_float(0xff800000); }

// Scaled logit: x / T exactly as torch's division computes it (T == 1: x).
__device__ __forceinline__ float vt_scaled(float x, float t) { return t == 1.0f ? x : x / t; }

// Online (max, sum exp(x - max), sum exp(x - max) * x) state.
struct Acc {
  float m, s, w;
};

__device__ __forceinline__ void acc_add(Acc& a, float x) {
  if (x == vt_neg_inf()) return;  // exp(-inf) = 0 adds nothing (and -inf * 0 is NaN)
  if (x > a.m) {
    const float c = a.m == vt_neg_inf() ? 0.0f : expf(a.m - x);
    a.s = a.s * c + 1.0f;
    a.w = a.w * c + x;
    a.m = x;
  } else {
    const float e = expf(x - a.m);
    a.s += e;
    a.w += e * x;
  }
}

__device__ __forceinline__ Acc acc_merge(Acc a, Acc b) {
  if (b.m == vt_neg_inf()) return a;
  if (a.m == vt_neg_inf()) return b;
  const float m = fmaxf(a.m, b.m);
  const float ca = expf(a.m - m), cb = expf(b.m - m);
  Acc r;
  r.m = m;
  r.s = a.s * ca + b.s * cb;
  r.w = a.w * ca + b.w * cb;
  return r;
}

// Whole-block reduction of the state (every thread gets the result).
__device__ Acc block_acc(Acc a) {
  __shared__ Acc part[WARPS];
  __shared__ Acc total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    Acc b;
    b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
    b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
    b.w = __shfl_xor_sync(0xffffffffu, a.w, o);
    a = acc_merge(a, b);
  }
  if (lane == 0) part[warp] = a;
  __syncthreads();
  if (threadIdx.x == 0) {
    Acc r = part[0];
    for (int i = 1; i < WARPS; ++i) r = acc_merge(r, part[i]);
    total = r;
  }
  __syncthreads();
  return total;
}

// (value, index) arg-max: larger value, then smaller index.
__device__ __forceinline__ void arg_better(float& v, long long& i, float v2, long long i2) {
  if (v2 > v || (v2 == v && i2 >= 0 && (i < 0 || i2 < i))) {
    v = v2;
    i = i2;
  }
}

__device__ long long block_argmax(float v, long long i) {
  __shared__ float pv[WARPS];
  __shared__ long long pi[WARPS];
  __shared__ long long best;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const long long i2 = __shfl_xor_sync(0xffffffffu, i, o);
    arg_better(v, i, v2, i2);
  }
  if (lane == 0) {
    pv[warp] = v;
    pi[warp] = i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bv = pv[0];
    long long bi = pi[0];
    for (int k = 1; k < WARPS; ++k) arg_better(bv, bi, pv[k], pi[k]);
    best = bi;
  }
  __syncthreads();
  return best;
}

// Four values into the state with one max test and at most one rescale (instead of a
// divergent branch per value).
__device__ __forceinline__ void acc_add4(Acc& a, float x0, float x1, float x2, float x3) {
  const float m4 = fmaxf(fmaxf(x0, x1), fmaxf(x2, x3));
  if (m4 > a.m) {
    const float c = a.m == vt_neg_inf() ? 0.0f : expf(a.m - m4);
    a.s *= c;
    a.w *= c;
    a.m = m4;
  }
  const float xs[4] = {x0, x1, x2, x3};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (xs[k] == vt_neg_inf()) continue;  // exp(-inf) = 0 adds nothing (and -inf * 0 is NaN)
    const float e = expf(xs[k] - a.m);
    a.s += e;
    a.w += e * xs[k];
  }
}

// The row's scaled-logit state: through 16-byte loads where the row allows (V % 4 == 0 and an
// aligned row), thread-strided (coalesced) either way.
__device__ Acc row_acc(const float* row, long long V, float t) {
  Acc a;
  a.m = vt_neg_inf();
  a.s = 0.0f;
  a.w = 0.0f;
  if (V % 4 == 0 && (reinterpret_cast<unsigned long long>(row) & 15ull) == 0) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int n4 = (int)(V / 4);
    // Four loads in flight per thread, summed in the one-load loop's order.
    constexpr int AHEAD = 4;
    for (int v = threadIdx.x; v < n4; v += THREADS * AHEAD) {
      float4 x[AHEAD];
#pragma unroll
      for (int j = 0; j < AHEAD; ++j) {
        if (v + j * THREADS < n4) x[j] = r4[v + j * THREADS];
      }
#pragma unroll
      for (int j = 0; j < AHEAD; ++j) {
        if (v + j * THREADS >= n4) break;
        acc_add4(a, vt_scaled(x[j].x, t), vt_scaled(x[j].y, t), vt_scaled(x[j].z, t),
                 vt_scaled(x[j].w, t));
      }
    }
  } else {
    for (long long v = threadIdx.x; v < V; v += THREADS) acc_add(a, vt_scaled(row[v], t));
  }
  return block_acc(a);
}

// The first of WARPS consecutive masses `sums` (after `start`) whose running total passes
// `target`, with the running total before it; when rounding leaves the target past them all
// (u * total rounded up to total), the last one with mass.
__device__ void vt_find_part(const float* sums, float start, float target, int& part,
                             float& before) {
  float acc = start;
  int own = -1, last = 0;
  float own_before = start, last_before = start;
  for (int w = 0; w < WARPS; ++w) {
    if (sums[w] > 0.0f) {
      last = w;
      last_before = acc;
    }
    if (own < 0 && acc + sums[w] > target && sums[w] > 0.0f) {
      own = w;
      own_before = acc;
    }
    acc += sums[w];
  }
  if (own < 0) {
    own = last;
    own_before = last_before;
  }
  part = own;
  before = own_before;
}

extern "C" __global__ void __launch_bounds__(THREADS) vt_sample_rows(const VtRowParams p) {
  const long long r = blockIdx.x;
  const long long V = p.vocab;
  const float* row = p.logits + r * V;
  const float t = p.temperature;
  __shared__ long long chosen;
  // The scaled-logit state: the sampling CDF's scale and the log-probability's normaliser.
  Acc a;
  a.m = 0.0f;
  a.s = 1.0f;
  a.w = 0.0f;
  __shared__ float row_m, row_s;
  if (p.uniforms == nullptr) {
    if (p.out_lp != nullptr) a = row_acc(row, V, t);
    float bv = vt_neg_inf();
    long long bi = -1;
    for (long long v = threadIdx.x; v < V; v += THREADS) arg_better(bv, bi, row[v], v);
    const long long best = block_argmax(bv, bi);
    if (threadIdx.x == 0) chosen = best < 0 ? 0 : best;
  } else {
    // Contiguous segments, one per warp, in tiles of 32 lanes x 4 consecutive tokens.
    const long long seg = ((V + WARPS - 1) / WARPS + 127) / 128 * 128;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float seg_sum[WARPS];
    __shared__ float seg_m[WARPS];
    __shared__ int owner;
    __shared__ float before;
    __shared__ float target;
    {
      // One pass for the row's max and every segment's mass: an online (max, sum) per lane
      // over the warp's segment, merged over the warp; the segments are rescaled to the row's
      // max below.
      // Per lane a (max, sum) over its tokens, four at a time (one 16-byte load when the row is
      // aligned): one max test and at most one rescale per four tokens instead of a divergent
      // branch per token (the pass was instruction-bound).
      const long long lo = warp * seg, hi = min(V, lo + seg);
      Acc la;
      la.m = vt_neg_inf();
      la.s = 0.0f;
      la.w = 0.0f;
      const bool vec = (reinterpret_cast<unsigned long long>(row) & 15ull) == 0;
      // Tiles of 128 tokens in order; four tiles' loads are issued before the first is summed
      // (one 16-byte load in flight per lane left the pass at ~2 TB/s: 154 us for 512 x 151936
      // on an H100). The arithmetic and its order are the one-tile loop's.
      constexpr int AHEAD = 4;
      for (long long base = lo; base < hi; base += 128 * AHEAD) {
        float4 f[AHEAD];
#pragma unroll
        for (int j = 0; j < AHEAD; ++j) {
          const long long v0 = base + 128 * j + lane * 4;
          if (vec && v0 + 3 < hi) f[j] = *reinterpret_cast<const float4*>(row + v0);
        }
#pragma unroll
        for (int j = 0; j < AHEAD; ++j) {
          const long long v0 = base + 128 * j + lane * 4;
          if (base + 128 * j >= hi) break;
          float x[4];
          if (vec && v0 + 3 < hi) {
            x[0] = vt_scaled(f[j].x, t);
            x[1] = vt_scaled(f[j].y, t);
            x[2] = vt_scaled(f[j].z, t);
            x[3] = vt_scaled(f[j].w, t);
          } else {
            for (int k = 0; k < 4; ++k) {
              x[k] = v0 + k < hi ? vt_scaled(row[v0 + k], t) : vt_neg_inf();
            }
          }
          const float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
          if (mx > la.m) {
            la.s = la.m == vt_neg_inf() ? 0.0f : la.s * expf(la.m - mx);
            la.m = mx;
          }
          if (la.m != vt_neg_inf()) {
            la.s +=
                (expf(x[0] - la.m) + expf(x[1] - la.m)) + (expf(x[2] - la.m) + expf(x[3] - la.m));
          }
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        Acc b;
        b.m = __shfl_xor_sync(0xffffffffu, la.m, o);
        b.s = __shfl_xor_sync(0xffffffffu, la.s, o);
        b.w = 0.0f;
        la = acc_merge(la, b);
      }
      if (lane == 0) {
        seg_m[warp] = la.m;
        seg_sum[warp] = la.s;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float mx = vt_neg_inf();
      for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, seg_m[w]);
      float total = 0.0f;
      for (int w = 0; w < WARPS; ++w) {
        seg_sum[w] = seg_m[w] == vt_neg_inf() ? 0.0f : seg_sum[w] * expf(seg_m[w] - mx);
        total += seg_sum[w];
      }
      row_m = mx;
      row_s = total;
      const float tgt = p.uniforms[r] * total;
      int own;
      float own_before;
      vt_find_part(seg_sum, 0.0f, tgt, own, own_before);
      owner = own;
      before = own_before;
      target = tgt;
      chosen = -1;
    }
    __syncthreads();
    const float M = row_m;
    a.m = row_m;
    a.s = row_s;
    // The owner segment in WARPS sub-segments (whole 128-token tiles): every warp sums one
    // (exp(x - M), the walk's terms), thread 0 finds the one the target falls in, and only that
    // one is walked token by token.
    const long long olo = owner * seg, ohi = min(V, olo + seg);
    const long long sub = ((ohi - olo + WARPS - 1) / WARPS + 127) / 128 * 128;
    __shared__ float sub_sum[WARPS];
    __shared__ int sub_owner;
    __shared__ float sub_before;
    {
      const long long lo = min(ohi, olo + warp * sub), hi = min(ohi, lo + sub);
      float ls = 0.0f;
      for (long long base = lo; base < hi; base += 128) {
        const long long v0 = base + lane * 4;
        for (int k = 0; k < 4; ++k) {
          const long long v = v0 + k;
          if (v < hi) ls += expf(vt_scaled(row[v], t) - M);
        }
      }
      for (int o = 16; o > 0; o >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);
      if (lane == 0) sub_sum[warp] = ls;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int own;
      float own_before;
      vt_find_part(sub_sum, before, target, own, own_before);
      sub_owner = own;
      sub_before = own_before;
    }
    __syncthreads();
    if (warp == sub_owner) {
      const long long lo = min(ohi, olo + warp * sub), hi = min(ohi, lo + sub);
      float running = sub_before;
      long long last_nz = -1;
      bool found = false;
      for (long long base = lo; base < hi && !found; base += 128) {
        const long long v0 = base + lane * 4;
        float e[4];
        float ls = 0.0f;
        for (int k = 0; k < 4; ++k) {
          const long long v = v0 + k;
          e[k] = v < hi ? expf(vt_scaled(row[v], t) - M) : 0.0f;
          if (e[k] > 0.0f) last_nz = v;
          ls += e[k];
        }
        float incl = ls;
        for (int o = 1; o < 32; o <<= 1) {
          const float n = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += n;
        }
        const float tile = __shfl_sync(0xffffffffu, incl, 31);
        if (running + tile > target) {
          const unsigned hit = __ballot_sync(0xffffffffu, running + incl > target);
          const int l = __ffs(hit) - 1;
          if (lane == l) {
            float c = running + (incl - ls);
            long long pick = -1, nz = -1;
            for (int k = 0; k < 4; ++k) {
              if (e[k] > 0.0f) nz = v0 + k;
              c += e[k];
              if (pick < 0 && c > target && e[k] > 0.0f) pick = v0 + k;
            }
            chosen = pick >= 0 ? pick : nz;
          }
          found = true;
        }
        running += tile;
      }
      __syncwarp();
      if (!found || chosen < 0) {
        // Rounding left the target past this segment's walk: its last token with mass.
        for (int o = 16; o > 0; o >>= 1) {
          const long long n = __shfl_xor_sync(0xffffffffu, last_nz, o);
          if (n > last_nz) last_nz = n;
        }
        if (lane == 0 && chosen < 0) chosen = last_nz < 0 ? lo : last_nz;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    p.tokens[r] = chosen;
    if (p.out_lp != nullptr) p.out_lp[r] = vt_scaled(row[chosen], t) - (a.m + logf(a.s));
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) vt_token_stats(const VtRowParams p) {
  const long long r = blockIdx.x;
  const long long V = p.vocab;
  const float* row = p.logits + r * V;
  const Acc a = row_acc(row, V, p.temperature);
  if (threadIdx.x == 0) {
    const float lse = a.m + logf(a.s);
    const float mean = a.w / a.s;
    const long long tg = p.targets[r];
    p.out_lp[r] = (tg >= 0 && tg < V) ? vt_scaled(row[tg], p.temperature) - lse
                                      : __int_as_float(0x7fc00000);
    if (p.out_ent != nullptr) p.out_ent[r] = lse - mean;
    p.lse[r] = lse;
    p.mean[r] = mean;
  }
}

__device__ __forceinline__ void vt_store(void* base, int dtype, long long i, float g) {
  if (dtype == 0) {
    static_cast<float*>(base)[i] = g;
  } else if (dtype == 1) {
    // round to nearest even (finite values; NaN stays NaN)
    unsigned int u = __float_as_uint(g);
    unsigned short h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      h = 0x7fc0;
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      h = static_cast<unsigned short>(u >> 16);
    }
    static_cast<unsigned short*>(base)[i] = h;
  } else {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(g));
    static_cast<unsigned short*>(base)[i] = h;
  }
}

// Defined with the elementwise kernels below.
__device__ __forceinline__ float vt_round(float g, int dtype);
__device__ __forceinline__ unsigned int vt_pack16(float lo, float hi, int dtype);

extern "C" __global__ void __launch_bounds__(THREADS) vt_token_stats_grad(const VtRowParams p) {
  const long long r = blockIdx.x;
  const long long V = p.vocab;
  const float* row = p.logits + r * V;
  const float t = p.temperature;
  const float lse = p.lse[r], mean = p.mean[r], glp = p.g_lp[r];
  const float gent = p.g_ent != nullptr ? p.g_ent[r] : 0.0f;
  const long long tg = p.targets[r];
  const float inv_t = 1.0f / t;
  if (V % 4 == 0 && V / 4 < 0x7fffffffLL && (reinterpret_cast<unsigned long long>(row) & 15ull) == 0 &&
      (p.grad_dtype == 0 ? (reinterpret_cast<unsigned long long>(p.grad) & 15ull) == 0
                         : (reinterpret_cast<unsigned long long>(p.grad) & 7ull) == 0)) {
    // Four logits per 16-byte load; four gradients per 16-byte (fp32) or 8-byte store.
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int n4 = (int)(V / 4);
    for (int v4 = threadIdx.x; v4 < n4; v4 += THREADS) {
      const float4 x = r4[v4];
      const float xv[4] = {x.x, x.y, x.z, x.w};
      float g[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float xs = vt_scaled(xv[k], t);
        const float pr = expf(xs - lse);
        float gk = -glp * pr - gent * pr * (xs - mean);
        if (4LL * v4 + k == tg) gk += glp;
        g[k] = t == 1.0f ? gk : gk * inv_t;
      }
      const long long o = r * V + 4LL * v4;
      if (p.grad_dtype == 0) {
        *reinterpret_cast<float4*>(static_cast<float*>(p.grad) + o) = make_float4(g[0], g[1], g[2], g[3]);
      } else {
        const int dt = p.grad_dtype;
        uint2 w;
        w.x = vt_pack16(vt_round(g[0], dt), vt_round(g[1], dt), dt);
        w.y = vt_pack16(vt_round(g[2], dt), vt_round(g[3], dt), dt);
        *reinterpret_cast<uint2*>(static_cast<unsigned short*>(p.grad) + o) = w;
      }
    }
    return;
  }
  for (long long v = threadIdx.x; v < V; v += THREADS) {
    const float xs = vt_scaled(row[v], t);
    const float pr = expf(xs - lse);
    float g = -glp * pr - gent * pr * (xs - mean);
    if (v == tg) g += glp;
    vt_store(p.grad, p.grad_dtype, r * V + v, t == 1.0f ? g : g * inv_t);
  }
}

// ---- rotary embedding: x * cos + rotate_half(x) * sin, rounding to the storage dtype after
// every op exactly as the torch op sequence does (mul, neg, mul, add), so the result is
// bit-identical to it; one thread per rotated pair (i, i + D/2).
__device__ __forceinline__ float vt_load(const void* p, int dtype, long long i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const unsigned short h = static_cast<const unsigned short*>(p)[i];
  if (dtype == 1) return __uint_as_float(static_cast<unsigned int>(h) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// Rounds to the storage dtype (and back to float).
__device__ __forceinline__ float vt_round(float g, int dtype) {
  if (dtype == 0) return g;
  if (dtype == 1) {
#if __CUDA_ARCH__ >= 800
    // One instruction; round-to-nearest-even as below (a NaN stays a NaN).
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(g));
    return __uint_as_float(static_cast<unsigned int>(b) << 16);
#else
    unsigned int u = __float_as_uint(g);
    if ((u & 0x7fffffffu) > 0x7f800000u) return g;
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
#endif
  }
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(g));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// silu(gate) * up over the two halves of a fused gate/up projection, rounded as torch's silu
// and mul round (silu in fp32 to the dtype, the product in fp32 to the dtype): bit-identical to
// silu(x[:, :I]) * x[:, I:].
__device__ __forceinline__ float vt_silu_mul1(float g, float u, int dtype) {
  const float s = vt_round(g / (1.0f + expf(-g)), dtype);
  return vt_round(s * u, dtype);
}
__device__ __forceinline__ unsigned int vt_pack16(float lo, float hi, int dtype) {
  unsigned int a, b;
  if (dtype == 1) {
    a = __float_as_uint(lo) >> 16;  // already rounded to bf16 by vt_round
    b = __float_as_uint(hi) >> 16;
  } else {
    unsigned short x, y;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(y) : "f"(hi));
    a = x;
    b = y;
  }
  return a | (b << 16);
}
__device__ __forceinline__ float vt_half16(unsigned int w, int hi, int dtype) {
  const unsigned short h = hi ? (unsigned short)(w >> 16) : (unsigned short)(w & 0xffffu);
  if (dtype == 1) return __uint_as_float(((unsigned int)h) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// One rotated pair (i, i + D/2) per thread. Forward: (x1 c1 - x2 s1, x2 c2 + x1 s2). Backward
// (the vector-Jacobian product of the forward, as autograd computes it through the torch ops:
// g * cos and rotate_half's transpose of g * sin, each rounded, then summed and rounded):
// (g1 c1 + g2 s2, g2 c2 - g1 s1). Index type I: 32-bit where everything fits (instruction-bound
// otherwise).
template <typename I>
__device__ __forceinline__ void vt_rope_body(const VtRopeParams& p) {
  const I half = (I)(p.d / 2), T = (I)p.t, H = (I)p.h;
  const I n = (I)p.b * H * T * half;
  for (I idx = (I)blockIdx.x * 256 + (I)threadIdx.x; idx < n; idx += (I)gridDim.x * 256) {
    const I i = idx % half;
    I rest = idx / half;
    const I t = rest % T;
    rest /= T;
    const I h = rest % H;
    const I b = rest / H;
    const I xo = b * (I)p.sb + h * (I)p.sh + t * (I)p.st;
    const float x1 = vt_load(p.x, p.dtype, xo + i * (I)p.sd);
    const float x2 = vt_load(p.x, p.dtype, xo + (i + half) * (I)p.sd);
    const I co = (b * T + t) * (I)p.d;
    const float c1 = vt_load(p.cos, p.dtype, co + i), c2 = vt_load(p.cos, p.dtype, co + i + half);
    const float s1 = vt_load(p.sin, p.dtype, co + i), s2 = vt_load(p.sin, p.dtype, co + i + half);
    float o1, o2;
    if (p.bwd) {
      o1 = vt_round(__fadd_rn(vt_round(__fmul_rn(x1, c1), p.dtype),
                              vt_round(__fmul_rn(x2, s2), p.dtype)),
                    p.dtype);
      o2 = vt_round(__fadd_rn(vt_round(__fmul_rn(x2, c2), p.dtype),
                              -vt_round(__fmul_rn(x1, s1), p.dtype)),
                    p.dtype);
    } else {
      o1 = vt_round(__fadd_rn(vt_round(__fmul_rn(x1, c1), p.dtype),
                              vt_round(__fmul_rn(-x2, s1), p.dtype)),
                    p.dtype);
      o2 = vt_round(__fadd_rn(vt_round(__fmul_rn(x2, c2), p.dtype),
                              vt_round(__fmul_rn(x1, s2), p.dtype)),
                    p.dtype);
    }
    const I oo = b * (I)p.ob + h * (I)p.oh + t * (I)p.ot;
    vt_store(p.out, p.dtype, oo + i * (I)p.od, o1);
    vt_store(p.out, p.dtype, oo + (i + half) * (I)p.od, o2);
  }
}

// Two neighbouring pairs (i, i + 1 | i + D/2, i + D/2 + 1) per thread through 32-bit loads and
// stores (16-bit dtypes, unit strides along D, even other strides, D % 4 == 0; the host checks),
// the dtype a template argument, 32-bit item arithmetic: an item is (row = b * T + t, head, i).
// Same arithmetic per element as vt_rope_body.
template <int DT>
__device__ __forceinline__ void vt_rope_x2(const VtRopeParams& p) {
  typedef unsigned int u32;
  const u32 half = (u32)(p.d / 2), q2 = half / 2, T = (u32)p.t;
  const u32 per_row = (u32)p.h * q2;
  const u32 n = (u32)p.b * T * per_row;
  const bool pow2 = (q2 & (q2 - 1)) == 0;
  const u32 q2_shift = __ffs(q2) - 1;
  for (u32 idx = blockIdx.x * 256u + threadIdx.x; idx < n; idx += gridDim.x * 256u) {
    const u32 r = idx / per_row, j = idx - r * per_row;
    const u32 h = pow2 ? (j >> q2_shift) : j / q2;
    const u32 i = 2 * (j - h * q2);
    const u32 b = r / T, t = r - b * T;
    const unsigned short* x = static_cast<const unsigned short*>(p.x) +
                              ((long long)b * p.sb + (long long)h * p.sh + (long long)t * p.st) + i;
    const unsigned short* cs = static_cast<const unsigned short*>(p.cos) + (long long)r * p.d + i;
    const unsigned short* sn = static_cast<const unsigned short*>(p.sin) + (long long)r * p.d + i;
    const u32 xa = *reinterpret_cast<const u32*>(x), xb = *reinterpret_cast<const u32*>(x + half);
    const u32 ca = *reinterpret_cast<const u32*>(cs), cb = *reinterpret_cast<const u32*>(cs + half);
    const u32 sa = *reinterpret_cast<const u32*>(sn), sb = *reinterpret_cast<const u32*>(sn + half);
    float o1[2], o2[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x1 = vt_half16(xa, e, DT), x2 = vt_half16(xb, e, DT);
      const float c1 = vt_half16(ca, e, DT), c2 = vt_half16(cb, e, DT);
      const float s1 = vt_half16(sa, e, DT), s2 = vt_half16(sb, e, DT);
      if (p.bwd) {
        o1[e] = vt_round(__fadd_rn(vt_round(__fmul_rn(x1, c1), DT), vt_round(__fmul_rn(x2, s2), DT)),
                         DT);
        o2[e] = vt_round(__fadd_rn(vt_round(__fmul_rn(x2, c2), DT), -vt_round(__fmul_rn(x1, s1), DT)),
                         DT);
      } else {
        o1[e] = vt_round(__fadd_rn(vt_round(__fmul_rn(x1, c1), DT), vt_round(__fmul_rn(-x2, s1), DT)),
                         DT);
        o2[e] = vt_round(__fadd_rn(vt_round(__fmul_rn(x2, c2), DT), vt_round(__fmul_rn(x1, s2), DT)),
                         DT);
      }
    }
    unsigned short* out = static_cast<unsigned short*>(p.out) +
                          ((long long)b * p.ob + (long long)h * p.oh + (long long)t * p.ot) + i;
    *reinterpret_cast<u32*>(out) = vt_pack16(o1[0], o1[1], DT);
    *reinterpret_cast<u32*>(out + half) = vt_pack16(o2[0], o2[1], DT);
  }
}

extern "C" __global__ void __launch_bounds__(256) vt_rope(const VtRopeParams p) {
  if (p.x2) {
    if (p.dtype == 1) {
      vt_rope_x2<1>(p);
    } else {
      vt_rope_x2<2>(p);
    }
    return;
  }
  if (p.small) {
    vt_rope_body<int>(p);
  } else {
    vt_rope_body<long long>(p);
  }
}
template <int DT>
__device__ __forceinline__ void vt_swiglu_vec(const VtSwigluParams& p) {
  const long long per_row = p.inter / 8;
  const long long n = p.rows * per_row;
  // Rows back to back (a training forward's separate gate and up): no row arithmetic.
  const bool flat = p.stride == p.inter && p.ustride == p.inter;
  const bool small = n < 0x40000000LL;
  for (long long idx = blockIdx.x * 256LL + threadIdx.x; idx < n; idx += gridDim.x * 256LL) {
    long long r, c;
    if (flat) {
      r = 0;
      c = idx * 8;
    } else if (small) {
      const unsigned int r32 = (unsigned int)idx / (unsigned int)per_row;
      r = r32;
      c = (idx - r * per_row) * 8;
    } else {
      r = idx / per_row;
      c = (idx - r * per_row) * 8;
    }
    const unsigned short* row = static_cast<const unsigned short*>(p.x) + r * p.stride;
    const unsigned short* urow = static_cast<const unsigned short*>(p.up) + r * p.ustride;
    const uint4 g = *reinterpret_cast<const uint4*>(row + c);
    const uint4 u = *reinterpret_cast<const uint4*>(urow + c);
    const unsigned int gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
    unsigned int ow[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float lo = vt_silu_mul1(vt_half16(gw[j], 0, DT), vt_half16(uw[j], 0, DT),
                                    DT);
      const float hi = vt_silu_mul1(vt_half16(gw[j], 1, DT), vt_half16(uw[j], 1, DT),
                                    DT);
      ow[j] = vt_pack16(lo, hi, DT);
    }
    *reinterpret_cast<uint4*>(static_cast<unsigned short*>(p.out) + r * p.inter + c) =
        make_uint4(ow[0], ow[1], ow[2], ow[3]);
  }
}

extern "C" __global__ void __launch_bounds__(256) vt_swiglu(const VtSwigluParams p) {
  if (p.vec) {
    if (p.dtype == 1) {
      vt_swiglu_vec<1>(p);
    } else {
      vt_swiglu_vec<2>(p);
    }
    return;
  }
  const long long n = p.rows * p.inter;
  for (long long idx = blockIdx.x * 256LL + threadIdx.x; idx < n; idx += gridDim.x * 256LL) {
    const long long r = idx / p.inter, c = idx - r * p.inter;
    const float v = vt_silu_mul1(vt_load(p.x, p.dtype, r * p.stride + c),
                                 vt_load(p.up, p.dtype, r * p.ustride + c), p.dtype);
    vt_store(p.out, p.dtype, idx, v);
  }
}

// The vector-Jacobian product of silu(g) * u for the output gradient go, rounded as autograd
// rounds it through torch's mul and silu backward kernels: du = go * s and dg =
// silu_backward(go * u, g), where s = silu(g) rounded to the dtype (the value mul saw) and
// silu_backward(dy, x) = dy * sig(x) * (1 + x (1 - sig(x))) in fp32, written as torch writes it.
__device__ __forceinline__ void vt_swiglu_bwd1(float go, float g, float u, int dtype, float& dg,
                                               float& du) {
  const float den = 1.0f + expf(-g);  // the same value in silu's forward and its backward
  const float s = vt_round(g / den, dtype);
  du = vt_round(go * s, dtype);
  const float dy = vt_round(go * u, dtype);
  const float sig = 1.0f / den;
  dg = vt_round(dy * sig * (1.0f + g * (1.0f - sig)), dtype);
}

template <int DT>
__device__ __forceinline__ void vt_swiglu_bwd_vec(const VtSwigluBwdParams& p) {
  const long long n8 = p.n / 8;
  for (long long idx = blockIdx.x * 256LL + threadIdx.x; idx < n8; idx += gridDim.x * 256LL) {
    const uint4 o = reinterpret_cast<const uint4*>(p.go)[idx];
    const uint4 g = reinterpret_cast<const uint4*>(p.g)[idx];
    const uint4 u = reinterpret_cast<const uint4*>(p.u)[idx];
    const unsigned int ow[4] = {o.x, o.y, o.z, o.w}, gw[4] = {g.x, g.y, g.z, g.w},
                       uw[4] = {u.x, u.y, u.z, u.w};
    unsigned int dgw[4], duw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float dg0, du0, dg1, du1;
      vt_swiglu_bwd1(vt_half16(ow[j], 0, DT), vt_half16(gw[j], 0, DT),
                     vt_half16(uw[j], 0, DT), DT, dg0, du0);
      vt_swiglu_bwd1(vt_half16(ow[j], 1, DT), vt_half16(gw[j], 1, DT),
                     vt_half16(uw[j], 1, DT), DT, dg1, du1);
      dgw[j] = vt_pack16(dg0, dg1, DT);
      duw[j] = vt_pack16(du0, du1, DT);
    }
    reinterpret_cast<uint4*>(p.dg)[idx] = make_uint4(dgw[0], dgw[1], dgw[2], dgw[3]);
    reinterpret_cast<uint4*>(p.du)[idx] = make_uint4(duw[0], duw[1], duw[2], duw[3]);
  }
}

extern "C" __global__ void __launch_bounds__(256) vt_swiglu_bwd(const VtSwigluBwdParams p) {
  if (p.vec) {
    if (p.dtype == 1) {
      vt_swiglu_bwd_vec<1>(p);
    } else {
      vt_swiglu_bwd_vec<2>(p);
    }
    return;
  }
  for (long long idx = blockIdx.x * 256LL + threadIdx.x; idx < p.n; idx += gridDim.x * 256LL) {
    float dg, du;
    vt_swiglu_bwd1(vt_load(p.go, p.dtype, idx), vt_load(p.g, p.dtype, idx),
                   vt_load(p.u, p.dtype, idx), p.dtype, dg, du);
    vt_store(p.dg, p.dtype, idx, dg);
    vt_store(p.du, p.dtype, idx, du);
  }
}
// A decode step's rotary embedding and KV-cache write in one launch: q rotated into q_out, k
// rotated and v copied into their cache rows. The rotation rounds exactly as vt_rope (and the
// torch ops) do. One thread per rotated pair (i, i + D/2) of a q, k or v head.
// 16-bit dtypes with head_dim % 4 == 0 and even strides: a thread takes two neighbouring pairs
// (i, i + 1 | i + D/2, i + D/2 + 1) through 32-bit loads and stores, the dtype a template
// argument. Same arithmetic per element as the generic loop below.
template <int DT>
__device__ __forceinline__ void vt_rope_store_x2(const VtRopeStoreParams& p) {
  const unsigned int half = (unsigned int)(p.d / 2), q2 = half / 2;
  const unsigned int nq = (unsigned int)p.h, nk = (unsigned int)p.kvh;
  const unsigned int heads = nq + 2 * nk;
  const unsigned int n = (unsigned int)p.s * heads * q2;
  typedef unsigned int u32;
  for (unsigned int idx = blockIdx.x * 256u + threadIdx.x; idx < n; idx += gridDim.x * 256u) {
    const unsigned int rest = idx / q2;
    const unsigned int i = 2 * (idx - rest * q2);
    const unsigned int s32 = rest / heads;
    const unsigned int hh = rest - s32 * heads;
    const long long s = s32;
    if (hh >= nq + nk) {  // v: a plain copy into the cache
      const unsigned int h = hh - nq - nk;
      const u32* src = reinterpret_cast<const u32*>(static_cast<const unsigned short*>(p.v) +
                                                    s * p.sv_s + h * p.sv_h + i);
      u32* dst = reinterpret_cast<u32*>(static_cast<unsigned short*>(p.v_cache) +
                                        (p.slots[s] * p.kvh + h) * p.d + i);
      dst[0] = src[0];
      dst[half / 2] = src[half / 2];
      continue;
    }
    const bool is_q = hh < nq;
    const unsigned int h = is_q ? hh : hh - nq;
    const unsigned short* x = static_cast<const unsigned short*>(is_q ? p.q : p.k) +
                              (is_q ? s * p.sq_s + h * p.sq_h : s * p.sk_s + h * p.sk_h) + i;
    const unsigned short* cs = static_cast<const unsigned short*>(p.cos) + s * p.d + i;
    const unsigned short* sn = static_cast<const unsigned short*>(p.sin) + s * p.d + i;
    const u32 xa = *reinterpret_cast<const u32*>(x), xb = *reinterpret_cast<const u32*>(x + half);
    const u32 ca = *reinterpret_cast<const u32*>(cs), cb = *reinterpret_cast<const u32*>(cs + half);
    const u32 sa = *reinterpret_cast<const u32*>(sn), sb = *reinterpret_cast<const u32*>(sn + half);
    float o1[2], o2[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x1 = vt_half16(xa, e, DT), x2 = vt_half16(xb, e, DT);
      const float c1 = vt_half16(ca, e, DT), c2 = vt_half16(cb, e, DT);
      const float s1 = vt_half16(sa, e, DT), s2 = vt_half16(sb, e, DT);
      o1[e] = vt_round(__fadd_rn(vt_round(__fmul_rn(x1, c1), DT), vt_round(__fmul_rn(-x2, s1), DT)),
                       DT);
      o2[e] = vt_round(__fadd_rn(vt_round(__fmul_rn(x2, c2), DT), vt_round(__fmul_rn(x1, s2), DT)),
                       DT);
    }
    unsigned short* out = static_cast<unsigned short*>(is_q ? p.q_out : p.k_cache) +
                          (is_q ? (s * p.h + h) * p.d : (p.slots[s] * p.kvh + h) * p.d) + i;
    *reinterpret_cast<u32*>(out) = vt_pack16(o1[0], o1[1], DT);
    *reinterpret_cast<u32*>(out + half) = vt_pack16(o2[0], o2[1], DT);
  }
}

// Index arithmetic in 32 bits (the host checks the item count fits): with 64-bit divisions by
// run-time divisors the kernel was instruction-bound (about 12 us at 512 x 16 heads x 128).
extern "C" __global__ void __launch_bounds__(256) vt_rope_store(const VtRopeStoreParams p) {
  if (p.x2) {
    if (p.dtype == 1) {
      vt_rope_store_x2<1>(p);
    } else {
      vt_rope_store_x2<2>(p);
    }
    return;
  }
  const unsigned int half = (unsigned int)(p.d / 2);
  const unsigned int nq = (unsigned int)p.h, nk = (unsigned int)p.kvh;
  const unsigned int heads = nq + 2 * nk;
  const unsigned int n = (unsigned int)p.s * heads * half;
  for (unsigned int idx = blockIdx.x * 256u + threadIdx.x; idx < n; idx += gridDim.x * 256u) {
    const unsigned int rest = idx / half;
    const unsigned int i = idx - rest * half;
    const unsigned int s32 = rest / heads;
    const unsigned int hh = rest - s32 * heads;
    const long long s = s32;
    if (hh >= nq + nk) {  // v: a plain copy into the cache
      const unsigned int h = hh - nq - nk;
      const long long src = s * p.sv_s + h * p.sv_h;
      const long long dst = (p.slots[s] * p.kvh + h) * p.d;
      vt_store(p.v_cache, p.dtype, dst + i, vt_load(p.v, p.dtype, src + i));
      vt_store(p.v_cache, p.dtype, dst + i + half, vt_load(p.v, p.dtype, src + i + half));
      continue;
    }
    const bool is_q = hh < nq;
    const unsigned int h = is_q ? hh : hh - nq;
    const void* x = is_q ? p.q : p.k;
    const long long xo = is_q ? s * p.sq_s + h * p.sq_h : s * p.sk_s + h * p.sk_h;
    const float x1 = vt_load(x, p.dtype, xo + i);
    const float x2 = vt_load(x, p.dtype, xo + i + half);
    const long long co = s * p.d;
    const float c1 = vt_load(p.cos, p.dtype, co + i), c2 = vt_load(p.cos, p.dtype, co + i + half);
    const float s1 = vt_load(p.sin, p.dtype, co + i), s2 = vt_load(p.sin, p.dtype, co + i + half);
    const float o1 = vt_round(__fadd_rn(vt_round(__fmul_rn(x1, c1), p.dtype),
                                        vt_round(__fmul_rn(-x2, s1), p.dtype)),
                              p.dtype);
    const float o2 = vt_round(__fadd_rn(vt_round(__fmul_rn(x2, c2), p.dtype),
                                        vt_round(__fmul_rn(x1, s2), p.dtype)),
                              p.dtype);
    void* out = is_q ? p.q_out : p.k_cache;
    const long long oo = is_q ? (s * p.h + h) * p.d : (p.slots[s] * p.kvh + h) * p.d;
    vt_store(out, p.dtype, oo + i, o1);
    vt_store(out, p.dtype, oo + i + half, o2);
  }
}

// ---- residual add + RMSNorm for forwards without autograd (decode, prefill, log-prob passes):
// per row, sum = x + delta rounded to the dtype (what torch's add writes), then
// out = sum * rsqrt(mean(sum^2) + eps) * w in fp32, rounded once. One block of 256 threads per
// row and a fixed reduction order, so a row's result does not depend on the other rows (decode
// steps and log-prob passes over the same row agree bit for bit).
__device__ __forceinline__ float vt_norm_block_sum(float v) {
  __shared__ float part[8];
  __shared__ float total;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < 8; ++w) t += part[w];
    total = t;
  }
  __syncthreads();
  return total;
}

template <int DT>
__device__ __forceinline__ void vt_add_rms_norm_vec(const VtAddNormParams& p) {
  const long long base = (long long)blockIdx.x * p.hidden;
  const int n8 = p.hidden / 8;
  const unsigned short* x = static_cast<const unsigned short*>(p.x) + base;
  const unsigned short* d = static_cast<const unsigned short*>(p.delta) + base;
  unsigned short* sum = static_cast<unsigned short*>(p.sum) + base;
  const unsigned short* h = p.delta != nullptr ? sum : x;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < n8; c += 256) {
    const uint4 xv = *reinterpret_cast<const uint4*>(x + 8 * c);
    unsigned int xw[4] = {xv.x, xv.y, xv.z, xv.w};
    if (p.delta != nullptr) {
      const uint4 dv = *reinterpret_cast<const uint4*>(d + 8 * c);
      const unsigned int dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float lo = vt_round(vt_half16(xw[j], 0, DT) + vt_half16(dw[j], 0, DT), DT);
        const float hi = vt_round(vt_half16(xw[j], 1, DT) + vt_half16(dw[j], 1, DT), DT);
        xw[j] = vt_pack16(lo, hi, DT);
      }
      *reinterpret_cast<uint4*>(sum + 8 * c) =
          make_uint4(xw[0], xw[1], xw[2], xw[3]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float lo = vt_half16(xw[j], 0, DT), hi = vt_half16(xw[j], 1, DT);
      ss += lo * lo;
      ss += hi * hi;
    }
  }
  const float rstd = rsqrtf(vt_norm_block_sum(ss) / (float)p.hidden + p.eps);
  const unsigned short* w = static_cast<const unsigned short*>(p.weight);
  unsigned short* out = static_cast<unsigned short*>(p.out) + base;
  for (int c = threadIdx.x; c < n8; c += 256) {
    // Each thread reads back the rows' elements it wrote itself.
    const uint4 hv = *reinterpret_cast<const uint4*>(h + 8 * c);
    const uint4 wv = *reinterpret_cast<const uint4*>(w + 8 * c);
    const unsigned int hw[4] = {hv.x, hv.y, hv.z, hv.w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
    unsigned int ow[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float lo = vt_round(vt_half16(hw[j], 0, DT) * rstd * vt_half16(ww[j], 0, DT), DT);
      const float hi = vt_round(vt_half16(hw[j], 1, DT) * rstd * vt_half16(ww[j], 1, DT), DT);
      ow[j] = vt_pack16(lo, hi, DT);
    }
    *reinterpret_cast<uint4*>(out + 8 * c) =
        make_uint4(ow[0], ow[1], ow[2], ow[3]);
  }
}

extern "C" __global__ void __launch_bounds__(256) vt_add_rms_norm(const VtAddNormParams p) {
  if (p.vec) {
    if (p.dtype == 1) {
      vt_add_rms_norm_vec<1>(p);
    } else {
      vt_add_rms_norm_vec<2>(p);
    }
    return;
  }
  // The same arithmetic one element at a time (any hidden size, fp32, unaligned rows). The
  // squares are summed in the vector path's order: per thread, its 8-element chunks in turn.
  const long long base = (long long)blockIdx.x * p.hidden;
  const int H = p.hidden;
  float ss = 0.0f;
  for (int c = threadIdx.x; 8 * c < H; c += 256) {
    for (int j = 0; j < 8 && 8 * c + j < H; ++j) {
      const long long i = base + 8 * c + j;
      float v = vt_load(p.x, p.dtype, i);
      if (p.delta != nullptr) {
        v = vt_round(v + vt_load(p.delta, p.dtype, i), p.dtype);
        vt_store(p.sum, p.dtype, i, v);
      }
      ss += v * v;
    }
  }
  const float rstd = rsqrtf(vt_norm_block_sum(ss) / (float)H + p.eps);
  const void* h = p.delta != nullptr ? p.sum : p.x;
  for (int c = threadIdx.x; 8 * c < H; c += 256) {
    for (int j = 0; j < 8 && 8 * c + j < H; ++j) {
      const long long i = base + 8 * c + j;
      vt_store(p.out, p.dtype, i,
               vt_load(h, p.dtype, i) * rstd * vt_load(p.weight, p.dtype, 8 * c + j));
    }
  }
}
// ---- its backward, for training forwards (AddRmsNormFn): with r = rsqrt(mean(h^2) + eps),
// dh = r w dy - h r^3 mean(w dy h) (+ the gradient arriving at the sum), rounded once, and the
// weight's gradient sum over rows of dy h r, accumulated in fp32 per block (dw_part) and summed
// over blocks by the host. r is recomputed exactly as the forward computed it (same order of
// squares, same block reduction). Each block walks rows blockIdx.x, + gridDim.x, ...; a thread
// keeps its C 8-element chunks (c = threadIdx.x + 256 k) of the weight and of its weight-gradient
// sums in registers across rows.
__device__ __forceinline__ float2 vt_norm_block_sum2(float a, float b) {
  __shared__ float2 part2[8];
  __shared__ float2 total2;
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if ((threadIdx.x & 31) == 0) part2[threadIdx.x >> 5] = make_float2(a, b);
  __syncthreads();
  if (threadIdx.x == 0) {
    float ta = 0.0f, tb = 0.0f;
    for (int w = 0; w < 8; ++w) {
      ta += part2[w].x;
      tb += part2[w].y;
    }
    total2 = make_float2(ta, tb);
  }
  __syncthreads();
  return total2;
}

__device__ __forceinline__ void vt_unpack8(const uint4 v, float* f, int dt) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = vt_half16(w[j], 0, dt);
    f[2 * j + 1] = vt_half16(w[j], 1, dt);
  }
}

template <int DT, int C>
__device__ __forceinline__ void vt_add_rms_norm_bwd_vec(const VtAddNormBwdParams& p) {
  const int n8 = p.hidden / 8;
  const float inv_h = 1.0f / (float)p.hidden;
  float wf[C][8], acc[C][8];
#pragma unroll
  for (int k = 0; k < C; ++k) {
    const int c = threadIdx.x + 256 * k;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[k][j] = 0.0f;
    if (c < n8) {
      vt_unpack8(*reinterpret_cast<const uint4*>(
                     static_cast<const unsigned short*>(p.weight) + 8 * c), wf[k], DT);
    }
  }
  for (long long r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const long long base = r * p.hidden;
    const unsigned short* h = static_cast<const unsigned short*>(p.h) + base;
    const unsigned short* dy = static_cast<const unsigned short*>(p.dy) + base;
    float hf[C][8], gf[C][8];
    float ss = 0.0f, dot = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int c = threadIdx.x + 256 * k;
      if (c < n8) {
        vt_unpack8(*reinterpret_cast<const uint4*>(h + 8 * c), hf[k], DT);
        vt_unpack8(*reinterpret_cast<const uint4*>(dy + 8 * c), gf[k], DT);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          ss += hf[k][j] * hf[k][j];
          dot += wf[k][j] * gf[k][j] * hf[k][j];
        }
      }
    }
    const float2 t = vt_norm_block_sum2(ss, dot);
    const float rstd = rsqrtf(t.x / (float)p.hidden + p.eps);
    const float coef = rstd * rstd * rstd * t.y * inv_h;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int c = threadIdx.x + 256 * k;
      if (c < n8) {
        float add[8];
        if (p.gs != nullptr) {
          vt_unpack8(*reinterpret_cast<const uint4*>(
                         static_cast<const unsigned short*>(p.gs) + base + 8 * c), add, DT);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) add[j] = 0.0f;
        }
        unsigned int ow[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float lo =
              rstd * wf[k][2 * j] * gf[k][2 * j] - hf[k][2 * j] * coef + add[2 * j];
          const float hi = rstd * wf[k][2 * j + 1] * gf[k][2 * j + 1] -
                           hf[k][2 * j + 1] * coef + add[2 * j + 1];
          ow[j] = vt_pack16(vt_round(lo, DT), vt_round(hi, DT), DT);
        }
        *reinterpret_cast<uint4*>(static_cast<unsigned short*>(p.dx) + base + 8 * c) =
            make_uint4(ow[0], ow[1], ow[2], ow[3]);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[k][j] += gf[k][j] * hf[k][j] * rstd;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < C; ++k) {
    const int c = threadIdx.x + 256 * k;
    if (c < n8) {
      float4* out = reinterpret_cast<float4*>(p.dw_part + (long long)blockIdx.x * p.hidden + 8 * c);
      out[0] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
      out[1] = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
    }
  }
}

// One kernel per chunk count (the host picks it from H): one kernel with all three would be
// allocated the registers of the largest and run at a quarter of the occupancy.
#define VT_ADD_NORM_BWD_KERNEL(C)                                                              \
  extern "C" __global__ void __launch_bounds__(256) vt_add_rms_norm_bwd##C(                    \
      const VtAddNormBwdParams p) {                                                            \
    if (p.dtype == 1) {                                                                        \
      vt_add_rms_norm_bwd_vec<1, C>(p);                                                        \
    } else {                                                                                   \
      vt_add_rms_norm_bwd_vec<2, C>(p);                                                        \
    }                                                                                          \
  }
VT_ADD_NORM_BWD_KERNEL(1)
VT_ADD_NORM_BWD_KERNEL(2)
VT_ADD_NORM_BWD_KERNEL(4)

// ---- the backward of a row gather (index_select along dim 0) without atomics: output row n is
// the sum, in fp32 and in the order given, of the gradient rows sources[offsets[n] ..
// offsets[n + 1]] (the positions that read row n), rounded once; rows nobody read get zeros.
// Grid-stride over (row, 8-element chunk) items, or (row, element) items off the vector path.
extern "C" __global__ void __launch_bounds__(256) vt_rows_sum(const VtRowsSumParams p) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  if (p.vec) {
    const long long c8 = p.cols / 8, items = p.rows * c8;
    for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < items;
         it += stride) {
      const long long n = it / c8, c = it - n * c8;
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (long long i = p.offsets[n]; i < p.offsets[n + 1]; ++i) {
        const uint4 v = *reinterpret_cast<const uint4*>(
            static_cast<const unsigned short*>(p.g) + p.sources[i] * p.cols + 8 * c);
        float f[8];
        vt_unpack8(v, f, p.dtype);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += f[j];
      }
      unsigned int ow[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        ow[j] = vt_pack16(vt_round(acc[2 * j], p.dtype), vt_round(acc[2 * j + 1], p.dtype),
                          p.dtype);
      }
      *reinterpret_cast<uint4*>(static_cast<unsigned short*>(p.out) + n * p.cols + 8 * c) =
          make_uint4(ow[0], ow[1], ow[2], ow[3]);
    }
    return;
  }
  const long long items = p.rows * p.cols;
  for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += stride) {
    const long long n = it / p.cols, c = it - n * p.cols;
    float acc = 0.0f;
    for (long long i = p.offsets[n]; i < p.offsets[n + 1]; ++i) {
      acc += vt_load(p.g, p.dtype, p.sources[i] * p.cols + c);
    }
    vt_store(p.out, p.dtype, it, acc);
  }
}

// ---- out += x * s in one pass: x fp32, s one fp32 read from the device (no host sync), the sum
// formed in fp32 and rounded once into out's dtype. Grid-stride over 8-element items (16-bit out,
// 16-byte accesses) or elements.
extern "C" __global__ void __launch_bounds__(256) vt_axpy_into(const VtAxpyParams p) {
  const float s = *p.s;
  const long long stride = (long long)gridDim.x * blockDim.x;
  if (p.vec) {
    const long long items = p.n / 8;
    for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < items;
         it += stride) {
      const float4 a = reinterpret_cast<const float4*>(p.x)[2 * it];
      const float4 b = reinterpret_cast<const float4*>(p.x)[2 * it + 1];
      uint4* o = reinterpret_cast<uint4*>(p.out) + it;
      float f[8];
      vt_unpack8(*o, f, p.dtype);
      const float xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      unsigned int ow[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float lo = __fadd_rn(f[2 * j], __fmul_rn(xs[2 * j], s));
        const float hi = __fadd_rn(f[2 * j + 1], __fmul_rn(xs[2 * j + 1], s));
        ow[j] = vt_pack16(vt_round(lo, p.dtype), vt_round(hi, p.dtype), p.dtype);
      }
      *o = make_uint4(ow[0], ow[1], ow[2], ow[3]);
    }
    return;
  }
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
    vt_store(p.out, p.dtype, i, __fadd_rn(vt_load(p.out, p.dtype, i), __fmul_rn(p.x[i], s)));
  }
}

// ---- column sums of an fp32 [rows, cols] matrix (per-block partial gradients), in a fixed
// order, added into (or written to) out [cols] with one rounding: block (32, 16) takes 32
// columns; thread (c, w) sums rows w, w + 16, ... of its column, then thread (c, 0) adds the 16
// partial sums in order. Deterministic: the same bits on every run.
extern "C" __global__ void __launch_bounds__(512) vt_cols_sum_into(const VtColsSumParams p) {
  __shared__ float sm[16][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.0f;
  if (c < p.cols) {
#pragma unroll 8
    for (long long r = threadIdx.y; r < p.rows; r += 16) acc += p.x[r * p.cols + c];
  }
  sm[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < p.cols) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < 16; ++w) t += sm[w][threadIdx.x];
    if (p.accumulate) t = __fadd_rn(vt_load(p.out, p.dtype, c), t);
    vt_store(p.out, p.dtype, c, t);
  }
}
)VTROW";

const std::string& row_source() {
  static const std::string src = std::string("// verl-rs row kernels\n") +
                                 VT_ROW_STR(VT_ROW_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_ROPE_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_SWIGLU_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_SWIGLU_BWD_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_ROPE_STORE_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_ADD_NORM_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_ADD_NORM_BWD_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_ROWS_SUM_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_AXPY_PARAMS_DEF) + "\n" +
                                 VT_ROW_STR(VT_COLS_SUM_PARAMS_DEF) + "\n" + kRowSource;
  return src;
}

#ifdef VERL_WITH_CUDA

VT_ROW_PARAMS_DEF
VT_ROPE_PARAMS_DEF
VT_SWIGLU_PARAMS_DEF
VT_SWIGLU_BWD_PARAMS_DEF
VT_ROPE_STORE_PARAMS_DEF
VT_ADD_NORM_PARAMS_DEF
VT_ADD_NORM_BWD_PARAMS_DEF
VT_ROWS_SUM_PARAMS_DEF
VT_AXPY_PARAMS_DEF
VT_COLS_SUM_PARAMS_DEF

using namespace vt_rt;

constexpr unsigned kThreads = 512;

struct RowKernels {
  CUfunction_t sample = nullptr;
  CUfunction_t stats = nullptr;
  CUfunction_t grad = nullptr;
  CUfunction_t rope = nullptr;
  CUfunction_t swiglu = nullptr;
  CUfunction_t rope_store = nullptr;
  CUfunction_t swiglu_bwd = nullptr;
  CUfunction_t add_norm = nullptr;
  CUfunction_t add_norm_bwd[3] = {nullptr, nullptr, nullptr};  // 1, 2, 4 chunks per thread
  CUfunction_t rows_sum = nullptr;
  CUfunction_t axpy = nullptr;
  CUfunction_t cols_sum = nullptr;
};

std::map<int, RowKernels> g_row_kernels;  // by device

RowKernels row_kernels(int index, const DeviceInfo& info) {
  {
    std::lock_guard<std::mutex> lock(rt_mutex());
    auto it = g_row_kernels.find(index);
    if (it != g_row_kernels.end()) return it->second;
  }
  const Binary bin = compile_source(row_source(), "verl_row_kernels", {}, info.arch, false);
  const auto fns = load_functions(
      bin, {"vt_sample_rows", "vt_token_stats", "vt_token_stats_grad", "vt_rope", "vt_swiglu",
                "vt_rope_store", "vt_swiglu_bwd", "vt_add_rms_norm", "vt_add_rms_norm_bwd1",
                "vt_add_rms_norm_bwd2", "vt_add_rms_norm_bwd4", "vt_rows_sum", "vt_axpy_into",
                "vt_cols_sum_into"});
  RowKernels k;
  k.sample = fns[0];
  k.stats = fns[1];
  k.grad = fns[2];
  k.rope = fns[3];
  k.swiglu = fns[4];
  k.rope_store = fns[5];
  k.swiglu_bwd = fns[6];
  k.add_norm = fns[7];
  k.add_norm_bwd[0] = fns[8];
  k.add_norm_bwd[1] = fns[9];
  k.add_norm_bwd[2] = fns[10];
  k.rows_sum = fns[11];
  k.axpy = fns[12];
  k.cols_sum = fns[13];
  std::lock_guard<std::mutex> lock(rt_mutex());
  return g_row_kernels.emplace(index, k).first->second;
}

std::string sizes_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

[[noreturn]] void bad(const std::string& what, const std::string& expected,
                      const std::string& found) {
  throw std::invalid_argument("row kernel " + what + ": expected " + expected + ", found " + found);
}

// A contiguous tensor on `device` with `dim` dimensions, `rows` leading size and `kind`.
void check(const at::Tensor* t, const char* name, int64_t dim, int64_t rows,
           c10::ScalarType kind, const at::Device& device) {
  if (t == nullptr || !t->defined()) bad(name, "a tensor", "none");
  if (t->device() != device) bad(std::string(name) + " device", device.str(), t->device().str());
  if (t->dim() != dim || t->size(0) != rows) {
    bad(std::string(name) + " shape", std::to_string(dim) + " dims with " + std::to_string(rows) +
                                          " rows",
        sizes_str(*t));
  }
  if (t->scalar_type() != kind) {
    bad(std::string(name) + " dtype", c10::toString(kind), c10::toString(t->scalar_type()));
  }
  if (!t->is_contiguous()) bad(name, "a contiguous tensor", "a strided one");
}

struct Launch {
  VtRowParams p{};
  int64_t rows = 0;
  int index = 0;
  RowKernels k;
};

Launch prepare(const at::Tensor* logits, double temperature) {
  if (logits == nullptr || !logits->defined() || !logits->is_cuda()) {
    bad("logits", "a CUDA tensor", logits && logits->defined() ? logits->device().str() : "none");
  }
  check(logits, "logits [rows, vocab]", 2, logits->size(0), c10::ScalarType::Float,
        logits->device());
  if (!(temperature > 0.0) || !std::isfinite(temperature)) {
    bad("temperature", "a finite value > 0", std::to_string(temperature));
  }
  if (logits->size(0) > 0x7fffffff) bad("rows", "< 2^31", std::to_string(logits->size(0)));
  Launch l;
  l.rows = logits->size(0);
  l.index = logits->device().index();
  l.p.logits = logits->data_ptr<float>();
  l.p.vocab = logits->size(1);
  l.p.temperature = static_cast<float>(temperature);
  if (l.p.vocab < 1) bad("vocab", ">= 1", std::to_string(l.p.vocab));
  return l;
}

void launch(Launch& l, CUfunction_t fn, const char* what) {
  if (l.rows == 0) return;
  const CudaApi& cu = cuda_checked();
  void* args[] = {&l.p};
  cu_check(cu.cuLaunchKernel(fn, static_cast<unsigned>(l.rows), 1, 1, kThreads, 1, 1, 0,
                             current_stream(l.index), args, nullptr),
           what);
}

void sample(const at::Tensor* logits, const at::Tensor* uniforms, double temperature,
            const at::Tensor* tokens, const at::Tensor* lp) {
  Launch l = prepare(logits, temperature);
  const at::Device dev = logits->device();
  c10::DeviceGuard guard(dev);
  check(tokens, "tokens [rows]", 1, l.rows, c10::ScalarType::Long, dev);
  if (uniforms != nullptr) {
    check(uniforms, "uniforms [rows]", 1, l.rows, c10::ScalarType::Float, dev);
    l.p.uniforms = uniforms->data_ptr<float>();
  }
  if (lp != nullptr) {
    check(lp, "log_probs [rows]", 1, l.rows, c10::ScalarType::Float, dev);
    l.p.out_lp = lp->data_ptr<float>();
  }
  l.p.tokens = reinterpret_cast<long long*>(tokens->data_ptr<int64_t>());
  const DeviceInfo& info = device_info(l.index);
  make_current(info);
  l.k = row_kernels(l.index, info);
  launch(l, l.k.sample, "cuLaunchKernel(vt_sample_rows)");
}

void stats(const at::Tensor* logits, const at::Tensor* targets, double temperature,
           const at::Tensor* lp, const at::Tensor* ent, const at::Tensor* lse,
           const at::Tensor* mean) {
  Launch l = prepare(logits, temperature);
  const at::Device dev = logits->device();
  c10::DeviceGuard guard(dev);
  check(targets, "targets [rows]", 1, l.rows, c10::ScalarType::Long, dev);
  check(lp, "log_probs [rows]", 1, l.rows, c10::ScalarType::Float, dev);
  check(lse, "lse [rows]", 1, l.rows, c10::ScalarType::Float, dev);
  check(mean, "mean [rows]", 1, l.rows, c10::ScalarType::Float, dev);
  if (ent != nullptr) {
    check(ent, "entropy [rows]", 1, l.rows, c10::ScalarType::Float, dev);
    l.p.out_ent = ent->data_ptr<float>();
  }
  l.p.targets = reinterpret_cast<const long long*>(targets->data_ptr<int64_t>());
  l.p.out_lp = lp->data_ptr<float>();
  l.p.lse = lse->data_ptr<float>();
  l.p.mean = mean->data_ptr<float>();
  const DeviceInfo& info = device_info(l.index);
  make_current(info);
  l.k = row_kernels(l.index, info);
  launch(l, l.k.stats, "cuLaunchKernel(vt_token_stats)");
}

void stats_grad(const at::Tensor* logits, const at::Tensor* targets, const at::Tensor* lse,
                const at::Tensor* mean, const at::Tensor* g_lp, const at::Tensor* g_ent,
                double temperature, const at::Tensor* grad) {
  Launch l = prepare(logits, temperature);
  const at::Device dev = logits->device();
  c10::DeviceGuard guard(dev);
  check(targets, "targets [rows]", 1, l.rows, c10::ScalarType::Long, dev);
  check(lse, "lse [rows]", 1, l.rows, c10::ScalarType::Float, dev);
  check(mean, "mean [rows]", 1, l.rows, c10::ScalarType::Float, dev);
  check(g_lp, "g_log_probs [rows]", 1, l.rows, c10::ScalarType::Float, dev);
  if (g_ent != nullptr) {
    check(g_ent, "g_entropy [rows]", 1, l.rows, c10::ScalarType::Float, dev);
    l.p.g_ent = g_ent->data_ptr<float>();
  }
  if (grad == nullptr || !grad->defined()) bad("grad", "a tensor", "none");
  switch (grad->scalar_type()) {
    case c10::ScalarType::Float:
      l.p.grad_dtype = 0;
      break;
    case c10::ScalarType::BFloat16:
      l.p.grad_dtype = 1;
      break;
    case c10::ScalarType::Half:
      l.p.grad_dtype = 2;
      break;
    default:
      bad("grad dtype", "float32, bfloat16 or float16", c10::toString(grad->scalar_type()));
  }
  check(grad, "grad [rows, vocab]", 2, l.rows, grad->scalar_type(), dev);
  if (grad->size(1) != l.p.vocab) bad("grad shape", sizes_str(*logits), sizes_str(*grad));
  l.p.targets = reinterpret_cast<const long long*>(targets->data_ptr<int64_t>());
  l.p.lse = lse->data_ptr<float>();
  l.p.mean = mean->data_ptr<float>();
  l.p.g_lp = g_lp->data_ptr<float>();
  l.p.grad = grad->data_ptr();
  const DeviceInfo& info = device_info(l.index);
  make_current(info);
  l.k = row_kernels(l.index, info);
  launch(l, l.k.grad, "cuLaunchKernel(vt_token_stats_grad)");
}

int storage_code(c10::ScalarType t, const char* what) {
  switch (t) {
    case c10::ScalarType::Float:
      return 0;
    case c10::ScalarType::BFloat16:
      return 1;
    case c10::ScalarType::Half:
      return 2;
    default:
      bad(what, "float32, bfloat16 or float16", c10::toString(t));
  }
}

// x [B, heads, T, head_dim] (any strides) rotated with cos/sin [B, T, head_dim] into `out` (x's
// shape, any strides that do not overlap): the forward, or with `bwd` its vector-Jacobian product.
// Blocks of 256 threads for a grid-stride loop over `items` work items: at most 16 per SM.
int64_t grid_blocks(int64_t items, const DeviceInfo& info) {
  const int64_t cap = static_cast<int64_t>(info.sms) * 16;
  return std::min<int64_t>((items + 255) / 256, cap);
}

// Launches `fn` over `blocks` blocks of 256 threads with the parameter block `p` on device
// `index`'s current stream.
template <typename P>
void launch_blocks(CUfunction_t fn, int64_t blocks, int index, P& p, const char* what) {
  const CudaApi& cu = cuda_checked();
  void* args[] = {&p};
  cu_check(cu.cuLaunchKernel(fn, static_cast<unsigned>(blocks), 1, 1, 256, 1, 1, 0,
                             current_stream(index), args, nullptr),
           what);
}

void rope_launch(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* sin,
                 const at::Tensor* out, bool bwd) {
  if (x == nullptr || !x->defined() || !x->is_cuda()) {
    bad("rope x", "a CUDA tensor", x && x->defined() ? x->device().str() : "none");
  }
  const at::Device dev = x->device();
  if (x->dim() != 4) bad("rope x", "[B, heads, T, head_dim]", sizes_str(*x));
  const int64_t B = x->size(0), H = x->size(1), T = x->size(2), D = x->size(3);
  if (D % 2 != 0) bad("rope head_dim", "an even number", std::to_string(D));
  const int dtype = storage_code(x->scalar_type(), "rope x dtype");
  for (const at::Tensor* t : {cos, sin}) {
    check(t, "rope cos/sin [B, T, head_dim]", 3, B, x->scalar_type(), dev);
    if (t->size(1) != T || t->size(2) != D) {
      bad("rope cos/sin shape", "[" + std::to_string(B) + ", " + std::to_string(T) + ", " +
                                    std::to_string(D) + "]",
          sizes_str(*t));
    }
  }
  if (out == nullptr || !out->defined()) bad("rope out", "a tensor", "none");
  if (out->device() != dev) bad("rope out device", dev.str(), out->device().str());
  if (out->scalar_type() != x->scalar_type()) {
    bad("rope out dtype", c10::toString(x->scalar_type()), c10::toString(out->scalar_type()));
  }
  if (!out->sizes().equals(x->sizes())) bad("rope out shape", sizes_str(*x), sizes_str(*out));
  if (!out->is_non_overlapping_and_dense()) {
    bad("rope out", "a dense tensor (no overlapping elements)", "a strided view");
  }
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtRopeParams p{};
  p.x = x->data_ptr();
  p.out = out->data_ptr();
  p.cos = cos->data_ptr();
  p.sin = sin->data_ptr();
  p.b = B;
  p.h = H;
  p.t = T;
  p.d = D;
  p.sb = x->stride(0);
  p.sh = x->stride(1);
  p.st = x->stride(2);
  p.sd = x->stride(3);
  p.ob = out->stride(0);
  p.oh = out->stride(1);
  p.ot = out->stride(2);
  p.od = out->stride(3);
  p.dtype = dtype;
  p.bwd = bwd ? 1 : 0;
  const int64_t n = B * H * T * (D / 2);
  if (n == 0) return;
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  int64_t blocks = grid_blocks(n, info);
  // 32-bit index arithmetic where the largest index, offset and loop bound fit.
  const auto extent = [](const at::Tensor& t) {
    int64_t e = 1;
    for (int64_t d = 0; d < t.dim(); ++d) e += (t.size(d) - 1) * std::abs(t.stride(d));
    return e;
  };
  const int64_t lim = (int64_t{1} << 31) - blocks * 256 - 1;
  p.small = (n < lim && extent(*x) < lim && extent(*out) < lim && B * T * D < lim) ? 1 : 0;
  const auto even = [](const at::Tensor& t) {
    return t.stride(0) % 2 == 0 && t.stride(1) % 2 == 0 && t.stride(2) % 2 == 0 &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  };
  p.x2 = (p.small && dtype != 0 && D % 4 == 0 && p.sd == 1 && p.od == 1 && even(*x) &&
          even(*out) && reinterpret_cast<uintptr_t>(p.cos) % 4 == 0 &&
          reinterpret_cast<uintptr_t>(p.sin) % 4 == 0)
             ? 1
             : 0;
  if (p.x2) blocks = grid_blocks(n / 2, info);  // half the items: two pairs each
  launch_blocks(k.rope, blocks, index, p, "cuLaunchKernel(vt_rope)");
}

void rope(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* sin,
          const at::Tensor* out) {
  rope_launch(x, cos, sin, out, false);
}

// silu(gate) * up into `out` [rows, I] (contiguous); gate and up [rows, I] with unit stride
// along the last dimension (any row stride).
void swiglu_launch(const at::Tensor& gate, const at::Tensor& up, const at::Tensor* out) {
  const at::Device dev = gate.device();
  const int64_t R = gate.size(0), I = gate.size(1);
  const int dtype = storage_code(gate.scalar_type(), "swiglu x dtype");
  check(out, "swiglu out [rows, intermediate]", 2, R, gate.scalar_type(), dev);
  if (out->size(1) != I) bad("swiglu out shape", "[" + std::to_string(R) + ", " +
                                                      std::to_string(I) + "]", sizes_str(*out));
  if (R == 0 || I == 0) return;
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtSwigluParams p{};
  p.x = gate.data_ptr();
  p.up = up.data_ptr();
  p.out = out->data_ptr();
  p.rows = R;
  p.inter = I;
  p.stride = R > 1 ? gate.stride(0) : I;
  p.ustride = R > 1 ? up.stride(0) : I;
  p.dtype = dtype;
  const auto addr = [](const void* q) { return reinterpret_cast<uintptr_t>(q); };
  p.vec = dtype != 0 && I % 8 == 0 && p.stride % 8 == 0 && p.ustride % 8 == 0 &&
          addr(p.x) % 16 == 0 && addr(p.up) % 16 == 0 && addr(p.out) % 16 == 0;
  const int64_t n = p.vec ? R * (I / 8) : R * I;
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  launch_blocks(k.swiglu, grid_blocks(n, info), index, p, "cuLaunchKernel(vt_swiglu)");
}

// x (+ delta) [rows, H] (contiguous, one dtype) RMS-normalised with weight [H] into `out`; with
// delta, the sum into `sum` first (see vt_add_rms_norm).
void add_rms_norm(const at::Tensor* x, const at::Tensor* delta, const at::Tensor* weight,
                  double eps, const at::Tensor* sum, const at::Tensor* out) {
  if (x == nullptr || !x->defined() || !x->is_cuda()) {
    bad("add_rms_norm x", "a CUDA tensor", x && x->defined() ? x->device().str() : "none");
  }
  const at::Device dev = x->device();
  if (x->dim() != 2) bad("add_rms_norm x", "[rows, hidden]", sizes_str(*x));
  const int64_t R = x->size(0), H = x->size(1);
  const auto kind = x->scalar_type();
  const int dtype = storage_code(kind, "add_rms_norm x dtype");
  check(x, "add_rms_norm x [rows, hidden]", 2, R, kind, dev);
  check(out, "add_rms_norm out [rows, hidden]", 2, R, kind, dev);
  if (out->size(1) != H) bad("add_rms_norm out shape", sizes_str(*x), sizes_str(*out));
  if (weight == nullptr || !weight->defined() || weight->dim() != 1 || weight->size(0) != H ||
      weight->scalar_type() != kind || weight->device() != dev || !weight->is_contiguous()) {
    bad("add_rms_norm weight", "a contiguous [" + std::to_string(H) + "] tensor of x's dtype on " +
                                   dev.str(),
        weight && weight->defined() ? sizes_str(*weight) + " " +
                                          c10::toString(weight->scalar_type()) + " on " +
                                          weight->device().str()
                                    : "none");
  }
  if (delta != nullptr) {
    check(delta, "add_rms_norm delta [rows, hidden]", 2, R, kind, dev);
    check(sum, "add_rms_norm sum [rows, hidden]", 2, R, kind, dev);
    if (delta->size(1) != H || sum->size(1) != H) {
      bad("add_rms_norm delta/sum shape", sizes_str(*x), sizes_str(*delta) + " / " +
                                                              sizes_str(*sum));
    }
  }
  if (!(eps >= 0.0) || !std::isfinite(eps)) bad("add_rms_norm eps", "a finite value >= 0",
                                                std::to_string(eps));
  if (H < 1 || H > 0x7fffffff / 8) bad("add_rms_norm hidden", "1..2^28", std::to_string(H));
  if (R > 0x7fffffff) bad("add_rms_norm rows", "< 2^31", std::to_string(R));
  if (R == 0) return;
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtAddNormParams p{};
  p.x = x->data_ptr();
  p.delta = delta != nullptr ? delta->data_ptr() : nullptr;
  p.weight = weight->data_ptr();
  p.sum = delta != nullptr ? sum->data_ptr() : nullptr;
  p.out = out->data_ptr();
  p.rows = R;
  p.hidden = static_cast<int>(H);
  p.dtype = dtype;
  p.eps = static_cast<float>(eps);
  const auto a16 = [](const void* q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  p.vec = dtype != 0 && H % 8 == 0 && a16(p.x) && a16(p.delta) && a16(p.weight) && a16(p.sum) &&
          a16(p.out);
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  const CudaApi& cu = cuda_checked();
  void* args[] = {&p};
  cu_check(cu.cuLaunchKernel(k.add_norm, static_cast<unsigned>(R), 1, 1, 256, 1, 1, 0,
                             current_stream(index), args, nullptr),
           "cuLaunchKernel(vt_add_rms_norm)");
}

void cols_sum_into(const at::Tensor& x, const at::Tensor& out, bool accumulate);

// The backward of add_rms_norm (see vt_add_rms_norm_bwd): dx [R, H] (h's dtype) of the rows
// `h` [R, H] normalised with `weight` [H], for the gradient `dy` of the normed rows plus `gs`
// (nullable) arriving at the rows themselves, and the weight's gradient (in its dtype). 16-bit
// dtypes, H % 8 == 0 and H <= 8192; every tensor contiguous and 16-byte aligned (the caller
// copies where not). With `grad_into` (the weight's .grad, possibly undefined) the weight's
// gradient is added there instead (made on first use) and the second result is undefined.
std::pair<at::Tensor, at::Tensor> add_rms_norm_bwd(const at::Tensor& dy, const at::Tensor& gs,
                                                   const at::Tensor& h, const at::Tensor& weight,
                                                   double eps, at::Tensor* grad_into = nullptr) {
  const at::Device dev = h.device();
  const int64_t R = h.size(0), H = h.size(1);
  const auto kind = h.scalar_type();
  const int dtype = storage_code(kind, "add_rms_norm backward dtype");
  if (dtype == 0 || H % 8 != 0 || H > 8192) {
    bad("add_rms_norm backward rows", "bf16/fp16 rows of a multiple of 8 up to 8192 elements",
        sizes_str(h) + " " + c10::toString(kind));
  }
  check(&dy, "add_rms_norm backward dy [rows, hidden]", 2, R, kind, dev);
  if (dy.size(1) != H) bad("add_rms_norm backward dy shape", sizes_str(h), sizes_str(dy));
  if (gs.defined()) {
    check(&gs, "add_rms_norm backward sum gradient [rows, hidden]", 2, R, kind, dev);
    if (gs.size(1) != H) bad("add_rms_norm backward sum gradient shape", sizes_str(h),
                             sizes_str(gs));
  }
  at::Tensor dx = at::empty({R, H}, h.options());
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  const DeviceInfo& info = device_info(index);
  // One wave: the blocks that fit an SM at each variant's registers (about 62, 95 and 159).
  const int64_t n8 = H / 8, variant = n8 <= 256 ? 0 : n8 <= 512 ? 1 : 2;
  const int64_t per_sm = variant == 0 ? 4 : variant == 1 ? 2 : 1;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(R, int64_t{info.sms} * per_sm));
  at::Tensor part = at::empty({blocks, H}, h.options().dtype(c10::ScalarType::Float));
  if (R == 0) {
    if (grad_into != nullptr) {
      if (!grad_into->defined()) *grad_into = at::zeros_like(weight);
      return {dx, at::Tensor()};
    }
    return {dx, at::zeros_like(weight)};
  }
  const auto a16 = [](const at::Tensor& t) {
    return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  if (!a16(dy) || !a16(gs) || !a16(h)) {
    bad("add_rms_norm backward", "16-byte aligned rows", "an unaligned tensor");
  }
  // A parameter viewed out of a flat buffer may sit at any offset.
  const at::Tensor w = a16(weight) && weight.is_contiguous() ? weight : weight.contiguous().clone();
  VtAddNormBwdParams p{};
  p.dy = dy.data_ptr();
  p.gs = gs.defined() ? gs.data_ptr() : nullptr;
  p.h = h.data_ptr();
  p.weight = w.data_ptr();
  p.dx = dx.data_ptr();
  p.dw_part = part.data_ptr<float>();
  p.rows = R;
  p.hidden = static_cast<int>(H);
  p.dtype = dtype;
  p.eps = static_cast<float>(eps);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  launch_blocks(k.add_norm_bwd[variant], blocks, index, p,
                "cuLaunchKernel(vt_add_rms_norm_bwd)");
  if (grad_into != nullptr) {
    // The weight's gradient summed straight into its .grad (made here on first use).
    const bool acc = grad_into->defined();
    if (acc && (grad_into->device() != dev || !grad_into->is_contiguous() ||
                grad_into->numel() != H)) {
      bad("add_rms_norm weight .grad", "a contiguous [" + std::to_string(H) + "] tensor on " +
                                           dev.str(),
          sizes_str(*grad_into) + " on " + grad_into->device().str());
    }
    if (!acc) *grad_into = at::empty({H}, weight.options()).view(weight.sizes());
    cols_sum_into(part, *grad_into, acc);
    return {dx, at::Tensor()};
  }
  at::Tensor dw = at::empty({H}, weight.options());
  cols_sum_into(part, dw, false);
  return {dx, dw.view(weight.sizes())};
}

// Row n of the result [N, C] (g's dtype): the sum of g's rows sources[offsets[n] ..
// offsets[n + 1]] (see vt_rows_sum); g [M, C] contiguous, offsets int64 [N + 1], sources int64
// [M], on g's device.
at::Tensor rows_sum(const at::Tensor& g, const at::Tensor& offsets, const at::Tensor& sources) {
  if (!g.is_cuda() || g.dim() != 2) bad("rows_sum gradient", "a CUDA [rows, cols] tensor", sizes_str(g));
  const at::Device dev = g.device();
  const int64_t N = offsets.numel() - 1, C = g.size(1);
  if (N < 0) bad("rows_sum offsets", "int64 [rows + 1]", sizes_str(offsets));
  check(&offsets, "rows_sum offsets [rows + 1]", 1, N + 1, c10::ScalarType::Long, dev);
  check(&sources, "rows_sum sources", 1, sources.size(0), c10::ScalarType::Long, dev);
  if (sources.numel() != g.size(0)) {
    bad("rows_sum sources", "one per gradient row (" + std::to_string(g.size(0)) + ")",
        sizes_str(sources));
  }
  const int dtype = storage_code(g.scalar_type(), "rows_sum dtype");
  const at::Tensor gc = g.contiguous();
  at::Tensor out = at::empty({N, C}, g.options());
  if (N == 0 || C == 0) return out;
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtRowsSumParams p{};
  p.g = gc.data_ptr();
  p.offsets = static_cast<const long long*>(offsets.data_ptr());
  p.sources = static_cast<const long long*>(sources.data_ptr());
  p.out = out.data_ptr();
  p.rows = N;
  p.cols = C;
  p.dtype = dtype;
  p.vec = dtype != 0 && C % 8 == 0 && reinterpret_cast<uintptr_t>(p.g) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  launch_blocks(k.rows_sum, grid_blocks(p.vec ? N * (C / 8) : N * C, info), index, p,
                "cuLaunchKernel(vt_rows_sum)");
  return out;
}

// out += x * s (see vt_axpy_into): `out` contiguous CUDA fp32/bf16/fp16, `x` fp32 contiguous with
// out's element count, `s` a one-element fp32 tensor on out's device.
void axpy_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& s) {
  if (!out.is_cuda() || !out.is_contiguous()) bad("axpy out", "a contiguous CUDA tensor", sizes_str(out));
  const at::Device dev = out.device();
  const int dtype = storage_code(out.scalar_type(), "axpy out dtype");
  if (x.device() != dev || x.scalar_type() != at::kFloat || !x.is_contiguous() ||
      x.numel() != out.numel()) {
    bad("axpy x", "a contiguous fp32 tensor of " + std::to_string(out.numel()) + " elements on " +
                      dev.str(), sizes_str(x) + " " + c10::toString(x.scalar_type()));
  }
  if (s.device() != dev || s.scalar_type() != at::kFloat || s.numel() != 1) {
    bad("axpy scale", "one fp32 element on " + dev.str(), sizes_str(s));
  }
  const int64_t n = out.numel();
  if (n == 0) return;
  const at::Tensor sc = s.contiguous();
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtAxpyParams p{};
  p.x = static_cast<const float*>(x.data_ptr());
  p.s = static_cast<const float*>(sc.data_ptr());
  p.out = out.data_ptr();
  p.n = n;
  p.dtype = dtype;
  p.vec = dtype != 0 && n % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  launch_blocks(k.axpy, grid_blocks(p.vec ? n / 8 : n, info), index, p,
                "cuLaunchKernel(vt_axpy_into)");
}

// out (+)= x.sum(0) (see vt_cols_sum_into): `x` contiguous fp32 [rows, cols] and `out` a
// contiguous CUDA [cols] tensor (fp32/bf16/fp16) on x's device; the sums in a fixed order, in
// fp32, rounded once into out's dtype (with `accumulate`, after adding out's value).
void cols_sum_into(const at::Tensor& x, const at::Tensor& out, bool accumulate) {
  if (!x.is_cuda() || x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous()) {
    bad("cols_sum x", "a contiguous fp32 CUDA [rows, cols] tensor",
        sizes_str(x) + " " + c10::toString(x.scalar_type()));
  }
  const at::Device dev = x.device();
  const int64_t R = x.size(0), C = x.size(1);
  if (out.device() != dev || !out.is_contiguous() || out.numel() != C) {
    bad("cols_sum out", "a contiguous [" + std::to_string(C) + "] tensor on " + dev.str(),
        sizes_str(out) + " on " + out.device().str());
  }
  if (C > (int64_t{1} << 30)) bad("cols_sum columns", "at most 2^30", std::to_string(C));
  const int dtype = storage_code(out.scalar_type(), "cols_sum out dtype");
  if (C == 0) return;
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtColsSumParams p{};
  p.x = static_cast<const float*>(x.data_ptr());
  p.out = out.data_ptr();
  p.rows = R;
  p.cols = static_cast<int>(C);
  p.dtype = dtype;
  p.accumulate = accumulate ? 1 : 0;
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  const CudaApi& cu = cuda_checked();
  void* args[] = {&p};
  cu_check(cu.cuLaunchKernel(k.cols_sum, static_cast<unsigned>((C + 31) / 32), 1, 1, 32, 16, 1, 0,
                             current_stream(index), args, nullptr),
           "cuLaunchKernel(vt_cols_sum_into)");
}

void swiglu(const at::Tensor* x, const at::Tensor* out) {
  if (x == nullptr || !x->defined() || !x->is_cuda()) {
    bad("swiglu x", "a CUDA tensor", x && x->defined() ? x->device().str() : "none");
  }
  if (x->dim() != 2 || x->size(1) % 2 != 0) {
    bad("swiglu x", "[rows, 2 * intermediate]", sizes_str(*x));
  }
  if (x->stride(1) != 1) bad("swiglu x", "unit stride along the last dimension", "a strided one");
  const int64_t I = x->size(1) / 2;
  swiglu_launch(x->narrow(1, 0, I), x->narrow(1, I, I), out);
}

// dg, du (contiguous, go's shape) of silu(g) * u for the output gradient go; all contiguous.
void swiglu_bwd_launch(const at::Tensor& go, const at::Tensor& g, const at::Tensor& u,
                       const at::Tensor& dg, const at::Tensor& du) {
  for (const at::Tensor* t : {&go, &g, &u, &dg, &du}) {
    if (!t->is_contiguous() || !t->sizes().equals(go.sizes()) ||
        t->scalar_type() != go.scalar_type() || t->device() != go.device()) {
      bad("swiglu backward operand", "contiguous tensors of one shape, dtype and device",
          sizes_str(*t) + " " + c10::toString(t->scalar_type()) + " on " + t->device().str());
    }
  }
  const int64_t n = go.numel();
  if (n == 0) return;
  const at::Device dev = go.device();
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtSwigluBwdParams p{};
  p.go = go.data_ptr();
  p.g = g.data_ptr();
  p.u = u.data_ptr();
  p.dg = dg.data_ptr();
  p.du = du.data_ptr();
  p.n = n;
  p.dtype = storage_code(go.scalar_type(), "swiglu backward dtype");
  const auto addr = [](const void* q) { return reinterpret_cast<uintptr_t>(q); };
  p.vec = p.dtype != 0 && n % 8 == 0;
  for (const void* q : {p.go, p.g, p.u, static_cast<const void*>(p.dg),
                        static_cast<const void*>(p.du)}) {
    if (addr(q) % 16 != 0) p.vec = 0;
  }
  const int64_t work = p.vec ? n / 8 : n;
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const RowKernels k = row_kernels(index, info);
  launch_blocks(k.swiglu_bwd, grid_blocks(work, info), index, p, "cuLaunchKernel(vt_swiglu_bwd)");
}

// Autograd functions over the kernels above, for training forwards: each backward is one kernel
// and bit-identical to autograd's backward through the torch ops the forward replaces.

// x [B, heads, T, head_dim] -> rotated, in x's memory layout where x is dense (a transposed view of
// a projection stays one), so the gradient handed back is laid out as x's producer wants it.
// An uninitialised dense tensor of x's shape whose dimensions are laid out in the order of x's
// strides (x's own layout where x is dense; for a slice of a wider projection, the layout that
// slice would have on its own).
at::Tensor empty_in_stride_order(const at::Tensor& x) {
  if (x.is_non_overlapping_and_dense()) return at::empty_like(x);
  std::vector<int64_t> perm(static_cast<size_t>(x.dim()));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(i);
  std::stable_sort(perm.begin(), perm.end(),
                   [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  std::vector<int64_t> sizes, inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    sizes.push_back(x.size(perm[i]));
    inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  }
  return at::empty(sizes, x.options()).permute(inverse);
}

struct RopeFn : public torch::autograd::Function<RopeFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& cos, const at::Tensor& sin) {
    at::Tensor out = empty_in_stride_order(x);
    rope_launch(&x, &cos, &sin, &out, false);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["strides"] = out.strides().vec();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const std::vector<int64_t> strides = ctx->saved_data["strides"].toIntVector();
    at::Tensor dx = at::empty_strided(g.sizes(), strides, g.options());
    rope_launch(&g, &saved[0], &saved[1], &dx, true);
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// silu(gate) * up over two tensors of one shape; saves gate and up (not silu(gate): the backward
// recomputes it, rounded as the forward rounded it).
struct SiluMulFn : public torch::autograd::Function<SiluMulFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up) {
    if (!gate.sizes().equals(up.sizes()) || gate.scalar_type() != up.scalar_type() ||
        gate.device() != up.device() || gate.dim() < 1) {
      bad("silu_mul gate/up", "two tensors of one shape, dtype and device",
          sizes_str(gate) + " and " + sizes_str(up));
    }
    if (!gate.is_cuda()) bad("silu_mul gate", "a CUDA tensor", gate.device().str());
    const at::Tensor g = gate.contiguous(), u = up.contiguous();
    const int64_t I = g.size(-1), R = I == 0 ? 0 : g.numel() / I;
    at::Tensor out = at::empty(g.sizes(), g.options());
    const at::Tensor out2 = out.view({R, I});
    swiglu_launch(g.view({R, I}), u.view({R, I}), &out2);
    ctx->save_for_backward({g, u});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor go = grads[0].contiguous();
    at::Tensor dg = at::empty(saved[0].sizes(), saved[0].options());
    at::Tensor du = at::empty(saved[1].sizes(), saved[1].options());
    swiglu_bwd_launch(go, saved[0], saved[1], dg, du);
    return {dg, du};
  }
};

// `t` as contiguous [R, H] rows at a 16-byte aligned address (a copy where it is not); undefined
// stays undefined.
at::Tensor aligned_rows(const at::Tensor& t, int64_t R, int64_t H) {
  if (!t.defined()) return t;
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c.view({R, H});
}

// x (+ delta) -> (the sum, its RMSNorm), as vt_add_rms_norm computes them, for training
// forwards: saves the normalised rows and the weight; the backward is one kernel over the rows
// (vt_add_rms_norm_bwd) plus a sum over its per-block weight-gradient shares. Without delta the
// result is the norm alone (autograd records no undefined input: the caller then passes x in
// delta's place and has_delta false). The gradient reaching the sum and the one through the norm
// are added in fp32 and rounded once; x and delta get the same gradient.
struct AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& delta_in,
                                                const at::Tensor& weight, double eps,
                                                bool has_delta, bool into_grad) {
    const at::Tensor delta = has_delta ? delta_in : at::Tensor();
    if (!x.is_cuda()) bad("add_rms_norm x", "a CUDA tensor", x.device().str());
    if (x.dim() < 1) bad("add_rms_norm x", "[.., hidden]", sizes_str(x));
    const int64_t H = x.size(-1), R = H == 0 ? 0 : x.numel() / H;
    if (delta.defined() && !delta.sizes().equals(x.sizes())) {
      bad("add_rms_norm delta", "x's shape " + sizes_str(x), sizes_str(delta));
    }
    const at::Tensor x2 = aligned_rows(x, R, H);
    const at::Tensor d2 = aligned_rows(delta, R, H);
    at::Tensor out = at::empty(x.sizes(), x.options());
    at::Tensor sum = delta.defined() ? at::empty(x.sizes(), x.options()) : at::Tensor();
    const at::Tensor out2 = out.view({R, H});
    const at::Tensor sum2 = delta.defined() ? sum.view({R, H}) : at::Tensor();
    add_rms_norm(&x2, delta.defined() ? &d2 : nullptr, &weight, eps,
                 delta.defined() ? &sum2 : nullptr, &out2);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({delta.defined() ? sum2 : x2, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_delta"] = delta.defined();
    // The parameter itself (not a saved-variable copy): the backward writes its .grad.
    if (into_grad) ctx->saved_data["w"] = weight;
    if (delta.defined()) return {sum, out};
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool has_delta = ctx->saved_data["has_delta"].toBool();
    const at::Tensor gs = has_delta ? grads[0] : at::Tensor();
    const at::Tensor dy = grads[has_delta ? 1 : 0];
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& h = saved[0];
    const int64_t R = h.size(0), H = h.size(1);
    if (!dy.defined()) {
      // Only the sum was used: it passes its gradient through to both inputs.
      return {gs, has_delta ? gs : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor()};
    }
    const at::Tensor& shape_of = grads[has_delta ? 1 : 0];
    at::Tensor* grad_into = nullptr;
    at::Tensor w;
    if (ctx->saved_data.count("w") != 0) {
      w = ctx->saved_data["w"].toTensor();
      if (w.requires_grad()) grad_into = &w.mutable_grad();
    }
    auto [dx, dw] = add_rms_norm_bwd(aligned_rows(dy, R, H), aligned_rows(gs, R, H), h, saved[1],
                                     ctx->saved_data["eps"].toDouble(), grad_into);
    dx = dx.view(shape_of.sizes());
    return {dx, has_delta ? dx : at::Tensor(), dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// x.index_select(0, index) whose backward sums the gradient rows that read each row of x with
// vt_rows_sum (no atomics, fp32 sums rounded once) instead of index_add_: `offsets` int64
// [x rows + 1] and `sources` int64 [index rows] list, for each row of x, the positions of index
// that name it (the caller builds them once per layout).
struct GatherRowsFn : public torch::autograd::Function<GatherRowsFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& index, const at::Tensor& offsets,
                            const at::Tensor& sources) {
    if (!x.is_cuda() || x.dim() < 1) bad("gather_rows x", "a CUDA tensor [rows, ..]", sizes_str(x));
    if (offsets.numel() != x.size(0) + 1) {
      bad("gather_rows offsets", "int64 [" + std::to_string(x.size(0) + 1) + "] (x's rows + 1)",
          sizes_str(offsets));
    }
    if (sources.numel() != index.numel()) {
      bad("gather_rows sources", "one per index entry (" + std::to_string(index.numel()) + ")",
          sizes_str(sources));
    }
    ctx->save_for_backward({offsets, sources});
    ctx->saved_data["sizes"] = x.sizes().vec();
    ctx->set_materialize_grads(false);
    return x.index_select(0, index);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t M = g.size(0), C = M == 0 ? 0 : g.numel() / M;
    at::Tensor dx = rows_sum(g.contiguous().view({M, C}), saved[0], saved[1]);
    return {dx.view(sizes), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A tensor equal to `value` whose backward hands precomputed gradients to two inputs: `ga * g`
// to `a` and `gb * g` to `b` (g the gradient arriving at the result, a scalar for a scalar
// value), each computed in their dtype (fp32 for an fp32 gradient) and written in the input's
// dtype in one pass. An undefined `ga`/`gb` gives that input no gradient. b's gradient may
// instead come as a product, `gb = lhs^T rhs` (lhs [K, b rows], rhs [K, b cols]): the GEMM then
// runs in the backward, scaled by g on the device, and lhs/rhs are released right after it.
// With `b_into_grad` (b a leaf), b's gradient goes straight into b.grad instead (added in one
// pass where it exists, written there where it does not; a product is one GEMM accumulating into
// b.grad) and autograd gets none for b: no gradient tensor of b's size for autograd's
// accumulation to add in a second pass.
struct InjectFn : public torch::autograd::Function<InjectFn> {
  // `ga`/`gb`/`lhs`/`rhs` are tensors or None: not autograd inputs (libtorch's custom functions
  // cannot take an undefined tensor as one).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& a, const at::Tensor& b, const c10::IValue& ga_v,
                            const c10::IValue& gb_v, const c10::IValue& lhs_v,
                            const c10::IValue& rhs_v, bool b_into_grad) {
    const at::Tensor ga = ga_v.isTensor() ? ga_v.toTensor() : at::Tensor();
    const at::Tensor gb = gb_v.isTensor() ? gb_v.toTensor() : at::Tensor();
    const at::Tensor lhs = lhs_v.isTensor() ? lhs_v.toTensor() : at::Tensor();
    const at::Tensor rhs = rhs_v.isTensor() ? rhs_v.toTensor() : at::Tensor();
    for (const auto& [x, gx, name] :
         {std::tuple<const at::Tensor&, const at::Tensor&, const char*>{a, ga, "a"},
          std::tuple<const at::Tensor&, const at::Tensor&, const char*>{b, gb, "b"}}) {
      if (gx.defined() && (!x.defined() || !gx.sizes().equals(x.sizes()))) {
        bad(std::string("inject_grads gradient of ") + name,
            x.defined() ? sizes_str(x) : std::string("a defined input"), sizes_str(gx));
      }
    }
    if (lhs.defined() != rhs.defined() || (lhs.defined() && gb.defined())) {
      bad("inject_grads gradient of b", "a tensor or the two factors of a product",
          "a mix of them");
    }
    if (lhs.defined()) {
      if (lhs.dim() != 2 || rhs.dim() != 2 || b.dim() != 2 || lhs.size(0) != rhs.size(0) ||
          lhs.size(1) != b.size(0) || rhs.size(1) != b.size(1)) {
        bad("inject_grads product lhs^T rhs for b " + sizes_str(b),
            "lhs [K, " + std::to_string(b.dim() == 2 ? b.size(0) : -1) + "] and rhs [K, " +
                std::to_string(b.dim() == 2 ? b.size(1) : -1) + "]",
            sizes_str(lhs) + " and " + sizes_str(rhs));
      }
      if (lhs.scalar_type() != rhs.scalar_type() || lhs.device() != b.device() ||
          rhs.device() != b.device()) {
        bad("inject_grads product factors", "one dtype, on b's device",
            std::string(c10::toString(lhs.scalar_type())) + " on " + lhs.device().str() +
                " and " + c10::toString(rhs.scalar_type()) + " on " + rhs.device().str());
      }
    }
    if (b_into_grad && !(b.defined() && b.is_leaf() && b.requires_grad())) {
      bad("inject_grads b (into its .grad)", "a leaf that requires grad", "another tensor");
    }
    ctx->saved_data["ga"] = ga;
    ctx->saved_data["gb"] = gb;
    ctx->saved_data["gb_lhs"] = lhs;
    ctx->saved_data["gb_rhs"] = rhs;
    ctx->saved_data["a_kind"] = static_cast<int64_t>(a.defined() ? a.scalar_type() : ga.scalar_type());
    ctx->saved_data["b_kind"] = static_cast<int64_t>(b.defined() ? b.scalar_type() : gb.scalar_type());
    // The leaf itself (not a saved-variable copy): backward writes its .grad.
    if (b_into_grad) ctx->saved_data["b_leaf"] = b;
    return value.clone();
  }

  // grad += x * s in grad's dtype, one rounding (x of grad's shape, s a one-element tensor).
  static void add_scaled_into(at::Tensor& grad, const at::Tensor& x, const at::Tensor& s) {
    const at::Tensor gs = s.to(x.scalar_type());
    if (grad.is_cuda() && grad.is_contiguous() && x.scalar_type() == at::kFloat &&
        x.is_contiguous() && gs.device() == grad.device()) {
      axpy_into(grad, x, gs);  // one pass, no temporaries, one rounding
      return;
    }
    // In row blocks: libtorch's mixed-dtype in-place op makes a temporary of the block in the
    // computation's dtype (fp32) and copies it back.
    if (grad.dim() == 0) {
      grad.addcmul_(x, gs);
      return;
    }
    const int64_t rows = grad.size(0);
    const int64_t per_row = rows == 0 ? 1 : std::max<int64_t>(1, grad.numel() / rows);
    const int64_t block = std::max<int64_t>(1, (int64_t{1} << 22) / per_row);
    for (int64_t r = 0; r < rows; r += block) {
      const int64_t n = std::min(block, rows - r);
      grad.narrow(0, r, n).addcmul_(x.narrow(0, r, n), gs);
    }
  }

  // lhs^T rhs in fp32 (16-bit operands accumulate in fp32 inside one GEMM on CUDA).
  static at::Tensor product_fp32(const at::Tensor& lhs, const at::Tensor& rhs) {
    if (lhs.is_cuda() && lhs.scalar_type() != at::kFloat && lhs.scalar_type() != at::kDouble) {
      return at::mm(lhs.t(), rhs, at::kFloat);
    }
    return at::mm(lhs.t().to(at::kFloat), rhs.to(at::kFloat));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    const auto saved = [&](const char* key) -> at::Tensor {
      const c10::IValue& v = ctx->saved_data[key];
      return v.isTensor() ? v.toTensor() : at::Tensor();
    };
    const auto scaled = [&](const char* key, const char* kind_key) -> at::Tensor {
      const at::Tensor gx = saved(key);
      if (!gx.defined() || !g.defined()) return at::Tensor();
      const auto kind = static_cast<c10::ScalarType>(ctx->saved_data[kind_key].toInt());
      at::Tensor out = at::empty(gx.sizes(), gx.options().dtype(kind));
      at::mul_out(out, gx, g.to(gx.scalar_type()));
      return out;
    };
    const at::Tensor lhs = saved("gb_lhs"), rhs = saved("gb_rhs");
    // The product's factors (the LM head's [tokens, vocab] logits gradient) are not needed past
    // this node: released now, not when the graph goes.
    ctx->saved_data["gb_lhs"] = c10::IValue();
    ctx->saved_data["gb_rhs"] = c10::IValue();
    const bool into = ctx->saved_data.count("b_leaf") != 0;
    at::Tensor gb_out;
    if (lhs.defined() && g.defined()) {
      const at::Tensor gf = g.to(at::kFloat).reshape({1});
      if (into) {
        at::Tensor leaf = ctx->saved_data["b_leaf"].toTensor();
        at::Tensor& grad = leaf.mutable_grad();
        if (!grad.defined()) grad = at::zeros(leaf.sizes(), leaf.options());
        // (alpha, beta) = (g, 1), read by the GEMM on the device.
        at::Tensor ab = at::ones({2}, gf.options());
        ab.narrow(0, 0, 1).copy_(gf);
        if (!vt_lt::grad_into(grad, lhs, rhs, ab)) {
          add_scaled_into(grad, product_fp32(lhs, rhs), gf);
        }
      } else {
        const auto kind = static_cast<c10::ScalarType>(ctx->saved_data["b_kind"].toInt());
        gb_out = product_fp32(lhs, rhs).mul_(gf).to(kind);
      }
    } else if (into) {
      const at::Tensor gb = saved("gb");
      if (gb.defined() && g.defined()) {
        at::Tensor leaf = ctx->saved_data["b_leaf"].toTensor();
        at::Tensor& grad = leaf.mutable_grad();
        if (grad.defined()) {
          add_scaled_into(grad, gb, g);
        } else {
          grad = at::empty(gb.sizes(), gb.options().dtype(leaf.scalar_type()));
          at::mul_out(grad, gb, g.to(gb.scalar_type()));
        }
      }
    } else {
      gb_out = scaled("gb", "b_kind");
    }
    return {at::Tensor(), scaled("ga", "a_kind"), gb_out, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// [S, n, D] with unit stride along D (any other strides).
void check_heads(const at::Tensor* t, const char* name, int64_t S, int64_t D,
                 c10::ScalarType kind, const at::Device& dev) {
  if (t == nullptr || !t->defined()) bad(name, "a tensor", "none");
  if (t->device() != dev) bad(std::string(name) + " device", dev.str(), t->device().str());
  if (t->dim() != 3 || t->size(0) != S || t->size(2) != D) {
    bad(std::string(name) + " shape", "[" + std::to_string(S) + ", heads, " + std::to_string(D) + "]",
        sizes_str(*t));
  }
  if (t->scalar_type() != kind) {
    bad(std::string(name) + " dtype", c10::toString(kind), c10::toString(t->scalar_type()));
  }
  if (t->stride(2) != 1) bad(name, "unit stride along head_dim", "a strided one");
}

void rope_store(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                const at::Tensor* cos, const at::Tensor* sin, const at::Tensor* slots,
                const at::Tensor* k_cache, const at::Tensor* v_cache, const at::Tensor* q_out) {
  if (q == nullptr || !q->defined() || !q->is_cuda()) {
    bad("rope_store q", "a CUDA tensor", q && q->defined() ? q->device().str() : "none");
  }
  const at::Device dev = q->device();
  if (q->dim() != 3) bad("rope_store q", "[S, heads, head_dim]", sizes_str(*q));
  const int64_t S = q->size(0), H = q->size(1), D = q->size(2);
  if (D % 2 != 0) bad("rope_store head_dim", "an even number", std::to_string(D));
  const auto kind = q->scalar_type();
  const int dtype = storage_code(kind, "rope_store q dtype");
  check_heads(q, "rope_store q", S, D, kind, dev);
  check_heads(k, "rope_store k", S, D, kind, dev);
  check_heads(v, "rope_store v", S, D, kind, dev);
  const int64_t KVH = k->size(1);
  if (v->size(1) != KVH) bad("rope_store v heads", std::to_string(KVH), sizes_str(*v));
  for (const at::Tensor* t : {cos, sin}) {
    check(t, "rope_store cos/sin [S, head_dim]", 2, S, kind, dev);
    if (t->size(1) != D) bad("rope_store cos/sin shape", "[S, " + std::to_string(D) + "]",
                             sizes_str(*t));
  }
  check(slots, "rope_store slots [S]", 1, S, c10::ScalarType::Long, dev);
  for (const at::Tensor* t : {k_cache, v_cache}) {
    if (t == nullptr || !t->defined()) bad("rope_store cache", "a tensor", "none");
    check(t, "rope_store k/v cache [rows, kv_heads, head_dim]", 3, t->size(0), kind, dev);
    if (t->size(1) != KVH || t->size(2) != D) {
      bad("rope_store cache shape", "[rows, " + std::to_string(KVH) + ", " + std::to_string(D) + "]",
          sizes_str(*t));
    }
  }
  check(q_out, "rope_store q_out [S, heads, head_dim]", 3, S, kind, dev);
  if (!q_out->sizes().equals(q->sizes())) bad("rope_store q_out shape", sizes_str(*q),
                                              sizes_str(*q_out));
  c10::DeviceGuard guard(dev);
  const int index = dev.index();
  VtRopeStoreParams p{};
  p.q = q->data_ptr();
  p.k = k->data_ptr();
  p.v = v->data_ptr();
  p.cos = cos->data_ptr();
  p.sin = sin->data_ptr();
  p.slots = reinterpret_cast<const long long*>(slots->data_ptr<int64_t>());
  p.q_out = q_out->data_ptr();
  p.k_cache = k_cache->data_ptr();
  p.v_cache = v_cache->data_ptr();
  p.sq_s = q->stride(0);
  p.sq_h = q->stride(1);
  p.sk_s = k->stride(0);
  p.sk_h = k->stride(1);
  p.sv_s = v->stride(0);
  p.sv_h = v->stride(1);
  p.s = S;
  p.h = H;
  p.kvh = KVH;
  p.d = D;
  p.dtype = dtype;
  const auto even = [](int64_t x) { return x % 2 == 0; };
  const auto addr4 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 4 == 0; };
  p.x2 = dtype != 0 && D % 4 == 0 && even(p.sq_s) && even(p.sq_h) && even(p.sk_s) &&
                 even(p.sk_h) && even(p.sv_s) && even(p.sv_h) && addr4(p.q) && addr4(p.k) &&
                 addr4(p.v) && addr4(p.cos) && addr4(p.sin) && addr4(p.q_out) &&
                 addr4(p.k_cache) && addr4(p.v_cache)
             ? 1
             : 0;
  const int64_t n = S * (H + 2 * KVH) * (D / 2) / (p.x2 ? 2 : 1);
  if (n == 0) return;
  const DeviceInfo& info = device_info(index);
  const int64_t blocks = grid_blocks(n, info);
  // The kernel indexes in 32 bits: the last index plus one grid stride must stay below 2^32.
  if (n + blocks * 256 >= (int64_t{1} << 32)) {
    bad("rope_store sequences x heads x head_dim / 2", "< 2^32 - grid", std::to_string(n));
  }
  make_current(info);
  const RowKernels kern = row_kernels(index, info);
  launch_blocks(kern.rope_store, blocks, index, p, "cuLaunchKernel(vt_rope_store)");
}

// A new event (driver API, no timing) recorded on `stream` of device `index`; the caller owns it.
void* record_event(int index, CUstream_t stream) {
  make_current(device_info(index));
  const CudaApi& cu = cuda_checked();
  void* ev = nullptr;
  cu_check(cu.cuEventCreate(&ev, 2 /* CU_EVENT_DISABLE_TIMING */), "cuEventCreate");
  const CUresult_t r = cu.cuEventRecord(ev, stream);
  if (r != 0) {
    cu.cuEventDestroy(ev);
    cu_check(r, "cuEventRecord");
  }
  return ev;
}

// Stream `waiter` of device `index` waits (on the device) for the work queued so far on `source`.
void stream_waits_for(int index, CUstream_t waiter, CUstream_t source) {
  void* ev = record_event(index, source);
  const CudaApi& cu = cuda_checked();
  const CUresult_t r = cu.cuStreamWaitEvent(waiter, ev, 0);
  cu.cuEventDestroy(ev);  // released once the wait is done
  cu_check(r, "cuStreamWaitEvent");
}

#endif  // VERL_WITH_CUDA

[[noreturn]] void no_cuda() {
  throw std::runtime_error("row kernels: this build of the torch extension has no CUDA");
}

}  // namespace

extern "C" {

const char* vt_row_kernels_source() { return row_source().c_str(); }

// Compiles the row kernels for compute capability `arch` without a GPU; `*log` (nullable; free
// with vt_free_error) receives NVRTC's log with ptxas' register/spill report.
char* vt_row_kernels_compile_check(int arch, char** log) {
  if (log != nullptr) *log = nullptr;
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    const Binary bin = compile_source(row_source(), "verl_row_kernels", {}, arch, true);
    if (log != nullptr) {
      *log = vt_util::error_string("target " + bin.target + ", " + std::to_string(bin.image.size()) +
                              " bytes\n" + bin.log);
    }
#else
    (void)arch;
    no_cuda();
#endif
  });
}

// The compute capability of CUDA device `index` as major * 10 + minor (e.g. 90).
char* vt_cuda_arch(int index, int* arch) {
  return vt_util::guarded([&] {
    if (arch == nullptr) throw std::invalid_argument("cuda_arch: null output");
    *arch = 0;
#ifdef VERL_WITH_CUDA
    *arch = device_info(index).arch;
#else
    (void)index;
    no_cuda();
#endif
  });
}

char* vt_sample_rows(at::Tensor* logits, at::Tensor* uniforms, double temperature,
                     at::Tensor* tokens, at::Tensor* log_probs) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    sample(logits, uniforms, temperature, tokens, log_probs);
#else
    (void)logits, (void)uniforms, (void)temperature, (void)tokens, (void)log_probs;
    no_cuda();
#endif
  });
}

char* vt_token_stats(at::Tensor* logits, at::Tensor* targets, double temperature,
                     at::Tensor* log_probs, at::Tensor* entropy, at::Tensor* lse,
                     at::Tensor* mean) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    stats(logits, targets, temperature, log_probs, entropy, lse, mean);
#else
    (void)logits, (void)targets, (void)temperature, (void)log_probs, (void)entropy, (void)lse,
        (void)mean;
    no_cuda();
#endif
  });
}

char* vt_token_stats_grad(at::Tensor* logits, at::Tensor* targets, at::Tensor* lse,
                          at::Tensor* mean, at::Tensor* g_log_probs, at::Tensor* g_entropy,
                          double temperature, at::Tensor* grad) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    stats_grad(logits, targets, lse, mean, g_log_probs, g_entropy, temperature, grad);
#else
    (void)logits, (void)targets, (void)lse, (void)mean, (void)g_log_probs, (void)g_entropy,
        (void)temperature, (void)grad;
    no_cuda();
#endif
  });
}

// Rotary embedding of `x` [B, heads, T, head_dim] (any strides) with `cos`/`sin` [B, T,
// head_dim] (x's dtype, contiguous) into `out` (x's shape, dense, its dimensions in any order):
// bit-identical to x * cos + rotate_half(x) * sin in torch ops.
char* vt_rope(at::Tensor* x, at::Tensor* cos, at::Tensor* sin, at::Tensor* out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    rope(x, cos, sin, out);
#else
    (void)x, (void)cos, (void)sin, (void)out;
    no_cuda();
#endif
  });
}

// silu(x[:, :I]) * x[:, I:] of `x` [rows, 2 I] (unit stride along the last dimension) into
// `out` [rows, I] (contiguous), bit-identical to those torch ops.
char* vt_swiglu(at::Tensor* x, at::Tensor* out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    swiglu(x, out);
#else
    (void)x, (void)out;
    no_cuda();
#endif
  });
}

// RMSNorm of x [rows, hidden] (or of x + delta, written into `sum`; delta and sum nullable
// together) with `weight` [hidden] into `out`: one kernel, each row on its own (see
// vt_add_rms_norm). CUDA, no autograd.
char* vt_add_rms_norm(at::Tensor* x, at::Tensor* delta, at::Tensor* weight, double eps,
                      at::Tensor* sum, at::Tensor* out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    add_rms_norm(x, delta, weight, eps, sum, out);
#else
    (void)x, (void)delta, (void)weight, (void)eps, (void)sum, (void)out;
    no_cuda();
#endif
  });
}

// A decode step's rotary embedding and KV-cache write: `q` [S, H, D] rotated into `q_out`
// (contiguous), `k` [S, KVH, D] rotated into row slots[s] of `k_cache` [rows, KVH, D] and `v`
// copied into `v_cache` there; cos/sin [S, D]. Rotation bit-identical to vt_rope.
char* vt_rope_store(at::Tensor* q, at::Tensor* k, at::Tensor* v, at::Tensor* cos, at::Tensor* sin,
                    at::Tensor* slots, at::Tensor* k_cache, at::Tensor* v_cache,
                    at::Tensor* q_out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    rope_store(q, k, v, cos, sin, slots, k_cache, v_cache, q_out);
#else
    (void)q, (void)k, (void)v, (void)cos, (void)sin, (void)slots, (void)k_cache, (void)v_cache,
        (void)q_out;
    no_cuda();
#endif
  });
}

// Autograd-recorded rotary embedding of `x` [B, heads, T, head_dim] (see RopeFn): a new tensor in
// `*out` (freed by the caller), bit-identical to the torch ops forward and backward.
char* vt_rope_autograd(at::Tensor* x, at::Tensor* cos, at::Tensor* sin, at::Tensor** out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (x == nullptr || cos == nullptr || sin == nullptr || out == nullptr) {
      bad("rope", "tensors", "a null handle");
    }
    if (cos->requires_grad() || sin->requires_grad()) {
      bad("rope cos/sin", "tensors that need no gradient", "a tensor that requires grad");
    }
    *out = new at::Tensor(RopeFn::apply(*x, *cos, *sin));
#else
    (void)x, (void)cos, (void)sin, (void)out;
    no_cuda();
#endif
  });
}

// Autograd-recorded silu(gate) * up (see SiluMulFn): a new tensor in `*out` (freed by the caller).
char* vt_silu_mul(at::Tensor* gate, at::Tensor* up, at::Tensor** out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (gate == nullptr || up == nullptr || out == nullptr) bad("silu_mul", "tensors", "null");
    *out = new at::Tensor(SiluMulFn::apply(*gate, *up));
#else
    (void)gate, (void)up, (void)out;
    no_cuda();
#endif
  });
}

// Autograd-recorded x (+ delta) and its RMSNorm (see AddRmsNormFn): new tensors in `*sum`
// (with delta; else left null) and `*out` (freed by the caller). `delta` may be null.
char* vt_add_rms_norm_autograd(at::Tensor* x, at::Tensor* delta, at::Tensor* weight, double eps,
                               int into_grad, at::Tensor** sum, at::Tensor** out) {
  return vt_util::guarded([&] {
    if (sum != nullptr) *sum = nullptr;
#ifdef VERL_WITH_CUDA
    if (x == nullptr || weight == nullptr || sum == nullptr || out == nullptr) {
      bad("add_rms_norm", "tensors", "a null handle");
    }
    auto res = AddRmsNormFn::apply(*x, delta ? *delta : *x, *weight, eps, delta != nullptr,
                                   into_grad != 0);
    if (delta != nullptr) {
      *sum = new at::Tensor(res[0]);
      *out = new at::Tensor(res[1]);
    } else {
      *out = new at::Tensor(res[0]);
    }
#else
    (void)x, (void)delta, (void)weight, (void)eps, (void)into_grad, (void)out;
    no_cuda();
#endif
  });
}

// Autograd-recorded x.index_select(0, index) with an atomics-free backward (see GatherRowsFn):
// a new tensor in `*out` (freed by the caller).
char* vt_gather_rows(at::Tensor* x, at::Tensor* index, at::Tensor* offsets, at::Tensor* sources,
                     at::Tensor** out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (x == nullptr || index == nullptr || offsets == nullptr || sources == nullptr ||
        out == nullptr) {
      bad("gather_rows", "tensors", "a null handle");
    }
    *out = new at::Tensor(GatherRowsFn::apply(*x, *index, *offsets, *sources));
#else
    (void)x, (void)index, (void)offsets, (void)sources, (void)out;
    no_cuda();
#endif
  });
}

// See InjectFn: a new tensor equal to `value` in `*out` (freed by the caller). `a`, `b`, `ga`,
// `gb` may be null (undefined); `b_into_grad` nonzero: b's gradient goes into b.grad.
char* vt_inject_grads(at::Tensor* value, at::Tensor* a, at::Tensor* b, at::Tensor* ga,
                      at::Tensor* gb, int b_into_grad, at::Tensor** out) {
  return vt_util::guarded([&] {
    if (value == nullptr || out == nullptr) bad("inject_grads", "a value", "null");
    if (a == nullptr || !a->defined() || b == nullptr || !b->defined()) {
      bad("inject_grads", "two defined inputs", "a null or undefined one");
    }
    const auto opt = [](at::Tensor* t) {
      return t != nullptr && t->defined() ? c10::IValue(*t) : c10::IValue();
    };
#ifdef VERL_WITH_CUDA
    *out = new at::Tensor(InjectFn::apply(*value, *a, *b, opt(ga), opt(gb), c10::IValue(),
                                          c10::IValue(), b_into_grad != 0));
#else
    (void)opt;
    no_cuda();
#endif
  });
}

// See InjectFn: as vt_inject_grads, with b's gradient the product lhs^T rhs (both defined),
// computed in the backward.
char* vt_inject_grads_product(at::Tensor* value, at::Tensor* a, at::Tensor* b, at::Tensor* ga,
                              at::Tensor* lhs, at::Tensor* rhs, int b_into_grad,
                              at::Tensor** out) {
  return vt_util::guarded([&] {
    if (value == nullptr || out == nullptr) bad("inject_grads", "a value", "null");
    if (a == nullptr || !a->defined() || b == nullptr || !b->defined()) {
      bad("inject_grads", "two defined inputs", "a null or undefined one");
    }
    if (lhs == nullptr || !lhs->defined() || rhs == nullptr || !rhs->defined()) {
      bad("inject_grads product", "two defined factors", "a null or undefined one");
    }
    const c10::IValue gav = ga != nullptr && ga->defined() ? c10::IValue(*ga) : c10::IValue();
#ifdef VERL_WITH_CUDA
    *out = new at::Tensor(InjectFn::apply(*value, *a, *b, gav, c10::IValue(), c10::IValue(*lhs),
                                          c10::IValue(*rhs), b_into_grad != 0));
#else
    (void)gav;
    no_cuda();
#endif
  });
}

// A CUDA event (driver API, no timing) recorded on device `index`'s current stream, in `*out`
// (freed with vt_event_free): the host can wait for the work queued before it without waiting
// for what is queued after.
char* vt_event_record(int index, void** out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (out == nullptr) bad("event_record", "an output slot", "null");
    c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<int8_t>(index)));
    *out = record_event(index, current_stream(index));
#else
    (void)index, (void)out;
    no_cuda();
#endif
  });
}

char* vt_event_synchronize(void* ev) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    cu_check(cuda_checked().cuEventSynchronize(ev), "cuEventSynchronize");
#else
    (void)ev;
    no_cuda();
#endif
  });
}

// A side stream of device `index` for copies that overlap the current stream's work (e.g.
// device-to-host copies of one chunk of offloaded state while the next chunk comes to the device:
// PCIe moves both directions at once). Freed with vt_side_free.
#ifdef VERL_WITH_CUDA
struct VtSide {
  c10::cuda::CUDAStream stream;
  int index;
};
#endif

char* vt_side_new(int index, void** out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (out == nullptr) bad("side_new", "an output slot", "null");
    c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<int8_t>(index)));
    *out = new VtSide{c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(index)),
                      index};
#else
    (void)index, (void)out;
    no_cuda();
#endif
  });
}

// The side stream waits (on the device) for the work queued so far on the current stream.
char* vt_side_fence(void* side) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (side == nullptr) bad("side_fence", "a side stream", "null");
    const VtSide& s = *static_cast<VtSide*>(side);
    c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<int8_t>(s.index)));
    stream_waits_for(s.index, reinterpret_cast<CUstream_t>(s.stream.stream()),
                     current_stream(s.index));
#else
    (void)side;
    no_cuda();
#endif
  });
}

// The current stream waits (on the device) for the work queued so far on the side stream.
char* vt_side_join(void* side) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (side == nullptr) bad("side_join", "a side stream", "null");
    const VtSide& s = *static_cast<VtSide*>(side);
    c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<int8_t>(s.index)));
    stream_waits_for(s.index, current_stream(s.index),
                     reinterpret_cast<CUstream_t>(s.stream.stream()));
#else
    (void)side;
    no_cuda();
#endif
  });
}

// dst.copy_(src, non_blocking=true) queued on the side stream; the caching allocator is told
// that the side stream uses src's (and a device dst's) memory, so neither is reused before the
// copy has run, even if the tensors are freed at once.
char* vt_side_copy(void* side, at::Tensor* dst, at::Tensor* src) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (side == nullptr || dst == nullptr || src == nullptr) {
      bad("side_copy", "a side stream and two tensors", "null");
    }
    const VtSide& s = *static_cast<VtSide*>(side);
    {
      // The side stream current for the copy (c10's CUDAStreamGuard would link the CUDA runtime).
      struct Current {
        c10::cuda::CUDAStream previous;
        explicit Current(const c10::cuda::CUDAStream& s)
            : previous(c10::cuda::getCurrentCUDAStream(s.device_index())) {
          c10::cuda::setCurrentCUDAStream(s);
        }
        ~Current() { c10::cuda::setCurrentCUDAStream(previous); }
      } current(s.stream);
      dst->copy_(*src, /*non_blocking=*/true);
    }
    for (const at::Tensor* t : {src, dst}) {
      if (t->is_cuda() && t->storage().data_ptr().get() != nullptr) {
        c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), s.stream);
      }
    }
#else
    (void)side, (void)dst, (void)src;
    no_cuda();
#endif
  });
}

// An event (as vt_event_record's) recorded after the work queued so far on the side stream.
char* vt_side_record(void* side, void** out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    if (side == nullptr || out == nullptr) bad("side_record", "a side stream and a slot", "null");
    const VtSide& s = *static_cast<VtSide*>(side);
    *out = record_event(s.index, reinterpret_cast<CUstream_t>(s.stream.stream()));
#else
    (void)side, (void)out;
    no_cuda();
#endif
  });
}

void vt_side_free(void* side) {
#ifdef VERL_WITH_CUDA
  delete static_cast<VtSide*>(side);
#else
  (void)side;
#endif
}

void vt_event_free(void* ev) {
#ifdef VERL_WITH_CUDA
  const CudaApi& cu = cuda_api();
  if (ev != nullptr && cu.error.empty()) cu.cuEventDestroy(ev);
#else
  (void)ev;
#endif
}

}  // extern "C"

// Paged-attention decode (one new query token per sequence) over a block-paged KV cache: a CUDA
// kernel compiled at run time with NVRTC and launched with the CUDA driver API on libtorch's
// current stream (so it can be captured in a CUDA graph). libnvrtc and libcuda are opened with
// dlopen, never linked.
//
//   out[s, h, :] = softmax_p(q[s, h, :] . K[s, p, h / (H / KVH), :] * scale) . V[s, p, ...]
//   over p in [max(0, seq_len - window), seq_len), position p in block table[s, p / block_size]
//   at offset p % block_size of k_cache/v_cache [num_blocks, block_size, kv_heads, head_dim].
//
// Kernels (source below, compiled per (kernel, dtype, head_dim, device)):
// * vt_pa_tc (bf16/fp16, head_dim % 64 == 0, sm_80+): one thread block of 4 warps per
//   (sequence, kv head, group of <= 8 query heads, context split). Each warp takes 16-key tiles in
//   turn and runs two tensor-core MMAs (m16n8k16, fp32 accumulation): S = Q K^T (query heads as
//   rows) and O^T += V^T P^T (head dims as rows, so no accumulator is wasted on padding heads),
//   with an online softmax in fp32 between them. K and V go from global memory straight into
//   MMA fragments (16-byte loads; the head-dim order inside a dot product is permuted so every
//   thread reads contiguous bytes), so each K/V byte is read from memory once per step for all
//   the query heads of its kv head. Warps are merged through shared memory at the end.
// * vt_pa_simt (every dtype, head_dim <= 256): the same decomposition on CUDA cores, one key per
//   warp at a time (the fp32 path and the fallback).
// * vt_pa_reduce: when the context is split over several blocks (flash-decoding, chosen when
//   sequences x kv heads would not fill the GPU), each split writes a normalised partial output
//   and its log-sum-exp to scratch tensors from torch's caching allocator and this kernel merges
//   them.
//
// Every extern "C" function catches C++ exceptions and reports them as a heap string the caller
// frees with vt_free_error (null on success). Without VERL_WITH_CUDA they report that CUDA is
// missing.

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
#include <c10/core/DeviceGuard.h>

#include "cuda_rt.h"

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>
#include <vector>
#endif

// The kernels' parameter block, defined once for the host and (as text) for the device source.
#define VT_PA_PARAMS_DEF                                                                     \
  struct VtPaParams {                                                                        \
    const void* q;              /* [S, H, D] */                                              \
    const void* k;              /* [NB, BS, KVH, D] */                                       \
    const void* v;              /* [NB, BS, KVH, D] */                                       \
    const long long* table;     /* [S, max_blocks] */                                        \
    const long long* seq_lens;  /* [S] */                                                    \
    void* out;                  /* [S, H, D] */                                              \
    float* part_o;              /* [S, H, parts, D] (parts > 1) */                           \
    float* part_lse;            /* [S, H, parts] (parts > 1), log2 domain */                 \
    long long kv_row_stride;    /* KVH * D: elements from one slot to the next */            \
    long long window;           /* <= 0: none */                                             \
    int heads;                                                                               \
    int groups;                 /* H / KVH */                                                \
    int chunks;                 /* ceil(groups / 8) */                                       \
    int max_blocks;                                                                          \
    int block_size;                                                                          \
    int block_shift;            /* log2(block_size) when a power of two, else -1 */          \
    int parts;                                                                               \
    int part_len;               /* keys per split, a multiple of 16 */                       \
    float scale_log2e;          /* softmax scale * log2(e) */                                \
    int queries;                /* vt_pa_multi: query rows */                                \
    const long long* q_rows;    /* vt_pa_multi: [queries] each query's block-table row */    \
  };

#define VT_PA_STR_(...) #__VA_ARGS__
#define VT_PA_STR(...) VT_PA_STR_(__VA_ARGS__)

namespace {

// Device source (after the parameter block). Also compiled for the host by the CPU emulator of
// tests/emu (VT_EMULATE), which provides the primitives of the first section itself.
const char* const kKernelSource = R"VTPA(
// ---------------------------------------------------------------------------------------------
// Portability layer: device implementations (the CPU emulator defines VT_EMULATE and its own).
#ifndef VT_EMULATE
#define VT_DEV __device__ __forceinline__
typedef unsigned int vt_u32;
struct vt_bf16 { unsigned short v; };
struct vt_f16 { unsigned short v; };
VT_DEV float vt_neg_inf() { return __int_as_float(0xff800000); }
VT_DEV float vt_exp2(float x) { return exp2f(x); }
VT_DEV float vt_log2(float x) { return log2f(x); }
VT_DEV float vt_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
VT_DEV float vt_shfl(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
VT_DEV vt_u32 vt_prmt(vt_u32 a, vt_u32 b, vt_u32 sel) { return __byte_perm(a, b, sel); }
// K/V loads: read-only, with L1 eviction priority "evict first" (a line serves one tile of one
// warp). On an H100 (S = 512, context 512 with a 256-token prompt shared by groups of 8, CUDA-graph
// replay) 74.8 -> 71.3 us at 1.5B heads and 41.6 -> 40.0 us at 0.5B heads against plain __ldg;
// L1::no_allocate for K and/or V, ld.global.cg, or evict_last for V did less.
VT_DEV uint4 vt_ld128(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::evict_first.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}
VT_DEV vt_u32 vt_ld32(const void* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }
VT_DEV float vt_to_float(float x) { return x; }
VT_DEV float vt_to_float(vt_bf16 x) { return __uint_as_float(((vt_u32)x.v) << 16); }
VT_DEV float vt_to_float(vt_f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.v));
  return f;
}
VT_DEV vt_f16 vt_f16_from_float(float f) {
  vt_f16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.v) : "f"(f));
  return h;
}
#ifdef VT_WITH_TC
// Two floats as one packed pair, `lo` in the low half (cvt puts its first operand high).
VT_DEV vt_u32 vt_pack(float lo, float hi, vt_bf16) {
  vt_u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
VT_DEV vt_u32 vt_pack(float lo, float hi, vt_f16) {
  vt_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// d += A(16x16, row) * B(16x8, col), fp32 accumulation.
VT_DEV void vt_mma(float (&d)[4], vt_u32 a0, vt_u32 a1, vt_u32 a2, vt_u32 a3, vt_u32 b0,
                   vt_u32 b1, vt_bf16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
VT_DEV void vt_mma(float (&d)[4], vt_u32 a0, vt_u32 a1, vt_u32 a2, vt_u32 a3, vt_u32 b0,
                   vt_u32 b1, vt_f16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif  // VT_WITH_TC
#endif  // VT_EMULATE

// ---------------------------------------------------------------------------------------------
// Shared by both environments.

VT_DEV vt_bf16 vt_bf16_from_float(float f) {
  vt_u32 u = __float_as_uint(f);
  vt_bf16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.v = 0x7fc0;  // NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    b.v = (unsigned short)(u >> 16);
  }
  return b;
}
VT_DEV void vt_store(float* p, float f) { *p = f; }
VT_DEV void vt_store(vt_bf16* p, float f) { *p = vt_bf16_from_float(f); }
VT_DEV void vt_store(vt_f16* p, float f) { *p = vt_f16_from_float(f); }

VT_DEV vt_u32 vt_word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Keys [start, stop) of split `part` of sequence `s`; empty (start >= stop) when there are none.
VT_DEV void vt_range(const VtPaParams& p, int s, int part, long long& start, long long& stop) {
  long long len = p.seq_lens[s];
  const long long cap = (long long)p.max_blocks * p.block_size;
  if (len > cap) len = cap;
  long long lo = 0;
  if (p.window > 0 && len > p.window) lo = len - p.window;
  start = lo + (long long)part * p.part_len;
  stop = start + p.part_len;
  if (stop > len) stop = len;
}

// Element offset of cache slot of position `pos` (block table row `tab`).
VT_DEV long long vt_slot(const VtPaParams& p, const long long* tab, long long pos) {
  const int ip = (int)pos;
  int b, o;
  if (p.block_shift >= 0) {
    b = ip >> p.block_shift;
    o = ip & (p.block_size - 1);
  } else {
    b = ip / p.block_size;
    o = ip - b * p.block_size;
  }
  return (tab[b] * p.block_size + o) * p.kv_row_stride;
}

// Where the 4 warps' unnormalised outputs sit in shared memory: warp w's value of head h, dim d
// at sm_o[w][VtOut<D>::at(h, d)]. With D % 64 == 0 (the tensor-core kernels) every run of D / 8
// dims is followed by one unused float and heads lie D + 12 floats apart, so the 32 lanes of a
// vt_tc_finish store (lane (r, c): head 2c or 2c + 1, dims r D/8 + 2i or + 1) hit 32 distinct
// banks; in a dense [8][D] layout they hit 2 (D = 128) or 4 (D = 64), serialising each store
// 16- or 8-fold. The combine's reads (consecutive dims per thread) stay at most 2-way.
template <int D>
struct VtOut {
  static constexpr bool padded = D % 64 == 0;
  static constexpr int run = D / 8;
  static constexpr int pitch = padded ? D + 12 : D;
  static constexpr int size = 8 * pitch;
  static VT_DEV int at(int h, int d) {
    return padded ? h * pitch + (d / run) * (run + 1) + d % run : h * D + d;
  }
};

// Merges the 4 warps' (max, sum, unnormalised output) per head and writes the result: the final
// output (one split) or the split's normalised partial output and log-sum-exp.
template <typename T, int D>
VT_DEV void vt_combine(const VtPaParams& p, int s, int head0, int nh, int part,
                       float (*sm_m)[8], float (*sm_l)[8], float (*sm_o)[VtOut<D>::size]) {
  __syncthreads();
  const float ninf = vt_neg_inf();
  for (int idx = threadIdx.x; idx < nh * D; idx += 128) {
    const int h = idx / D;
    const int d = idx - h * D;
    float mx = ninf;
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, sm_m[w][h]);
    float l = 0.f, o = 0.f;
    if (mx != ninf) {
      for (int w = 0; w < 4; ++w) {
        const float mw = sm_m[w][h];
        if (mw != ninf) {
          const float f = vt_exp2(mw - mx);
          l += f * sm_l[w][h];
          o += f * sm_o[w][VtOut<D>::at(h, d)];
        }
      }
    }
    const float val = l > 0.f ? o / l : 0.f;
    const long long row = (long long)s * p.heads + head0 + h;
    if (p.parts == 1) {
      vt_store(reinterpret_cast<T*>(p.out) + row * D + d, val);
    } else {
      p.part_o[(row * p.parts + part) * D + d] = val;
      if (d == 0) p.part_lse[row * p.parts + part] = l > 0.f ? mx + vt_log2(l) : ninf;
    }
  }
}

// Block (blockIdx.x = sequence, blockIdx.y = kv head * chunks + chunk, blockIdx.z = split).
struct VtBlock {
  int s, part, kvh, head0, nh;
  long long start, stop;
};
VT_DEV VtBlock vt_block(const VtPaParams& p) {
  VtBlock b;
  b.s = (int)blockIdx.x;
  b.part = (int)blockIdx.z;
  b.kvh = (int)blockIdx.y / p.chunks;
  const int chunk = (int)blockIdx.y - b.kvh * p.chunks;
  b.head0 = b.kvh * p.groups + chunk * 8;
  b.nh = p.groups - chunk * 8;
  if (b.nh > 8) b.nh = 8;
  vt_range(p, b.s, b.part, b.start, b.stop);
  return b;
}

// CUDA-core kernel: every dtype, head_dim <= 256. Each warp takes one key at a time; lane i holds
// head dims i, i + 32, ...
template <typename T, int D>
VT_DEV void vt_simt_body(const VtPaParams& p) {
  constexpr int DPL = (D + 31) / 32;
  __shared__ float sm_m[4][8];
  __shared__ float sm_l[4][8];
  __shared__ float sm_o[4][VtOut<D>::size];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const VtBlock b = vt_block(p);
  const float ninf = vt_neg_inf();
  float qf[8][DPL], acc[8][DPL], m[8], l[8];
  const T* q = reinterpret_cast<const T*>(p.q) + ((long long)b.s * p.heads + b.head0) * D;
#pragma unroll
  for (int h = 0; h < 8; ++h) {
    m[h] = ninf;
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
      const int d = lane + 32 * j;
      qf[h][j] = (h < b.nh && d < D) ? vt_to_float(q[h * D + d]) : 0.f;
      acc[h][j] = 0.f;
    }
  }
  const long long* tab = p.table + (long long)b.s * p.max_blocks;
  const T* kb = reinterpret_cast<const T*>(p.k) + (long long)b.kvh * D;
  const T* vb = reinterpret_cast<const T*>(p.v) + (long long)b.kvh * D;
  for (long long pos = b.start + warp; pos < b.stop; pos += 4) {
    const long long off = vt_slot(p, tab, pos);
    float kf[DPL], vf[DPL];
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
      const int d = lane + 32 * j;
      kf[j] = d < D ? vt_to_float(kb[off + d]) : 0.f;
      vf[j] = d < D ? vt_to_float(vb[off + d]) : 0.f;
    }
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      if (h < b.nh) {  // uniform over the block
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < DPL; ++j) dot += qf[h][j] * kf[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += vt_shfl_xor(dot, o);
        const float x = dot * p.scale_log2e;
        const float m_new = fmaxf(m[h], x);
        const float corr = vt_exp2(m[h] - m_new);
        const float pr = vt_exp2(x - m_new);
        l[h] = l[h] * corr + pr;
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = acc[h][j] * corr + pr * vf[j];
        m[h] = m_new;
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 8; ++h) {
    if (lane == 0) {
      sm_m[warp][h] = m[h];
      sm_l[warp][h] = l[h];
    }
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
      const int d = lane + 32 * j;
      if (d < D) sm_o[warp][VtOut<D>::at(h, d)] = acc[h][j];
    }
  }
  vt_combine<T, D>(p, b.s, b.head0, b.nh, b.part, sm_m, sm_l, sm_o);
}

#if defined(VT_WITH_TC) || defined(VT_EMULATE)
// One 16-key tile of a warp (tile start t0, keys at or past `stop` masked): S = Q K^T from the
// q fragments `qa` and the tile's K fragments `kv`, the online softmax of head r (lane = 4 r + c)
// into (m, l), and O^T += V^T P^T into `o` from the V rows `vv`. Its arithmetic is the whole
// definition of a query's result, shared by the decode and the multi-query kernels.
template <typename T, int D>
VT_DEV void vt_tc_step(const vt_u32 (&qa)[D / 16][2], float (&o)[D / 16][4], float& m, float& l,
                       const uint4 (&kv)[2][D / 32], const uint4 (&vv)[4][D / 64], int t0,
                       int stop, int r, int c, int nh, float scale_log2e) {
  constexpr int NK = D / 16;
  constexpr int NKV = D / 32;
  const float ninf = vt_neg_inf();
  // S = Q K^T: sc[n] = (head r: keys t0 + 8n + 2c, +1 | head r + 8: padding).
  float sc[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int jj = 0; jj < NKV; ++jj) {
      vt_mma(sc[n], qa[2 * jj][0], 0u, qa[2 * jj][1], 0u, kv[n][jj].x, kv[n][jj].y, T());
      vt_mma(sc[n], qa[2 * jj + 1][0], 0u, qa[2 * jj + 1][1], 0u, kv[n][jj].z, kv[n][jj].w,
             T());
    }
  }
  // Online softmax (log2 domain) for head r; the 4 lanes of a quad hold its 16 keys.
  float x[2][2];
  float mx = ninf;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int pos = t0 + 8 * n + 2 * c + e;
      x[n][e] = pos < stop ? sc[n][e] * scale_log2e : ninf;
      mx = fmaxf(mx, x[n][e]);
    }
  }
  mx = fmaxf(mx, vt_shfl_xor(mx, 1));
  mx = fmaxf(mx, vt_shfl_xor(mx, 2));
  const float m_new = fmaxf(m, mx);
  const float m_use = m_new == ninf ? 0.f : m_new;
  const float corr = vt_exp2(m - m_use);
  float pr[2][2];
  float psum = 0.f;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      pr[n][e] = r < nh ? vt_exp2(x[n][e] - m_use) : 0.f;
      psum += pr[n][e];
    }
  }
  l = l * corr + psum;
  m = m_new;
  // O^T columns are heads 2c and 2c + 1: their rescale factors live in quads 2c and 2c + 1.
  const float ca = vt_shfl(corr, 8 * c);
  const float cb = vt_shfl(corr, 8 * c + 4);
  const vt_u32 pb0 = vt_pack(pr[0][0], pr[0][1], T());
  const vt_u32 pb1 = vt_pack(pr[1][0], pr[1][1], T());
#pragma unroll
  for (int i = 0; i < NK; ++i) {
    o[i][0] *= ca;
    o[i][1] *= cb;
    o[i][2] *= ca;
    o[i][3] *= cb;
    const vt_u32 w0 = vt_word(vv[0][i >> 2], i & 3);
    const vt_u32 w1 = vt_word(vv[1][i >> 2], i & 3);
    const vt_u32 w8 = vt_word(vv[2][i >> 2], i & 3);
    const vt_u32 w9 = vt_word(vv[3][i >> 2], i & 3);
    vt_mma(o[i], vt_prmt(w0, w1, 0x5410u), vt_prmt(w0, w1, 0x7632u), vt_prmt(w8, w9, 0x5410u),
           vt_prmt(w8, w9, 0x7632u), pb0, pb1, T());
  }
}

// Merges the 4 warps' (m, l, o) of query row `row` (heads head0 .. head0 + nh) through shared
// memory and writes its output (see vt_combine).
template <typename T, int D>
VT_DEV void vt_tc_finish(const VtPaParams& p, int row, int head0, int nh, int part,
                         const float (&o)[D / 16][4], float m, float l, int warp, int r, int c,
                         float (*sm_m)[8], float (*sm_l)[8], float (*sm_o)[VtOut<D>::size]) {
  constexpr int NK = D / 16;
  l += vt_shfl_xor(l, 1);
  l += vt_shfl_xor(l, 2);
  if (c == 0) {
    sm_m[warp][r] = m;
    sm_l[warp][r] = l;
  }
#pragma unroll
  for (int i = 0; i < NK; ++i) {
    const int d0 = r * (D / 8) + 2 * i;
    sm_o[warp][VtOut<D>::at(2 * c, d0)] = o[i][0];
    sm_o[warp][VtOut<D>::at(2 * c + 1, d0)] = o[i][1];
    sm_o[warp][VtOut<D>::at(2 * c, d0 + 1)] = o[i][2];
    sm_o[warp][VtOut<D>::at(2 * c + 1, d0 + 1)] = o[i][3];
  }
  vt_combine<T, D>(p, row, head0, nh, part, sm_m, sm_l, sm_o);
}

// The q fragments of query row `row` (heads head0 + r, r < nh; zero rows past nh).
template <typename T, int D>
VT_DEV void vt_tc_load_q(const VtPaParams& p, long long row, int head0, int nh, int r, int c,
                         vt_u32 (&qa)[D / 16][2]) {
  const T* q = reinterpret_cast<const T*>(p.q) + (row * p.heads + head0) * D;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int base = (j >> 1) * 32 + c * 8 + (j & 1) * 4;
    qa[j][0] = r < nh ? vt_ld32(q + r * D + base) : 0u;
    qa[j][1] = r < nh ? vt_ld32(q + r * D + base + 2) : 0u;
  }
}

// A warp's tiles of one block-table row (sequence `seq`, kv head `kvh`) from key `start`: the
// K/V rows of keys below `stop` (the longest of the Q queries) are loaded once per tile and every
// query j runs vt_tc_step on them with its own `stops[j]` (a tile past a query's stop is an exact
// no-op for it), so each query's state is what a decode step of that query alone computes.
template <typename T, int D, int Q>
VT_DEV void vt_tc_loop(const VtPaParams& p, int seq, int kvh, long long start, int stop,
                       const int (&stops)[Q], const vt_u32 (&qa)[Q][D / 16][2],
                       float (&o)[Q][D / 16][4], float (&m)[Q], float (&l)[Q], int warp, int r,
                       int c, int nh) {
  constexpr int NKV = D / 32;
  constexpr int NV = D / 64;
  const uint4 zero4 = {0u, 0u, 0u, 0u};
  const long long* tab = p.table + (long long)seq * p.max_blocks;
  const T* kb = reinterpret_cast<const T*>(p.k) + (long long)kvh * D;
  const T* vb = reinterpret_cast<const T*>(p.v) + (long long)kvh * D + r * (D / 8);

  // When every 16-key tile lies in one cache block (blocks of a multiple of 16 slots, tiles
  // starting on a multiple of 16), a tile's rows need one table entry, which is read a tile
  // ahead: the data loads of a tile then do not wait for its table load.
  // Positions fit 32 bits (a table row holds at most 2^31 slots): fewer registers.
  const bool one_block = p.block_shift >= 4 && (start & 15) == 0;
  int t0 = (int)start + 16 * warp;
  int block_next = one_block && t0 < stop ? (int)tab[t0 >> p.block_shift] : 0;
  for (; t0 < stop; t0 += 64) {
    const int block = block_next;
    if (one_block && t0 + 64 < stop) block_next = (int)tab[(t0 + 64) >> p.block_shift];
    const auto slot = [&](int pos) -> long long {
      return one_block ? ((long long)block * p.block_size + (pos & (p.block_size - 1))) *
                             p.kv_row_stride
                       : vt_slot(p, tab, pos);
    };
    // Loads first: K rows of keys t0 + r and t0 + 8 + r, V rows of keys t0 + 2c + {0, 1, 8, 9}.
    uint4 kv[2][NKV];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int pos = t0 + 8 * n + r;
      if (pos < stop) {
        const T* row = kb + slot(pos) + c * 8;
#pragma unroll
        for (int jj = 0; jj < NKV; ++jj) kv[n][jj] = vt_ld128(row + jj * 32);
      } else {
#pragma unroll
        for (int jj = 0; jj < NKV; ++jj) kv[n][jj] = zero4;
      }
    }
    uint4 vv[4][NV];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = t0 + 2 * c + (e & 1) + (e >> 1) * 8;
      if (pos < stop) {
        const T* row = vb + slot(pos);
#pragma unroll
        for (int u = 0; u < NV; ++u) vv[e][u] = vt_ld128(row + u * 8);
      } else {
#pragma unroll
        for (int u = 0; u < NV; ++u) vv[e][u] = zero4;
      }
    }
#pragma unroll
    for (int j = 0; j < Q; ++j) {
      vt_tc_step<T, D>(qa[j], o[j], m[j], l[j], kv, vv, t0, stops[j], r, c, nh, p.scale_log2e);
    }
  }
}

// Tensor-core kernel: bf16/fp16, D % 64 == 0. Lane = 4 * r + c (r = lane / 4, c = lane % 4).
//
// S = Q K^T per 16-key tile as two m16n8k16 MMAs (keys t0..t0+7 and t0+8..t0+15), rows = the
// chunk's query heads (8 valid rows, 8 zero rows), k = head dims. The head-dim order inside the
// dot product is free, so k-step j uses dims base(j, c) + {0,1} (as k = 2c, 2c+1) and
// base(j, c) + {2,3} (as k = 2c+8, 2c+9) with base = 32 (j / 2) + 8 c + 4 (j % 2): lane (r, c)
// loads 16 contiguous bytes per 32 dims of key r's row and feeds them to two k-steps directly.
//
// O^T += V^T P^T as one m16n8k16 MMA per 16 head dims (m-tile i), k = the tile's 16 keys,
// n = query heads. Rows of m-tile i are dims r*D/8 + 2i (row r) and r*D/8 + 2i + 1 (row r+8), so
// lane (r, c) needs the contiguous dims [r*D/8, (r+1)*D/8) of keys 2c, 2c+1, 2c+8, 2c+9 and builds
// its A fragments with byte permutes. P^T's B fragment (keys 2c, 2c+1 | 2c+8, 2c+9 of head r) is
// exactly what lane (r, c) holds of S, so probabilities never leave registers.
template <typename T, int D>
VT_DEV void vt_tc_body(const VtPaParams& p) {
  constexpr int NK = D / 16;  // k-steps of Q K^T, m-tiles of V^T P^T
  constexpr int NKV = D / 32;  // 16-byte K vectors per lane per key
  constexpr int NV = D / 64;   // 16-byte V vectors per lane per key
  __shared__ float sm_m[4][8];
  __shared__ float sm_l[4][8];
  __shared__ float sm_o[4][VtOut<D>::size];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, c = lane & 3;
  const VtBlock b = vt_block(p);
  const float ninf = vt_neg_inf();

  vt_u32 qa1[1][NK][2];
  vt_tc_load_q<T, D>(p, b.s, b.head0, b.nh, r, c, qa1[0]);
  float o1[1][NK][4];
#pragma unroll
  for (int i = 0; i < NK; ++i) o1[0][i][0] = o1[0][i][1] = o1[0][i][2] = o1[0][i][3] = 0.f;
  float m1[1] = {ninf}, l1[1] = {0.f};
  const int stops[1] = {(int)b.stop};
  vt_tc_loop<T, D, 1>(p, b.s, b.kvh, b.start, (int)b.stop, stops, qa1, o1, m1, l1, warp, r, c, b.nh);
  vt_tc_finish<T, D>(p, b.s, b.head0, b.nh, b.part, o1[0], m1[0], l1[0], warp, r, c, sm_m, sm_l,
                     sm_o);
}

// Multi-query kernel (vt_pa_multi, tensor cores): forwards in which every query attends as its
// own decode step would (`consistent_attention`'s prefill and log-prob passes). Query i (of
// `queries` rows of q and out) reads block-table row q_rows[i] up to its length seq_lens[i]; one
// split, no window. A thread block takes Q consecutive queries: when they read the same table row
// (all but the blocks that straddle two rows of a forward), the keys and values they share are
// loaded once for all of them; otherwise it runs them one after another. Either way each query's
// result is bit-identical to vt_tc_body's for that query alone.
template <typename T, int D>
struct VtMq {
#ifdef VT_MULTI_QUERIES
  static constexpr int Q = VT_MULTI_QUERIES;
#else
  static constexpr int Q = D == 64 ? 4 : (D == 128 ? 2 : 1);
#endif
};

template <typename T, int D>
VT_DEV void vt_tc_multi_body(const VtPaParams& p) {
  constexpr int NK = D / 16;
  constexpr int Q = VtMq<T, D>::Q;
  __shared__ float sm_m[4][8];
  __shared__ float sm_l[4][8];
  __shared__ float sm_o[4][VtOut<D>::size];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, c = lane & 3;
  const int n = p.queries;
  const int i0 = (int)blockIdx.x * Q;
  const int kvh = (int)blockIdx.y / p.chunks;
  const int chunk = (int)blockIdx.y - kvh * p.chunks;
  const int head0 = kvh * p.groups + chunk * 8;
  const int nh = p.groups - chunk * 8 < 8 ? p.groups - chunk * 8 : 8;
  const long long cap = (long long)p.max_blocks * p.block_size;
  const float ninf = vt_neg_inf();
  int stops[Q];
  int rows[Q];
  int stop = 0;
  bool shared = true;
  vt_u32 qa[Q][NK][2];
  float o[Q][NK][4];
  float m[Q], l[Q];
  const int row0 = (int)p.q_rows[i0];
#pragma unroll
  for (int j = 0; j < Q; ++j) {
    const int qi = i0 + j;
    long long len = 0;
    rows[j] = row0;
    if (qi < n) {
      rows[j] = (int)p.q_rows[qi];
      len = p.seq_lens[qi];
      if (len > cap) len = cap;
      if (len < 0) len = 0;
    }
    shared = shared && rows[j] == row0;
    stops[j] = (int)len;
    stop = stops[j] > stop ? stops[j] : stop;
    vt_tc_load_q<T, D>(p, qi < n ? qi : i0, head0, qi < n ? nh : 0, r, c, qa[j]);
#pragma unroll
    for (int i = 0; i < NK; ++i) o[j][i][0] = o[j][i][1] = o[j][i][2] = o[j][i][3] = 0.f;
    m[j] = ninf;
    l[j] = 0.f;
  }
  if (shared) {
    vt_tc_loop<T, D, Q>(p, row0, kvh, 0, stop, stops, qa, o, m, l, warp, r, c, nh);
  } else {
#pragma unroll
    for (int j = 0; j < Q; ++j) {
      typedef vt_u32 Qa1[1][NK][2];
      typedef float O1[1][NK][4];
      typedef float S1[1];
      const int stop1[1] = {stops[j]};
      vt_tc_loop<T, D, 1>(p, rows[j], kvh, 0, stops[j], stop1, reinterpret_cast<const Qa1&>(qa[j]),
                          reinterpret_cast<O1&>(o[j]), reinterpret_cast<S1&>(m[j]),
                          reinterpret_cast<S1&>(l[j]), warp, r, c, nh);
    }
  }
#pragma unroll
  for (int j = 0; j < Q; ++j) {
    if (i0 + j < n) {
      vt_tc_finish<T, D>(p, i0 + j, head0, nh, 0, o[j], m[j], l[j], warp, r, c, sm_m, sm_l, sm_o);
      __syncthreads();  // the shared partials are read before the next query writes its own
    }
  }
}
#endif

// Merges the splits of one (sequence, head) (blockIdx.x = s * H + h).
template <typename T, int D>
VT_DEV void vt_reduce_body(const VtPaParams& p) {
  const long long row = blockIdx.x;
  const float ninf = vt_neg_inf();
  const float* lse = p.part_lse + row * p.parts;
  float mx = ninf;
  for (int k = 0; k < p.parts; ++k) mx = fmaxf(mx, lse[k]);
  for (int d = threadIdx.x; d < D; d += 128) {
    float num = 0.f, den = 0.f;
    if (mx != ninf) {
      for (int k = 0; k < p.parts; ++k) {
        const float lk = lse[k];
        if (lk != ninf) {
          const float w = vt_exp2(lk - mx);
          num += w * p.part_o[(row * p.parts + k) * D + d];
          den += w;
        }
      }
    }
    vt_store(reinterpret_cast<T*>(p.out) + row * D + d, den > 0.f ? num / den : 0.f);
  }
}

// Entry points of one compiled program: VT_DTYPE (0 fp32, 1 bf16, 2 fp16), VT_HEAD_DIM.
#ifdef VT_DTYPE
#if VT_DTYPE == 0
typedef float vt_t;
#elif VT_DTYPE == 1
typedef vt_bf16 vt_t;
#else
typedef vt_f16 vt_t;
#endif
#ifndef VT_MIN_BLOCKS
#define VT_MIN_BLOCKS 1
#endif
#ifdef VT_WITH_TC
extern "C" __global__ void __launch_bounds__(128, VT_MIN_BLOCKS) vt_pa_main(const VtPaParams p) {
  vt_tc_body<vt_t, VT_HEAD_DIM>(p);
}
extern "C" __global__ void __launch_bounds__(128) vt_pa_multi(const VtPaParams p) {
  vt_tc_multi_body<vt_t, VT_HEAD_DIM>(p);
}
#else
extern "C" __global__ void __launch_bounds__(128) vt_pa_main(const VtPaParams p) {
  vt_simt_body<vt_t, VT_HEAD_DIM>(p);
}
#endif
extern "C" __global__ void __launch_bounds__(128) vt_pa_reduce(const VtPaParams p) {
  vt_reduce_body<vt_t, VT_HEAD_DIM>(p);
}
#endif
)VTPA";

const std::string& full_source() {
  static const std::string src =
      std::string("// verl-rs paged decode attention\n") + VT_PA_STR(VT_PA_PARAMS_DEF) + "\n" +
      kKernelSource;
  return src;
}

#ifdef VERL_WITH_CUDA

VT_PA_PARAMS_DEF

using namespace vt_rt;

// Thread blocks per SM the tensor-core kernel is compiled for (ptxas caps its registers to fit).
// head_dim 128 uncapped takes 178 registers, so only 2 blocks (8 warps) fit an SM and the loads
// of too few warps are in flight; capped at 168 (3 blocks, no spills) it ran 85.0 -> 77.6 us at
// S=512, context 512, 12/2 heads on an H200 (1.5B decode step 6.72 -> 6.42 ms). head_dim 64
// already fits 4 blocks.
int min_blocks(int head_dim) {
  return head_dim == 128 ? 3 : 1;
}

// Queries per thread block of the multi-query kernel: 4 at head_dim 64, 2 at 128, else 1
// (their state fits the registers without spills).
int multi_queries(int head_dim) {
  return head_dim == 64 ? 4 : (head_dim == 128 ? 2 : 1);
}

// Compiles the paged-attention kernels for (dtype 0/1/2, head_dim, tensor cores?) for compute
// capability `arch`.
Binary compile_program(int dtype, int head_dim, bool tc, int arch, bool verbose) {
  std::vector<std::string> opts = {
      "-DVT_DTYPE=" + std::to_string(dtype),
      "-DVT_HEAD_DIM=" + std::to_string(head_dim),
  };
  if (tc) opts.push_back("-DVT_WITH_TC");
  if (tc) opts.push_back("-DVT_MIN_BLOCKS=" + std::to_string(min_blocks(head_dim)));
  if (tc) opts.push_back("-DVT_MULTI_QUERIES=" + std::to_string(multi_queries(head_dim)));
  try {
    return compile_source(full_source(), "verl_paged_attention", opts, arch, verbose);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("paged attention (") + (tc ? "tensor-core" : "CUDA-core") +
                             " kernel, dtype " + std::to_string(dtype) + ", head_dim " +
                             std::to_string(head_dim) + "): " + e.what());
  }
}

// ---- compiled-kernel cache and launch ---------------------------------------------------------
struct Kernels {
  CUfunction_t main = nullptr;
  CUfunction_t reduce = nullptr;
  CUfunction_t multi = nullptr;  // tensor-core programs only
};

std::map<std::tuple<int, int, int, int>, Kernels> g_kernels;  // (tc, dtype, head_dim, device)

Kernels kernels_for(bool tc, int dtype, int head_dim, int index, const DeviceInfo& info) {
  const auto key = std::make_tuple(tc ? 1 : 0, dtype, head_dim, index);
  {
    std::lock_guard<std::mutex> lock(rt_mutex());
    auto it = g_kernels.find(key);
    if (it != g_kernels.end()) return it->second;
  }
  // Compile outside the lock; a concurrent first call may compile twice (the first insert wins).
  const Binary bin = compile_program(dtype, head_dim, tc, info.arch, false);
  const auto fns = tc ? load_functions(bin, {"vt_pa_main", "vt_pa_reduce", "vt_pa_multi"})
                      : load_functions(bin, {"vt_pa_main", "vt_pa_reduce"});
  Kernels k;
  k.main = fns[0];
  k.reduce = fns[1];
  if (tc) k.multi = fns[2];
  std::lock_guard<std::mutex> lock(rt_mutex());
  return g_kernels.emplace(key, k).first->second;
}

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

[[noreturn]] void bad_input(const std::string& what, const std::string& expected,
                            const std::string& found) {
  throw std::invalid_argument("paged attention " + what + ": expected " + expected + ", found " +
                              found);
}

void check_tensor(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  if (!t.defined()) bad_input(name, "a defined tensor", "an undefined tensor");
  if (t.dim() != dim) {
    bad_input(name, std::to_string(dim) + " dimensions", shape_str(t));
  }
  if (t.device() != device) {
    bad_input(std::string(name) + " device", device.str(), t.device().str());
  }
  if (!t.is_contiguous()) bad_input(name, "a contiguous tensor", "strides " + [&] {
    std::ostringstream s;
    s << t.strides();
    return s.str();
  }());
}

int dtype_code(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return 0;
    case c10::ScalarType::BFloat16:
      return 1;
    case c10::ScalarType::Half:
      return 2;
    default:
      bad_input("q dtype", "float32, bfloat16 or float16", c10::toString(t));
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The parameter fields every launch shares: pointers, kv heads and their groups of query heads
// (in chunks of 8), the table's shape and the block size (with its shift when a power of two),
// and the softmax scale in the log2 domain. Shapes were checked by the caller.
void fill_params(VtPaParams& p, const at::Tensor& q, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& block_table,
                 const at::Tensor& seq_lens, const at::Tensor& out, double scale) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  const int64_t BS = k_cache.size(1), groups = H / KVH;
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.table = reinterpret_cast<const long long*>(block_table.data_ptr<int64_t>());
  p.seq_lens = reinterpret_cast<const long long*>(seq_lens.data_ptr<int64_t>());
  p.out = out.data_ptr();
  p.kv_row_stride = KVH * D;
  p.heads = static_cast<int>(H);
  p.groups = static_cast<int>(groups);
  p.chunks = static_cast<int>((groups + 7) / 8);
  p.max_blocks = static_cast<int>(block_table.size(1));
  p.block_size = static_cast<int>(BS);
  p.block_shift = -1;
  if ((BS & (BS - 1)) == 0) {
    int sh = 0;
    while ((int64_t(1) << sh) < BS) ++sh;
    p.block_shift = sh;
  }
  p.scale_log2e = static_cast<float>(scale * 1.4426950408889634);
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                  int64_t window, const at::Tensor& out, int64_t kernel, int64_t num_splits) {
  if (!q.defined() || !q.is_cuda()) {
    bad_input("q", "a CUDA tensor", q.defined() ? q.device().str() : "undefined");
  }
  const at::Device device = q.device();
  check_tensor(q, "q [S, heads, head_dim]", 3, device);
  check_tensor(k_cache, "k_cache [blocks, block_size, kv_heads, head_dim]", 4, device);
  check_tensor(v_cache, "v_cache [blocks, block_size, kv_heads, head_dim]", 4, device);
  check_tensor(block_table, "block_table [S, max_blocks]", 2, device);
  check_tensor(seq_lens, "seq_lens [S]", 1, device);
  check_tensor(out, "out [S, heads, head_dim]", 3, device);
  const int dtype = dtype_code(q.scalar_type());
  for (const auto* t : {&k_cache, &v_cache, &out}) {
    if (t->scalar_type() != q.scalar_type()) {
      bad_input("k_cache/v_cache/out dtype", std::string("q's dtype ") +
                c10::toString(q.scalar_type()), c10::toString(t->scalar_type()));
    }
  }
  for (const auto* t : {&block_table, &seq_lens}) {
    if (t->scalar_type() != c10::ScalarType::Long) {
      bad_input("block_table/seq_lens dtype", "int64", c10::toString(t->scalar_type()));
    }
  }
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t MB = block_table.size(1);
  if (k_cache.size(3) != D) {
    bad_input("k_cache head_dim", "q's head_dim " + std::to_string(D), shape_str(k_cache));
  }
  if (!v_cache.sizes().equals(k_cache.sizes())) {
    bad_input("v_cache shape", "k_cache's " + shape_str(k_cache), shape_str(v_cache));
  }
  if (block_table.size(0) != S) {
    bad_input("block_table rows", "one per sequence (" + std::to_string(S) + ")",
              shape_str(block_table));
  }
  if (seq_lens.size(0) != S) {
    bad_input("seq_lens", "one per sequence (" + std::to_string(S) + ")", shape_str(seq_lens));
  }
  if (!out.sizes().equals(q.sizes())) bad_input("out shape", shape_str(q), shape_str(out));
  if (D < 1 || D > 256) bad_input("head_dim", "1..=256", std::to_string(D));
  if (KVH < 1 || H % KVH != 0) {
    bad_input("heads", "a multiple of kv_heads (" + std::to_string(KVH) + ")", std::to_string(H));
  }
  if (BS < 1) bad_input("block_size", ">= 1", std::to_string(BS));
  if (MB * BS >= (int64_t(1) << 31) || NB * BS * KVH * D >= (int64_t(1) << 62)) {
    bad_input("cache size", "fewer than 2^31 positions per sequence",
              std::to_string(MB) + " blocks of " + std::to_string(BS));
  }
  if (!std::isfinite(scale)) bad_input("scale", "a finite number", std::to_string(scale));
  if (S > (int64_t(1) << 31) - 1) bad_input("sequences", "< 2^31", std::to_string(S));
  if (S == 0 || H == 0) return;
  (void)NB;

  c10::DeviceGuard guard(device);  // the CUDA impl registered by libc10_cuda (no cudart refs)
  const int index = device.index();
  const DeviceInfo& info = device_info(index);
  make_current(info);

  const int64_t groups = H / KVH;
  const int64_t chunks = (groups + 7) / 8;
  if (KVH * chunks > 65535) bad_input("kv_heads", "at most 65535 thread-block rows", "more");
  const bool tc_ok = dtype != 0 && D % 64 == 0 && info.arch >= 80 && aligned16(q.data_ptr()) &&
                     aligned16(k_cache.data_ptr()) && aligned16(v_cache.data_ptr());
  bool tc = tc_ok;
  if (kernel == 1) tc = false;
  if (kernel == 2 && !tc_ok) {
    bad_input("tensor-core kernel", "bf16/fp16, head_dim % 64 == 0, sm_80+, 16-byte aligned",
              std::string(c10::toString(q.scalar_type())) + ", head_dim " + std::to_string(D) +
                  ", sm_" + std::to_string(info.arch));
  }
  const Kernels k = kernels_for(tc, dtype, static_cast<int>(D), index, info);

  // Splits of the context (known on the host without reading seq_lens: the table's capacity,
  // or the window).
  int64_t max_range = MB * BS;
  if (window > 0 && window < max_range) max_range = window;
  const int64_t base_blocks = S * KVH * chunks;
  int64_t parts = 1;
  if (num_splits > 0) {
    parts = num_splits;
  } else {
    // About four blocks per SM: measured on an H200 at S=512, 14/2 heads, D=64, context 768,
    // one split (1024 blocks, ~7.8 per SM) ran at 3.2 TB/s and two splits at 2.5 TB/s.
    const int64_t target = 4 * static_cast<int64_t>(info.sms);
    if (base_blocks < target) parts = (target + base_blocks - 1) / base_blocks;
    const int64_t by_len = (max_range + 255) / 256;  // at least ~256 keys per split
    if (parts > by_len) parts = by_len;
  }
  if (parts < 1) parts = 1;
  if (parts > 65535) parts = 65535;
  int64_t part_len = (max_range + parts - 1) / parts;
  part_len = ((part_len + 15) / 16) * 16;
  if (part_len < 16) part_len = 16;
  parts = (max_range + part_len - 1) / part_len;
  if (parts < 1) parts = 1;

  VtPaParams p{};
  fill_params(p, q, k_cache, v_cache, block_table, seq_lens, out, scale);
  p.window = window;
  p.parts = static_cast<int>(parts);
  p.part_len = static_cast<int>(part_len);

  at::Tensor part_o, part_lse;  // scratch from torch's caching allocator (graph-safe)
  if (parts > 1) {
    const auto f32 = q.options().dtype(c10::ScalarType::Float);
    part_o = at::empty({S, H, parts, D}, f32);
    part_lse = at::empty({S, H, parts}, f32);
    p.part_o = part_o.data_ptr<float>();
    p.part_lse = part_lse.data_ptr<float>();
  }
  const CudaApi& cu = cuda_checked();
  CUstream_t stream = current_stream(index);
  void* args[] = {&p};
  cu_check(cu.cuLaunchKernel(k.main, static_cast<unsigned>(S), static_cast<unsigned>(KVH * chunks),
                             static_cast<unsigned>(parts), 128, 1, 1, 0, stream, args, nullptr),
           "cuLaunchKernel(vt_pa_main)");
  if (parts > 1) {
    cu_check(cu.cuLaunchKernel(k.reduce, static_cast<unsigned>(S * H), 1, 1, 128, 1, 1, 0, stream,
                               args, nullptr),
             "cuLaunchKernel(vt_pa_reduce)");
  }
}

// Attention of queries that each attend as their own decode step (one split, no window): q/out
// [N, heads, head_dim], query i reading row q_rows[i] of block_table [R, max_blocks] up to its
// length seq_lens[i]. Through vt_pa_multi where the tensor-core kernel applies, else the decode
// kernel over the table rows gathered per query; the results are the same.
void paged_multi(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_table, const at::Tensor& q_rows,
                 const at::Tensor& seq_lens, double scale, const at::Tensor& out) {
  if (!q.defined() || !q.is_cuda()) {
    bad_input("q", "a CUDA tensor", q.defined() ? q.device().str() : "undefined");
  }
  const at::Device device = q.device();
  check_tensor(q, "q [N, heads, head_dim]", 3, device);
  check_tensor(block_table, "block_table [rows, max_blocks]", 2, device);
  check_tensor(q_rows, "q_rows [N]", 1, device);
  if (q_rows.size(0) != q.size(0) || q_rows.scalar_type() != c10::ScalarType::Long) {
    bad_input("q_rows", "int64, one table row per query (" + std::to_string(q.size(0)) + ")",
              shape_str(q_rows));
  }
  check_tensor(k_cache, "k_cache [blocks, block_size, kv_heads, head_dim]", 4, device);
  const int dtype = dtype_code(q.scalar_type());
  const int64_t N = q.size(0), D = q.size(2), H = q.size(1), KVH = k_cache.size(2);
  c10::DeviceGuard guard(device);
  const int index = device.index();
  const DeviceInfo& info = device_info(index);
  make_current(info);
  const bool tc = dtype != 0 && D % 64 == 0 && D <= 256 && info.arch >= 80 &&
                  aligned16(q.data_ptr()) && aligned16(k_cache.data_ptr()) &&
                  aligned16(v_cache.data_ptr()) && KVH >= 1 && H % KVH == 0 &&
                  k_cache.scalar_type() == q.scalar_type() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_table.scalar_type() == c10::ScalarType::Long;
  if (!tc) {
    paged_decode(q, k_cache, v_cache, block_table.index_select(0, q_rows), seq_lens, scale, 0, out,
                 0, 1);
    return;
  }
  check_tensor(v_cache, "v_cache [blocks, block_size, kv_heads, head_dim]", 4, device);
  check_tensor(seq_lens, "seq_lens [N]", 1, device);
  check_tensor(out, "out [N, heads, head_dim]", 3, device);
  if (!v_cache.sizes().equals(k_cache.sizes()) || k_cache.size(3) != D ||
      v_cache.scalar_type() != q.scalar_type()) {
    bad_input("v_cache", "k_cache's shape and q's dtype and head_dim", shape_str(v_cache));
  }
  if (seq_lens.size(0) != N || seq_lens.scalar_type() != c10::ScalarType::Long) {
    bad_input("seq_lens", "int64, one per query (" + std::to_string(N) + ")", shape_str(seq_lens));
  }
  if (!out.sizes().equals(q.sizes()) || out.scalar_type() != q.scalar_type()) {
    bad_input("out", "q's shape and dtype", shape_str(out));
  }
  const int64_t MB = block_table.size(1), BS = k_cache.size(1);
  if (MB * BS >= (int64_t(1) << 31) || block_table.size(0) >= (int64_t(1) << 31)) {
    bad_input("cache size", "fewer than 2^31 positions per sequence",
              std::to_string(MB) + " blocks of " + std::to_string(BS));
  }
  if (N == 0 || H == 0) return;
  const Kernels k = kernels_for(true, dtype, static_cast<int>(D), index, info);
  const int64_t groups = H / KVH, chunks = (groups + 7) / 8;
  const int64_t per_block = multi_queries(static_cast<int>(D));
  const int64_t blocks = (N + per_block - 1) / per_block;
  if (N > (int64_t(1) << 31) - 1 || KVH * chunks > 65535) {
    bad_input("queries", "fewer than 2^31", std::to_string(N));
  }
  VtPaParams p{};
  fill_params(p, q, k_cache, v_cache, block_table, seq_lens, out, scale);
  p.q_rows = reinterpret_cast<const long long*>(q_rows.data_ptr<int64_t>());
  p.window = 0;
  p.parts = 1;
  p.part_len = static_cast<int>(((MB * BS + 15) / 16) * 16);
  p.queries = static_cast<int>(N);
  const CudaApi& cu = cuda_checked();
  void* args[] = {&p};
  cu_check(cu.cuLaunchKernel(k.multi, static_cast<unsigned>(blocks),
                             static_cast<unsigned>(KVH * chunks), 1, 128, 1, 1, 0,
                             current_stream(index), args, nullptr),
           "cuLaunchKernel(vt_pa_multi)");
}

#endif  // VERL_WITH_CUDA

}  // namespace

extern "C" {

// The kernels' CUDA C++ source (static; not to be freed).
const char* vt_paged_attention_source() { return full_source().c_str(); }

// Compiles the kernels for (dtype 0 fp32 / 1 bf16 / 2 fp16, head_dim, tc 0/1) and compute
// capability `arch` (e.g. 90) without a GPU; `*log` (nullable; free with vt_free_error) receives
// NVRTC's log, which includes ptxas' register/spill report.
char* vt_paged_attention_compile_check(int dtype, int head_dim, int tc, int arch, char** log) {
  if (log != nullptr) *log = nullptr;
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    const Binary bin = compile_program(dtype, head_dim, tc != 0, arch, true);
    if (log != nullptr) {
      *log = vt_util::error_string("target " + bin.target + ", " + std::to_string(bin.image.size()) +
                             " bytes, NVRTC " + nvrtc_api().path + "\n" + bin.log);
    }
#else
    (void)dtype;
    (void)head_dim;
    (void)tc;
    (void)arch;
    throw std::runtime_error("paged attention: this build of the torch extension has no CUDA");
#endif
  });
}

// Decode attention over a paged KV cache (see the top of this file), written into `out`.
// `kernel`: 0 automatic, 1 CUDA cores, 2 tensor cores; `num_splits`: 0 automatic, else the
// number of context splits. Launches asynchronously on the current stream; nothing synchronises
// with the host or allocates outside torch's caching allocator, so it can be graph-captured
// (after a first, uncaptured call has compiled the kernel).
char* vt_paged_decode_attention_ex(at::Tensor* q, at::Tensor* k_cache, at::Tensor* v_cache,
                                   at::Tensor* block_table, at::Tensor* seq_lens, double scale,
                                   int64_t window, at::Tensor* out, int64_t kernel,
                                   int64_t num_splits) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    paged_decode(*q, *k_cache, *v_cache, *block_table, *seq_lens, scale, window, *out, kernel,
                 num_splits);
#else
    (void)q;
    (void)k_cache;
    (void)v_cache;
    (void)block_table;
    (void)seq_lens;
    (void)scale;
    (void)window;
    (void)out;
    (void)kernel;
    (void)num_splits;
    throw std::runtime_error("paged attention: this build of the torch extension has no CUDA");
#endif
  });
}

// paged_multi above: queries that each attend as their own decode step.
char* vt_paged_multi_query_attention(at::Tensor* q, at::Tensor* k_cache, at::Tensor* v_cache,
                                     at::Tensor* block_table, at::Tensor* q_rows,
                                     at::Tensor* seq_lens, double scale, at::Tensor* out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    paged_multi(*q, *k_cache, *v_cache, *block_table, *q_rows, *seq_lens, scale, *out);
#else
    (void)q;
    (void)k_cache;
    (void)v_cache;
    (void)block_table;
    (void)q_rows;
    (void)seq_lens;
    (void)scale;
    (void)out;
    throw std::runtime_error("paged attention: this build of the torch extension has no CUDA");
#endif
  });
}

char* vt_paged_decode_attention(at::Tensor* q, at::Tensor* k_cache, at::Tensor* v_cache,
                                at::Tensor* block_table, at::Tensor* seq_lens, double scale,
                                int64_t window, at::Tensor* out) {
  return vt_paged_decode_attention_ex(q, k_cache, v_cache, block_table, seq_lens, scale, window,
                                      out, 0, 0);
}

}  // extern "C"

// CPU emulator for the paged-attention kernels of src/paged_attention.cpp (their source is
// written to kernel.cu by tests/paged_attention.rs). One OS thread per CUDA thread, blocks run
// one after another; warp shuffles and mma.sync exchange values through per-warp slots with
// barriers, and the m16n8k16 MMA follows the fragment layouts of the PTX ISA:
//   A (16x16, row): a0..a7 in 4 regs; reg = (row >= 8) + 2 * (k >= 8), lane = 4 * (row % 8) +
//                   (k % 8) / 2, low half = even k
//   B (16x8, col):  reg = (k >= 8), lane = 4 * n + (k % 8) / 2, low half = even k
//   C/D (16x8):     reg = 2 * (row >= 8) + col % 2, lane = 4 * (row % 8) + col / 2
// Loads through vt_ld128/vt_ld32 are checked for alignment and bounds; unused cache slots hold
// NaN and unused table entries -1, so masking mistakes show up. Exit status 0 when every case
// matches a float64 reference.

#define VT_EMULATE 1
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#define VT_DEV inline
#define __shared__ static
typedef unsigned int vt_u32;
struct vt_bf16 { unsigned short v; };
struct vt_f16 { unsigned short v; };
struct uint4 { unsigned int x, y, z, w; };
struct vt_dim3 { unsigned x, y, z; };
thread_local vt_dim3 threadIdx, blockIdx;

struct Barrier {
  explicit Barrier(int n) : n(n) {}
  void wait() {
    std::unique_lock<std::mutex> lk(mu);
    const unsigned long g = gen;
    if (++count == n) {
      count = 0;
      ++gen;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return gen != g; });
    }
  }
  std::mutex mu;
  std::condition_variable cv;
  int n, count = 0;
  unsigned long gen = 0;
};

Barrier g_block(128);
Barrier* g_warp[4];
float g_f[4][32];
vt_u32 g_a[4][32][4], g_b[4][32][2];
float g_c[4][32][4];

struct Range { const char* lo; const char* hi; };
std::vector<Range> g_ranges;
std::mutex g_err_mu;
int g_bad_loads = 0;

void check_load(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  if ((reinterpret_cast<uintptr_t>(p) & (n - 1)) != 0) {
    std::lock_guard<std::mutex> lk(g_err_mu);
    if (g_bad_loads++ < 5) std::printf("misaligned %zu-byte load at %p\n", n, p);
    return;
  }
  for (const auto& r : g_ranges) {
    if (c >= r.lo && c + n <= r.hi) return;
  }
  std::lock_guard<std::mutex> lk(g_err_mu);
  if (g_bad_loads++ < 5) std::printf("out-of-bounds %zu-byte load at %p\n", n, p);
}

void __syncthreads() { g_block.wait(); }
inline int lane_id() { return threadIdx.x & 31; }
inline int warp_id() { return threadIdx.x >> 5; }

inline float vt_neg_inf() { return -INFINITY; }
inline float vt_exp2(float x) { return std::exp2(x); }
inline float vt_log2(float x) { return std::log2(x); }
inline vt_u32 __float_as_uint(float f) {
  vt_u32 u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(vt_u32 u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float vt_shfl_xor(float v, int m) {
  const int w = warp_id(), l = lane_id();
  g_f[w][l] = v;
  g_warp[w]->wait();
  const float r = g_f[w][l ^ m];
  g_warp[w]->wait();
  return r;
}
inline float vt_shfl(float v, int src) {
  const int w = warp_id(), l = lane_id();
  g_f[w][l] = v;
  g_warp[w]->wait();
  const float r = g_f[w][src & 31];
  g_warp[w]->wait();
  return r;
}
inline vt_u32 vt_prmt(vt_u32 a, vt_u32 b, vt_u32 sel) {
  unsigned char bytes[8];
  std::memcpy(bytes, &a, 4);
  std::memcpy(bytes + 4, &b, 4);
  vt_u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= vt_u32(bytes[(sel >> (4 * i)) & 7]) << (8 * i);
  return r;
}
inline uint4 vt_ld128(const void* p) {
  check_load(p, 16);
  uint4 r;
  std::memcpy(&r, p, 16);
  return r;
}
inline vt_u32 vt_ld32(const void* p) {
  check_load(p, 4);
  vt_u32 r;
  std::memcpy(&r, p, 4);
  return r;
}
inline float bf16_bits_to_float(unsigned short h) { return u2f(vt_u32(h) << 16); }
inline float f16_bits_to_float(unsigned short h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
inline unsigned short f16_bits(float f) {
  _Float16 x = static_cast<_Float16>(f);
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}
inline float vt_to_float(float x) { return x; }
inline float vt_to_float(vt_bf16 x) { return bf16_bits_to_float(x.v); }
inline float vt_to_float(vt_f16 x) { return f16_bits_to_float(x.v); }
inline vt_f16 vt_f16_from_float(float f) { return vt_f16{f16_bits(f)}; }
inline vt_bf16 vt_bf16_from_float(float f);  // defined by the kernel source
inline vt_u32 vt_pack(float lo, float hi, vt_bf16) {
  return vt_u32(vt_bf16_from_float(lo).v) | (vt_u32(vt_bf16_from_float(hi).v) << 16);
}
inline vt_u32 vt_pack(float lo, float hi, vt_f16) {
  return vt_u32(f16_bits(lo)) | (vt_u32(f16_bits(hi)) << 16);
}
inline float half_of(vt_u32 reg, int hi, vt_bf16) {
  return bf16_bits_to_float(static_cast<unsigned short>(reg >> (16 * hi)));
}
inline float half_of(vt_u32 reg, int hi, vt_f16) {
  return f16_bits_to_float(static_cast<unsigned short>(reg >> (16 * hi)));
}
template <typename Tag>
inline void vt_mma(float (&d)[4], vt_u32 a0, vt_u32 a1, vt_u32 a2, vt_u32 a3, vt_u32 b0,
                   vt_u32 b1, Tag tag) {
  const int w = warp_id(), l = lane_id();
  g_a[w][l][0] = a0;
  g_a[w][l][1] = a1;
  g_a[w][l][2] = a2;
  g_a[w][l][3] = a3;
  g_b[w][l][0] = b0;
  g_b[w][l][1] = b1;
  for (int j = 0; j < 4; ++j) g_c[w][l][j] = d[j];
  g_warp[w]->wait();
  float res[4];
  const int grp = l >> 2, tig = l & 3;
  for (int j = 0; j < 4; ++j) {
    const int row = grp + (j >= 2 ? 8 : 0);
    const int col = tig * 2 + (j & 1);
    float acc = g_c[w][l][j];
    for (int k = 0; k < 16; ++k) {
      const int al = 4 * (row % 8) + (k % 8) / 2;
      const int ar = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int bl = 4 * col + (k % 8) / 2;
      const int br = k >= 8 ? 1 : 0;
      acc += half_of(g_a[w][al][ar], k & 1, tag) * half_of(g_b[w][bl][br], k & 1, tag);
    }
    res[j] = acc;
  }
  g_warp[w]->wait();
  for (int j = 0; j < 4; ++j) d[j] = res[j];
}

#include "kernel.cu"

// ---------------------------------------------------------------------------------------------

void launch(const std::function<void(const VtPaParams&)>& fn, const VtPaParams& p, unsigned gx,
            unsigned gy, unsigned gz) {
  for (unsigned z = 0; z < gz; ++z) {
    for (unsigned y = 0; y < gy; ++y) {
      for (unsigned x = 0; x < gx; ++x) {
        std::vector<std::thread> ts;
        ts.reserve(128);
        for (unsigned t = 0; t < 128; ++t) {
          ts.emplace_back([&, t] {
            threadIdx = vt_dim3{t, 0, 0};
            blockIdx = vt_dim3{x, y, z};
            fn(p);
          });
        }
        for (auto& th : ts) th.join();
      }
    }
  }
}

template <typename T> T quant(float f);
template <> float quant<float>(float f) { return f; }
template <> vt_bf16 quant<vt_bf16>(float f) { return vt_bf16_from_float(f); }
template <> vt_f16 quant<vt_f16>(float f) { return vt_f16_from_float(f); }

struct Case {
  const char* name;
  int tc;  // 1: tensor-core kernel
  int heads, kv_heads, block_size, parts;
  long long window;
  std::vector<long long> lens;
  double tol;
};

template <typename T, int D>
bool run_case(const Case& c, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int S = static_cast<int>(c.lens.size()), H = c.heads, KVH = c.kv_heads, BS = c.block_size;
  std::vector<int> need(S);
  int max_blocks = 1, total = 0;
  for (int s = 0; s < S; ++s) {
    need[s] = static_cast<int>((c.lens[s] + BS - 1) / BS);
    max_blocks = std::max(max_blocks, need[s] + 1);
    total += need[s];
  }
  const int NB = total + 3;
  std::vector<int> perm(NB);
  for (int i = 0; i < NB; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<long long> table(static_cast<size_t>(S) * max_blocks, -1);
  int next = 0;
  for (int s = 0; s < S; ++s)
    for (int b = 0; b < need[s]; ++b) table[static_cast<size_t>(s) * max_blocks + b] = perm[next++];

  const size_t kv_elems = static_cast<size_t>(NB) * BS * KVH * D;
  // 16-byte aligned storage.
  std::vector<uint4> qbuf((S * H * D * sizeof(T) + 15) / 16), kbuf((kv_elems * sizeof(T) + 15) / 16),
      vbuf((kv_elems * sizeof(T) + 15) / 16), obuf((S * H * D * sizeof(T) + 15) / 16);
  T* q = reinterpret_cast<T*>(qbuf.data());
  T* k = reinterpret_cast<T*>(kbuf.data());
  T* v = reinterpret_cast<T*>(vbuf.data());
  T* out = reinterpret_cast<T*>(obuf.data());
  for (int i = 0; i < S * H * D; ++i) q[i] = quant<T>(normal(rng));
  const float nan = std::nanf("");
  for (size_t i = 0; i < kv_elems; ++i) {
    k[i] = quant<T>(nan);
    v[i] = quant<T>(nan);
  }
  for (int s = 0; s < S; ++s)
    for (long long pos = 0; pos < c.lens[s]; ++pos) {
      const long long slot = table[static_cast<size_t>(s) * max_blocks + pos / BS] * BS + pos % BS;
      for (int i = 0; i < KVH * D; ++i) {
        k[slot * KVH * D + i] = quant<T>(normal(rng));
        v[slot * KVH * D + i] = quant<T>(normal(rng));
      }
    }
  for (int i = 0; i < S * H * D; ++i) out[i] = quant<T>(nan);

  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  long long max_range = static_cast<long long>(max_blocks) * BS;
  if (c.window > 0 && c.window < max_range) max_range = c.window;
  int part_len = static_cast<int>((max_range + c.parts - 1) / c.parts);
  part_len = std::max(16, (part_len + 15) / 16 * 16);
  const int parts = std::max(1, static_cast<int>((max_range + part_len - 1) / part_len));
  const int groups = H / KVH, chunks = (groups + 7) / 8;
  std::vector<float> part_o(static_cast<size_t>(S) * H * parts * D, nan),
      part_lse(static_cast<size_t>(S) * H * parts, nan);

  VtPaParams p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.table = table.data();
  p.seq_lens = c.lens.data();
  p.out = out;
  p.part_o = parts > 1 ? part_o.data() : nullptr;
  p.part_lse = parts > 1 ? part_lse.data() : nullptr;
  p.kv_row_stride = static_cast<long long>(KVH) * D;
  p.window = c.window;
  p.heads = H;
  p.groups = groups;
  p.chunks = chunks;
  p.max_blocks = max_blocks;
  p.block_size = BS;
  p.block_shift = -1;
  if ((BS & (BS - 1)) == 0) {
    int sh = 0;
    while ((1 << sh) < BS) ++sh;
    p.block_shift = sh;
  }
  p.parts = parts;
  p.part_len = part_len;
  p.scale_log2e = static_cast<float>(scale * 1.4426950408889634);

  g_ranges = {{reinterpret_cast<const char*>(q), reinterpret_cast<const char*>(q + S * H * D)},
              {reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(k + kv_elems)},
              {reinterpret_cast<const char*>(v), reinterpret_cast<const char*>(v + kv_elems)}};
  g_bad_loads = 0;
  if (c.tc) {
    if constexpr (!std::is_same<T, float>::value) {
      launch([](const VtPaParams& pp) { vt_tc_body<T, D>(pp); }, p, S, KVH * chunks, parts);
    }
  } else {
    launch([](const VtPaParams& pp) { vt_simt_body<T, D>(pp); }, p, S, KVH * chunks, parts);
  }
  if (parts > 1) launch([](const VtPaParams& pp) { vt_reduce_body<T, D>(pp); }, p, S * H, 1, 1);

  // float64 reference on the quantised inputs.
  double worst = 0.0;
  bool nan_seen = false;
  for (int s = 0; s < S; ++s) {
    const long long len = std::min<long long>(c.lens[s], static_cast<long long>(max_blocks) * BS);
    const long long lo = (c.window > 0 && len > c.window) ? len - c.window : 0;
    for (int h = 0; h < H; ++h) {
      const int kvh = h / groups;
      std::vector<double> logits;
      double mx = -INFINITY;
      for (long long pos = lo; pos < len; ++pos) {
        const long long slot = table[static_cast<size_t>(s) * max_blocks + pos / BS] * BS + pos % BS;
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += double(vt_to_float(q[(s * H + h) * D + d])) *
                 vt_to_float(k[(slot * KVH + kvh) * D + d]);
        logits.push_back(dot * scale);
        mx = std::max(mx, dot * scale);
      }
      double den = 0;
      for (double& x : logits) den += (x = std::exp(x - mx));
      for (int d = 0; d < D; ++d) {
        double num = 0;
        for (long long pos = lo; pos < len; ++pos) {
          const long long slot =
              table[static_cast<size_t>(s) * max_blocks + pos / BS] * BS + pos % BS;
          num += logits[pos - lo] * vt_to_float(v[(slot * KVH + kvh) * D + d]);
        }
        const double want = den > 0 ? num / den : 0.0;
        const double got = vt_to_float(out[(s * H + h) * D + d]);
        if (std::isnan(got)) nan_seen = true;
        worst = std::max(worst, std::fabs(got - want));
      }
    }
  }
  const bool ok = !nan_seen && worst <= c.tol && g_bad_loads == 0;
  std::printf("%-4s %-44s D=%-3d parts=%d: max |diff| %.3e%s%s\n", ok ? "ok" : "FAIL", c.name, D,
              parts, worst, nan_seen ? " NaN in output" : "",
              g_bad_loads ? " bad loads" : "");
  std::fflush(stdout);
  return ok;
}

// The multi-query kernel against the decode kernel run once per query (the table row repeated
// for each): S rows of past[s] cached positions plus t queries each (query i of row s at
// position past[s] + i), bit for bit.
template <typename T, int D>
bool run_multi_case(const char* name, int H, int KVH, int BS, int t,
                    const std::vector<long long>& past, unsigned seed, int run = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int S = static_cast<int>(past.size());
  int max_blocks = 1, total = 0;
  std::vector<int> need(S);
  for (int s = 0; s < S; ++s) {
    need[s] = static_cast<int>((past[s] + t + BS - 1) / BS);
    max_blocks = std::max(max_blocks, need[s]);
    total += need[s];
  }
  const int NB = total + 2;
  std::vector<int> perm(NB);
  for (int i = 0; i < NB; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<long long> table(static_cast<size_t>(S) * max_blocks, -1);
  int next = 0;
  for (int s = 0; s < S; ++s)
    for (int b = 0; b < need[s]; ++b) table[static_cast<size_t>(s) * max_blocks + b] = perm[next++];
  const size_t kv_elems = static_cast<size_t>(NB) * BS * KVH * D;
  const int N = S * t;
  std::vector<uint4> qbuf((N * H * D * sizeof(T) + 15) / 16), kbuf((kv_elems * sizeof(T) + 15) / 16),
      vbuf((kv_elems * sizeof(T) + 15) / 16), o1buf((N * H * D * sizeof(T) + 15) / 16),
      o2buf((N * H * D * sizeof(T) + 15) / 16);
  T* q = reinterpret_cast<T*>(qbuf.data());
  T* k = reinterpret_cast<T*>(kbuf.data());
  T* v = reinterpret_cast<T*>(vbuf.data());
  T* out1 = reinterpret_cast<T*>(o1buf.data());
  T* out2 = reinterpret_cast<T*>(o2buf.data());
  const float nan = std::nanf("");
  for (int i = 0; i < N * H * D; ++i) q[i] = quant<T>(normal(rng));
  for (size_t i = 0; i < kv_elems; ++i) k[i] = v[i] = quant<T>(nan);
  for (int s = 0; s < S; ++s)
    for (long long pos = 0; pos < past[s] + t; ++pos) {
      const long long slot = table[static_cast<size_t>(s) * max_blocks + pos / BS] * BS + pos % BS;
      for (int i = 0; i < KVH * D; ++i) {
        k[slot * KVH * D + i] = quant<T>(normal(rng));
        v[slot * KVH * D + i] = quant<T>(normal(rng));
      }
    }
  // Queries in row order, or (run > 0) runs of `run` queries of each row interleaved round-robin,
  // as a packed stream has them: blocks of consecutive queries then straddle rows.
  std::vector<std::pair<int, long long>> order;
  if (run == 0) {
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < t; ++i) order.push_back({s, past[s] + i + 1});
  } else {
    for (int i0 = 0; i0 < t; i0 += run)
      for (int s = 0; s < S; ++s)
        for (int i = i0; i < std::min(t, i0 + run); ++i) order.push_back({s, past[s] + i + 1});
  }
  std::vector<long long> lens(N), q_rows(N), table_rep(static_cast<size_t>(N) * max_blocks);
  for (int i = 0; i < N; ++i) {
    q_rows[i] = order[i].first;
    lens[i] = order[i].second;
    for (int b = 0; b < max_blocks; ++b)
      table_rep[static_cast<size_t>(i) * max_blocks + b] =
          table[static_cast<size_t>(q_rows[i]) * max_blocks + b];
  }
  const int groups = H / KVH, chunks = (groups + 7) / 8;
  VtPaParams p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.seq_lens = lens.data();
  p.kv_row_stride = static_cast<long long>(KVH) * D;
  p.heads = H;
  p.groups = groups;
  p.chunks = chunks;
  p.max_blocks = max_blocks;
  p.block_size = BS;
  p.block_shift = -1;
  if ((BS & (BS - 1)) == 0) {
    int sh = 0;
    while ((1 << sh) < BS) ++sh;
    p.block_shift = sh;
  }
  p.parts = 1;
  p.part_len = (max_blocks * BS + 15) / 16 * 16;
  p.scale_log2e = static_cast<float>(1.0 / std::sqrt(double(D)) * 1.4426950408889634);
  g_ranges = {{reinterpret_cast<const char*>(q), reinterpret_cast<const char*>(q + N * H * D)},
              {reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(k + kv_elems)},
              {reinterpret_cast<const char*>(v), reinterpret_cast<const char*>(v + kv_elems)}};
  g_bad_loads = 0;
  VtPaParams p1 = p;
  p1.table = table_rep.data();
  p1.out = out1;
  launch([](const VtPaParams& pp) { vt_tc_body<T, D>(pp); }, p1, N, KVH * chunks, 1);
  VtPaParams p2 = p;
  p2.table = table.data();
  p2.out = out2;
  p2.queries = N;
  p2.q_rows = q_rows.data();
  constexpr int Q = VtMq<T, D>::Q;
  launch([](const VtPaParams& pp) { vt_tc_multi_body<T, D>(pp); }, p2, (N + Q - 1) / Q,
         KVH * chunks, 1);
  bool same = true, nan_seen = false;
  for (int i = 0; i < N * H * D; ++i) {
    unsigned short a, b;
    std::memcpy(&a, &out1[i], 2);
    std::memcpy(&b, &out2[i], 2);
    same &= a == b;
    nan_seen |= std::isnan(vt_to_float(out1[i]));
  }
  const bool ok = same && !nan_seen && g_bad_loads == 0;
  std::printf("%-4s %-44s D=%-3d Q=%d: %s%s%s\n", ok ? "ok" : "FAIL", name, D, Q,
              same ? "bit-identical to one decode step per query" : "DIFFERS",
              nan_seen ? " NaN in output" : "", g_bad_loads ? " bad loads" : "");
  std::fflush(stdout);
  return ok;
}

// The shared-memory layout of the warps' partial outputs (VtOut): every (head, dim) has its own
// slot inside the array, and each store instruction of vt_tc_finish (lane (r, c) writes head
// 2c + (k & 1), dim r D/8 + 2i + (k >> 1)) puts its 32 lanes in 32 distinct 4-byte banks.
template <int D>
bool check_out_layout() {
  std::vector<int> seen(VtOut<D>::size, 0);
  for (int h = 0; h < 8; ++h) {
    for (int d = 0; d < D; ++d) {
      const int a = VtOut<D>::at(h, d);
      if (a < 0 || a >= VtOut<D>::size || seen[a]++) {
        std::printf("FAIL out layout D=%d: (%d, %d) -> %d collides or is out of range\n", D, h, d, a);
        return false;
      }
    }
  }
  if (D % 64 != 0) {  // CUDA-core kernel only: dense
    std::printf("ok   out layout D=%d (dense)\n", D);
    return true;
  }
  for (int i = 0; i < D / 16; ++i) {
    for (int k = 0; k < 4; ++k) {
      bool bank[32] = {};
      for (int lane = 0; lane < 32; ++lane) {
        const int r = lane >> 2, c = lane & 3;
        const int b = VtOut<D>::at(2 * c + (k & 1), r * (D / 8) + 2 * i + (k >> 1)) % 32;
        if (bank[b]) {
          std::printf("FAIL out layout D=%d: store (i=%d, k=%d) has a bank conflict\n", D, i, k);
          return false;
        }
        bank[b] = true;
      }
    }
  }
  std::printf("ok   out layout D=%d (tensor-core stores conflict-free)\n", D);
  return true;
}

int main() {
  for (auto& w : g_warp) w = new Barrier(32);
  bool ok = true;
  const std::vector<long long> ragged = {1, 37, 0, 100, 16, 65};
  const std::vector<long long> short_ragged = {1, 19, 0, 40};
  ok &= check_out_layout<64>() && check_out_layout<80>() && check_out_layout<128>() &&
        check_out_layout<192>() && check_out_layout<256>();
  // Tensor-core kernel.
  ok &= run_case<vt_bf16, 64>({"tc bf16 14/2 bs16", 1, 14, 2, 16, 1, 0, ragged, 3e-2}, 1);
  ok &= run_case<vt_bf16, 64>({"tc bf16 14/2 bs16 window 50 split", 1, 14, 2, 16, 3, 50, ragged, 3e-2}, 2);
  ok &= run_case<vt_f16, 64>({"tc f16 32/8 bs12 split", 1, 32, 8, 12, 3, 0, {3, 70, 0}, 5e-3}, 3);
  ok &= run_case<vt_bf16, 128>({"tc bf16 20/2 (2 chunks) bs8", 1, 20, 2, 8, 1, 0, {45, 2}, 3e-2}, 4);
  ok &= run_case<vt_f16, 128>({"tc f16 14/2 bs16 window 33 split", 1, 14, 2, 16, 2, 33, {90, 7}, 5e-3}, 5);
  ok &= run_case<vt_bf16, 192>({"tc bf16 8/8 bs32", 1, 8, 8, 32, 1, 0, {50}, 3e-2}, 6);
  ok &= run_case<vt_bf16, 256>({"tc bf16 4/1 bs16 split", 1, 4, 1, 16, 2, 0, {70, 33}, 3e-2}, 7);
  // CUDA-core kernel.
  ok &= run_case<float, 64>({"simt f32 14/2 bs16 split", 0, 14, 2, 16, 2, 0, short_ragged, 1e-4}, 8);
  ok &= run_case<float, 80>({"simt f32 6/2 bs12 window 9", 0, 6, 2, 12, 1, 9, short_ragged, 1e-4}, 9);
  ok &= run_case<vt_bf16, 64>({"simt bf16 10/1 bs16", 0, 10, 1, 16, 1, 0, {23, 5}, 3e-2}, 10);
  ok &= run_case<vt_f16, 128>({"simt f16 4/2 bs4 window 20 split", 0, 4, 2, 4, 2, 20, {30, 3}, 5e-3}, 11);
  // Multi-query kernel (consistent prefill and log-prob passes).
  ok &= run_multi_case<vt_bf16, 64>("multi bf16 14/2 bs16", 14, 2, 16, 7, {0, 21, 3}, 20);
  ok &= run_multi_case<vt_f16, 64>("multi f16 32/8 bs12", 32, 8, 12, 5, {9, 0}, 21);
  ok &= run_multi_case<vt_bf16, 128>("multi bf16 20/2 (2 chunks) bs8", 20, 2, 8, 5, {2, 30}, 22);
  ok &= run_multi_case<vt_bf16, 128>("multi bf16 12/2 one block per row", 12, 2, 37, 37, {0}, 23);
  ok &= run_multi_case<vt_f16, 192>("multi f16 8/8 bs16", 8, 8, 16, 3, {17}, 24);
  ok &= run_multi_case<vt_bf16, 64>("multi bf16 14/2 bs16 interleaved runs of 3", 14, 2, 16, 9,
                                    {0, 40, 5}, 25, 3);
  ok &= run_multi_case<vt_f16, 128>("multi f16 12/2 bs16 interleaved runs of 1", 12, 2, 16, 4,
                                    {7, 0, 19}, 26, 1);
  std::printf(ok ? "all emulated cases match\n" : "SOME EMULATED CASES FAILED\n");
  return ok ? 0 : 1;
}

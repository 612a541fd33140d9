// Which cuBLASLt algorithms could run the decode step's GEMMs faster while keeping each row's
// bits equal to those of a training-size GEMM (what `consistent_attention` needs)?
//
// For each Qwen2.5 projection shape at M = 512 rows (a decode step of 512 sequences) it asks
// cuBLASLt's heuristic for up to 64 algorithms within a 1 KiB workspace (the setting under
// `consistent_attention`), times each (CUDA events, median of 9 runs of 50), and checks its 512
// rows bit for bit against the first 512 rows of the same GEMM at M = 4096 with the heuristic's
// first choice (what libtorch runs). Prints one line per algorithm: its configuration, µs,
// TFLOP/s, and whether its rows match.
//
// Build and run on the GPU machine (no libtorch needed; the CUDA toolkit's headers, including
// CCCL's, and the cuBLASLt that torch loads, from the pip `nvidia/cu13` folder):
//   NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
//   g++ -O2 -std=c++17 bench/lt_algo_probe.cpp -I/usr/local/cuda/include \
//       -I/usr/local/cuda/targets/x86_64-linux/include/cccl -I$NV/include \
//       $NV/lib/libcublasLt.so.13 $NV/lib/libcudart.so.13 -Wl,-rpath,$NV/lib -o /tmp/lt_probe
//   /tmp/lt_probe          # the heuristic's algorithms, weights warm in L2
//   /tmp/lt_probe --all    # every (algorithm, tile, stages, custom option, cluster) without
//                          # split-K that cuBLASLt accepts, weights cold (rotating copies larger
//                          # than L2, as in a decode step): the fastest with the same rows
//                          # against the heuristic's first choice
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x)                                                                       \
  do {                                                                              \
    auto e_ = (x);                                                                  \
    if (e_ != 0) {                                                                  \
      std::fprintf(stderr, "%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, (int)e_); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

struct Shape {
  const char* name;
  int n, k;
  bool bias;
};

// y[M, N] = x[M, K] W[N, K]^T (+ b), row-major bf16, fp32 accumulation; in cuBLASLt's
// column-major terms D (N x M) = op_T(W: K x N) * x (K x M).
struct Gemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  Gemm(int m, int n, int k, const void* bias) {
    CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
    if (bias != nullptr) {
      cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                        sizeof(bias)));
      cudaDataType_t bt = CUDA_R_16BF;
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    }
    CK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, k));
    CK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, k));
    CK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, n, m, n));
  }
  ~Gemm() {
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(d);
    cublasLtMatmulDescDestroy(op);
  }
};

int attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t which) {
  int v = 0;
  size_t got = 0;
  uint64_t big = 0;
  if (which == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID || which == CUBLASLT_ALGO_CONFIG_TILE_ID ||
      which == CUBLASLT_ALGO_CONFIG_STAGES_ID) {
    uint16_t s = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, which, &s, sizeof(s), &got) == 0) return s;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, which, &v, sizeof(v), &got) == 0) return v;
    return -1;
  }
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, which, &v, sizeof(v), &got) == 0) return v;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, which, &big, sizeof(big), &got) == 0)
    return (int)big;
  return -1;
}

template <typename T>
std::vector<T> cap_list(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t which) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, which, nullptr, 0, &bytes) != 0 || bytes == 0)
    return {};
  std::vector<T> v(bytes / sizeof(T));
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, which, v.data(), bytes, &bytes) != 0) return {};
  return v;
}

// Median µs of `reps` runs of `iters` calls of run(i) (i = call index, to rotate weight copies).
template <typename F>
float time_us(cudaStream_t st, int reps, int iters, F&& run) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int rep = 0; rep < reps; ++rep) {
    CK(cudaEventRecord(e0, st));
    for (int it = 0; it < iters; ++it) run(it);
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1000.f / iters);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int exhaustive(const Shape* shapes, int nshapes) {
  const int M = 512, MBIG = 4096;
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  void* ws = nullptr;
  const size_t ws_size = 1024;
  CK(cudaMalloc(&ws, ws_size));
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  const auto C32 = CUBLAS_COMPUTE_32F;
  int ids[256];
  int nids = 0;
  CK(cublasLtMatmulAlgoGetIds(lt, C32, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                              CUDA_R_16BF, 256, ids, &nids));
  std::printf("%d algorithm ids\n", nids);
  std::printf("%-16s %7s %7s | %7s %7s  %5s %5s %6s %6s %5s  %s\n", "shape", "heur us", "TFLOP/s",
              "best us", "TFLOP/s", "algo", "tile", "stages", "custom", "clust", "tried/ran/same");
  for (int si = 0; si < nshapes; ++si) {
    const Shape& s = shapes[si];
    const size_t wbytes = (size_t)s.n * s.k * 2;
    const int copies = std::max(2, (int)((160u << 20) / wbytes) + 1);
    std::vector<__nv_bfloat16> hx((size_t)MBIG * s.k), hw((size_t)s.n * s.k), hb(s.n);
    for (auto& v : hx) v = __float2bfloat16(nd(rng));
    for (auto& v : hw) v = __float2bfloat16(nd(rng) * 0.02f);
    for (auto& v : hb) v = __float2bfloat16(nd(rng) * 0.02f);
    __nv_bfloat16 *x, *w, *b, *ybig, *y;
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMalloc(&w, wbytes * copies));
    CK(cudaMalloc(&b, hb.size() * 2));
    CK(cudaMalloc(&ybig, (size_t)MBIG * s.n * 2));
    CK(cudaMalloc(&y, (size_t)M * s.n * 2));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    for (int c = 0; c < copies; ++c)
      CK(cudaMemcpy((char*)w + c * wbytes, hw.data(), wbytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    const void* bias = s.bias ? b : nullptr;
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &ws_size, sizeof(ws_size)));
    const float one = 1.f, zero = 0.f;
    std::vector<uint16_t> want((size_t)M * s.n), have((size_t)M * s.n);
    {
      Gemm g(MBIG, s.n, s.k, bias);
      cublasLtMatmulHeuristicResult_t h[1];
      int got = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.a, g.b, g.d, g.d, pref, 1, h, &got));
      CK(cublasLtMatmul(lt, g.op, &one, w, g.a, x, g.b, &zero, ybig, g.d, ybig, g.d, &h[0].algo,
                        ws, ws_size, st));
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(want.data(), ybig, want.size() * 2, cudaMemcpyDeviceToHost));
    }
    Gemm g(M, s.n, s.k, bias);
    auto launch = [&](const cublasLtMatmulAlgo_t& a, int i) {
      return cublasLtMatmul(lt, g.op, &one, (char*)w + (i % copies) * wbytes, g.a, x, g.b, &zero,
                            y, g.d, y, g.d, &a, ws, ws_size, st);
    };
    cublasLtMatmulHeuristicResult_t h0[1];
    int got = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.a, g.b, g.d, g.d, pref, 1, h0, &got));
    const float heur = time_us(st, 9, 60, [&](int i) { launch(h0[0].algo, i); });
    struct Cand {
      float us;
      cublasLtMatmulAlgo_t algo;
    };
    std::vector<Cand> cands;
    int tried = 0, ran = 0, same = 0;
    const uint16_t clusters[] = {0, 2, 3, 5};
    for (int ii = 0; ii < nids; ++ii) {
      cublasLtMatmulAlgo_t base;
      if (cublasLtMatmulAlgoInit(lt, C32, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                                 CUDA_R_16BF, ids[ii], &base) != 0)
        continue;
      auto tiles = cap_list<uint32_t>(base, CUBLASLT_ALGO_CAP_TILE_IDS);
      auto stages = cap_list<uint32_t>(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
      if (tiles.empty()) tiles.push_back(0);
      if (stages.empty()) stages.push_back(0);
      int32_t cmax = 0;
      size_t sz = 0;
      cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &cmax,
                                        sizeof(cmax), &sz);
      for (uint32_t tile : tiles)
        for (uint32_t stg : stages)
          for (uint32_t cu = 0; cu <= (uint32_t)std::min(cmax, 7); ++cu)
            for (uint16_t cl : clusters) {
              cublasLtMatmulAlgo_t a = base;
              int32_t one_split = 1;
              uint32_t none = 0;
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                                   sizeof(tile));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stg,
                                                   sizeof(stg));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &cu,
                                                   sizeof(cu));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                   &one_split, sizeof(one_split));
              cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                   &none, sizeof(none));
              if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                                       &cl, sizeof(cl)) != 0 &&
                  cl != 0)
                continue;
              cublasLtMatmulHeuristicResult_t chk;
              ++tried;
              if (cublasLtMatmulAlgoCheck(lt, g.op, g.a, g.b, g.d, g.d, &a, &chk) != 0) continue;
              if (chk.workspaceSize > ws_size) continue;
              if (launch(a, 0) != 0) {
                cudaGetLastError();
                continue;
              }
              if (cudaStreamSynchronize(st) != 0) {
                cudaGetLastError();
                continue;
              }
              ++ran;
              CK(cudaMemcpy(have.data(), y, have.size() * 2, cudaMemcpyDeviceToHost));
              if (std::memcmp(have.data(), want.data(), have.size() * 2) != 0) continue;
              ++same;
              cands.push_back({time_us(st, 3, 20, [&](int i) { launch(a, i); }), a});
            }
    }
    std::sort(cands.begin(), cands.end(), [](const Cand& p, const Cand& q) { return p.us < q.us; });
    if (cands.size() > 8) cands.resize(8);
    for (auto& c : cands) c.us = time_us(st, 9, 60, [&](int i) { launch(c.algo, i); });
    std::sort(cands.begin(), cands.end(), [](const Cand& p, const Cand& q) { return p.us < q.us; });
    const double flop = 2.0 * M * s.n * s.k;
    if (cands.empty()) {
      std::printf("%-16s %7.1f %7.1f | none (%d/%d/%d)\n", s.name, heur, flop / heur * 1e-6,
                  tried, ran, same);
    } else {
      const auto& a = cands[0].algo;
      std::printf("%-16s %7.1f %7.1f | %7.1f %7.1f  %5d %5d %6d %6d %5d  %d/%d/%d\n", s.name, heur,
                  flop / heur * 1e-6, cands[0].us, flop / cands[0].us * 1e-6,
                  attr(a, CUBLASLT_ALGO_CONFIG_ID), attr(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  attr(a, CUBLASLT_ALGO_CONFIG_STAGES_ID), attr(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                  attr(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), tried, ran, same);
    }
    std::fflush(stdout);
    cublasLtMatmulPreferenceDestroy(pref);
    cudaFree(x);
    cudaFree(w);
    cudaFree(b);
    cudaFree(ybig);
    cudaFree(y);
  }
  return 0;
}

int main(int argc, char** argv) {
  const Shape shapes[] = {
      {"1.5B qkv+bias", 2048, 1536, true}, {"1.5B o_proj", 1536, 1536, false},
      {"1.5B gate_up", 17920, 1536, false}, {"1.5B down", 1536, 8960, false},
      {"0.5B qkv+bias", 1152, 896, true},   {"0.5B o_proj", 896, 896, false},
      {"0.5B gate_up", 9728, 896, false},   {"0.5B down", 896, 4864, false},
  };
  if (argc > 1 && std::strcmp(argv[1], "--all") == 0)
    return exhaustive(shapes, (int)(sizeof(shapes) / sizeof(shapes[0])));
  const int M = 512, MBIG = 4096;
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  void* ws = nullptr;
  const size_t ws_size = 1024;
  CK(cudaMalloc(&ws, ws_size));
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const Shape& s : shapes) {
    std::vector<__nv_bfloat16> hx((size_t)MBIG * s.k), hw((size_t)s.n * s.k), hb(s.n);
    for (auto& v : hx) v = __float2bfloat16(nd(rng));
    for (auto& v : hw) v = __float2bfloat16(nd(rng) * 0.02f);
    for (auto& v : hb) v = __float2bfloat16(nd(rng) * 0.02f);
    __nv_bfloat16 *x, *w, *b, *ybig, *y;
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMalloc(&w, hw.size() * 2));
    CK(cudaMalloc(&b, hb.size() * 2));
    CK(cudaMalloc(&ybig, (size_t)MBIG * s.n * 2));
    CK(cudaMalloc(&y, (size_t)M * s.n * 2));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    const void* bias = s.bias ? b : nullptr;
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &ws_size, sizeof(ws_size)));
    const float one = 1.f, zero = 0.f;
    // Reference: M = 4096 with the heuristic's first choice.
    std::vector<uint16_t> want((size_t)M * s.n);
    {
      Gemm g(MBIG, s.n, s.k, bias);
      cublasLtMatmulHeuristicResult_t h[1];
      int got = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.a, g.b, g.d, g.d, pref, 1, h, &got));
      CK(cublasLtMatmul(lt, g.op, &one, w, g.a, x, g.b, &zero, ybig, g.d, ybig, g.d, &h[0].algo,
                        ws, ws_size, st));
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(want.data(), ybig, want.size() * 2, cudaMemcpyDeviceToHost));
    }
    Gemm g(M, s.n, s.k, bias);
    cublasLtMatmulHeuristicResult_t h[64];
    int got = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.a, g.b, g.d, g.d, pref, 64, h, &got));
    const double flop = 2.0 * M * s.n * s.k;
    std::printf("== %s: M=%d N=%d K=%d, %d algorithms\n", s.name, M, s.n, s.k, got);
    std::printf("   rank  algo  tile stages splitK red swizzle custom  cluster     us   TFLOP/s  rows\n");
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < got; ++i) {
      const cublasLtMatmulAlgo_t& a = h[i].algo;
      auto run = [&] {
        return cublasLtMatmul(lt, g.op, &one, w, g.a, x, g.b, &zero, y, g.d, y, g.d, &a, ws,
                              ws_size, st);
      };
      if (run() != 0) {
        std::printf("   %4d  fails\n", i);
        continue;
      }
      CK(cudaStreamSynchronize(st));
      std::vector<uint16_t> have((size_t)M * s.n);
      CK(cudaMemcpy(have.data(), y, have.size() * 2, cudaMemcpyDeviceToHost));
      const bool same = std::memcmp(have.data(), want.data(), have.size() * 2) == 0;
      std::vector<float> t;
      for (int rep = 0; rep < 9; ++rep) {
        CK(cudaEventRecord(e0, st));
        for (int it = 0; it < 50; ++it) run();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.f / 50.f);
      }
      std::sort(t.begin(), t.end());
      const float us = t[4];
      std::printf("   %4d %5d %5d %6d %6d %3d %7d %6d %8d %6.1f %8.1f  %s\n", i,
                  attr(a, CUBLASLT_ALGO_CONFIG_ID), attr(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  attr(a, CUBLASLT_ALGO_CONFIG_STAGES_ID), attr(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                  attr(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                  attr(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                  attr(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                  attr(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), us, flop / us * 1e-6,
                  same ? "same" : "DIFFER");
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cudaFree(x);
    cudaFree(w);
    cudaFree(b);
    cudaFree(ybig);
    cudaFree(y);
  }
  return 0;
}

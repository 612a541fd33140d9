// The few libtorch C++ entry points tch does not bind: CUDA graphs (capture on a side stream,
// replay, a shared private memory pool) and the fused AdamW kernel.
//
// Every function catches C++ exceptions and reports them as a heap string the caller frees with
// vt_free_error (null on success): an exception must never unwind into Rust.
//
// Built with VERL_WITH_CUDA when the libtorch install has CUDA (libtorch_cuda + CUDA runtime
// headers); without it the graph functions report that CUDA graphs are unavailable.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "ext_util.h"

#include <cstdlib>
#include <stdexcept>

#include <cstring>
#include <map>
#include <mutex>
#include <exception>
#include <string>
#include <vector>

#ifdef VERL_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#endif

namespace vt_lt {
// lt_gemm.cpp: d = alpha * a^T b + beta * d through cuBLASLt, (alpha, beta) read on the device;
// false where it cannot run (the caller computes it otherwise).
bool grad_into(const at::Tensor& d, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& alpha_beta);
}  // namespace vt_lt

namespace {

std::vector<at::Tensor> tensor_list(at::Tensor** ts, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(*ts[i]);
  }
  return out;
}

#ifdef VERL_WITH_CUDA
// A graph plus the stream it is captured on and the stream that was current before.
struct Graph {
  at::cuda::CUDAGraph graph;
  c10::optional<c10::cuda::CUDAStream> side;
  c10::optional<c10::cuda::CUDAStream> previous;
};
#endif


// (alpha, beta) = (1, 1) as fp32 on `device`, made once per device.
const at::Tensor& unit_scales(const at::Device& device) {
  static std::mutex m;
  static std::map<int, at::Tensor>* per = new std::map<int, at::Tensor>();
  std::lock_guard<std::mutex> lock(m);
  auto it = per->find(device.index());
  if (it == per->end()) {
    it = per->emplace(device.index(), at::ones({2}, at::TensorOptions().dtype(at::kFloat).device(device))).first;
  }
  return it->second;
}

// y = x W^T (+ b) whose backward adds W's (and b's) gradient straight into W.grad (b.grad): where
// .grad exists, the weight-gradient GEMM accumulates into it (beta = 1: one GEMM and one rounding
// per micro-batch; on CUDA through vt_lt::grad_into, see below); where it does not, a plain GEMM
// becomes it.
// autograd's AccumulateGrad would add a separately computed gradient with its own kernel (an
// extra pass over every weight per micro-batch). W and b get no gradient through autograd:
// this is for backward() into .grad, not for autograd.grad with respect to them.
void accumulate_param_grads(at::Tensor& w, at::Tensor& b, const at::Tensor& gy2,
                            const at::Tensor& x);

struct LinearAccumFn : public torch::autograd::Function<LinearAccumFn> {
  // `b`: a tensor or None. It is not an autograd input (undefined tensors cannot be); its
  // gradient goes into its .grad like W's.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const c10::IValue& b) {
    ctx->save_for_backward({x});
    // The parameters themselves (not saved-variable copies): backward writes their .grad.
    ctx->saved_data["w"] = w;
    ctx->saved_data["b"] = b;
    return at::linear(x, w, b.isTensor() ? c10::optional<at::Tensor>(b.toTensor()) : c10::nullopt);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& gy = grads[0];
    const at::Tensor none;
    if (!gy.defined()) return {none, none, none};
    const at::Tensor x = ctx->get_saved_variables()[0];
    at::Tensor w = ctx->saved_data["w"].toTensor();
    const c10::IValue bv = ctx->saved_data["b"];
    at::Tensor b = bv.isTensor() ? bv.toTensor() : at::Tensor();
    const at::Tensor gy2 = gy.reshape({-1, w.size(0)});
    at::Tensor gx;
    if (ctx->needs_input_grad(0)) gx = at::mm(gy2, w).view(x.sizes());
    accumulate_param_grads(w, b, gy2, x);
    return {gx, none, none};
  }
};

// For the weight `w` [out, in] (and bias `b`, possibly undefined) of y = x w^T (+ b): adds
// gy2^T x into w.grad and gy2's column sums into b.grad (each made on first use), for the
// parameters that require grad. gy2 [rows, out], x [.., in].
void accumulate_param_grads(at::Tensor& w, at::Tensor& b, const at::Tensor& gy2,
                            const at::Tensor& x) {
  const int64_t in = w.size(1);
  if (w.requires_grad()) {
    const at::Tensor x2 = x.reshape({-1, in});
    at::Tensor& g = w.mutable_grad();
    if (g.defined()) {
      // On CUDA one cuBLASLt GEMM with its scale factors on the device: fp32 accumulation and
      // one rounding into .grad. libtorch's addmm_ (the fallback) rounds the product to .grad's
      // 16-bit dtype first: its results are those of a separate add.
      if (!(g.is_cuda() && vt_lt::grad_into(g, gy2, x2, unit_scales(g.device())))) {
        g.addmm_(gy2.t(), x2);
      }
    } else {
      g = at::mm(gy2.t(), x2);
    }
  }
  if (b.defined() && b.requires_grad()) {
    at::Tensor& g = b.mutable_grad();
    at::Tensor s = gy2.sum(0);
    if (g.defined()) {
      g.add_(s);
    } else {
      g = s;
    }
  }
}

// Two projections of one input (a SwiGLU MLP's gate and up): (x wa^T (+ ba), x wb^T (+ bb)),
// each weight's (and bias's) gradient added straight into its .grad as LinearAccumFn does, and
// x's gradient as one GEMM plus one accumulating GEMM (ga wa, then += gb wb in the second GEMM's
// epilogue) where autograd would run two GEMMs and a separate add (on CUDA the same bits:
// libtorch's addmm_ rounds a 16-bit product before adding; on the CPU it rounds once).
struct LinearPairAccumFn : public torch::autograd::Function<LinearPairAccumFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& wa,
                                                const at::Tensor& wb, const c10::IValue& ba,
                                                const c10::IValue& bb) {
    ctx->save_for_backward({x});
    ctx->saved_data["wa"] = wa;
    ctx->saved_data["wb"] = wb;
    ctx->saved_data["ba"] = ba;
    ctx->saved_data["bb"] = bb;
    const auto opt = [](const c10::IValue& v) {
      return v.isTensor() ? c10::optional<at::Tensor>(v.toTensor()) : c10::nullopt;
    };
    return {at::linear(x, wa, opt(ba)), at::linear(x, wb, opt(bb))};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor none;
    const at::Tensor x = ctx->get_saved_variables()[0];
    at::Tensor gx;
    for (int i = 0; i < 2; ++i) {
      const at::Tensor& gy = grads[i];
      if (!gy.defined()) continue;
      at::Tensor w = ctx->saved_data[i == 0 ? "wa" : "wb"].toTensor();
      const c10::IValue bv = ctx->saved_data[i == 0 ? "ba" : "bb"];
      at::Tensor b = bv.isTensor() ? bv.toTensor() : at::Tensor();
      const at::Tensor gy2 = gy.reshape({-1, w.size(0)});
      if (ctx->needs_input_grad(0)) {
        if (gx.defined()) {
          gx.addmm_(gy2, w);
        } else {
          gx = at::mm(gy2, w);
        }
      }
      accumulate_param_grads(w, b, gy2, x);
    }
    if (gx.defined()) gx = gx.view(x.sizes());
    return {gx, none, none, none, none};
  }
};

// embedding(W, ids) whose backward adds W's gradient straight into W.grad, touching only the
// rows of the ids present: `W.grad[ids] += dy` with duplicates summed in the accumulation type
// before one rounding per row (index_put_ with accumulate, sort-based on CUDA: deterministic), the
// positions holding `padding_idx` (>= 0) left out. Where W.grad does not exist it starts from
// zeros. autograd's embedding backward builds a dense [V, H] gradient (a zero fill of the whole
// table) that its accumulation then adds into W.grad: two passes over the table per micro-batch.
// W gets no gradient through autograd: for backward() into .grad, as LinearAccumFn.
struct EmbeddingAccumFn : public torch::autograd::Function<EmbeddingAccumFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& w,
                            const at::Tensor& ids, int64_t padding_idx) {
    ctx->save_for_backward({ids});
    ctx->saved_data["w"] = w;
    ctx->saved_data["pad"] = padding_idx;
    return at::embedding(w, ids, padding_idx, false, false);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& gy = grads[0];
    const at::Tensor none;
    at::Tensor w = ctx->saved_data["w"].toTensor();
    if (!gy.defined() || !w.requires_grad()) return {none, none, none};
    const at::Tensor ids = ctx->get_saved_variables()[0].reshape({-1});
    const int64_t pad = ctx->saved_data["pad"].toInt();
    at::Tensor g = gy.reshape({-1, w.size(1)});
    if (pad >= 0) g = g.masked_fill(ids.eq(pad).unsqueeze(1), 0);
    at::Tensor& grad = w.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(w, at::MemoryFormat::Contiguous);
    // On CUDA, accumulating index_put_ runs torch's sorting kernel. On
    // the CPU its accumulation races between threads (measured: two 2-thread runs of the same
    // step differed by 6e-8), so it takes index_add_, which walks the ids in order.
    if (grad.is_cuda()) {
      grad.index_put_({ids}, g.to(grad.scalar_type()), /*accumulate=*/true);
    } else {
      grad.index_add_(0, ids, g.to(grad.scalar_type()));
    }
    return {none, none, none};
  }
};

// y = x W^T whose backward adds W's gradient into caller-owned accumulators instead of handing
// it to autograd: `accs` are W's row blocks in order (several when W is a concatenation, such as
// q/k/v), each a contiguous tensor of its block's shape in any floating dtype. Each block's
// weight-gradient GEMM accumulates into its accumulator (beta = 1); from bf16/fp16 activations
// into an fp32 accumulator on CUDA the GEMM itself sums in fp32 (no rounding of the product to the
// activations' dtype, no separate conversion and add pass). W gets no gradient through autograd.
struct LinearIntoFn : public torch::autograd::Function<LinearIntoFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const std::vector<at::Tensor>& accs) {
    ctx->save_for_backward({x});
    ctx->saved_data["w"] = w;
    ctx->saved_data["accs"] = c10::List<at::Tensor>(accs);
    return at::linear(x, w);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& gy = grads[0];
    const at::Tensor none;
    if (!gy.defined()) return {none, none, none};
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor w = ctx->saved_data["w"].toTensor();
    const auto accs = ctx->saved_data["accs"].toTensorList();
    const int64_t out = w.size(0), in = w.size(1);
    const at::Tensor gy2 = gy.reshape({-1, out});
    at::Tensor gx;
    if (ctx->needs_input_grad(0)) gx = at::mm(gy2, w).view(x.sizes());
    const at::Tensor x2 = x.reshape({-1, in});
    int64_t row = 0;
    for (size_t i = 0; i < accs.size(); ++i) {
      at::Tensor acc = accs.get(i);
      const int64_t n = acc.size(0);
      const at::Tensor gt = gy2.narrow(1, row, n).t();
      row += n;
      if (acc.scalar_type() == gy2.scalar_type()) {
        acc.addmm_(gt, x2);
      } else if (acc.scalar_type() == at::kFloat && acc.is_cuda()) {
        at::addmm_out(acc, acc, gt, x2, at::kFloat);
      } else {
        acc.add_(at::mm(gt, x2));
      }
    }
    return {gx, none, none};
  }
};

}  // namespace

extern "C" {

void vt_free_error(char* e) { std::free(e); }

// torch.cuda.empty_cache(): returns the caching allocator's unused blocks to the driver (so other
// processes and cuMemGetInfo see the memory freed, e.g. after offloading to the host). No-op
// without CUDA.
char* vt_cuda_empty_cache() {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  });
}

// `torch.cuda.memory._set_allocator_settings(settings)`: parses allocator options
// ("expandable_segments:True", ...) into the caching allocator's configuration at run time; new
// segments follow them. Reports that CUDA is missing in a build without it.
char* vt_cuda_allocator_settings(const char* settings) {
  return vt_util::guarded([&] {
    if (settings == nullptr) throw std::invalid_argument("cuda_allocator_settings: null settings");
#ifdef VERL_WITH_CUDA
    c10::CachingAllocator::setAllocatorSettings(std::string(settings));
#else
    throw std::runtime_error("cuda_allocator_settings: this build of the torch extension has no CUDA");
#endif
  });
}

// The CUDA caching allocator's statistics for `device` into `out[0..5]`: bytes allocated now and at
// their peak (`torch.cuda.memory_allocated` / `max_memory_allocated`), reserved now and at their
// peak (`memory_reserved` / `max_memory_reserved`), and the bytes `torch.cuda.empty_cache()` would
// hand back to the driver (segments with no block in use: reserved - active - inactive split).
// All 0 without CUDA.
char* vt_cuda_memory_stats(int64_t device, int64_t* out) {
  return vt_util::guarded([&] {
    if (out == nullptr) throw std::invalid_argument("cuda_memory_stats: null output");
    for (int i = 0; i < 5; ++i) out[i] = 0;
#ifdef VERL_WITH_CUDA
    const auto s =
        c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = s.allocated_bytes[all].current;
    out[1] = s.allocated_bytes[all].peak;
    out[2] = s.reserved_bytes[all].current;
    out[3] = s.reserved_bytes[all].peak;
    const int64_t r = s.reserved_bytes[all].current - s.active_bytes[all].current -
                      s.inactive_split_bytes[all].current;
    out[4] = r > 0 ? r : 0;
#else
    (void)device;
#endif
  });
}

// Resets the caching allocator's peak statistics of `device` (`torch.cuda.reset_peak_memory_stats`):
// the next `max_allocated` / `max_reserved` readings are peaks since this call.
char* vt_cuda_reset_peak_memory_stats(int64_t device) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
#else
    (void)device;
#endif
  });
}

// `dst.copy_(src, non_blocking=true)`: between a CUDA tensor and pinned host memory the copy is
// queued on the current stream and the call returns at once.
char* vt_copy_nonblocking(at::Tensor* dst, at::Tensor* src) {
  return vt_util::guarded([&] {
    if (dst == nullptr || src == nullptr) throw std::invalid_argument("copy: null tensor");
    dst->copy_(*src, /*non_blocking=*/true);
  });
}

// torch.backends.cuda.preferred_blas_library("cublaslt"): every GEMM (mm, addmm, bmm, their
// backward) goes through cuBLASLt, whose workspace TORCH_CUBLASLT_WORKSPACE_SIZE sizes apart from
// cuBLAS's. The setter's one-time "experimental feature" warning is swallowed: the caller documents
// the choice. Errors without CUDA.
char* vt_prefer_cublaslt() {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    struct Quiet : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    at::globalContext().setBlasPreferredBackend(at::BlasBackend::Cublaslt);
    if (at::globalContext().blasPreferredBackend() != at::BlasBackend::Cublaslt) {
      throw std::runtime_error("libtorch kept its BLAS backend: cuBLASLt is not available");
    }
#else
    throw std::runtime_error("cuBLASLt: this build of the torch extension has no CUDA");
#endif
  });
}

// `p.grad = None` for each of n tensors: the next backward's gradient then becomes `.grad` as it
// is (no copy into a zero-filled buffer, no zero fill before it).
// Whether autograd records operations on this thread (c10's thread-local grad mode).
int vt_grad_enabled() { return c10::GradMode::is_enabled() ? 1 : 0; }

char* vt_clear_grads(at::Tensor** ts, int64_t n) {
  return vt_util::guarded([&] {
    for (int64_t i = 0; i < n; ++i) {
      if (ts[i] == nullptr) throw std::invalid_argument("clear_grads: null tensor");
      ts[i]->mutable_grad() = at::Tensor();
    }
  });
}

// Causal attention of variable-length sequences through libtorch's flash-attention kernel
// (`at::_flash_attention_forward` with cumulative lengths; autograd records its backward):
// `q` `[total_q, heads, D]`, `k`/`v` `[total_k, kv_heads, D]` (bf16/fp16, CUDA), `cu_q`/`cu_k`
// int32 `[B + 1]`. Sequence i's queries cu_q[i]..cu_q[i+1] attend to its keys cu_k[i]..cu_k[i+1]
// with the causal mask aligned to the bottom right (a sequence with fewer queries than keys holds
// the last ones). `*out`: a new heap tensor `[total_q, heads, D]`.
char* vt_varlen_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                          const at::Tensor* cu_q, const at::Tensor* cu_k, int64_t max_q,
                          int64_t max_k, at::Tensor** out) {
  return vt_util::guarded([&] {
    if (q == nullptr || k == nullptr || v == nullptr || cu_q == nullptr || cu_k == nullptr ||
        out == nullptr) {
      throw std::invalid_argument("varlen attention: null argument");
    }
    *out = nullptr;
    auto r = at::_flash_attention_forward(*q, *k, *v, *cu_q, *cu_k, max_q, max_k, 0.0,
                                          /*is_causal=*/true, /*return_debug_mask=*/false);
    *out = new at::Tensor(std::get<0>(r));
  });
}

// See LinearAccumFn: `*out` = x W^T (+ b) (a new heap tensor); `b` nullable.
char* vt_linear_accum(const at::Tensor* x, const at::Tensor* w, const at::Tensor* b,
                      at::Tensor** out) {
  return vt_util::guarded([&] {
    if (x == nullptr || w == nullptr || out == nullptr) {
      throw std::invalid_argument("linear_accum: null argument");
    }
    *out = nullptr;
    if (w->dim() != 2 || x->dim() < 1 || x->size(-1) != w->size(1)) {
      throw std::invalid_argument("linear_accum: expected x [.., in] and weight [out, in], found " +
                                  c10::str(x->sizes()) + " and " + c10::str(w->sizes()));
    }
    const c10::IValue bias = b != nullptr && b->defined() ? c10::IValue(*b) : c10::IValue();
    *out = new at::Tensor(LinearAccumFn::apply(*x, *w, bias));
  });
}

// (x wa^T (+ ba), x wb^T (+ bb)) recorded by autograd with LinearPairAccumFn's backward: new
// tensors in `*a_out` and `*b_out` (freed by the caller); `ba`, `bb` may be null.
char* vt_linear_pair_accum(const at::Tensor* x, const at::Tensor* wa, const at::Tensor* wb,
                           const at::Tensor* ba, const at::Tensor* bb, at::Tensor** a_out,
                           at::Tensor** b_out) {
  return vt_util::guarded([&] {
    if (x == nullptr || wa == nullptr || wb == nullptr || a_out == nullptr || b_out == nullptr) {
      throw std::invalid_argument("linear_pair_accum: null argument");
    }
    *a_out = nullptr;
    *b_out = nullptr;
    for (const at::Tensor* w : {wa, wb}) {
      if (w->dim() != 2 || x->dim() < 1 || x->size(-1) != w->size(1)) {
        throw std::invalid_argument(
            "linear_pair_accum: expected x [.., in] and weights [out, in], found " +
            c10::str(x->sizes()) + " and " + c10::str(w->sizes()));
      }
    }
    const auto iv = [](const at::Tensor* t) {
      return t != nullptr && t->defined() ? c10::IValue(*t) : c10::IValue();
    };
    auto res = LinearPairAccumFn::apply(*x, *wa, *wb, iv(ba), iv(bb));
    *a_out = new at::Tensor(res[0]);
    *b_out = new at::Tensor(res[1]);
  });
}

// See EmbeddingAccumFn: `*out` = embedding(W, ids) (a new heap tensor); `padding_idx` < 0 for none.
char* vt_embedding_accum(const at::Tensor* w, const at::Tensor* ids, int64_t padding_idx,
                         at::Tensor** out) {
  return vt_util::guarded([&] {
    if (w == nullptr || ids == nullptr || out == nullptr) {
      throw std::invalid_argument("embedding_accum: null argument");
    }
    *out = nullptr;
    if (w->dim() != 2) {
      throw std::invalid_argument("embedding_accum: expected a weight [rows, dim], found " +
                                  c10::str(w->sizes()));
    }
    if (padding_idx >= w->size(0)) {
      throw std::invalid_argument("embedding_accum: padding_idx " + std::to_string(padding_idx) +
                                  " is not a row of a table of " + std::to_string(w->size(0)));
    }
    *out = new at::Tensor(EmbeddingAccumFn::apply(*w, *ids, padding_idx));
  });
}

// LinearIntoFn: `accs` (n of them) are W's row blocks' gradient accumulators.
char* vt_linear_into(const at::Tensor* x, const at::Tensor* w, at::Tensor** accs, int64_t n,
                     at::Tensor** out) {
  return vt_util::guarded([&] {
    if (x == nullptr || w == nullptr || out == nullptr || (n > 0 && accs == nullptr)) {
      throw std::invalid_argument("linear_into: null argument");
    }
    *out = nullptr;
    if (w->dim() != 2 || x->dim() < 1 || x->size(-1) != w->size(1)) {
      throw std::invalid_argument("linear_into: expected x [.., in] and weight [out, in], found " +
                                  c10::str(x->sizes()) + " and " + c10::str(w->sizes()));
    }
    std::vector<at::Tensor> list = tensor_list(accs, n);
    int64_t rows = 0;
    for (const at::Tensor& a : list) {
      if (a.dim() != 2 || a.size(1) != w->size(1) || !a.is_contiguous() ||
          a.device() != w->device() || !at::isFloatingType(a.scalar_type())) {
        throw std::invalid_argument(
            "linear_into: expected contiguous floating accumulators [rows, " +
            std::to_string(w->size(1)) + "] on the weight's device, found " +
            c10::str(a.sizes()) + " " + c10::str(a.scalar_type()));
      }
      rows += a.size(0);
    }
    if (rows != w->size(0)) {
      throw std::invalid_argument("linear_into: accumulators hold " + std::to_string(rows) +
                                  " rows, the weight " + std::to_string(w->size(0)));
    }
    *out = new at::Tensor(LinearIntoFn::apply(*x, *w, list));
  });
}

// torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=keep_graph, allow_unused=True):
// the gradients of `inputs` (n_in slots of `out`; null where unreachable or not requiring grad)
// given those of `outputs`, without building a surrogate loss.
char* vt_grad(at::Tensor** outputs, at::Tensor** grad_outputs, int64_t n_out, at::Tensor** inputs,
              int64_t n_in, int keep_graph, at::Tensor** out) {
  return vt_util::guarded([&] {
    if ((n_out > 0 && (outputs == nullptr || grad_outputs == nullptr)) ||
        (n_in > 0 && (inputs == nullptr || out == nullptr))) {
      throw std::invalid_argument("grad: null argument");
    }
    for (int64_t i = 0; i < n_in; ++i) out[i] = nullptr;
    std::vector<at::Tensor> outs = tensor_list(outputs, n_out);
    std::vector<at::Tensor> gos = tensor_list(grad_outputs, n_out);
    std::vector<at::Tensor> ins;
    std::vector<int64_t> where;
    for (int64_t i = 0; i < n_in; ++i) {
      if (inputs[i] != nullptr && inputs[i]->defined() && inputs[i]->requires_grad()) {
        ins.push_back(*inputs[i]);
        where.push_back(i);
      }
    }
    if (ins.empty()) return;
    const auto res = torch::autograd::grad(outs, ins, gos, keep_graph != 0,
                                           /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < res.size(); ++k) {
      if (res[k].defined()) out[where[k]] = new at::Tensor(res[k]);
    }
  });
}

int vt_cuda_graphs_compiled() {
#ifdef VERL_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

// torch.optim.AdamW(fused=True)'s step on n parameters: `steps[i]` are float scalars already
// holding this step's count (1 on the first step).
char* vt_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                     at::Tensor** exp_avg_sqs, at::Tensor** steps, int64_t n, double lr,
                     double beta1, double beta2, double weight_decay, double eps) {
  return vt_util::guarded([&] {
    auto p = tensor_list(params, n);
    auto g = tensor_list(grads, n);
    auto m = tensor_list(exp_avgs, n);
    auto v = tensor_list(exp_avg_sqs, n);
    auto s = tensor_list(steps, n);
    std::vector<at::Tensor> max_v;
    at::_fused_adamw_(p, g, m, v, max_v, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  });
}

char* vt_graph_new(void** out) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    *out = new Graph();
#else
    *out = nullptr;
    throw std::runtime_error("CUDA graphs: this build of the torch extension has no CUDA");
#endif
  });
}

void vt_graph_free(void* g) {
#ifdef VERL_WITH_CUDA
  delete static_cast<Graph*>(g);
#else
  (void)g;
#endif
}

// Makes a fresh non-default stream current (capture cannot run on the default stream), after
// the device has finished all queued work when `sync` is non-zero (work that runs eagerly on the
// side stream, a warm-up, must see it; a capture alone launches nothing, so the device may keep
// running queued work meanwhile). Work launched until vt_graph_end_side runs on it.
char* vt_graph_begin_side(void* g, int sync) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    auto* graph = static_cast<Graph*>(g);
    if (sync != 0) c10::cuda::device_synchronize();
    graph->previous = c10::cuda::getCurrentCUDAStream();
    graph->side = c10::cuda::getStreamFromPool();
    c10::cuda::setCurrentCUDAStream(*graph->side);
#else
    (void)g;
    (void)sync;
    throw std::runtime_error("CUDA graphs: this build of the torch extension has no CUDA");
#endif
  });
}

// Restores the stream that was current before vt_graph_begin_side, after the side stream's work.
char* vt_graph_end_side(void* g) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    auto* graph = static_cast<Graph*>(g);
    if (graph->side) {
      graph->side->synchronize();
    }
    if (graph->previous) {
      c10::cuda::setCurrentCUDAStream(*graph->previous);
    }
    graph->side.reset();
    graph->previous.reset();
#else
    (void)g;
#endif
  });
}

// Starts capturing the current (side) stream. `share` (nullable) is a graph whose private memory
// pool this one shares.
char* vt_graph_capture_begin(void* g, void* share) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    auto* graph = static_cast<Graph*>(g);
    at::cuda::MempoolId_t pool = {0, 0};
    if (share != nullptr) {
      pool = static_cast<Graph*>(share)->graph.pool();
    }
    graph->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
#else
    (void)g;
    (void)share;
    throw std::runtime_error("CUDA graphs: this build of the torch extension has no CUDA");
#endif
  });
}

char* vt_graph_capture_end(void* g) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    static_cast<Graph*>(g)->graph.capture_end();
#else
    (void)g;
    throw std::runtime_error("CUDA graphs: this build of the torch extension has no CUDA");
#endif
  });
}

// Launches the captured work on the current stream.
char* vt_graph_replay(void* g) {
  return vt_util::guarded([&] {
#ifdef VERL_WITH_CUDA
    static_cast<Graph*>(g)->graph.replay();
#else
    (void)g;
    throw std::runtime_error("CUDA graphs: this build of the torch extension has no CUDA");
#endif
  });
}

// libtorch's (kineto) profiler over this process: CUDA kernels and copies (and CPU-side aten ops
// with `cpu`) from vt_trace_start to vt_trace_stop, saved as a Chrome trace (JSON) at `path`.
char* vt_trace_start(int cpu) {
  return vt_util::guarded([&] {
    using torch::profiler::impl::ActivityType;
    using torch::profiler::impl::ProfilerConfig;
    using torch::profiler::impl::ProfilerState;
    const ProfilerConfig cfg(ProfilerState::KINETO);
    std::set<ActivityType> acts{ActivityType::CUDA};
    if (cpu != 0) acts.insert(ActivityType::CPU);
    torch::autograd::profiler::prepareProfiler(cfg, acts);
    torch::autograd::profiler::enableProfiler(cfg, acts);
  });
}

char* vt_trace_stop(const char* path) {
  return vt_util::guarded([&] {
    auto result = torch::autograd::profiler::disableProfiler();
    if (result && path != nullptr) result->save(path);
  });
}

}  // extern "C"

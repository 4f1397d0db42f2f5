// The backward's configuration sweeps, without JAX or XLA: they time launchers and
// configurations directly (CUDA events, CUDA graphs), which is how the llm.c kernels' default
// block sizes and kernel 11's and 12's configuration choices are set. How a call compares with a
// copy and with the peers is the kernel bench's question (python -m benchmarks.kernels);
// correctness is tests/cuda/check.cu's.
//
//   tune blocks ROWS C DTYPE [kernel ...]  time llm.c's kernels (default 1-10) at each block size
//   tune sweep ROWS C DTYPE [default]      time every kernel 11 and 12 configuration (or only
//                                          kernel 12's default), replayed from a CUDA graph (the
//                                          GPU's time alone), each with a correctness spot check
//
// Build (tools/tune/build.sh OUT_DIR tune does this):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness tools/tune/tune.cu ffi/registry.cc \
//        $(find ffi/kernels -name '*.cu') -o tune
#include "harness.cuh"

namespace {

// Times kernels 1-10 at each of their block sizes (median of 15 runs, CUDA events), on random
// data: what llm.c's own benchmark loop did, to pick each kernel's default block size.
int blocks(int64_t rows, int64_t C, Dtype d, const std::vector<int>& kernels) {
  const int sms = device0_attribute(cudaDevAttrMultiProcessorCount);
  const RefusalLimits device = device0_refusal_limits();
  const size_t it = dtype_item_bytes(d), st = dtype_acc_bytes(d);
  const double bytes = double(3 * rows * C + 3 * C) * it + 2.0 * rows * st;
  Problem pb(d, rows, C, 5);
  DeviceBuf dy(pb.h_dy.size()), x(pb.h_x.size()), dx(rows * C * it), w(C * it), dw(C * it), db(C * it),
      mean(rows * st), rstd(rows * st), ws(kWorkspaceHeaderBytes + 32 * int64_t(sms) * 2 * C * st);
  CHECK_CUDA(cudaMemcpy(dy.ptr, pb.h_dy.data(), pb.h_dy.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(x.ptr, pb.h_x.data(), pb.h_x.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(w.ptr, pb.h_w.data(), pb.h_w.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(mean.ptr, pb.h_mean.data(), pb.h_mean.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(rstd.ptr, pb.h_rstd.data(), pb.h_rstd.size(), cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0)); CHECK_CUDA(cudaEventCreate(&e1));
  std::printf("%s %lldx%lld (%.0f MB)\n", dtype_name(d), (long long)rows, (long long)C, bytes / 1e6);
  for (int kernel : kernels) {
    const KernelFacts& k = facts(kernel);
    if (!TakesDtype(k, d)) continue;
    for (int bs : BlockSizes(k)) {
      if (refuses(kernel, d, C, bs, device)) continue;
      NormBwdParams p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, rows, C, 1, 0, d, bs,
                           ws.ptr, ws.bytes};
      p.norm = NormKind::kLayerNorm;
      auto launch = [&] { return launch_kernel(kernel, p, 0); };
      cudaError_t err = launch();
      std::vector<float> ms;
      for (int i = 0; i < 15 && err == cudaSuccess; ++i) {
        CHECK_CUDA(cudaEventRecord(e0));
        err = launch();
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      if (err != cudaSuccess) {
        std::printf("  kernel %2d block_size %4d: %s\n", kernel, bs, cudaGetErrorString(err));
        continue;
      }
      std::sort(ms.begin(), ms.end());
      const double us = ms[ms.size() / 2] * 1e3;
      std::printf("  kernel %2d block_size %4d: %9.1f us %6.0f GB/s\n", kernel, bs, us, bytes / us / 1e3);
    }
  }
  return 0;
}

// The buffers and parameters of one full-size problem, every input byte 0x3c; sweep fills the
// inputs with random values.
struct FilledProblem {
  DeviceBuf dy, x, dx, w, dw, db, mean, rstd, ws;
  NormBwdParams p;
  FilledProblem(int64_t rows, int64_t C, Dtype d, int sms)
      : dy(rows * C * dtype_item_bytes(d)), x(rows * C * dtype_item_bytes(d)), dx(rows * C * dtype_item_bytes(d)), w(C * dtype_item_bytes(d)),
        dw(C * dtype_item_bytes(d)), db(C * dtype_item_bytes(d)), mean(rows * dtype_acc_bytes(d)), rstd(rows * dtype_acc_bytes(d)),
        ws(kWorkspaceHeaderBytes + std::min<int64_t>(rows, 4 * sms) * 2 * C * dtype_acc_bytes(d)),
        p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, rows, C, 1, 0, d, 0, ws.ptr, ws.bytes} {
    p.norm = NormKind::kLayerNorm;
    for (DeviceBuf* b : {&dy, &x, &w, &mean, &rstd}) CHECK_CUDA(cudaMemset(b->ptr, 0x3c, b->bytes));
  }
};

// Times every kernel 11 and kernel 12 configuration that fits, or only kernel 12's default.
int sweep(int64_t rows, int64_t C, Dtype d, bool default_only) {
  const int sms = device0_attribute(cudaDevAttrMultiProcessorCount);
  const size_t it = dtype_item_bytes(d);
  const double bytes = double(3 * rows * C + 3 * C) * it + 2.0 * rows * dtype_acc_bytes(d);
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0)); CHECK_CUDA(cudaEventCreate(&e1));
  // Median over 15 samples of 10 back-to-back calls, each call's time the sample's over 10. The
  // calls are replayed from a CUDA graph, as under XLA's command buffers: launched one by one, a
  // call whose kernel is shorter than the host's launch work times the host.
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto time_it = [&](auto&& fn) {
    constexpr int kCalls = 10;
    fn(stream);   // warm-up; the launchers' first call asks the driver about their kernel
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaGraphExec_t exec = nullptr;
    cudaGraph_t graph;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    for (int c = 0; c < kCalls; ++c) fn(stream);
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphDestroy(graph));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));   // the first replay uploads the graph
    std::vector<float> ms;
    for (int i = 0; i < 15; ++i) {
      CHECK_CUDA(cudaEventRecord(e0, stream));
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t / kCalls);
    }
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;   // median, microseconds
  };
  std::printf("%s %lldx%lld (%.0f MB)\n", dtype_name(d), (long long)rows, (long long)C, bytes / 1e6);

  // Device buffers for the kernel, filled like a real call: dy and x independent standard
  // normals, weight 1 + 0.1 N(0, 1), mean 0 and rstd 1 (x's own statistics, near enough). Data
  // that makes dx all zeros would time faster than the bench on the same configuration.
  Problem pb(d, std::min<int64_t>(rows, 64), C, 1);   // small reference problem, for a correctness spot check
  std::mt19937 gen(3);
  std::normal_distribution<double> n(0, 1);
  auto upload = [&](DeviceBuf& buf, Dtype as, auto&& value, size_t count) {
    std::vector<double> v(count);
    for (auto& e : v) e = value();
    std::vector<unsigned char> h;
    encode(as, v, h);
    CHECK_CUDA(cudaMemcpy(buf.ptr, h.data(), h.size(), cudaMemcpyHostToDevice));
  };
  const Dtype stat = d == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32;   // mean and rstd are acc_t
  FilledProblem f(rows, C, d, sms);
  upload(f.dy, d, [&] { return n(gen); }, rows * C);
  upload(f.x, d, [&] { return n(gen); }, rows * C);
  upload(f.w, d, [&] { return 1 + 0.1 * n(gen); }, C);
  upload(f.mean, stat, [] { return 0.0; }, rows);
  upload(f.rstd, stat, [] { return 1.0; }, rows);
  const NormBwdParams& p = f.p;
  Kernel11Config picked;
  const bool has_pick = kernel11_pick(d, C, C % (16 / it) == 0, device0_limits(), &picked);
  std::vector<Kernel11Config> cfgs;
  if (!default_only) cfgs = kernel11_candidates(d, C, C % (16 / it) == 0, device0_limits());
  for (const Kernel11Config& c : cfgs) {
    Outputs o;
    const cudaError_t err = run(pb, 11, 0, &c, &o, sms);
    const double e = err ? INFINITY : rel_err(d, o.dx, pb.ref_dx);
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(norm_bwd_kernel11_config(p, c, st)); });
    const bool is_pick = has_pick && c.nv == picked.nv && c.prefetch == picked.prefetch && c.tpr == picked.tpr &&
                         c.reg_sums == picked.reg_sums;
    std::printf("  vec=%d nv=%d prefetch=%d tpr=%4d groups=%3d sums=%s: %8.1f us %6.0f GB/s  dx err %.1e%s\n",
                c.vec, c.nv, int(c.prefetch), c.tpr, c.groups, c.reg_sums ? "regs" : "smem", us, bytes / us / 1e3, e,
                is_pick ? "  <- default" : "");
  }
  if (!has_pick && !default_only) {
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(norm_bwd_kernel11_wide(p, st)); });
    std::printf("  k11 wide path: %8.1f us %6.0f GB/s\n", us, bytes / us / 1e3);
  }
  if (kernel12_wide_fits(d, C, device0_limits()) && !default_only) {
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(norm_bwd_kernel12_wide(p, st)); });
    std::printf("  k12 wide path: %8.1f us %6.0f GB/s\n", us, bytes / us / 1e3);
  }
  Kernel12Config pick12;
  const bool has12 = kernel12_pick(d, C, device0_limits(), &pick12);
  Kernel12Config chunk_pick;   // small rows: the ring of row chunks' pick is the default
  const bool has_chunks = kernel12_chunk_pick(d, C, device0_limits(), &chunk_pick);
  for (const Kernel12Config& c : kernel12_candidates(d, C, device0_limits())) {
    const Kernel12Config& pick = c.chunks ? chunk_pick : pick12;
    const bool is_pick = (c.chunks ? has_chunks : has12) && c.nv == pick.nv && c.nb == pick.nb &&
                         c.tpr == pick.tpr && c.groups == pick.groups && c.raw_weight == pick.raw_weight &&
                         c.split == pick.split;
    if (default_only && !is_pick) continue;
    Outputs o;
    const cudaError_t err = run(pb, 12, 0, nullptr, &o, sms, 1, &c);
    const double e = err ? INFINITY : rel_err(d, o.dx, pb.ref_dx);
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(norm_bwd_kernel12_config(p, c, st)); });
    std::printf("  k12%s split=%d regs=%d raw_w=%d nv=%d nb=%d tpr=%4d groups=%2d: %8.1f us %6.0f GB/s  dx err %.1e%s\n",
                c.chunks ? " chunks" : "", c.split, int(c.regs), int(c.raw_weight), c.nv, c.nb, c.tpr, c.groups, us,
                bytes / us / 1e3, e,
                is_pick ? "  <- default" : "");
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "sweep" && (argc == 5 || (argc == 6 && std::string(argv[5]) == "default"))) {
    return sweep(std::atoll(argv[2]), std::atoll(argv[3]), parse_dtype(argv[4]), argc == 6);
  }
  if (mode == "blocks" && argc >= 5) {
    // The kernels with a list of block sizes to try (llm.c's 1-10), or those asked for.
    std::vector<int> kernels;
    for (int i = 5; i < argc; ++i) kernels.push_back(std::atoi(argv[i]));
    if (kernels.empty()) {
      for (const KernelFacts& k : AllKernels()) {
        if (k.max_block_size != 0) kernels.push_back(k.id);
      }
    }
    for (int id : kernels) {
      const KernelFacts* k = FindKernel(id);
      if (k == nullptr || k->max_block_size == 0) {
        std::fprintf(stderr, "tune blocks: kernel %d has no block sizes to try\n", id);
        return 2;
      }
    }
    return blocks(std::atoll(argv[2]), std::atoll(argv[3]), parse_dtype(argv[4]), kernels);
  }
  std::fprintf(stderr,
               "usage: tune blocks ROWS C DTYPE [kernel ...] | tune sweep ROWS C DTYPE [default]\n");
  return 2;
}

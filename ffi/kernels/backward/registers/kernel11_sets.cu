// QK-norm's backward in one launch: two sets of head rows (attention's q heads and k heads,
// common/head_rows.h), each with its own dweight, walked by one persistent grid of kernel 11's
// row loop (kernel11_body.cuh), then one finalize_partials launch for both dweights.
//
// Blocks are dealt to the sets in proportion to their rows (grouped-query attention has 4 to 8
// times more q heads than k heads), so that the two sets' blocks finish together; a set with
// rows gets at least one block. The configuration is kernel 11's pick for C, held to row groups
// of at most a warp (the head rows' widest is kHeadRowsMaxBytes).
#include <algorithm>

#include "backward/launch.cuh"
#include "backward/partials_finalize.h"
#include "backward/registers/kernel11.h"
#include "backward/registers/kernel11_body.cuh"

namespace lnbwd {
namespace {

// A block of kernel11_sets: the rows of its set, the set's blocks, and its slot in the set's
// segment of slots.
struct SetRows {
  int64_t first;   // the block's index among its set's blocks: its groups' first rows
  int64_t end;     // the set's rows
  int bps;         // the set's blocks
  size_t own_slot;
  HeadRows heads;
  __device__ __forceinline__ BlockRows rows() const { return {first, end, bps, 0}; }
  __device__ __forceinline__ size_t slot() const { return own_slot; }
};

// Two sets of head rows in one grid (QK-norm's q heads and k heads): blocks [0, blocks0) walk
// set 0's rows, the others set 1's, as kernel 11 walks a segment. The partial slots are two
// segments of gridDim.x slots each, set s's at [s * gridDim.x, (s + 1) * gridDim.x): a block
// writes its sums to its slot in its set's segment and zeros to its slot in the other, so that
// finalize_partials adds each set's slots as it adds any two segments'.
// HEADS: some set is head rows inside wider token rows (the fused projection); without, both sets
// are contiguous and the row loop is kernel 11's own (row * C), with no cursor to hold.
template <typename T, typename O, int VEC, int NV, bool PREFETCH, Rows R, bool HEADS>
__global__ void __launch_bounds__(block_threads<R, NV>(), min_blocks<R, NV, PREFETCH>())
kernel11_sets(acc_t<T>* __restrict__ partials, BwdSets<T, O> sets, int C, NormArgs<acc_t<T>> norm, int tpr,
              int groups) {
  using A = acc_t<T>;
  allow_finalize_launch();
  const int k = blockIdx.x >= static_cast<unsigned>(sets.blocks0);   // the block's set
  A* other = partials + (static_cast<size_t>(1 - k) * gridDim.x + blockIdx.x) * 2 * C;
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) __stcg(other + c, A(0));
  // Each field chosen by the (block-uniform) set: a select of two parameters, no local copy.
  auto pick = [k](auto a, auto b) { return k ? b : a; };
  const BwdSet<T, O>& s0 = sets.set[0];
  const BwdSet<T, O>& s1 = sets.set[1];
  const SetRows where{k ? blockIdx.x - sets.blocks0 : blockIdx.x, pick(s0.rows, s1.rows),
                      k ? static_cast<int>(gridDim.x) - sets.blocks0 : sets.blocks0,
                      static_cast<size_t>(k) * gridDim.x + blockIdx.x,
                      HeadRows{pick(s0.heads.heads, s1.heads.heads), pick(s0.heads.token_stride, s1.heads.token_stride)}};
  kernel11_body<T, O, false, VEC, NV, PREFETCH, R, HEADS>(pick(s0.dx, s1.dx), partials, pick(s0.dy, s1.dy),
                                                         pick(s0.x, s1.x), pick(s0.weight, s1.weight), nullptr,
                                                         pick(s0.mean, s1.mean), pick(s0.rstd, s1.rstd), where, C,
                                                         norm, tpr, groups);
}

// Blocks per set and the launch, for the kernel of this configuration (plan_only: the plan).
template <typename T, typename O, int VEC, int NV, bool PREFETCH, Rows R>
cudaError_t launch_sets(const NormBwdParams& a, const NormBwdParams& b, const Kernel11Config& cfg,
                        cudaStream_t stream) {
  constexpr bool compiled = VEC > 1 && variant(R, NV, PREFETCH);
  if constexpr (!compiled) {
    return cudaErrorInvalidValue;
  } else {
    const bool heads = a.heads.heads > 0 || b.heads.heads > 0;
    auto kernel = heads ? kernel11_sets<T, O, VEC, NV, PREFETCH, R, true> : kernel11_sets<T, O, VEC, NV, PREFETCH, R, false>;
    LaunchPlan own;
    LaunchPlan& plan = a.plan ? *a.plan : own;
    plan.kernel = 11;
    plan.path = "head rows, two sets";
    const int threads = cfg.tpr * cfg.groups;
    const size_t smem = kernel11_smem_bytes(cfg, a.C, sizeof(acc_t<T>));
    plan.threads = threads;
    plan.smem = smem;
    DeviceLimits lim;
    LNBWD_RETURN_IF_CUDA_ERROR(device_limits(a.device, &lim));
    if (smem > lim.smem_optin) return cudaErrorInvalidConfiguration;
    int resident = 0;
    LNBWD_RETURN_IF_CUDA_ERROR(
        resident_units(a.device, reinterpret_cast<const void*>(kernel), threads, smem, 1, &resident));
    if (resident < 1) return cudaErrorInvalidConfiguration;
    // As many blocks as fit at once, no more than the sets have steps of `groups` rows, and no
    // more than the workspace has pairs of slots (a block has one in each set's segment).
    const int need = (a.rows > 0) + (b.rows > 0);
    int64_t blocks = static_cast<int64_t>(resident) * lim.sms;
    blocks = std::min(blocks, ceil_div<int64_t>(a.rows, cfg.groups) + ceil_div<int64_t>(b.rows, cfg.groups));
    blocks = std::min(blocks, partial_slots<T>(a) / 2);
    if (blocks < std::max(need, 1) || blocks > INT32_MAX / 2) return cudaErrorInvalidValue;
    const double share = static_cast<double>(a.rows) / static_cast<double>(a.rows + b.rows);
    const int64_t blocks0 = std::clamp<int64_t>(static_cast<int64_t>(share * blocks + 0.5), a.rows > 0 ? 1 : 0,
                                                blocks - (b.rows > 0 ? 1 : 0));
    plan.blocks = blocks;
    plan.slots = 2 * blocks;
    plan.cooperative = false;
    plan.workspace_bytes =
        kWorkspaceHeaderBytes + static_cast<size_t>(plan.slots) * 2 * static_cast<size_t>(a.C) * sizeof(acc_t<T>);
    if (a.plan_only) return cudaSuccess;

    BwdSets<T, O> s;
    int i = 0;
    for (const NormBwdParams* p : {&a, &b}) {
      const bool rms = p->norm == NormKind::kRmsNorm;
      s.set[i].dx = static_cast<T*>(p->dx);
      s.set[i].dy = static_cast<const T*>(p->dy);
      s.set[i].x = static_cast<const T*>(p->x);
      s.set[i].weight = static_cast<const O*>(p->weight);
      s.set[i].mean = static_cast<const stat_t<T>*>(rms ? p->rstd : p->mean);
      s.set[i].rstd = static_cast<const stat_t<T>*>(p->rstd);
      s.set[i].rows = p->rows;
      s.set[i].heads = p->heads.heads > 0 ? p->heads : HeadRows{1, p->C};   // contiguous: a head a token
      ++i;
    }
    s.blocks0 = static_cast<int>(blocks0);
    const NormArgs<acc_t<T>> norm = {acc_t<T>(a.norm == NormKind::kRmsNorm ? 0 : 1),
                                      static_cast<acc_t<T>>(kernel_offset(a.norm, a.offset))};
    kernel<<<static_cast<unsigned int>(blocks), threads, smem, stream>>>(partials_of<T>(a), s, static_cast<int>(a.C),
                                                                        norm, cfg.tpr, cfg.groups);
    LNBWD_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    // Both dweights: segments of `blocks` slots each, into a.dweight's two rows.
    NormBwdParams f = a;
    f.segments = 2;
    f.dbias = nullptr;
    f.dresidual = nullptr;
    return finalize_partials_launch(f, lim, static_cast<int>(blocks), stream);
  }
}

template <typename T, typename O, int VEC>
cudaError_t launch_variant(const NormBwdParams& a, const NormBwdParams& b, const Kernel11Config& cfg,
                           cudaStream_t stream) {
  auto with_rows = [&](auto nv, auto prefetch) -> cudaError_t {
    constexpr int NV = decltype(nv)::value;
    constexpr bool PF = decltype(prefetch)::value;
    if (cfg.tpr == 32) return launch_sets<T, O, VEC, NV, PF, Rows::kWarps>(a, b, cfg, stream);
    if (cfg.tpr > 32 || cfg.tpr * cfg.groups != kSmallThreads) return cudaErrorInvalidValue;
    if (!cfg.reg_sums) return launch_sets<T, O, VEC, NV, PF, Rows::kSmallShared>(a, b, cfg, stream);
    return a.norm == NormKind::kRmsNorm ? launch_sets<T, O, VEC, NV, PF, Rows::kSmallRegsRms>(a, b, cfg, stream)
                                        : launch_sets<T, O, VEC, NV, PF, Rows::kSmallRegs>(a, b, cfg, stream);
  };
  using std::integral_constant;
  if (cfg.prefetch) {
    switch (cfg.nv) {
      case 1: return with_rows(integral_constant<int, 1>{}, std::true_type{});
      case 2: return with_rows(integral_constant<int, 2>{}, std::true_type{});
    }
    return cudaErrorInvalidValue;
  }
  switch (cfg.nv) {
    case 2: return with_rows(integral_constant<int, 2>{}, std::false_type{});
    case 3: if constexpr (sizeof(T) <= 4) return with_rows(integral_constant<int, 3>{}, std::false_type{}); break;
    case 4: return with_rows(integral_constant<int, 4>{}, std::false_type{});
  }
  return cudaErrorInvalidValue;
}

// What both sets must share, and what the sets' kernel cannot take.
bool sets_ok(const NormBwdParams& a, const NormBwdParams& b) {
  const bool rms = a.norm == NormKind::kRmsNorm;
  if (!rms && a.norm != NormKind::kLayerNorm) return false;
  if (b.dtype != a.dtype || b.C != a.C || b.weight_f32 != a.weight_f32 || b.norm != a.norm || b.offset != a.offset) {
    return false;
  }
  if (a.C < 1 || a.C * dtype_bytes(a.dtype) > kHeadRowsMaxBytes || a.dbias != nullptr) return false;
  for (const NormBwdParams* p : {&a, &b}) {
    if (p->rows < 0 || p->dresidual != nullptr || !head_rows_ok(p->heads, p->C) || rms != (p->mean == nullptr)) {
      return false;
    }
  }
  return true;
}

}  // namespace

cudaError_t norm_bwd_sets_config(const NormBwdParams& a, const NormBwdParams& b, const Kernel11Config& cfg,
                                 cudaStream_t stream) {
  if (!sets_ok(a, b)) return cudaErrorInvalidValue;
  return dispatch_types(a, [&](auto t, auto o, auto) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr int vec = 16 / sizeof(T);
    if (cfg.vec != vec || (!a.plan_only && (!can_vectorize<T>(a) || !can_vectorize<T>(b)))) {
      return cudaErrorInvalidValue;
    }
    return launch_variant<T, O, vec>(a, b, cfg, stream);
  });
}

cudaError_t norm_bwd_sets(const NormBwdParams& a, const NormBwdParams& b, cudaStream_t stream) {
  if (!sets_ok(a, b)) return cudaErrorInvalidValue;
  if (a.rows == 0 && b.rows == 0 && !a.plan_only) return cudaSuccess;
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(a.device, &lim));
  Kernel11Config cfg;
  if (!kernel11_pick(a.dtype, a.C, true, lim, &cfg, 32) || cfg.tpr > 32) return cudaErrorInvalidValue;
  return norm_bwd_sets_config(a, b, cfg, stream);
}

cudaError_t norm_bwd_sets_workspace_bytes(Dtype dtype, int64_t rows_a, int64_t rows_b, int64_t C, int device,
                                          LaunchPlan* plan) {
  NormBwdParams a = {};
  a.dtype = dtype;
  a.C = C;
  a.rows = rows_a;
  a.segments = 1;
  a.norm = NormKind::kRmsNorm;   // the plan is the same for both kinds
  a.workspace_bytes = SIZE_MAX;  // no limit from the workspace: this asks what it must hold
  a.device = device;
  a.plan = plan;
  a.plan_only = true;
  NormBwdParams b = a;
  b.rows = rows_b;
  b.plan = nullptr;
  if (rows_a + rows_b == 0) {
    *plan = LaunchPlan{};
    plan->workspace_bytes = kWorkspaceHeaderBytes;
    return cudaSuccess;
  }
  return norm_bwd_sets(a, b, nullptr);
}

}  // namespace lnbwd

// The kernel registry's table (see registry.h). llm.c's kernels 1-10 take their limits from
// kernels/backward/llmc/llmc_limits.h, which their launchers check too; kernels 11 and 12 take any
// C.
#include "registry.h"

#include "kernels/backward/llmc/llmc_limits.h"

namespace lnbwd {
namespace {

std::string Kernel(const KernelFacts& k) { return "kernel " + std::to_string(k.id); }

// llm.c's kernels: C a multiple of their vector step (kernels 8-9), and the block's dweight/dbias
// sums for all C columns in the device's shared memory.
std::string LlmcLimitsOf(const KernelFacts& k, const KernelRequest& r, const RefusalLimits& device) {
  const LlmcLimits l = llmc_limits(k.id, r.dtype, r.C, r.block_size);
  if (r.C % l.c_multiple != 0) {
    return Kernel(k) + " steps over rows in whole warps of 16-byte vectors: C must be a multiple of " +
           std::to_string(l.c_multiple) + " for " + dtype_name(r.dtype) + ", got C=" + std::to_string(r.C);
  }
  if (static_cast<int64_t>(l.smem_bytes) > device.max_smem_per_block) {
    return Kernel(k) + " keeps dweight/dbias sums for all C columns in shared memory: C=" + std::to_string(r.C) +
           " (" + dtype_name(r.dtype) + ", block_size " + std::to_string(l.block_size) + ") needs " +
           std::to_string(l.smem_bytes) + " bytes, more than the " + std::to_string(device.max_smem_per_block) +
           " a block may have on " + device.source;
  }
  return "";
}

// Kernels 11 and 12 take any C >= 1 (kernel 12 falls back to kernel 11 where its ring cannot go).
std::string AnyC(const KernelFacts&, const KernelRequest&, const RefusalLimits&) { return ""; }

constexpr unsigned kAll = dtype_bit(Dtype::kF32) | dtype_bit(Dtype::kBF16) | dtype_bit(Dtype::kF16) | dtype_bit(Dtype::kF64);

// What limits C for llm.c's kernels that keep all C columns' sums in shared memory.
#define LNBWD_SMEM_2C "2*C fp32 sums in shared memory: C up to 29056 on Hopper"
#define LNBWD_SMEM_2C_FLAG "2*C fp32 sums and a flag in shared memory: C up to 29055 on Hopper"
#define LNBWD_X128 "C a multiple of 128 (float32) or 256 (bfloat16, float16): whole warp steps of 16-byte vectors; "

// An llm.c kernel's entry: dtypes and block sizes from llmc_limits.h.
KernelFacts Llmc(int id, const char* name, const char* description, bool deterministic, bool precise,
                 const char* constraints) {
  const LlmcKernelFacts& f = kLlmcFacts[id];
  return KernelFacts{id, name, description, f.dtypes, 32, f.max_block_size, f.default_block_size,
                     deterministic, precise, /*segments=*/false, /*device_limited=*/true,
                     /*rmsnorm=*/kLlmcRunsRmsnorm, /*v2_operands=*/kLlmcTakesV2Operands, constraints, LlmcLimitsOf};
}

std::vector<KernelFacts> MakeTable() {
  return {
      Llmc(1, "naive",
           "llm.c kernel 1: a thread per row loops over C (uncoalesced), global fp32 atomicAdd into "
           "dweight/dbias (zeroed first)",
           false, true, "float32 only; any C >= 1"),
      Llmc(2, "smem_reduce",
           "llm.c kernel 2: a warp per row (cooperative groups), block sums in shared memory with shared "
           "atomics, global atomics into one fp32 scratch row, then a conversion kernel",
           false, true, "any C >= 1; " LNBWD_SMEM_2C),
      Llmc(3, "persistent_atomics",
           "llm.c kernel 3: persistent grid of warps, shared-memory sums, each block adds them into "
           "dweight/dbias with atomics in the output dtype (bf16/f16 atomics lose precision)",
           false, false, "any C >= 1; " LNBWD_SMEM_2C),
      Llmc(4, "atomic_cas_bf16",
           "llm.c kernel 4: kernel 3 with the final bf16 adds as atomicCAS loops on bf16 pairs (bf16 "
           "running sums lose precision)",
           false, false, "bfloat16 only; any C >= 1; " LNBWD_SMEM_2C),
      Llmc(5, "block_scratch",
           "llm.c kernel 5: one persistent block per SM, shared-memory sums written to per-block fp32 "
           "slots, the last block adds the slots",
           false, true, "any C >= 1; " LNBWD_SMEM_2C_FLAG),
      Llmc(6, "shared_scratch",
           "llm.c kernel 6: persistent warps, shared-memory sums added with global fp32 atomics into one "
           "scratch row, the last block converts it",
           false, true, "any C >= 1; " LNBWD_SMEM_2C_FLAG),
      Llmc(7, "no_cooperative_groups",
           "llm.c kernel 7: kernel 6 written with plain warp shuffles instead of cooperative groups",
           false, true, "any C >= 1; " LNBWD_SMEM_2C_FLAG),
      Llmc(8, "x128",
           "llm.c kernel 8: kernel 7 with 16-byte loads and stores, shared sums in a bank-conflict-free "
           "transposed order",
           false, true, LNBWD_X128 LNBWD_SMEM_2C_FLAG),
      Llmc(9, "block_reduce",
           "llm.c kernel 9: kernel 8 with a cross-warp reduction through shared memory instead of "
           "atomics, per-block fp32 slots added in order by the last block",
           true, true,
           LNBWD_X128 "2*C + 2*block_size fp32 in shared memory: C + block_size up to 29055 on Hopper"),
      Llmc(10, "vector_smem",
           "llm.c kernel 10: a warp per row, 16-byte loads, block sums of dweight/dbias in shared memory, "
           "last block adds per-block fp32 slots (repaired)",
           true, true, "2*C fp32 sums in shared memory: C up to about 25000 (bf16) / 27000 (fp32) on Hopper"),
      KernelFacts{11, "rows_in_registers",
                  "kernel 12's fallback: each row read once and kept in registers for both passes, 16-byte "
                  "streaming loads, persistent grid; each block writes its fp32 partial sums to a slot and a "
                  "second kernel adds the slots in order (with JAX_LNBWD_COOPERATIVE_FINISH=1, a grid that "
                  "fits on the GPU at once adds them itself after a grid-wide barrier)",
                  kAll, 0, 0, 0, true, true, true, false, /*rmsnorm=*/true, /*v2_operands=*/true,
                  "any C >= 1; block shape chosen from C (block_size 0 = auto); rows up to about 25000 "
                  "columns stay in registers, wider rows take two streaming passes",
                  AnyC},
      KernelFacts{12, "bulk_copy_ring",
                  "default on Hopper: rows streamed into a shared-memory ring by the bulk copy engine "
                  "(cp.async.bulk), several rows ahead; sums in registers; per-block fp32 partial sums in slots "
                  "added in order by a second kernel, as kernel 11's (the same opt-in grid-wide barrier)",
                  kAll, 0, 0, 0, true, true, true, false, /*rmsnorm=*/true, /*v2_operands=*/true,
                  "any C >= 1; the ring needs sm_90 and C*itemsize % 16 == 0 with two rows of dy and x per "
                  "buffer in 227 KB of shared memory; fp32/bf16/fp16 rows are split over a cluster of two "
                  "blocks (half a row each) from C = 4096 in 16-bit and where a whole row does not fit, up to "
                  "C = 16384 fp32 and 32768 16-bit (halves 16-byte aligned); other fp32 rows up to C = 16384 "
                  "stream in chunks, twice (wide-row path); otherwise kernel 11",
                  AnyC},
  };
}

}  // namespace

const std::vector<KernelFacts>& AllKernels() {
  static const std::vector<KernelFacts> table = MakeTable();
  return table;
}

const KernelFacts* FindKernel(int id) {
  for (const KernelFacts& k : AllKernels()) {
    if (k.id == id) return &k;
  }
  return nullptr;
}

int MinKernelId() { return AllKernels().front().id; }
int MaxKernelId() { return AllKernels().back().id; }

bool TakesDtype(const KernelFacts& k, Dtype d) { return (k.dtypes & dtype_bit(d)) != 0; }

std::vector<int> BlockSizes(const KernelFacts& k) {
  if (k.max_block_size == 0) return {0};
  std::vector<int> out;
  for (int bs = k.min_block_size; bs <= k.max_block_size; bs *= 2) out.push_back(bs);
  return out;
}

int ResolvedBlockSize(const KernelFacts& k, int block_size) {
  return block_size == 0 ? k.default_block_size : block_size;
}

std::string KernelIdsWith(bool KernelFacts::*fact) {
  std::vector<int> ids;
  for (const KernelFacts& k : AllKernels()) {
    if (k.*fact) ids.push_back(k.id);
  }
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == ids.size() ? " and " : ", ") + std::to_string(ids[i]);
  }
  return out;
}

std::string DtypeList(unsigned dtypes) {
  std::string out;
  for (Dtype d : kAllDtypes) {
    if (dtypes & dtype_bit(d)) out += (out.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  return out;
}

std::string KernelRefusal(const KernelFacts& k, const KernelRequest& r, const RefusalLimits& device) {
  if (!TakesDtype(k, r.dtype)) {
    return Kernel(k) + " does not support dtype " + dtype_name(r.dtype) + " (it takes " + DtypeList(k.dtypes) + ")";
  }
  const int bs = ResolvedBlockSize(k, r.block_size);
  const std::vector<int> sizes = BlockSizes(k);
  bool listed = false;
  for (int s : sizes) listed = listed || s == bs;
  if (!listed) {
    if (k.max_block_size == 0) {
      return Kernel(k) + " got block_size " + std::to_string(r.block_size) +
             " but expected 0: it chooses its block shape from C";
    }
    return Kernel(k) + " got block_size " + std::to_string(r.block_size) + " but expected 0 (its default, " +
           std::to_string(k.default_block_size) + ") or a power of two from " + std::to_string(k.min_block_size) +
           " to " + std::to_string(k.max_block_size);
  }
  if (!k.segments && (r.segments != 1 || r.weight_rows != 1)) {
    const std::string c = std::to_string(r.C);
    return Kernel(k) + " sums over all rows: 'dweight' must have shape (1, " + c + ") and 'weight' (1, " + c +
           "), got (" + std::to_string(r.segments) + ", " + c + ") and (" + std::to_string(r.weight_rows) + ", " +
           c + ")";
  }
  if (r.C < 1) return Kernel(k) + " needs C >= 1, got C=" + std::to_string(r.C);
  KernelRequest resolved = r;
  resolved.block_size = bs;
  return k.limits(k, resolved, device);
}

}  // namespace lnbwd

// Rows that are attention heads inside a wider token row: QK-norm on the fused QKV projection.
//
// The projection writes, for every token, the q heads, then the k heads, then the v heads, each
// C (head_dim) elements:
//   qkv[token] = [q_0 .. q_{Hq-1} | k_0 .. k_{Hk-1} | v_0 .. v_{Hk-1}],  width (Hq + 2 Hk) * C.
// QK-norm normalizes each q and k head as a row of its own, in place, without copying q and k
// out. A set of such rows (q's heads, or k's) is described by its first head's address and
//   heads         heads per token in the set (Hq, or Hk);
//   token_stride  elements from one token's row to the next (the projection's width),
// and row r of the set is head r % heads of token r / heads, at element
//   (r / heads) * token_stride + (r % heads) * C.
// heads = 0 means plain contiguous rows (row r at r * C), what every other launch has; the
// kernels that take head rows (forward_rows_sets, kernel11_sets) see contiguous rows as one head
// a token, token_stride = C.
//
// A kernel's thread walks rows r, r + stride, r + 2 stride, ... (stride = rows per grid step),
// so HeadCursor keeps (token, head) and adds (stride / heads, stride % heads) with a carry: one
// 64-bit division per thread at the start, none per row (a division per row would cost a
// small row's thread as many instructions as a third of its loads and sums).
#pragma once

#include <cstdint>
#include <type_traits>

namespace lnbwd {

// The widest row the head-row kernels hold: a warp of 32 threads with 4 vectors of 16 bytes each
// (bf16 rows of 1024, fp32 of 512, fp64 of 256). Wider rows, and rows not 16-byte aligned, are
// refused; jax_lnbwd reads this limit (ffi/module.cc) and normalizes them by two calls instead.
constexpr int64_t kHeadRowsMaxBytes = 32 * 4 * 16;

struct HeadRows {
  int64_t heads = 0;          // 0: contiguous rows
  int64_t token_stride = 0;   // elements between tokens (heads > 0)
};

#ifdef __CUDACC__
// The cursor a kernel holds for its rows: a HeadCursor for head rows, nothing for contiguous ones
// (no variable at all, so that their code is what it was before head rows existed).
struct NoCursor {};
struct HeadCursor;
struct HeadCursor {
  int64_t token = 0;
  int64_t head = 0;
  int64_t step_tokens = 0;   // stride / heads
  int64_t step_heads = 0;    // stride % heads

  HeadCursor() = default;
  __device__ __forceinline__ HeadCursor(const HeadRows& h, int64_t row, int64_t stride) {
    token = row / h.heads;
    head = row - token * h.heads;
    step_tokens = stride / h.heads;
    step_heads = stride - step_tokens * h.heads;
  }
  // The element offset of the cursor's row.
  __device__ __forceinline__ int64_t at(const HeadRows& h, int C) const { return token * h.token_stride + head * C; }
  // The cursor of the row `stride` further on.
  __device__ __forceinline__ HeadCursor next(const HeadRows& h) const {
    HeadCursor n = *this;
    n.token += step_tokens;
    n.head += step_heads;
    if (n.head >= h.heads) {
      n.head -= h.heads;
      ++n.token;
    }
    return n;
  }
};
template <bool HEADS>
using CursorOf = std::conditional_t<HEADS, HeadCursor, NoCursor>;
#endif

}  // namespace lnbwd

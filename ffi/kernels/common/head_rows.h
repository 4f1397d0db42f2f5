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
// The forward's threads take about one row each and compute its offset (head_row_offset); kernel
// 11's threads walk rows r, r + stride, r + 2 stride, ... (stride = rows per grid step) with a
// HeadCursor, which adds a fixed step per row and divides only once.
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

// Whether the launchers take this layout for rows of C elements: heads fit the kernels' 32-bit
// head counter, and a token's heads fit its stride.
inline bool head_rows_ok(const HeadRows& h, int64_t C) {
  return h.heads >= 0 && h.heads <= INT32_MAX && (h.heads == 0 || h.token_stride >= C);
}

#ifdef __CUDACC__
// The cursor a kernel holds for its rows: a HeadCursor for head rows, nothing for contiguous ones
// (no variable at all, so that their code is what it was before head rows existed).
struct NoCursor {};

// Row r's token and head: r / heads and r % heads. No division for contiguous rows (one head a
// token); 32 bits where r and heads fit (a 64-bit division is a long subroutine that costs a
// small row's thread as much as its loads, and registers).
struct TokenHead {
  int64_t token;
  int head;
};
__device__ __forceinline__ TokenHead token_head(const HeadRows& h, int64_t row) {
  if (h.heads == 1) return {row, 0};
  const int64_t token = ((row | h.heads) >> 31) == 0
                            ? static_cast<int64_t>(static_cast<uint32_t>(row) / static_cast<uint32_t>(h.heads))
                            : row / h.heads;
  return {token, static_cast<int>(row - token * h.heads)};
}

// The element offset of a row at token th.token, head th.head: token * token_stride + head * C.
__device__ __forceinline__ int64_t head_row_offset(const HeadRows& h, int C, TokenHead th) {
  return th.token * h.token_stride + static_cast<int64_t>(th.head) * C;
}
// The element offset of row r. The forward, whose threads take about one row each, asks this per
// row.
__device__ __forceinline__ int64_t head_row_offset(const HeadRows& h, int C, int64_t row) {
  return head_row_offset(h, C, token_head(h, row));
}

// The cursor of a thread that walks many rows (kernel 11's persistent grid): the row's offset and
// head, moved by a fixed step of (stride / heads) tokens and (stride % heads) heads, plus one token
// when the heads carry past `heads`. Per row one 64-bit add, one 32-bit add and a compare; the
// divisions are once per thread.
struct HeadCursor {
  int64_t offset = 0;      // the row's first element
  int64_t step = 0;        // stride / heads tokens and stride % heads heads further on
  int head = 0;            // the row's head, < heads
  int step_heads = 0;      // stride % heads

  HeadCursor() = default;
  __device__ __forceinline__ HeadCursor(const HeadRows& h, int C, int64_t row, int64_t stride) {
    const TokenHead steps = token_head(h, stride);
    const TokenHead first = token_head(h, row);
    offset = head_row_offset(h, C, first);
    head = first.head;
    step_heads = steps.head;
    step = steps.token * h.token_stride + static_cast<int64_t>(steps.head) * C;
  }
  // The element offset of the cursor's row.
  __device__ __forceinline__ int64_t at() const { return offset; }
  // The cursor of the row `stride` further on: past the last head, the next token's heads
  // (token_stride on from the token's first head, heads * C on from the head past its last).
  __device__ __forceinline__ HeadCursor next(const HeadRows& h, int C) const {
    HeadCursor n = *this;
    n.offset += step;
    n.head += step_heads;
    if (n.head >= h.heads) {
      n.head -= static_cast<int>(h.heads);
      n.offset += h.token_stride - h.heads * C;
    }
    return n;
  }
};
template <bool HEADS>
using CursorOf = std::conditional_t<HEADS, HeadCursor, NoCursor>;
#endif

}  // namespace lnbwd

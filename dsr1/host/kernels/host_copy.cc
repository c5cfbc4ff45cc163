// Host copies for loading weights on CPU (dsr1/cpu/host_copy.py), built into the same library as
// rows_dot.cc: a transpose of one matrix, and the table lookup that dequantizes FP8 blocks. Loops
// over cache-sized tiles (bf16 transposed 8 x 8 at a time in SSE registers); the callers run them
// in threads (ctypes releases the GIL), each call a part of a weight: numpy's copy of a transposed
// view is several times slower, and its `take` of FP8 codes holds the GIL.
#include <emmintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kTile = 64;  // 64 x 64 elements: a tile of the source and of the result stay in L1

// An 8 x 8 square of 2-byte elements transposed in registers (unpacks of 16-, 32-, then 64-bit lanes):
// twice the scalar loop's speed.
inline void transpose_8x8(const uint16_t* src, int64_t src_stride, uint16_t* dst, int64_t dst_stride) {
  __m128i a[8], b[8], c[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      c[4 * i + 2 * j] = _mm_unpacklo_epi32(b[4 * i + j], b[4 * i + j + 2]);
      c[4 * i + 2 * j + 1] = _mm_unpackhi_epi32(b[4 * i + j], b[4 * i + j + 2]);
    }
  for (int i = 0; i < 4; ++i) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i * dst_stride), _mm_unpacklo_epi64(c[i], c[i + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * i + 1) * dst_stride), _mm_unpackhi_epi64(c[i], c[i + 4]));
  }
}

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols, tile by tile; 2-byte
// elements in 8 x 8 squares where whole ones fit.
template <typename T>
void transpose(const T* src, int64_t rows, int64_t cols, int64_t src_stride, T* dst, int64_t dst_stride) {
  constexpr int64_t kSquare = sizeof(T) == 2 ? 8 : 1;
  for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
    const int64_t c1 = std::min(cols, c0 + kTile);
    for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile);
      for (int64_t c = c0; c < c1; c += kSquare)
        for (int64_t r = r0; r < r1; r += kSquare) {
          if constexpr (kSquare == 8) {
            if (c + 8 <= c1 && r + 8 <= r1) {
              transpose_8x8(src + r * src_stride + c, src_stride, dst + c * dst_stride + r, dst_stride);
              continue;
            }
          }
          for (int64_t j = c; j < std::min(c + kSquare, c1); ++j)
            for (int64_t i = r; i < std::min(r + kSquare, r1); ++i) dst[j * dst_stride + i] = src[i * src_stride + j];
        }
    }
  }
}

// out[r * out_rows + c * out_cols] = tables[block(r, c)][codes[r * code_stride + c]]: each code looked
// up in the 256-entry table of its `block`-square block, counted from (row0, col0), the region's place
// in the whole weight (its first blocks may be partial). `tables` is [blocks down][blocks across][256].
// The loops follow `out`'s memory: row by row, or column by column where `out` is a transposed view.
template <typename T>
void take_blocks(const uint8_t* codes, int64_t rows, int64_t cols, int64_t code_stride, const T* tables,
                 int64_t block, int64_t row0, int64_t col0, T* out, int64_t out_rows, int64_t out_cols) {
  const int64_t across = (col0 + cols - 1) / block - col0 / block + 1;
  for (int64_t a = 0; a < rows;) {
    const int64_t b = std::min(rows, ((row0 + a) / block + 1) * block - row0);
    for (int64_t c = 0; c < cols;) {
      const int64_t d = std::min(cols, ((col0 + c) / block + 1) * block - col0);
      const T* table = tables + (((row0 + a) / block - row0 / block) * across + (col0 + c) / block - col0 / block) * 256;
      if (out_cols < out_rows) {
        for (int64_t r = a; r < b; ++r)
          for (int64_t j = c; j < d; ++j) out[r * out_rows + j * out_cols] = table[codes[r * code_stride + j]];
      } else {
        for (int64_t j = c; j < d; ++j)
          for (int64_t r = a; r < b; ++r) out[r * out_rows + j * out_cols] = table[codes[r * code_stride + j]];
      }
      c = d;
    }
    a = b;
  }
}

}  // namespace

extern "C" {

void dsr1_transpose_1(const uint8_t* src, int64_t rows, int64_t cols, int64_t src_stride, uint8_t* dst,
                      int64_t dst_stride) {
  transpose(src, rows, cols, src_stride, dst, dst_stride);
}
void dsr1_transpose_2(const uint16_t* src, int64_t rows, int64_t cols, int64_t src_stride, uint16_t* dst,
                      int64_t dst_stride) {
  transpose(src, rows, cols, src_stride, dst, dst_stride);
}
void dsr1_transpose_4(const uint32_t* src, int64_t rows, int64_t cols, int64_t src_stride, uint32_t* dst,
                      int64_t dst_stride) {
  transpose(src, rows, cols, src_stride, dst, dst_stride);
}

void dsr1_take_blocks_2(const uint8_t* codes, int64_t rows, int64_t cols, int64_t code_stride, const uint16_t* tables,
                        int64_t block, int64_t row0, int64_t col0, uint16_t* out, int64_t out_rows, int64_t out_cols) {
  take_blocks(codes, rows, cols, code_stride, tables, block, row0, col0, out, out_rows, out_cols);
}
void dsr1_take_blocks_4(const uint8_t* codes, int64_t rows, int64_t cols, int64_t code_stride, const uint32_t* tables,
                        int64_t block, int64_t row0, int64_t col0, uint32_t* out, int64_t out_rows, int64_t out_cols) {
  take_blocks(codes, rows, cols, code_stride, tables, block, row0, col0, out, out_rows, out_cols);
}

}  // extern "C"

// dsr1's CPU kernel for decode products: y[g, r, o] = sum_i x[g, r, i] * w[index, g, o, i], or
// w[index[g], o, i] (the `_each` handlers: each group of rows its own matrix, an expert loop's blocks;
// `dsr1_bf16_rows_dot_*`: bf16 rows with `vdpbf16ps`; `dsr1_swiglu_rows_dot`, `dsr1_combine_rows_dot`:
// an expert loop's three products in two calls; `dsr1_mla_decode_context` (and `_bf16_`, `_int8_`,
// `_bf16_int8_`): decode attention; `dsr1_rows_matmul_f32`: the router's logits;
// `dsr1_rows_dot_each_amx`: blocks of many bf16 rows, a prefill's, on AMX tiles, at the end).
//
// A few float32 rows (a decode batch, an expert's block of rows) against one matrix of a stack
// whose values are bf16 bits (uint16) or int8, stored transposed (`[..., out, in]`); `g` counts
// independent products (attention heads), 1 for most. Each weight
// row is read once for all rows and widened to float32 in registers, so the product runs at memory
// speed where XLA:CPU, from two rows on, writes a widened float32 copy of the weight first (see
// dsr1/cpu/ffi.py). The matrix is picked by `index` inside the stack (an expert of a layer),
// so no slice of it is copied out first. Built by cpu_kernels.py for the CPU it runs on (x86-64 with
// AVX-512, or AVX2 and FMA).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The vectors the CPU has: 16 float32 lanes with AVX-512, else 8 with AVX2 and FMA.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec zeros() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline float sum(Vec a) { return _mm512_reduce_add_ps(a); }
inline Vec widen_lanes(const uint16_t* p) {  // bf16 bits are the high half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec widen_lanes(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec round_to_int(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec a, Vec n) { return _mm512_scalef_ps(a, n); }  // a * 2^n, n an integer
inline Vec round_bf16_lanes(Vec a) {  // to the nearest bf16, ties to even (finite values)
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(int32_t(0xffff0000u))));
}
inline void store_high_halves(uint16_t* p, Vec a) {  // each lane's high 16 bits (a bf16 value's bits)
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(a), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
// Lane i of the result = the sum of acc[i]'s lanes: 16 sums in 15 adds of whole vectors and their
// shuffles, where 16 reductions one by one take ~8 instructions each.
inline Vec lane_sums(const Vec (&acc)[kLanes]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = acc[2i], b = acc[2i+1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum of acc[4i], ..., acc[4i+3]
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec zeros() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline float sum(Vec a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline Vec widen_lanes(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec widen_lanes(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec round_to_int(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec a, Vec n) {  // a * 2^n, n an integer in [-252, 254]: two normal powers of two
  const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(a, pow2(half)), pow2(_mm256_sub_epi32(whole, half)));
}
inline Vec round_bf16_lanes(Vec a) {  // to the nearest bf16, ties to even (finite values)
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int32_t(0xffff0000u))));
}
inline void store_high_halves(uint16_t* p, Vec a) {  // each lane's high 16 bits (a bf16 value's bits)
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(a), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}
// Lane i of the result = the sum of acc[i]'s lanes (as the AVX-512 variant, 8 vectors).
inline Vec lane_sums(const Vec (&acc)[kLanes]) {
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(pairs[2 * i]), b = _mm256_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#else
#error "dsr1's rows_dot kernel needs AVX2 and FMA, or AVX-512 (dsr1 falls back to XLA's own products)"
#endif

inline float widen(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;  // bf16 is the high half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(int8_t v) { return float(v); }

// e^x of every lane for x <= 0 (scores less their maximum) to ~1 ulp of float32: Cephes' expf, a
// polynomial of r = x - n ln 2 (|r| <= ln 2 / 2, ln 2 in two parts), times 2^n.
inline Vec exp_lanes(Vec x) {
  x = max(x, broadcast(-104.0f));  // e^-104 is below float32's smallest denormal
  const Vec n = round_to_int(mul(x, broadcast(1.44269504088896341f)));
  Vec r = fmadd(n, broadcast(-0.693359375f), x);
  r = fmadd(n, broadcast(2.12194440e-4f), r);
  Vec p = broadcast(1.9875691500e-4f);
  for (const float coefficient : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                                  5.0000001201e-1f})
    p = fmadd(p, r, broadcast(coefficient));
  return times_pow2(fmadd(p, mul(r, r), add(r, broadcast(1.0f))), n);
}

// Software prefetch, into L2 (an L1 prefetch holds one of L1's few fill buffers until its line
// arrives): the hardware prefetchers alone leave blocks of many rows (more compute per byte) well
// below the memory's speed, and 4 KB ahead into L2 serves one row and many alike.
constexpr int64_t kPrefetchBytes = 4096;

// R rows against the weight rows (output columns) [o0, o1). U vectors per step keep enough
// independent multiply-adds in flight for few rows (R * U accumulators); a row's summation order
// depends on U only.
template <typename T, int R, int U = (R >= 4 ? 1 : 4 / R)>
void rows_block(const float* x, const T* w, float* y, int64_t in, int64_t out, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const T* wo = w + o * in;
    Vec acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = zeros();
    int64_t i = 0;
    for (; i + kLanes * U <= in; i += kLanes * U)
      for (int u = 0; u < U; ++u) {
        const T* block = wo + i + kLanes * u;
        if ((i + kLanes * u) * int64_t(sizeof(T)) % 64 == 0)  // once per cache line: the line 4 KB ahead
          _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T1);
        const Vec wv = widen_lanes(block);
        for (int r = 0; r < R; ++r) acc[r][u] = fmadd(load(x + r * in + i + kLanes * u), wv, acc[r][u]);
      }
    for (; i + kLanes <= in; i += kLanes) {  // whole vectors left over: into the first sums
      const Vec wv = widen_lanes(wo + i);
      for (int r = 0; r < R; ++r) acc[r][0] = fmadd(load(x + r * in + i), wv, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      Vec a = acc[r][0];
      for (int u = 1; u < U; ++u) a = add(a, acc[r][u]);
      float s = sum(a);
      for (int64_t k = i; k < in; ++k) s += x[r * in + k] * widen(wo[k]);
      y[r * out + o] = s;
    }
  }
}

// bf16 rows (their bits) against bf16 bits with AVX-512 BF16's `vdpbf16ps`: 32 multiply-adds of
// bf16 pairs into 16 float32 sums per instruction, the weight used as loaded, so twice the
// multiply-adds of the float32 path per instruction and no widening. Where the CPU runs it about as
// fast as a float32 FMA products of several rows become memory-bound again; some CPUs run it at a
// quarter of their FMA rate (`dsr1_bf16_dot_rate` measures it).
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

inline __m512bh bf16_lanes(const uint16_t* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

template <int R>
void bf16_rows_block(const uint16_t* x, const uint16_t* w, float* y, int64_t in, int64_t out, int64_t o0,
                     int64_t o1) {
  constexpr int U = R >= 3 ? 2 : 4;  // independent sums in flight: the instruction's latency is ~6 cycles
  for (int64_t o = o0; o < o1; ++o) {
    const uint16_t* wo = w + o * in;
    __m512 acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 * U <= in; i += 32 * U)
      for (int u = 0; u < U; ++u) {
        const uint16_t* block = wo + i + 32 * u;  // 64 bytes: a cache line
        _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T1);
        const __m512bh wv = bf16_lanes(block, ~__mmask32(0));
        for (int r = 0; r < R; ++r)
          acc[r][u] = _mm512_dpbf16_ps(acc[r][u], bf16_lanes(x + r * in + i + 32 * u, ~__mmask32(0)), wv);
      }
    for (; i < in; i += 32) {  // the rest: zeros past the end add nothing
      const __mmask32 mask = in - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (in - i)) - 1;
      const __m512bh wv = bf16_lanes(wo + i, mask);
      for (int r = 0; r < R; ++r) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], bf16_lanes(x + r * in + i, mask), wv);
    }
    for (int r = 0; r < R; ++r) {
      __m512 a = acc[r][0];
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
      y[r * out + o] = _mm512_reduce_add_ps(a);
    }
  }
}
#else
constexpr bool kBf16Dot = false;

template <int R>
void bf16_rows_block(const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

constexpr int kMaxBlockRows = 8;

// R rows of x (float32, or bf16 bits against bf16 bits: `vdpbf16ps`), R <= kMaxBlockRows.
template <typename X, typename T, int R = kMaxBlockRows>
void rows_tail(const X* x, const T* w, float* y, int64_t rows, int64_t in, int64_t out, int64_t o0,
               int64_t o1) {
  if constexpr (R > 0) {
    if (rows != R) return rows_tail<X, T, R - 1>(x, w, y, rows, in, out, o0, o1);
    if constexpr (std::is_same_v<X, uint16_t>)
      return bf16_rows_block<R>(x, w, y, in, out, o0, o1);
    else
      return rows_block<T, R>(x, w, y, in, out, o0, o1);
  }
}

// Blocks of up to 8 rows, each reading the weight rows [o0, o1) once.
template <typename X, typename T>
void rows_range(const X* x, const T* w, float* y, int64_t rows, int64_t in, int64_t out, int64_t o0,
                int64_t o1) {
  for (int64_t r = 0; r < rows; r += kMaxBlockRows)
    rows_tail<X, T>(x + r * in, w, y + r * out, std::min<int64_t>(kMaxBlockRows, rows - r), in, out, o0, o1);
}

// Parts of the output are claimed from a shared counter by the calling thread and by helper
// threads. The caller waits only for parts already started, so a busy helper cannot stall it, and a
// helper that comes late finds nothing left (the state is shared, not on the caller's stack).
struct Parts {
  std::atomic<int64_t> next{0}, done{0};
  int64_t count = 0;
  std::function<void(int64_t)> run;

  void work() {
    for (int64_t p; (p = next.fetch_add(1)) < count;) {
      run(p);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// How long a helper keeps looking for the next product before it sleeps. A decode step calls the
// kernel every few microseconds, and a task on XLA's intra-op pool (what this used before) started
// so late that the caller read most 1 MB expert matrices alone, at a fraction of the rate one matrix
// of the same bytes reads.
constexpr auto kSpin = std::chrono::microseconds(200);

// Threads beside the caller, as many as XLA's intra-op pool has less one (XLA sizes it to the cores
// this process may use), started on the first product and kept for the process (like OpenMP's).
class Helpers {
 public:
  static Helpers& get(int64_t pool_threads) {
    // Never destroyed: the threads outlive static destructors.
    static Helpers* helpers = new Helpers(std::max<int64_t>(pool_threads, 1) - 1);
    return *helpers;
  }

  // Offers `parts` to the helpers; the caller then works on them itself.
  void offer(std::shared_ptr<Parts> parts) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      current_ = std::move(parts);
      ++posted_;
    }
    if (sleeping_.load() > 0) wake_.notify_all();
  }

  // The threads that work on a product: the helpers and the caller.
  int64_t workers() const { return others_ + 1; }

 private:
  explicit Helpers(int64_t others) : others_(others) {
    for (int64_t t = 0; t < others_; ++t) std::thread([this] { serve(); }).detach();
  }

  void serve() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Parts> parts = next_after(seen);
      if (parts) parts->work();
    }
  }

  // The parts posted after `seen` (updating it): spinning a while, then asleep until there are some.
  std::shared_ptr<Parts> next_after(uint64_t& seen) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (posted_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
      for (int k = 0; k < 64; ++k) _mm_pause();
    std::unique_lock<std::mutex> lock(mutex_);
    if (posted_ == seen) {
      ++sleeping_;
      wake_.wait(lock, [&] { return posted_.load() != seen; });
      --sleeping_;
    }
    seen = posted_;
    return current_;
  }

  const int64_t others_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> posted_{0};
  std::atomic<int> sleeping_{0};
  std::shared_ptr<Parts> current_;
};

constexpr int64_t kPartElements = 1 << 15;  // a part reads at least 64 KB of bf16: less is not worth a task

// Parts of one matrix's output columns: one, or one per worker for a large matrix (more parts cost
// more than they balance: each starts a stream of reads anew).
int64_t parts_per_group(ffi::ThreadPool& pool, int64_t matrix_elements) {
  return std::clamp<int64_t>(matrix_elements / kPartElements, 1, Helpers::get(pool.num_threads()).workers());
}

// Runs `run(p)` for every part p < count on the calling thread and the helpers; returns when all are done.
void run_parts(ffi::ThreadPool& pool, int64_t count, std::function<void(int64_t)> run) {
  auto parts = std::make_shared<Parts>();
  parts->count = count;
  parts->run = std::move(run);
  if (count > 1) Helpers::get(pool.num_threads()).offer(parts);
  parts->work();
  while (parts->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

// A skipped group's output columns [o0, o1).
void zero_rows(float* y, int64_t rows, int64_t out, int64_t o0, int64_t o1) {
  for (int64_t r = 0; r < rows; ++r) std::fill(y + r * out + o0, y + r * out + o1, 0.0f);
}

// Which matrix a group reads. `kEach` false: one index for all groups, which are the matrix's heads
// (`w[index, g]`). `kEach` true: one index per group (`w[index[g]]`, `w` has no group axis; an
// expert loop's blocks): a negative index skips the group, its output zeros. Indices past the stack
// are clamped to its last matrix.
template <typename T, bool kEach>
struct Matrices {
  const T* w;
  const int32_t* index;
  int64_t count, groups, size;

  const T* of(int64_t g) const {
    const int64_t k = index[kEach ? g : 0];
    if (kEach && k < 0) return nullptr;
    const int64_t m = std::clamp<int64_t>(k, 0, count - 1);
    return w + (kEach ? m : m * groups + g) * size;
  }
};

// Whether rows x [g, rows, in] meet a stack of matrices w [..., out, in] (`in` alike).
bool rows_meet(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd) {
  return xd.size() == 3 && wd.size() >= 2 && wd[wd.size() - 1] == xd[2];
}

// A stack of bf16 matrices [..., out, in] read by an expert loop's blocks: group g reads `index[g]`.
Matrices<uint16_t, true> each_matrix(const ffi::Buffer<ffi::U16>& w, const ffi::Buffer<ffi::S32>& index,
                                     int64_t out, int64_t in) {
  const int64_t groups = index.element_count();
  return {reinterpret_cast<const uint16_t*>(w.typed_data()), index.typed_data(),
          std::max<int64_t>(1, w.element_count() / std::max<int64_t>(1, out * in)), groups, out * in};
}

// Group g's rows that count: `used[g]` of `rows` where given, else all.
int64_t used_rows(const int32_t* used, int64_t g, int64_t rows) {
  return used ? std::clamp<int64_t>(used[g], 0, rows) : rows;
}

// `used` (an expert loop's blocks, with an index per group): the rows of each group that count, the
// first `used[g]`; the rest of the group's output is zeros, not computed (a prefill's blocks are
// padded to a whole block per expert). Null: every row.
template <ffi::DataType D, typename T, bool kEach, ffi::DataType XD, typename X>
ffi::Error rows_dot(ffi::ThreadPool& pool, ffi::Buffer<XD>& x, ffi::Buffer<D>& w, ffi::Buffer<ffi::S32>& index,
                    const int32_t* used, ffi::ResultBuffer<ffi::F32>& y) {
  if (std::is_same_v<X, uint16_t> && !kBf16Dot) return ffi::Error::Internal("rows_dot: this build has no AVX-512 BF16");
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (!rows_meet(xd, wd) || y->dimensions()[2] != wd[wd.size() - 2])
    return ffi::Error::InvalidArgument("rows_dot: x [g, rows, in] against w [..., (g,) out, in] -> [g, rows, out]");
  const int64_t groups = xd[0], rows = xd[1], in = xd[2], out = wd[wd.size() - 2];
  if (kEach && int64_t(index.element_count()) != groups)
    return ffi::Error::InvalidArgument("rows_dot: one matrix index per group of rows");
  const int64_t per_matrix = (kEach ? 1 : groups) * out * in;
  const Matrices<T, kEach> matrices{reinterpret_cast<const T*>(w.typed_data()), index.typed_data(),
                                    std::max<int64_t>(1, w.element_count() / std::max<int64_t>(1, per_matrix)),
                                    groups, out * in};
  const X* xp = reinterpret_cast<const X*>(x.typed_data());
  float* yp = y->typed_data();
  const int64_t per_group = parts_per_group(pool, out * in);
  run_parts(pool, groups * per_group, [=](int64_t p) {
    const int64_t g = p / per_group, o0 = out * (p % per_group) / per_group, o1 = out * (p % per_group + 1) / per_group;
    float* yg = yp + g * rows * out;
    const T* wg = matrices.of(g);
    const int64_t n = wg ? used_rows(used, g, rows) : 0;
    if (n) rows_range<X, T>(xp + g * rows * in, wg, yg, n, in, out, o0, o1);
    zero_rows(yg + n * out, rows - n, out, o0, o1);
  });
  return ffi::Error::Success();
}

template <ffi::DataType D, typename T, ffi::DataType XD = ffi::F32, typename X = float>
ffi::Error RowsDot(ffi::ThreadPool pool, ffi::Buffer<XD> x, ffi::Buffer<D> w, ffi::Buffer<ffi::S32> index,
                   ffi::ResultBuffer<ffi::F32> y) {
  return rows_dot<D, T, false, XD, X>(pool, x, w, index, nullptr, y);
}

template <ffi::DataType D, typename T, ffi::DataType XD = ffi::F32, typename X = float>
ffi::Error RowsDotEach(ffi::ThreadPool pool, ffi::Buffer<XD> x, ffi::Buffer<D> w, ffi::Buffer<ffi::S32> index,
                       ffi::Buffer<ffi::S32> used, ffi::ResultBuffer<ffi::F32> y) {
  if (used.element_count() != index.element_count())
    return ffi::Error::InvalidArgument("rows_dot: one count of used rows per group");
  return rows_dot<D, T, true, XD, X>(pool, x, w, index, used.typed_data(), y);
}

// Every row in one row's summation order (`rows_block<T, 1>`: four sums per row), whatever the
// number of rows: a pair's sums never depend on which other tokens picked its expert in the step
// (batch invariance: drafts' verification meets other neighbours than plain decoding). Blocks of up
// to three rows (12 accumulators fit AVX2's registers) over a few weight rows at a time, so the
// blocks after the first read those weight rows from cache.
template <typename T>
void rows_each(const float* x, const T* w, float* y, int64_t rows, int64_t in, int64_t out, int64_t o0, int64_t o1) {
  constexpr int64_t kWeightRows = 8;
  for (int64_t o = o0; o < o1; o += kWeightRows) {
    const int64_t oe = std::min(o + kWeightRows, o1);
    for (int64_t r = 0; r < rows; r += 3) {
      const float* xr = x + r * in;
      float* yr = y + r * out;
      switch (std::min<int64_t>(3, rows - r)) {
        case 3: rows_block<T, 3, 4>(xr, w, yr, in, out, o, oe); break;
        case 2: rows_block<T, 2, 4>(xr, w, yr, in, out, o, oe); break;
        default: rows_block<T, 1, 4>(xr, w, yr, in, out, o, oe);
      }
    }
  }
}

// SwiGLU's value for one output: SiLU(gate) * up, in the order both SwiGLU kernels compute it.
inline float silu_times(float gate, float up) { return up * (gate / (1.0f + std::exp(-gate))); }

// y[o] += w * product[o] for o in [o0, o1): a routed pair's weighted output added to its token.
inline void add_weighted(float* y, const float* product, float w, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) y[o] += w * product[o];
}

// The expert loop's blocks in two calls (decode: a few float32 rows per block, bf16 experts) instead
// of three products with SiLU x up and the routing-weighted scatter to the tokens as XLA ops between
// them (tens of small XLA operations per layer). `SwigluRowsDot`: h[g] =
// SiLU(x[g] . gate[index[g]]) * (x[g] . up[index[g]]), gate and up read part by part alike, for the
// first `used[g]` rows of each group (the rest: zeros). `CombineRowsDot`: out[token[g, r]] +=
// weight[g, r] * (h[g, r] . down[index[g]]) for the first `used[g]` rows of each group, each part a
// range of output columns of every group, so no two threads add to the same output; a negative index
// or token skips a group or a row. h float32, or bf16 bits (`vdpbf16ps`: a prefill's blocks, whose
// [g, rows, out] products XLA would otherwise write out and sum). float32 rows sum in the pairs
// kernels' order (`rows_each`), so a verification step's blocks give each token what a decode
// step's pairs give it.
ffi::Error SwigluRowsDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> gate,
                         ffi::Buffer<ffi::U16> up, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> used,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = gate.dimensions();
  if (!rows_meet(xd, wd) || gate.element_count() != up.element_count() || int64_t(index.element_count()) != xd[0] ||
      used.element_count() != index.element_count())
    return ffi::Error::InvalidArgument(
        "swiglu_rows_dot: x [g, rows, in], gate and up [..., out, in], index and used [g]");
  const int64_t groups = xd[0], rows = xd[1], in = xd[2], out = wd[wd.size() - 2];
  const auto gates = each_matrix(gate, index, out, in), ups = each_matrix(up, index, out, in);
  const float* xp = x.typed_data();
  const int32_t* counts = used.typed_data();
  float* yp = y->typed_data();
  const int64_t per_group = parts_per_group(pool, out * in);
  run_parts(pool, groups * per_group, [=](int64_t p) {
    const int64_t g = p / per_group, o0 = out * (p % per_group) / per_group, o1 = out * (p % per_group + 1) / per_group;
    float* yg = yp + g * rows * out;
    const uint16_t* wg = gates.of(g);
    const int64_t n = wg ? used_rows(counts, g, rows) : 0;
    zero_rows(yg + n * out, rows - n, out, o0, o1);
    if (!n) return;
    thread_local std::vector<float> gated;
    gated.resize(n * out);
    rows_each(xp + g * rows * in, wg, gated.data(), n, in, out, o0, o1);
    rows_each(xp + g * rows * in, ups.of(g), yg, n, in, out, o0, o1);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = o0; o < o1; ++o) yg[r * out + o] = silu_times(gated[r * out + o], yg[r * out + o]);
  });
  return ffi::Error::Success();
}

template <ffi::DataType XD, typename X>
ffi::Error CombineRowsDot(ffi::ThreadPool pool, ffi::Buffer<XD> h, ffi::Buffer<ffi::U16> down,
                          ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> used, ffi::Buffer<ffi::S32> token,
                          ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32> y) {
  if (std::is_same_v<X, uint16_t> && !kBf16Dot)
    return ffi::Error::Internal("combine_rows_dot: this build has no AVX-512 BF16");
  const auto hd = h.dimensions(), wd = down.dimensions(), yd = y->dimensions();
  if (!rows_meet(hd, wd) || yd.size() != 2 || yd[1] != wd[wd.size() - 2] ||
      int64_t(index.element_count()) != hd[0] || used.element_count() != index.element_count() ||
      int64_t(token.element_count()) != hd[0] * hd[1] || token.element_count() != weight.element_count())
    return ffi::Error::InvalidArgument(
        "combine_rows_dot: h [g, rows, in], down [..., out, in], index and used [g], token and weight [g, rows] -> "
        "[tokens, out]");
  const int64_t groups = hd[0], rows = hd[1], in = hd[2], out = wd[wd.size() - 2], tokens = yd[0];
  const auto downs = each_matrix(down, index, out, in);
  const X* hp = reinterpret_cast<const X*>(h.typed_data());
  const int32_t* counts = used.typed_data();
  const int32_t* tp = token.typed_data();
  const float* wp = weight.typed_data();
  float* yp = y->typed_data();
  const int64_t parts = parts_per_group(pool, out * in);
  run_parts(pool, parts, [=](int64_t p) {
    const int64_t o0 = out * p / parts, o1 = out * (p + 1) / parts;
    zero_rows(yp, tokens, out, o0, o1);
    thread_local std::vector<float> product;
    product.resize(rows * out);
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* wg = downs.of(g);
      const int64_t n = wg ? used_rows(counts, g, rows) : 0;
      if (!n) continue;
      if constexpr (std::is_same_v<X, float>)
        rows_each(hp + g * rows * in, wg, product.data(), n, in, out, o0, o1);
      else
        rows_range<X, uint16_t>(hp + g * rows * in, wg, product.data(), n, in, out, o0, o1);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = tp[g * rows + r];
        if (t < 0 || t >= tokens) continue;
        add_weighted(yp + t * out, product.data() + r * out, wp[g * rows + r], o0, o1);
      }
    }
  });
  return ffi::Error::Success();
}

// A decode step's token-expert pairs straight from the router (`matrix [tokens, k]`: the matrix of a
// stack each pair reads, negative where the expert is not this device's), grouped by matrix here: each
// hit expert read once for all its rows, in ascending order of matrix, each group's pairs in their
// order (as a stable sort by expert orders them). Replaces the sort, the block layout and the row
// gathers that XLA ran between the two calls (~100 thunks per layer).
struct PairGroups {
  std::vector<int64_t> pairs;   // pair numbers (token * k + j), grouped
  std::vector<int64_t> starts;  // group g holds pairs[starts[g], starts[g + 1])
  std::vector<int32_t> matrices;
};

PairGroups group_pairs(const int32_t* matrix, int64_t count) {
  PairGroups groups;
  for (int64_t p = 0; p < count; ++p)
    if (matrix[p] >= 0) groups.pairs.push_back(p);
  std::stable_sort(groups.pairs.begin(), groups.pairs.end(),
                   [&](int64_t a, int64_t b) { return matrix[a] < matrix[b]; });
  for (int64_t i = 0; i < int64_t(groups.pairs.size()); ++i)
    if (i == 0 || matrix[groups.pairs[i]] != groups.matrices.back()) {
      groups.starts.push_back(i);
      groups.matrices.push_back(matrix[groups.pairs[i]]);
    }
  groups.starts.push_back(groups.pairs.size());
  return groups;
}

// Rows `rows[i]` of x [.., width] one after another in `out` [n, width].
void gather_rows(const float* x, const int64_t* rows, int64_t n, int64_t width, std::vector<float>& out) {
  out.resize(n * width);
  for (int64_t i = 0; i < n; ++i) std::copy(x + rows[i] * width, x + (rows[i] + 1) * width, out.data() + i * width);
}

// The matrix `m` of a stack of `count` matrices of `size` elements, clamped to the stack.
const uint16_t* stack_matrix(const uint16_t* w, int64_t m, int64_t count, int64_t size) {
  return w + std::clamp<int64_t>(m, 0, count - 1) * size;
}

// h[p] = SiLU(x[p / k] . gate[matrix[p]]) * (x[p / k] . up[matrix[p]]) for x [tokens, in] against
// gate and up [..., out, in]; zeros for a pair whose matrix is negative.
ffi::Error SwigluPairs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> matrix,
                       ffi::Buffer<ffi::U16> gate, ffi::Buffer<ffi::U16> up, ffi::ResultBuffer<ffi::F32> h) {
  const auto xd = x.dimensions(), md = matrix.dimensions(), wd = gate.dimensions();
  if (xd.size() != 2 || md.size() != 2 || md[0] != xd[0] || wd.size() < 2 || wd[wd.size() - 1] != xd[1] ||
      gate.element_count() != up.element_count() || int64_t(h->element_count()) != md[0] * md[1] * wd[wd.size() - 2])
    return ffi::Error::InvalidArgument(
        "swiglu_pairs: x [tokens, in], matrix [tokens, k], gate and up [..., out, in] -> [tokens, k, out]");
  const int64_t k = md[1], in = xd[1], out = wd[wd.size() - 2], size = out * in;
  const int64_t count = std::max<int64_t>(1, gate.element_count() / std::max<int64_t>(1, size));
  const int32_t* mp = matrix.typed_data();
  const float* xp = x.typed_data();
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(gate.typed_data());
  const uint16_t* up_ = reinterpret_cast<const uint16_t*>(up.typed_data());
  float* hp = h->typed_data();
  const PairGroups groups = group_pairs(mp, md[0] * k);
  for (int64_t p = 0; p < md[0] * k; ++p)
    if (mp[p] < 0) std::fill(hp + p * out, hp + (p + 1) * out, 0.0f);
  const int64_t per_group = parts_per_group(pool, size), n_groups = groups.matrices.size();
  run_parts(pool, n_groups * per_group, [&, k, in, out, size, count](int64_t part) {
    const int64_t g = part / per_group, o0 = out * (part % per_group) / per_group;
    const int64_t o1 = out * (part % per_group + 1) / per_group;
    const int64_t* pairs = groups.pairs.data() + groups.starts[g];
    const int64_t n = groups.starts[g + 1] - groups.starts[g];
    thread_local std::vector<int64_t> tokens;
    thread_local std::vector<float> rows, gated, linear;
    tokens.resize(n);
    for (int64_t i = 0; i < n; ++i) tokens[i] = pairs[i] / k;
    gather_rows(xp, tokens.data(), n, in, rows);
    gated.resize(n * out);
    linear.resize(n * out);
    rows_each(rows.data(), stack_matrix(gp, groups.matrices[g], count, size), gated.data(), n, in, out, o0, o1);
    rows_each(rows.data(), stack_matrix(up_, groups.matrices[g], count, size), linear.data(), n, in, out, o0, o1);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = o0; o < o1; ++o) hp[pairs[i] * out + o] = silu_times(gated[i * out + o], linear[i * out + o]);
  });
  return ffi::Error::Success();
}

// y[t] = sum over the pairs p = t * k + j whose matrix is not negative of
// weight[p] * (h[p] . down[matrix[p]]), for h [tokens, k, in] against down [..., out, in]; each part
// a range of output columns, so no two threads add to the same value; the pairs added in the order
// `group_pairs` gives.
ffi::Error CombinePairs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::S32> matrix,
                        ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::U16> down, ffi::ResultBuffer<ffi::F32> y) {
  const auto hd = h.dimensions(), md = matrix.dimensions(), wd = down.dimensions(), yd = y->dimensions();
  if (hd.size() != 3 || md.size() != 2 || hd[0] != md[0] || hd[1] != md[1] ||
      weight.element_count() != matrix.element_count() || wd.size() < 2 || wd[wd.size() - 1] != hd[2] ||
      yd.size() != 2 || yd[0] != hd[0] || yd[1] != wd[wd.size() - 2])
    return ffi::Error::InvalidArgument(
        "combine_pairs: h [tokens, k, in], matrix and weight [tokens, k], down [..., out, in] -> [tokens, out]");
  const int64_t k = md[1], in = hd[2], out = wd[wd.size() - 2], size = out * in, tokens = hd[0];
  const int64_t count = std::max<int64_t>(1, down.element_count() / std::max<int64_t>(1, size));
  const float* hp = h.typed_data();
  const float* wp = weight.typed_data();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(down.typed_data());
  float* yp = y->typed_data();
  const PairGroups groups = group_pairs(matrix.typed_data(), tokens * k);
  const int64_t parts = parts_per_group(pool, size);
  run_parts(pool, parts, [&, k, in, out, size, count, tokens](int64_t part) {
    const int64_t o0 = out * part / parts, o1 = out * (part + 1) / parts;
    zero_rows(yp, tokens, out, o0, o1);
    thread_local std::vector<float> rows, product;
    for (int64_t g = 0; g + 1 < int64_t(groups.starts.size()); ++g) {
      const int64_t* pairs = groups.pairs.data() + groups.starts[g];
      const int64_t n = groups.starts[g + 1] - groups.starts[g];
      gather_rows(hp, pairs, n, in, rows);
      product.resize(n * out);
      rows_each(rows.data(), stack_matrix(dp, groups.matrices[g], count, size), product.data(), n, in, out, o0, o1);
      for (int64_t i = 0; i < n; ++i)
        add_weighted(yp + pairs[i] / k * out, product.data() + i * out, wp[pairs[i]], o0, o1);
    }
  });
  return ffi::Error::Success();
}

// A few float32 rows against matrix `index` of a float32 stack laid out `[..., in, out]` (the router's
// `x @ W`), read in place: a layer scan would slice the layer's matrix out first, a copy that costs
// more than the product. Each row's sums over a block of outputs stay
// in registers while the matrix's rows stream past, in input order.
template <int R, int V>
void matmul_block(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t o0) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zeros();
  for (int64_t i = 0; i < in; ++i) {
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(w + i * out + o0 + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xr = broadcast(x[r * in + i]);
      for (int v = 0; v < V; ++v) acc[r][v] = fmadd(xr, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(y + r * out + o0 + v * kLanes, acc[r][v]);
}

constexpr int kMatmulVectors = 4;  // output vectors per block: 4 rows x 4 sums and the matrix's 4 in registers

// Rows [0, R) against outputs [o0, o1): whole blocks, then single vectors, then single outputs.
template <int R>
void matmul_rows(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + kMatmulVectors * kLanes <= o1; o += kMatmulVectors * kLanes)
    matmul_block<R, kMatmulVectors>(x, w, y, in, out, o);
  for (; o + kLanes <= o1; o += kLanes) matmul_block<R, 1>(x, w, y, in, out, o);
  for (; o < o1; ++o)
    for (int r = 0; r < R; ++r) {
      float sum = 0;
      for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * w[i * out + o];
      y[r * out + o] = sum;
    }
}

template <int R = 4>
void matmul_tail(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out, int64_t o0,
                 int64_t o1) {
  if constexpr (R > 0) {
    if (rows != R) return matmul_tail<R - 1>(x, w, y, rows, in, out, o0, o1);
    matmul_rows<R>(x, w, y, in, out, o0, o1);
  }
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2 || wd[wd.size() - 2] != xd[1] || index.element_count() != 1 ||
      int64_t(y->element_count()) != xd[0] * wd[wd.size() - 1])
    return ffi::Error::InvalidArgument("rows_matmul: x [rows, in] against w [..., in, out], index [1] -> [rows, out]");
  const int64_t rows = xd[0], in = xd[1], out = wd[wd.size() - 1];
  const int64_t count = int64_t(w.element_count()) / std::max<int64_t>(1, in * out);
  const float* matrix = w.typed_data() + std::clamp<int64_t>(index.typed_data()[0], 0, count - 1) * in * out;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  // Parts: blocks of outputs (R1's 256 experts: 4), each reading its columns of the matrix once for all rows.
  const int64_t block = kMatmulVectors * kLanes, blocks = std::max<int64_t>(1, (out + block - 1) / block);
  run_parts(pool, blocks, [=](int64_t part) {
    const int64_t o0 = part * block, o1 = std::min(out, o0 + block);
    for (int64_t r = 0; r < rows; r += 4)
      matmul_tail(xp + r * in, matrix, yp + r * out, std::min<int64_t>(4, rows - r), in, out, o0, o1);
  });
  return ffi::Error::Success();
}

// Absorbed MLA attention of one new token per row (decode) against a cache of bf16 latents held as
// bits, read in place in its pages (`c_kv [layers, pages, page_size, r]`, `k_pe [layers, pages,
// page_size, rope]`, the layer by index, row b's pages `table[b]`: a serving engine's page pool, or a
// contiguous cache `[layers, B, S, r]` as B pages of S positions), with the new token's own latent as
// one more key: one call per layer instead of XLA's score and value products, each of which widened
// its block of the cache to float32 first,
// or of a gather of each block of pages and an online softmax over them; an int8 cache's latents with
// their scale per position (`MlaDecodeContext`). The same steps as the XLA path
// (`attention._cache_softmax`): float32 scores `(q . c + q_pe . pe) * scale` of the first
// `lengths[b]` positions and the own key, one softmax, the probabilities rounded to bf16 (the cache's
// dtype, as HF rounds them), then their float32 sum over the latents; sums in another order.
// Per block of 8 heads, in three passes over a row's keys: scores two keys at a time (each key widened
// once for the block, its 16 sums reduced together), the softmax in vectors, then the value sums a tile
// of widened keys at a time, each latent loaded once for the block; bf16 queries (a bf16 model's) score
// and sum with `vdpbf16ps` where the CPU runs it fast: several times faster than widening the row's
// whole cache first and summing one head at a time. The blocks of a part (up to 4: R1's 128 heads
// in 4 parts per row) take each chunk of keys in turn, an int8 cache's made bf16 once for them all.
inline float round_bf16(float v) {  // to the nearest bf16, ties to even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Cached positions whose latents the value sums widen to float32 at a time: a tile (32 KB at r 256)
// stays in L1 while every head of a part's blocks reads it. (Widening a row's whole cache first cost ~4x at
// 4,096 positions: 4 MB of float32 latents, read again from L3 by every head.)
constexpr int64_t kValueTile = 32;

// Where a row's cached positions j < len are in the pool `[pages, page_size, width]`: `at[j]`, in page
// `table[j / page_size]`.
template <typename T>
void find_keys(const T* pool, const int32_t* table, int64_t pages, int64_t page_size, int64_t len, int64_t width,
               std::vector<const T*>& at) {
  at.resize(len);
  for (int64_t j = 0, i = 0; j < len; ++i) {  // page by page: no division per key
    const T* page = pool + std::clamp<int64_t>(table[i], 0, pages - 1) * page_size * width;
    for (int64_t slot = 0; slot < page_size && j < len; ++slot, ++j) at[j] = page + slot * width;
  }
}

void widen_row(const uint16_t* from, int64_t r, float* to) {
  int64_t k = 0;
  for (; k + kLanes <= r; k += kLanes) store(to + k, widen_lanes(from + k));
  for (; k < r; ++k) to[k] = widen(from[k]);
}

// The bf16 bits of `r` int8 values, exactly (8 significant bits hold every int8): their float32's high
// halves.
void bf16_bits_of(const int8_t* from, int64_t r, uint16_t* to) {
  int64_t k = 0;
  for (; k + kLanes <= r; k += kLanes) store_high_halves(to + k, widen_lanes(from + k));
  for (; k < r; ++k) {
    const float value = widen(from[k]);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    to[k] = uint16_t(bits >> 16);
  }
}

// Keys [j0, j1) of one row as bf16 bits, `key[j - j0]`: a bf16 cache's where they lie (`c[j]`), an int8
// cache's made bf16 into `buffer` (once for all of a part's blocks of heads); key `len` is the own key
// `own`, and keys past it the own key again (the value sums' last pair: weight 0).
template <typename T>
void bf16_keys(const T* const* c, int64_t len, const uint16_t* own, int64_t r, int64_t j0, int64_t j1,
               std::vector<uint16_t>& buffer, const uint16_t** key) {
  if constexpr (!std::is_same_v<T, uint16_t>) buffer.resize((j1 - j0) * r);
  for (int64_t j = j0; j < j1; ++j) {
    if (j >= len) {
      key[j - j0] = own;
    } else if constexpr (std::is_same_v<T, uint16_t>) {
      key[j - j0] = c[j];
    } else {
      bf16_bits_of(c[j], r, buffer.data() + (j - j0) * r);
      key[j - j0] = buffer.data() + (j - j0) * r;
    }
  }
}

// `ctx[h][k0, k0 + V * kLanes)` += head h's probabilities `p[h][j0, j1)` (rows `keys` apart) times the
// tile's latents, for heads h < N: each latent loaded once for all heads. Every sum runs in key order
// through `ctx`, so its chain of multiply-adds is the whole row's, as one head at a time gave it.
template <int N, int V>
[[gnu::always_inline]] inline void add_tile(const float* p, int64_t keys, const float* tile, float* ctx, int64_t j0,
                                            int64_t j1, int64_t r, int64_t k0) {
  Vec acc[N][V];
  for (int h = 0; h < N; ++h)
    for (int v = 0; v < V; ++v) acc[h][v] = load(ctx + h * r + k0 + v * kLanes);
  for (int64_t j = j0; j < j1; ++j) {
    Vec latent[V];
    for (int v = 0; v < V; ++v) latent[v] = load(tile + (j - j0) * r + k0 + v * kLanes);
    for (int h = 0; h < N; ++h) {
      const Vec ph = broadcast(p[h * keys + j]);
      for (int v = 0; v < V; ++v) acc[h][v] = fmadd(ph, latent[v], acc[h][v]);
    }
  }
  for (int h = 0; h < N; ++h)
    for (int v = 0; v < V; ++v) store(ctx + h * r + k0 + v * kLanes, acc[h][v]);
}

// Keys [j0, j1) of heads [0, N) into `ctx [N, r]`: vectors two at a time (AVX-512's 32 registers hold
// 8 heads x 2 sums), then one, then single widths.
template <int N>
void add_keys(const float* p, int64_t keys, const float* tile, float* ctx, int64_t j0, int64_t j1, int64_t r) {
  constexpr int kPair = kLanes == 16 ? 2 : 1;
  int64_t k0 = 0;
  for (; k0 + kPair * kLanes <= r; k0 += kPair * kLanes) add_tile<N, kPair>(p, keys, tile, ctx, j0, j1, r, k0);
  for (; k0 + kLanes <= r; k0 += kLanes) add_tile<N, 1>(p, keys, tile, ctx, j0, j1, r, k0);
  for (; k0 < r; ++k0)
    for (int h = 0; h < N; ++h)
      for (int64_t j = j0; j < j1; ++j) ctx[h * r + k0] += p[h * keys + j] * tile[(j - j0) * r + k0];
}

template <int N = kMaxBlockRows>
void add_heads(int64_t n, const float* p, int64_t keys, const float* tile, float* ctx, int64_t j0, int64_t j1,
               int64_t r) {
  if constexpr (N > 0) {
    if (n != N) return add_heads<N - 1>(n, p, keys, tile, ctx, j0, j1, r);
    add_keys<N>(p, keys, tile, ctx, j0, j1, r);
  }
}

// Keys scored per pass (`score_keys`): 8 heads' sums of each fill one vector (`lane_sums`).
constexpr int kPassKeys = kLanes / kMaxBlockRows;

// The sums `acc[p * 8 + h]` (`rest`: widths past the last whole vector) += `x[h] . keys[p]` for heads
// h < N and the pass's keys p (bf16 bits): each key widened once for all heads, each query row loaded
// once for all keys. Inlined, so that the sums stay in registers.
template <int N>
[[gnu::always_inline]] inline void dot_keys(const float* x, const uint16_t* const (&keys)[kPassKeys],
                                            int64_t width, Vec (&acc)[kLanes], float (&rest)[kLanes]) {
  int64_t k = 0;
  for (; k + kLanes <= width; k += kLanes) {
    Vec key[kPassKeys];
    for (int p = 0; p < kPassKeys; ++p) {
      if (k % 32 == 0)  // once per cache line: the line 4 KB ahead
        _mm_prefetch(reinterpret_cast<const char*>(keys[p] + k) + kPrefetchBytes, _MM_HINT_T1);
      key[p] = widen_lanes(keys[p] + k);
    }
    for (int h = 0; h < N; ++h) {
      const Vec xh = load(x + h * width + k);
      for (int p = 0; p < kPassKeys; ++p) acc[p * kMaxBlockRows + h] = fmadd(xh, key[p], acc[p * kMaxBlockRows + h]);
    }
  }
  for (; k < width; ++k)
    for (int p = 0; p < kPassKeys; ++p)
      for (int h = 0; h < N; ++h) rest[p * kMaxBlockRows + h] += x[h * width + k] * widen(keys[p][k]);
}

// The same with bf16 queries (their bits; a bf16 model's) against the bf16 keys with `vdpbf16ps`: 32
// multiply-adds per instruction, no widening; a last part vector masked (zeros add nothing).
template <int N>
[[gnu::always_inline]] inline void dot_keys(const uint16_t* x, const uint16_t* const (&keys)[kPassKeys],
                                            int64_t width, Vec (&acc)[kLanes], float (&)[kLanes]) {
#if defined(__AVX512BF16__)
  for (int64_t k = 0; k < width; k += 32) {
    const __mmask32 mask = width - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (width - k)) - 1;
    __m512bh key[kPassKeys];
    for (int p = 0; p < kPassKeys; ++p) {  // 64 bytes: a cache line
      _mm_prefetch(reinterpret_cast<const char*>(keys[p] + k) + kPrefetchBytes, _MM_HINT_T1);
      key[p] = bf16_lanes(keys[p] + k, mask);
    }
    for (int h = 0; h < N; ++h) {
      const __m512bh xh = bf16_lanes(x + h * width + k, mask);
      for (int p = 0; p < kPassKeys; ++p)
        acc[p * kMaxBlockRows + h] = _mm512_dpbf16_ps(acc[p * kMaxBlockRows + h], xh, key[p]);
    }
  }
#endif
}

// Scores `s[h * stride + j]` of heads h < N of one row: `(q . c + q_pe . pe) * scale` for its keys
// j < count (`c[j]`, `pe[j]`); with `key_scale` (an int8 cache's), `(key_scale[j] q . c + q_pe . pe) *
// scale`, as XLA's path scales the latent product. One float32 sum per score.
template <int N, typename X>
void score_keys(const X* q, const X* q_pe, const uint16_t* const* c, const uint16_t* const* pe,
                const float* key_scale, int64_t count, int64_t r, int64_t rope, float scale, float* s,
                int64_t stride) {
  for (int64_t j0 = 0; j0 < count; j0 += kPassKeys) {
    const uint16_t* latent[kPassKeys];
    const uint16_t* rotary[kPassKeys];
    float lanes[kLanes];
    for (int p = 0; p < kPassKeys; ++p) {  // past the last key: the last key again, its sums unused
      const int64_t j = std::min(j0 + p, count - 1);
      latent[p] = c[j];
      rotary[p] = pe[j];
      if (key_scale) std::fill(lanes + p * kMaxBlockRows, lanes + (p + 1) * kMaxBlockRows, key_scale[j]);
    }
    Vec acc[kLanes];
    float rest[kLanes] = {};
    for (Vec& a : acc) a = zeros();
    dot_keys<N>(q, latent, r, acc, rest);
    Vec scaled = zeros();
    if (key_scale) {  // the latent sums times their keys' scales, then the rotary sums anew
      scaled = mul(add(lane_sums(acc), load(rest)), load(lanes));
      std::fill(rest, rest + kLanes, 0.0f);
      for (Vec& a : acc) a = zeros();
    }
    dot_keys<N>(q_pe, rotary, rope, acc, rest);
    store(lanes, mul(add(scaled, add(lane_sums(acc), load(rest))), broadcast(scale)));
    for (int p = 0; p < kPassKeys && j0 + p < count; ++p)
      for (int h = 0; h < N; ++h) s[h * stride + j0 + p] = lanes[p * kMaxBlockRows + h];
  }
}

template <typename X, int N = kMaxBlockRows>
void score_heads(int64_t n, const X* q, const X* q_pe, const uint16_t* const* c, const uint16_t* const* pe,
                 const float* key_scale, int64_t count, int64_t r, int64_t rope, float scale, float* s,
                 int64_t stride) {
  if constexpr (N > 0) {
    if (n != N) return score_heads<X, N - 1>(n, q, q_pe, c, pe, key_scale, count, r, rope, scale, s, stride);
    score_keys<N>(q, q_pe, c, pe, key_scale, count, r, rope, scale, s, stride);
  }
}

// One head's scores `x [n]` -> their softmax, each probability (times `weight[j]`, an int8 cache's
// scales, where given) rounded to bf16 (as `_cache_softmax` and `weighted_values`).
void softmax_to_bf16(float* x, int64_t n, const float* weight) {
  Vec top_lanes = broadcast(-INFINITY);
  const int64_t whole = n - n % kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) top_lanes = max(top_lanes, load(x + j));
  float lanes[kLanes];
  store(lanes, top_lanes);
  float top = *std::max_element(lanes, lanes + kLanes);
  for (int64_t j = whole; j < n; ++j) top = std::max(top, x[j]);
  // The last part vector through a buffer (its unused lanes' values are never read back).
  std::fill(lanes, lanes + kLanes, top);
  std::copy(x + whole, x + n, lanes);
  Vec total_lanes = zeros();
  for (int64_t j = 0; j < whole; j += kLanes) {
    const Vec e = exp_lanes(sub(load(x + j), broadcast(top)));
    store(x + j, e);
    total_lanes = add(total_lanes, e);
  }
  store(lanes, exp_lanes(sub(load(lanes), broadcast(top))));
  float total = sum(total_lanes);
  for (int64_t j = whole; j < n; ++j) total += (x[j] = lanes[j - whole]);
  if (weight) {
    for (int64_t j = 0; j < whole; j += kLanes)
      store(x + j, round_bf16_lanes(mul(div(load(x + j), broadcast(total)), load(weight + j))));
    for (int64_t j = whole; j < n; ++j) x[j] = round_bf16(x[j] / total * weight[j]);
    return;
  }
  for (int64_t j = 0; j < whole; j += kLanes) store(x + j, round_bf16_lanes(div(load(x + j), broadcast(total))));
  for (int64_t j = whole; j < n; ++j) x[j] = round_bf16(x[j] / total);
}

#if defined(__AVX512BF16__)
constexpr int64_t kPairTile = 32;  // key pairs per tile of the bf16 value sums: 64 keys, 32 KB at r 256

// The value sums of heads [0, N) with `vdpbf16ps` (bf16 queries, latent width a multiple of 32) over
// the key pairs [i0, i1): keys two at a time (`key[2 (i - i0)]` and the next: bf16 bits), their latents
// interleaved in pairs (two shuffles per 32 widths, shared by the heads) against each head's two
// probabilities, already bf16 (`prob[h * pairs + i]`: keys 2i and 2i + 1 in the low and high half;
// past the last key 0). Sums go to `sums [N, r]` in the shuffles' lane order (`unshuffle_pairs` puts
// them back).
template <int N>
void add_pairs(const uint32_t* prob, int64_t pairs, int64_t i0, int64_t i1, const uint16_t* const* key, int64_t r,
               float* sums) {
  for (int64_t k0 = 0; k0 < r; k0 += 32) {
    __m512 acc[N][2];
    for (int h = 0; h < N; ++h)
      for (int v = 0; v < 2; ++v) acc[h][v] = _mm512_loadu_ps(sums + h * r + k0 + 16 * v);
    for (int64_t i = i0; i < i1; ++i) {
      const uint16_t* const* pair = key + 2 * (i - i0);
      const __m512i a = _mm512_loadu_si512(pair[0] + k0), b = _mm512_loadu_si512(pair[1] + k0);
      const __m512bh low = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
      const __m512bh high = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
      for (int h = 0; h < N; ++h) {
        const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int32_t(prob[h * pairs + i])));
        acc[h][0] = _mm512_dpbf16_ps(acc[h][0], low, p);
        acc[h][1] = _mm512_dpbf16_ps(acc[h][1], high, p);
      }
    }
    for (int h = 0; h < N; ++h)
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(sums + h * r + k0 + 16 * v, acc[h][v]);
  }
}

template <int N = kMaxBlockRows>
void add_pairs_heads(int64_t n, const uint32_t* prob, int64_t pairs, int64_t i0, int64_t i1,
                     const uint16_t* const* key, int64_t r, float* sums) {
  if constexpr (N > 0) {
    if (n != N) return add_pairs_heads<N - 1>(n, prob, pairs, i0, i1, key, r, sums);
    add_pairs<N>(prob, pairs, i0, i1, key, r, sums);
  }
}

// `add_pairs`' sums in width order: per 32 widths, its low vector holds widths 8L + {0..3} in 128-bit
// lane L, its high vector 8L + {4..7}.
void unshuffle_pairs(const float* sums, float* ctx, int64_t count) {
  for (int64_t k0 = 0; k0 < count; k0 += 32) {
    const __m512 low = _mm512_loadu_ps(sums + k0), high = _mm512_loadu_ps(sums + k0 + 16);
    const __m512 first = _mm512_shuffle_f32x4(low, high, 0x44), second = _mm512_shuffle_f32x4(low, high, 0xee);
    _mm512_storeu_ps(ctx + k0, _mm512_shuffle_f32x4(first, first, 0xd8));
    _mm512_storeu_ps(ctx + k0 + 16, _mm512_shuffle_f32x4(second, second, 0xd8));
  }
}

// The value sums of `heads` heads (blocks of `kMaxBlockRows`) from their bf16 probabilities `s [heads,
// keys]` with `vdpbf16ps`, a tile of `kPairTile` key pairs at a time (`bf16_keys`, shared by the blocks),
// against a bf16 or an int8 cache's latents `c` (`len` of them; the own key `own`).
template <typename T>
void add_values_bf16(const float* s, int64_t heads, int64_t keys, const T* const* c, int64_t len,
                     const uint16_t* own, int64_t r, float* ctx) {
  thread_local std::vector<uint32_t> prob;
  thread_local std::vector<uint16_t> buffer;
  thread_local std::vector<float> sums;
  const int64_t pairs = (keys + 1) / 2;
  prob.assign(heads * pairs, 0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < keys; ++j) {
      uint32_t bits;
      std::memcpy(&bits, s + h * keys + j, sizeof bits);
      prob[h * pairs + j / 2] |= (bits >> 16) << (16 * (j % 2));
    }
  const uint16_t* key[2 * kPairTile];
  sums.assign(heads * r, 0.0f);
  for (int64_t i0 = 0; i0 < pairs; i0 += kPairTile) {
    const int64_t i1 = std::min(pairs, i0 + kPairTile);
    bf16_keys(c, len, own, r, 2 * i0, 2 * i1, buffer, key);
    for (int64_t h0 = 0; h0 < heads; h0 += kMaxBlockRows)
      add_pairs_heads(std::min<int64_t>(kMaxBlockRows, heads - h0), prob.data() + h0 * pairs, pairs, i0, i1, key, r,
                      sums.data() + h0 * r);
  }
  unshuffle_pairs(sums.data(), ctx, heads * r);
}
#endif

// Keys scored per step for all of a part's blocks of heads: their bf16 bits (an int8 cache's made so
// once) stay in L2 while every block reads them, where each block streaming the row's keys on its own
// read R1's 4.7 MB per row at 4,096 positions 16 times over.
constexpr int64_t kScoreChunk = 64;
constexpr int64_t kMaxPartBlocks = 4;  // blocks of heads per part at most: R1's 128 heads in 4 parts

// Heads [0, heads) of one row, in blocks of `kMaxBlockRows`: `q [heads, r]`, `q_pe [heads, rope]` against
// its `len` cached positions and its own key into `ctx [heads, r]`. `c`: the cached latents
// (`find_keys`), `pe`: the rotary parts, the own key's appended, `key_scale`: an int8 cache's scales, the
// own key's 1 appended (else null), `own_c`: the own key's latent (bf16 bits), scored and summed as one
// more key, the last (as XLA's path adds it).
template <typename X, typename T>
void attend_heads(const X* q, const X* q_pe, const T* const* c, const uint16_t* const* pe, const float* key_scale,
                  const uint16_t* own_c, float* ctx, int64_t heads, int64_t len, int64_t r, int64_t rope,
                  float scale) {
  thread_local std::vector<float> s, tile;
  thread_local std::vector<uint16_t> buffer;
  const int64_t keys = len + 1;
  s.resize(heads * keys);
  const uint16_t* key[std::max(kScoreChunk, kValueTile)];
  for (int64_t j0 = 0; j0 < keys; j0 += kScoreChunk) {
    const int64_t j1 = std::min(keys, j0 + kScoreChunk);
    bf16_keys(c, len, own_c, r, j0, j1, buffer, key);
    for (int64_t h0 = 0; h0 < heads; h0 += kMaxBlockRows)
      score_heads(std::min<int64_t>(kMaxBlockRows, heads - h0), q + h0 * r, q_pe + h0 * rope, key, pe + j0,
                  key_scale ? key_scale + j0 : nullptr, j1 - j0, r, rope, scale, s.data() + h0 * keys + j0, keys);
  }
  for (int64_t h = 0; h < heads; ++h) softmax_to_bf16(s.data() + h * keys, keys, key_scale);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, uint16_t>)  // bf16 queries: `vdpbf16ps` where it runs fast
    if (r % 32 == 0) return add_values_bf16(s.data(), heads, keys, c, len, own_c, r, ctx);
#endif
  std::fill(ctx, ctx + heads * r, 0.0f);
  tile.resize(kValueTile * r);
  for (int64_t j0 = 0; j0 < keys; j0 += kValueTile) {
    const int64_t j1 = std::min(keys, j0 + kValueTile);
    bf16_keys(c, len, own_c, r, j0, j1, buffer, key);
    for (int64_t j = j0; j < j1; ++j) widen_row(key[j - j0], r, tile.data() + (j - j0) * r);
    for (int64_t h0 = 0; h0 < heads; h0 += kMaxBlockRows)
      add_heads(std::min<int64_t>(kMaxBlockRows, heads - h0), s.data() + h0 * keys, keys, tile.data(),
                ctx + h0 * r, j0, j1, r);
  }
}

// float32 queries, or (`X` uint16_t) bf16 ones as bits, scored with `vdpbf16ps` (`dot_keys`), against
// a cache of bf16 bits (`T` uint16_t) or of int8 latents (`T` int8_t) with a float32 scale per
// position `c_scale [layers, pages, page_size]` (for bf16 caches: empty, unused).
template <ffi::DataType XD, typename X, ffi::DataType CD, typename T>
ffi::Error MlaDecodeContext(ffi::ThreadPool pool, ffi::Buffer<XD> q, ffi::Buffer<XD> q_pe, ffi::Buffer<CD> c_kv,
                            ffi::Buffer<ffi::U16> k_pe, ffi::Buffer<ffi::F32> c_scale, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::U16> own_c,
                            ffi::Buffer<ffi::U16> own_pe, ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> ctx) {
  const auto qd = q.dimensions(), pd = q_pe.dimensions(), cd = c_kv.dimensions(), ed = k_pe.dimensions();
  const auto td = table.dimensions(), sd = c_scale.dimensions();
  constexpr bool scaled = std::is_same_v<T, int8_t>;
  if (qd.size() != 3 || pd.size() != 3 || cd.size() != 4 || ed.size() != 4 || td.size() != 2 || pd[0] != qd[0] ||
      pd[1] != qd[1] || td[0] != qd[0] || cd[3] != qd[2] || ed[0] != cd[0] || ed[1] != cd[1] || ed[2] != cd[2] ||
      ed[3] != pd[2] || layer.element_count() != 1 || int64_t(lengths.element_count()) != qd[0] ||
      int64_t(own_c.element_count()) != qd[0] * qd[2] || int64_t(own_pe.element_count()) != qd[0] * pd[2] ||
      scale.element_count() != 1 || int64_t(ctx->element_count()) != qd[0] * qd[1] * qd[2] ||
      (scaled && (sd.size() != 3 || sd[0] != cd[0] || sd[1] != cd[1] || sd[2] != cd[2])))
    return ffi::Error::InvalidArgument(
        "mla_decode_context: q [B, H, r], q_pe [B, H, rope], c_kv [layers, pages, page_size, r], k_pe [layers, "
        "pages, page_size, rope], c_scale [layers, pages, page_size] (int8 c_kv), layer [1], lengths [B], table "
        "[B, P], own_c [B, r], own_pe [B, rope], scale [1] -> [B, H, r]");
  const int64_t rows = qd[0], heads = qd[1], r = qd[2], rope = pd[2], pages = cd[1], page_size = cd[2];
  const int64_t row_pages = td[1];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, cd[0] - 1);
  const T* cl = reinterpret_cast<const T*>(c_kv.typed_data()) + l * pages * page_size * r;
  const uint16_t* el = reinterpret_cast<const uint16_t*>(k_pe.typed_data()) + l * pages * page_size * rope;
  const float* sl = scaled ? c_scale.typed_data() + l * pages * page_size : nullptr;
  const X *qp = reinterpret_cast<const X*>(q.typed_data()), *pp = reinterpret_cast<const X*>(q_pe.typed_data());
  const uint16_t* oc = reinterpret_cast<const uint16_t*>(own_c.typed_data());
  const uint16_t* op = reinterpret_cast<const uint16_t*>(own_pe.typed_data());
  const int32_t *held = lengths.typed_data(), *tp = table.typed_data();
  const float sc = scale.typed_data()[0];
  float* out = ctx->typed_data();
  // A part takes a range of one row's blocks of heads: as few parts per row as keep every worker busy,
  // so that a row's keys are read (an int8 cache's made bf16) on one core, but at most
  // `kMaxPartBlocks` blocks, whose scores `[heads, keys]` a part holds at once.
  if (rows == 0 || heads == 0) return ffi::Error::Success();
  if (pages == 0 || page_size == 0) return ffi::Error::InvalidArgument("mla_decode_context: a cache without pages");
  const int64_t blocks = (heads + kMaxBlockRows - 1) / kMaxBlockRows;
  const int64_t workers = Helpers::get(pool.num_threads()).workers();
  const int64_t per_row = std::clamp<int64_t>(
      std::max((workers + rows - 1) / rows, (blocks + kMaxPartBlocks - 1) / kMaxPartBlocks), 1, blocks);
  run_parts(pool, rows * per_row, [=](int64_t part) {
    const int64_t b = part / per_row, j = part % per_row;
    const int64_t len = std::clamp<int64_t>(held[b], 0, row_pages * page_size);
    const int32_t* row_table = tp + b * row_pages;
    thread_local std::vector<const T*> c;
    thread_local std::vector<const uint16_t*> pe;
    thread_local std::vector<const float*> scale_at;
    thread_local std::vector<float> key_scale;
    find_keys(cl, row_table, pages, page_size, len, r, c);
    find_keys(el, row_table, pages, page_size, len, rope, pe);
    pe.push_back(op + b * rope);
    if constexpr (scaled) {
      find_keys(sl, row_table, pages, page_size, len, 1, scale_at);
      key_scale.resize(len + 1);
      for (int64_t k = 0; k < len; ++k) key_scale[k] = *scale_at[k];
      key_scale[len] = 1.0f;  // the own key's latent is not quantized
    }
    const int64_t h0 = blocks * j / per_row * kMaxBlockRows;
    const int64_t h1 = std::min(heads, blocks * (j + 1) / per_row * kMaxBlockRows), at = b * heads + h0;
    attend_heads(qp + at * r, pp + at * rope, c.data(), pe.data(), scaled ? key_scale.data() : nullptr, oc + b * r,
                 out + at * r, h1 - h0, len, r, rope, sc);
  });
  return ffi::Error::Success();
}

// Many rows (a prefill's expert blocks) with AMX: bf16 rows against the bf16 matrix, float32 sums.
// The tile product C[16 outputs, 16 rows] += A[16 outputs, 32 inputs] . B[32 inputs, 16 rows] reads A
// straight from the weight's rows in place (`[out, in]`, a row stride apart) and B from the rows
// packed into tiles of 16 input pairs x 16 rows (AMX's pair-interleaved layout; packing in XLA cost
// more than the products). Up to 32 rows per pass: tiles 0-3 hold C for 32 outputs x 32 rows, 4-5 B,
// 6-7 A.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kAmx = true;

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX's tile state only to a process that asks for it, once.
bool amx_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// A C tile stored to `c` (outputs o.., rows r..) into y [rows, out], transposed, the rows that exist.
void scatter_tile(const float (&c)[16][16], float* y, int64_t rows, int64_t out, int64_t o, int64_t r) {
  for (int64_t t = 0; t < std::min<int64_t>(16, rows - r); ++t)
    for (int i = 0; i < 16; ++i) y[(r + t) * out + o + i] = c[i][t];
}

// x [rows, in] as B tiles [tiles of 16 rows, in / 32, 16 input pairs, 16 rows, 2], rows past the
// last zero: each tile a 16 x 16 transpose of input pairs (4 bytes).
void pack_rows(const uint16_t* x, int64_t rows, int64_t in, std::vector<uint32_t>& packed) {
  const int64_t chunks = in / 32, tiles = (rows + 15) / 16;
  packed.assign(tiles * chunks * 256, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x + r * in);
    uint32_t* tile_row = packed.data() + (r / 16) * chunks * 256 + r % 16;
    for (int64_t k = 0; k < in / 2; ++k) tile_row[(k / 16) * 256 + (k % 16) * 16] = pairs[k];
  }
}

// Outputs [o0, o1) (multiples of 32) of x [rows, in] (bf16 bits) against w [out, in].
void amx_range(const uint16_t* x, const uint16_t* w, float* y, int64_t rows, int64_t in, int64_t out, int64_t o0,
               int64_t o1) {
  thread_local std::vector<uint32_t> packed;
  pack_rows(x, rows, in, packed);
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  const int64_t chunks = in / 32, tiles = (rows + 15) / 16, stride = in * int64_t(sizeof(uint16_t));
  const uint32_t* xp = packed.data();
  for (int64_t t0 = 0; t0 < tiles; t0 += 2) {
    const bool two = t0 + 1 < tiles;
    for (int64_t o = o0; o < o1; o += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* a = w + o * in + c * 32;
        // The next 32 weight rows, a pass of the chunks ahead.
        for (int r = 32; r < 64; ++r) _mm_prefetch(reinterpret_cast<const char*>(a + r * in), _MM_HINT_T0);
        _tile_loadd(6, a, stride);
        _tile_loadd(7, a + 16 * in, stride);
        _tile_loadd(4, xp + (t0 * chunks + c) * 256, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 7, 4);
        if (two) {
          _tile_loadd(5, xp + ((t0 + 1) * chunks + c) * 256, 64);
          _tile_dpbf16ps(2, 6, 5);
          _tile_dpbf16ps(3, 7, 5);
        }
      }
      alignas(64) float c[16][16];  // the tile numbers are immediates: no loop over them
      _tile_stored(0, c, 64);
      scatter_tile(c, y, rows, out, o, t0 * 16);
      _tile_stored(1, c, 64);
      scatter_tile(c, y, rows, out, o + 16, t0 * 16);
      if (two) {
        _tile_stored(2, c, 64);
        scatter_tile(c, y, rows, out, o, t0 * 16 + 16);
        _tile_stored(3, c, 64);
        scatter_tile(c, y, rows, out, o + 16, t0 * 16 + 16);
      }
    }
  }
  _tile_release();
}
#else
constexpr bool kAmx = false;
bool amx_permitted() { return false; }
void amx_range(const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) {}
#endif

// y[g, r, o] = sum_i x[g, r, i] * w[index[g], o, i] for bf16 bits x and w [..., out, in], out and in
// multiples of 32; a negative index gives zeros, and so do the rows of group g from `used[g]` on.
ffi::Error AmxRowsDot(ffi::ThreadPool pool, ffi::Buffer<ffi::U16> x, ffi::Buffer<ffi::U16> w,
                      ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> used, ffi::ResultBuffer<ffi::F32> y) {
  if (!kAmx || !amx_permitted()) return ffi::Error::Internal("rows_dot: this CPU or build has no AMX");
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (!rows_meet(xd, wd) || xd[2] % 32 || wd[wd.size() - 2] % 32 ||
      int64_t(index.element_count()) != xd[0] || used.element_count() != index.element_count())
    return ffi::Error::InvalidArgument(
        "rows_dot: x [g, rows, in] against w [..., out, in], multiples of 32; index and used [g]");
  const int64_t groups = xd[0], rows = xd[1], in = xd[2], out = wd[wd.size() - 2];
  const auto matrices = each_matrix(w, index, out, in);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const int32_t* counts = used.typed_data();
  float* yp = y->typed_data();
  // Parts whole groups where there are enough of them: each part packs its rows once.
  const int64_t per_group = groups >= 4 ? 1 : parts_per_group(pool, out * in), blocks = out / 32;
  run_parts(pool, groups * per_group, [=](int64_t p) {
    const int64_t g = p / per_group, q = p % per_group;
    const int64_t o0 = blocks * q / per_group * 32, o1 = blocks * (q + 1) / per_group * 32;
    float* yg = yp + g * rows * out;
    const uint16_t* wg = matrices.of(g);
    const int64_t n = wg ? used_rows(counts, g, rows) : 0;
    if (n) amx_range(xp + g * rows * in, wg, yg, n, in, out, o0, o1);
    zero_rows(yg + n * out, rows - n, out, o0, o1);
  });
  return ffi::Error::Success();
}

}  // namespace

// A handler's binding: XLA's thread pool, the buffers `Args`, one float32 result.
template <typename Binding>
auto bound(Binding binding) {
  return std::move(binding).template Ret<ffi::Buffer<ffi::F32>>();
}
template <typename Arg, typename... Rest, typename Binding>
auto bound(Binding binding) {
  return bound<Rest...>(std::move(binding).template Arg<Arg>());
}
template <ffi::DataType... Args>
auto Signature() {
  return bound<ffi::Buffer<Args>...>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>());
}

// rows_dot's handlers: (x, w, index) -> y, x float32 or bf16 bits, w bf16 bits or int8; `_each`: an
// index per group of rows, and the rows of each that are used, (x, w, index, used) -> y.
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_rows_dot_bf16, (RowsDot<ffi::U16, uint16_t>),
                              (Signature<ffi::F32, ffi::U16, ffi::S32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_rows_dot_int8, (RowsDot<ffi::S8, int8_t>), (Signature<ffi::F32, ffi::S8, ffi::S32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_rows_dot_each_bf16, (RowsDotEach<ffi::U16, uint16_t>),
                              (Signature<ffi::F32, ffi::U16, ffi::S32, ffi::S32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_rows_dot_each_int8, (RowsDotEach<ffi::S8, int8_t>),
                              (Signature<ffi::F32, ffi::S8, ffi::S32, ffi::S32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_bf16_rows_dot_bf16, (RowsDot<ffi::U16, uint16_t, ffi::U16, uint16_t>),
                              (Signature<ffi::U16, ffi::U16, ffi::S32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_bf16_rows_dot_each_bf16, (RowsDotEach<ffi::U16, uint16_t, ffi::U16, uint16_t>),
                              (Signature<ffi::U16, ffi::U16, ffi::S32, ffi::S32>()));
// (x, gate, up, index, used) -> SiLU(x . gate) * (x . up); (h, down, index, used, token, weight) -> sums.
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_swiglu_rows_dot, SwigluRowsDot,
                              (Signature<ffi::F32, ffi::U16, ffi::U16, ffi::S32, ffi::S32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_combine_rows_dot, (CombineRowsDot<ffi::F32, float>),
                              (Signature<ffi::F32, ffi::U16, ffi::S32, ffi::S32, ffi::S32, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_bf16_combine_rows_dot, (CombineRowsDot<ffi::U16, uint16_t>),
                              (Signature<ffi::U16, ffi::U16, ffi::S32, ffi::S32, ffi::S32, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_rows_dot_each_amx, AmxRowsDot,
                              (Signature<ffi::U16, ffi::U16, ffi::S32, ffi::S32>()));
// (x, w, index) -> x . w[index] for a float32 stack `[..., in, out]` (the router's).
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_rows_matmul_f32, RowsMatmul, (Signature<ffi::F32, ffi::F32, ffi::S32>()));
// (x, matrix, gate, up) -> SiLU(x . gate) * (x . up) per pair; (h, matrix, weight, down) -> sums per token.
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_swiglu_pairs, SwigluPairs, (Signature<ffi::F32, ffi::S32, ffi::U16, ffi::U16>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_combine_pairs, CombinePairs, (Signature<ffi::F32, ffi::S32, ffi::F32, ffi::U16>()));
// (q, q_pe, c_kv, k_pe, c_scale, layer, lengths, table, own_c, own_pe, scale) -> the attention context.
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_mla_decode_context, (MlaDecodeContext<ffi::F32, float, ffi::U16, uint16_t>),
                              (Signature<ffi::F32, ffi::F32, ffi::U16, ffi::U16, ffi::F32, ffi::S32, ffi::S32, ffi::S32,
                                         ffi::U16, ffi::U16, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_bf16_mla_decode_context, (MlaDecodeContext<ffi::U16, uint16_t, ffi::U16, uint16_t>),
                              (Signature<ffi::U16, ffi::U16, ffi::U16, ffi::U16, ffi::F32, ffi::S32, ffi::S32, ffi::S32,
                                         ffi::U16, ffi::U16, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_int8_mla_decode_context, (MlaDecodeContext<ffi::F32, float, ffi::S8, int8_t>),
                              (Signature<ffi::F32, ffi::F32, ffi::S8, ffi::U16, ffi::F32, ffi::S32, ffi::S32, ffi::S32,
                                         ffi::U16, ffi::U16, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dsr1_bf16_int8_mla_decode_context,
                              (MlaDecodeContext<ffi::U16, uint16_t, ffi::S8, int8_t>),
                              (Signature<ffi::U16, ffi::U16, ffi::S8, ffi::U16, ffi::F32, ffi::S32, ffi::S32, ffi::S32,
                                         ffi::U16, ffi::U16, ffi::F32>()));

#if defined(__AVX512BF16__)
// Seconds for `n` rounds of 12 independent multiply-add chains of `op` (registers only: enough chains
// to cover the instructions' latency).
template <typename Op>
double chain_seconds(int64_t n, Op op) {
  __m512 a0 = _mm512_set1_ps(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
         a10 = a0, a11 = a0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n; ++k) {
    a0 = op(a0), a1 = op(a1), a2 = op(a2), a3 = op(a3), a4 = op(a4), a5 = op(a5), a6 = op(a6), a7 = op(a7);
    a8 = op(a8), a9 = op(a9), a10 = op(a10), a11 = op(a11);
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7));
    asm volatile("" : "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
#endif

// How many `vdpbf16ps` this CPU retires per float32 FMA (the best of a few ~0.1 ms runs of each): 0
// without AVX-512 BF16. As each does twice the FMA's multiply-adds, bf16 rows pay off from ~0.5.
extern "C" double dsr1_bf16_dot_rate() {
#if defined(__AVX512BF16__)
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80)), b = reinterpret_cast<__m512bh>(_mm512_setzero_si512());
  const __m512 one = _mm512_set1_ps(1), zero = _mm512_setzero_ps();
  double dot = 1e9, fma = 1e9;
  for (int trial = 0; trial < 5; ++trial) {
    dot = std::min(dot, chain_seconds(50000, [&](__m512 c) { return _mm512_dpbf16_ps(c, a, b); }));
    fma = std::min(fma, chain_seconds(50000, [&](__m512 c) { return _mm512_fmadd_ps(c, one, zero); }));
  }
  return fma / dot;
#else
  return 0;
#endif
}

// Whether the AMX handler runs here (built for AMX, and Linux grants the tile state).
extern "C" int dsr1_amx() { return amx_permitted(); }

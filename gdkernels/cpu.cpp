// The CPU decode matmuls for int4 and int8 weights: x86 AVX2 + FMA, with AVX-512 VNNI's vpdpbusd where the CPU
// has it, built by kernels/cpu.py on first use for this machine (-march=native).
//
// PyTorch's int4 CPU op dequantizes every weight to float and multiplies in float: on AVX2 that is
// compute-bound, well under the memory bandwidth (BENCHMARKS.md). Here, as llama.cpp does for its
// Q4 formats, the activations are quantized to int8 per block of 32 columns and multiplied with
// the weights in integers. Over a block, with x' the quantized x,
//   sum x * ((q - 8) * scale + zero) ~ scale * (sum(x' * q) - 8 * sum(x')) + zero * sum(x):
// integer sums, and the exact sum of x for the zero point. The weights are stored interleaved (cpu.interleave):
// each 32-byte load holds 4 bytes of each of 8 blocks, so int32 lane b of the sums is block b's, whole, and
// 8 blocks take one float multiply-add for their scales. A load is unpacked once for up to 4 rows of x (a batch
// shares the weights' work), and each row's arithmetic is the same whatever the others.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> 8 float32
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

inline __m256i dot(__m256i acc, __m256i u, __m256i s) {  // acc + the sums of 4 products u8 * s8, lane by lane
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else  // (a pair of products must fit int16: int8 weights go in as |w|, x with w's sign)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// x [M, K] per block of 32 columns, in two int8 parts: x = d * (hi + lo / 128), hi = round(x / d)
// with d = max |x| / 127, lo the remainder (|lo| <= 64), so x is carried to ~1/32000 of the
// block's largest value (bf16 carries ~1/512 of each value). A row's chunk of 8 blocks: 512 bytes, the hi parts
// then the lo parts, each as 8 vectors in the order of the weights' 8 vectors (dot_chunk); lane b of a vector
// holds block b's 4 values. Per block b of row m: `d` (here d / 128, the unit of 128 * hi + lo), the exact
// `sum` of x and `sum8` = 8 * the sum of the quantized x, at m * Bp + b (Bp: the blocks rounded up to 8).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, sum, sum8;
};

QuantizedX quantize_x(const at::Tensor& x, int64_t Bp, bool int4) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedX out{std::vector<int8_t>(M * Bp * 64), std::vector<float>(M * Bp), std::vector<float>(M * Bp),
                 std::vector<float>(M * Bp)};
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* xb = xp + m * K + 32 * b;
      __m256 v[4], top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
        total = _mm256_add_ps(total, v[i]);
      }
      __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      t = _mm_max_ps(t, _mm_movehl_ps(t, t));
      const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t))), sum = hsum(total);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i hi[4], lo[4], quantized = _mm256_setzero_si256();  // (the quantized sum, in units of d / 128)
      for (int i = 0; i < 4; ++i) {  // round to nearest, ties to even (as nearbyint)
        const __m256 f = _mm256_mul_ps(v[i], inv), h = _mm256_round_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        hi[i] = _mm256_cvtps_epi32(h);
        lo[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(f, h), _mm256_set1_ps(128.f)));
        quantized = _mm256_add_epi32(quantized, _mm256_add_epi32(_mm256_slli_epi32(hi[i], 7), lo[i]));
      }
      // 32 values as int8 in column order, then each 4-byte group to its vector (int4: in each 8 columns, the
      // even ones, then the odd ones: the low nibbles', then the high nibbles')
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      const __m256i nibbles = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                               0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
      int8_t* chunk = out.q.data() + (m * Bp + b / 8 * 8) * 64 + b % 8 * 4;
      for (int part = 0; part < 2; ++part) {
        const __m256i* p = part ? lo : hi;
        __m256i q = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(p[0], p[1]), _mm256_packs_epi32(p[2], p[3])), order);
        if (int4) q = _mm256_shuffle_epi8(q, nibbles);
        alignas(32) int32_t groups[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(groups), q);
        for (int k = 0; k < 8; ++k) std::memcpy(chunk + 256 * part + 32 * k, groups + k, 4);
      }
      const __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(quantized), _mm256_extracti128_si256(quantized, 1));
      const int32_t total_q = _mm_cvtsi128_si32(_mm_hadd_epi32(_mm_hadd_epi32(q4, q4), _mm_hadd_epi32(q4, q4)));
      out.d[m * Bp + b] = amax / (127.f * 128.f);
      out.sum[m * Bp + b] = sum;
      out.sum8[m * Bp + b] = 8.f * out.d[m * Bp + b] * static_cast<float>(total_q);
    }
  }
  return out;
}

// One output column, rows m0..m0+R-1 of x: y[r * N] for each. wn: the column's weights, interleaved; int4: sn and
// zn its scales and zeros (bf16 per block), int8: `scale`.
template <int R, bool INT4>
void rows_dot(const QuantizedX& X, int64_t m0, int64_t K, const uint8_t* wn, const uint16_t* sn, const uint16_t* zn,
              float scale, int64_t Bp, float* y, int64_t N) {
  const int64_t blocks = K / 32, block_bytes = INT4 ? 16 : 32;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < blocks; c += 8) {
    const int64_t n = std::min<int64_t>(8, blocks - c);  // blocks in this chunk (the last may hold fewer)
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const uint8_t* wc = wn + c * block_bytes;
    __m256i hi[R], lo[R];
    for (int r = 0; r < R; ++r) hi[r] = lo[r] = _mm256_setzero_si256();
    for (int64_t g = 0; g < block_bytes / 4; ++g) {  // a load: 4 bytes of each block
      const __m256i v = _mm256_maskload_epi32(reinterpret_cast<const int*>(wc + 4 * n * g), lanes);
      for (int h = 0; h < (INT4 ? 2 : 1); ++h) {
        const int64_t k = INT4 ? 2 * g + h : g;  // the k-th of the chunk's 8 weight vectors
        // int8: w + 128 (unsigned), or with AVX2 |w| times x with w's sign
        const __m256i u = INT4 ? _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15))
                               : VNNI ? _mm256_xor_si256(v, _mm256_set1_epi8(-128)) : _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = X.q.data() + ((m0 + r) * Bp + c) * 64 + 32 * k;
          const __m256i xh = load(xq), xl = load(xq + 256);
          if constexpr (INT4 && !VNNI) {  // AVX2: int16 sums, 8 vectors' pairs of products fit (8 * 2 * 15 * 127)
            hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(u, xh));
            lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(u, xl));
          } else {
            hi[r] = dot(hi[r], u, INT4 || VNNI ? xh : _mm256_sign_epi8(xh, v));
            lo[r] = dot(lo[r], u, INT4 || VNNI ? xl : _mm256_sign_epi8(xl, v));
          }
        }
      }
    }
    for (int r = 0; INT4 && !VNNI && r < R; ++r) {  // (then widened to int32)
      hi[r] = _mm256_madd_epi16(hi[r], _mm256_set1_epi16(1));
      lo[r] = _mm256_madd_epi16(lo[r], _mm256_set1_epi16(1));
    }
    const __m256 s = INT4 ? bf16x8(sn + c) : _mm256_set1_ps(1.f), z = INT4 ? bf16x8(zn + c) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * Bp + c;
      const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi[r], 7), lo[r]));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(s, _mm256_loadu_ps(X.d.data() + at)), acc[r]);
      if (INT4) acc[r] = _mm256_fmadd_ps(z, _mm256_loadu_ps(X.sum.data() + at), acc[r]);  // + zero * sum(x)
      if (INT4 || VNNI)  // int4: - scale * 8 sum(x'); int8 as w + 128: - 128 sum(x')
        acc[r] = _mm256_fnmadd_ps(INT4 ? s : _mm256_set1_ps(16.f), _mm256_loadu_ps(X.sum8.data() + at), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = scale * hsum(acc[r]);
}

// y [M, N] float32 = x [M, K] float32 @ W.T, column n from the weights' row n (`row_bytes` bytes); rows 4 at a time.
template <bool INT4>
at::Tensor linear(const at::Tensor& x, const uint8_t* w, int64_t N, int64_t row_bytes, const uint16_t* sp,
                  const uint16_t* zp, const float* scales) {
  const int64_t M = x.size(0), K = x.size(1), Bp = (K / 32 + 7) / 8 * 8;
  const QuantizedX X = quantize_x(x, Bp, INT4);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  // Threads only for products big enough to pay for the hand-off (the model's smallest, 576x576, does).
#pragma omp parallel for schedule(static) if (N * K >= 262144)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    const uint16_t *sn = INT4 ? sp + n * Bp : nullptr, *zn = INT4 ? zp + n * Bp : nullptr;
    const float scale = INT4 ? 1.f : scales[n];
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows_dot<4, INT4>(X, m, K, wn, sn, zn, scale, Bp, yp + m * N + n, N);
    if (M - m == 3) rows_dot<3, INT4>(X, m, K, wn, sn, zn, scale, Bp, yp + m * N + n, N);
    if (M - m == 2) rows_dot<2, INT4>(X, m, K, wn, sn, zn, scale, Bp, yp + m * N + n, N);
    if (M - m == 1) rows_dot<1, INT4>(X, m, K, wn, sn, zn, scale, Bp, yp + m * N + n, N);
  }
  return y;
}

}  // namespace

// x [M, K] float32; w uint8 [N, K/2] interleaved (cpu.interleave) from the file's layout, where column 2j is in
// the low nibble of byte j and 2j+1 in the high one; scales, zeros bf16 [N, Bp]: one per block of 32 columns,
// Bp = K/32 rounded up to a multiple of 8 (padded with zeros): w = (q - 8) * scale + zero. Returns y [M, N] float32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_linear: x must be contiguous float32 [M, K]");
  const int64_t K = x.size(1), N = w.size(0), Bp = (K / 32 + 7) / 8 * 8;
  TORCH_CHECK(K % 32 == 0 && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) * 2 == K,
              "int4_linear: w must be contiguous uint8 [N, K/2], K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
              scales.is_contiguous() && zeros.is_contiguous() && scales.numel() == N * Bp && zeros.numel() == N * Bp,
              "int4_linear: scales and zeros must be contiguous bf16 [N, K/32 rounded up to a multiple of 8]");
  return linear<true>(x, w.data_ptr<uint8_t>(), N, K / 2, reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>()), nullptr);
}

// x [M, K] float32 (K a multiple of 32); w int8 [N, K] interleaved (cpu.interleave); scales float32 [N]:
// W = w * scales[:, None]. Returns y [M, N] float32. The unsigned operand is |w|, times x with w's sign.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_linear: x must be contiguous float32 [M, K]");
  const int64_t K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == K,
              "int8_linear: w must be contiguous int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "int8_linear: scales must be contiguous float32 [N]");
  return linear<false>(x, reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>()), N, K, nullptr, nullptr,
                       scales.data_ptr<float>());
}

// Attention over a static cache that reads each query's keys up to its position only (the decode
// step then costs what its positions cost, not what the cache holds: one build serves every length).
// q [B, H, S, D] float32; k, v [B, Hkv, L, D] float32 or bf16 (a cache's first B rows); pos [S] or
// [B, S] int64, each < L: query s of row b sees keys 0..pos. Returns y [B, H, S, D] float32.
inline __m256 exp8(__m256 x) {  // e^x for x <= 0: 2^n e^r, |r| <= ln(2) / 2, e^r to degree 6 (rel. error < 2e-7)
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));  // (Cephes' ln 2)
  __m256 e = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(c));
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(e), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}

template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  else return bf16x8(reinterpret_cast<const uint16_t*>(p));
}

template <typename T>
void attend(const float* q, const T* k, const T* v, const int64_t* pos, float* y, int64_t B, int64_t H,
            int64_t Hkv, int64_t S, int64_t L, int64_t D, bool per_row, int64_t work) {
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
#pragma omp parallel for schedule(dynamic, 1) collapse(2) if (work >= 131072)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      int64_t longest = 0;  // the row's most keys a query reads: the scores' room
      for (int64_t s = 0; s < S; ++s) longest = std::max(longest, pos[per_row ? b * S + s : s] + 1);
      std::vector<float> p(longest);
      const int64_t kvh = h / (H / Hkv);
      const T* kh = k + (b * Hkv + kvh) * L * D;
      const T* vh = v + (b * Hkv + kvh) * L * D;
      for (int64_t s = 0; s < S; ++s) {
        const float* qs = q + ((b * H + h) * S + s) * D;
        const int64_t n = pos[per_row ? b * S + s : s] + 1;
        int64_t t = 0;
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= n; t += 8) {  // 8 keys at a time: 8 independent sums, reduced together
          __m256 acc[8];
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(qs + d);
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, load8(kh + (t + j) * D + d), acc[j]);
          }
          const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
          const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
          const __m256 dots = _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                          _mm256_permute2f128_ps(u0, u1, 0x31)), _mm256_set1_ps(scale));
          _mm256_storeu_ps(p.data() + t, dots);
          top8 = _mm256_max_ps(top8, dots);
        }
        float top = -INFINITY, total = 0.f;
        for (int j = 0; j < 8; ++j) top = std::max(top, top8[j]);
        for (; t < n; ++t) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d), load8(kh + t * D + d), acc);
          top = std::max(top, p[t] = hsum(acc) * scale);
        }
        __m256 sum8 = _mm256_setzero_ps();
        for (t = 0; t + 8 <= n; t += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + t), _mm256_set1_ps(top)));
          _mm256_storeu_ps(p.data() + t, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        for (; t < n; ++t) total += (p[t] = std::exp(p[t] - top));
        total += hsum(sum8);
        float* ys = y + ((b * H + h) * S + s) * D;  // sum of p[t] v[t], accumulated in place, 8 keys a pass
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(ys + d, _mm256_setzero_ps());
        for (t = 0; t < n; t += 8) {
          const int64_t keys = std::min<int64_t>(8, n - t);
          for (int64_t d = 0; d < D; d += 8) {
            __m256 o = _mm256_loadu_ps(ys + d);
            for (int64_t j = 0; j < keys; ++j) o = _mm256_fmadd_ps(_mm256_set1_ps(p[t + j]), load8(vh + (t + j) * D + d), o);
            _mm256_storeu_ps(ys + d, o);
          }
        }
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(ys + d, _mm256_mul_ps(_mm256_loadu_ps(ys + d), _mm256_set1_ps(1.f / total)));
      }
    }
  }
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "attention: q must be contiguous float32 [B, H, S, D]");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.is_contiguous() &&
              v.is_contiguous() && k.size(0) == B && k.size(3) == D && D % 8 == 0 && H % k.size(1) == 0 &&
              (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "attention: k and v must be contiguous float32 or bf16 [B, Hkv, L, D], D a multiple of 8");
  const bool per_row = pos.dim() == 2;
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.size(-1) == S && (!per_row || pos.size(0) == B),
              "attention: pos must be contiguous int64 [S] or [B, S]");
  const int64_t Hkv = k.size(1), L = k.size(2);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < L, "attention: a position is outside the cache");
  at::Tensor y = at::empty(q.sizes(), q.options());
  const int64_t work = B * H * S * (pp[pos.numel() - 1] + 1) * D;
  if (k.scalar_type() == at::kFloat)
    attend(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), pp, y.data_ptr<float>(), B, H, Hkv, S, L, D,
           per_row, work);
  else
    attend(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), pp, y.data_ptr<float>(), B, H, Hkv, S, L, D,
           per_row, work);
  return y;
}

TORCH_LIBRARY(graphdecode, m) {
  m.def("int4_linear(Tensor x, Tensor w, Tensor scales, Tensor zeros) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor pos) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphdecode, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("attention", &attention);
}

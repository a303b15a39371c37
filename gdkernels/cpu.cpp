// The CPU decode matmuls for int4 and int8 weights: x86 AVX2 + FMA, built by kernels/cpu.py on first use.
//
// PyTorch's int4 CPU op dequantizes every weight to float and multiplies in float: on AVX2 that is
// compute-bound, well under the memory bandwidth (BENCHMARKS.md). Here, as llama.cpp does for its
// Q4 formats, the activations are quantized to int8 per block of 32 columns and multiplied with
// the 4-bit weights in integers (vpmaddubsw: 32 products an instruction), one float multiply-add a
// block for the scales. Over a block, with x' the quantized x,
//   sum x * ((q - 8) * scale + zero) ~ scale * (sum(x' * q) - 8 * sum(x')) + zero * sum(x):
// integer sums, and the exact sum of x for the zero point.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// x [M, K] per block of 32 columns, in two int8 parts: x = d * (hi + lo / 128), hi = round(x / d)
// with d = max |x| / 127, lo the remainder (|lo| <= 64), so x is carried to ~1/32000 of the
// block's largest value (bf16 carries ~1/512 of each value). Block b of row m: `d` (here d / 128,
// the unit of 128 * hi + lo), the exact `sum` of x and `sum8` = 8 * the sum of the quantized x, at
// m * Bp + b. The values: 64 bytes a block, its 32 hi then its 32 lo; with `nibble_order`, a pair of blocks is
// stored as the even columns of both (32 bytes) then their odd columns, hi and then lo, the order
// in which a 32-byte load of an int4 weight gives its low and its high nibbles.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, sum, sum8;
};

QuantizedX quantize_x(const at::Tensor& x, int64_t Bp, bool nibble_order) {
  const int64_t M = x.size(0), K = x.size(1), B = K / 32;
  QuantizedX out{std::vector<int8_t>(2 * M * K), std::vector<float>(M * Bp, 0.f), std::vector<float>(M * Bp, 0.f),
                 std::vector<float>(M * Bp, 0.f)};
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = xp + m * K + 32 * b;
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < 32; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        sum += xb[i];
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* block = out.q.data() + 2 * m * K + (nibble_order ? 128 * (b / 2) + 16 * (b % 2) : 64 * b);
      int32_t total = 0;  // the quantized sum, in units of d / 128
      for (int j = 0; j < 32; ++j) {
        const float v = xb[j] * inv, hi = std::nearbyint(v), lo = std::nearbyint((v - hi) * 128.f);
        const int at = nibble_order ? (j % 2) * 32 + j / 2 : j;
        block[at] = static_cast<int8_t>(hi);
        block[(nibble_order ? 64 : 32) + at] = static_cast<int8_t>(lo);
        total += 128 * static_cast<int32_t>(hi) + static_cast<int32_t>(lo);
      }
      out.d[m * Bp + b] = amax / (127.f * 128.f);
      out.sum[m * Bp + b] = sum;
      out.sum8[m * Bp + b] = 8.f * out.d[m * Bp + b] * static_cast<float>(total);
    }
  }
  return out;
}

}  // namespace

// x [M, K] float32; w uint8 [N, K/2], column 2j in the low nibble of byte j, 2j+1 in the high one;
// scales, zeros bf16 [N, Bp]: one per block of 32 columns, Bp = K/32 rounded up to a multiple of 8
// (padded with zeros): w = (q - 8) * scale + zero. Returns y [M, N] float32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_linear: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), B = K / 32, Bp = (B + 7) / 8 * 8;
  TORCH_CHECK(K % 64 == 0 && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) * 2 == K,
              "int4_linear: w must be contiguous uint8 [N, K/2], K a multiple of 64");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
              scales.is_contiguous() && zeros.is_contiguous() && scales.numel() == N * Bp && zeros.numel() == N * Bp,
              "int4_linear: scales and zeros must be contiguous bf16 [N, K/32 rounded up to a multiple of 8]");

  const QuantizedX xq = quantize_x(x, Bp, true);

  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::BFloat16>());
  const int8_t* xqp = xq.q.data();
  const float* xdp = xq.d.data();
  const float* xsp = xq.sum.data();
  const float* x8p = xq.sum8.data();
  const int64_t pairs = B / 2;
  // Threads only for products big enough to pay for the hand-off (the model's smallest, 576x576, does).
#pragma omp parallel for schedule(static) if (N * K >= 262144)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wn = wp + n * (K / 2);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1), x128 = _mm256_set1_epi16(128);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xqm = xqp + 2 * m * K;
      __m256 acc = _mm256_setzero_ps(), zacc = _mm256_setzero_ps();
      for (int64_t c = 0; c < Bp / 8; ++c) {  // 8 blocks (4 pairs) a step
        const __m256 s = bf16x8(sp + n * Bp + 8 * c), z = bf16x8(zp + n * Bp + 8 * c);
        zacc = _mm256_fmadd_ps(z, _mm256_loadu_ps(xsp + m * Bp + 8 * c), zacc);  // zero * sum(x)
        zacc = _mm256_fnmadd_ps(s, _mm256_loadu_ps(x8p + m * Bp + 8 * c), zacc);  // - scale * 8 sum(x')
        const __m256 sd = _mm256_mul_ps(s, _mm256_loadu_ps(xdp + m * Bp + 8 * c));  // weight scale x x's scale
        const int64_t end = std::min<int64_t>(4, pairs - 4 * c);
        for (int64_t j = 0; j < end; ++j) {
          const int64_t pr = 4 * c + j;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + 32 * pr));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          const __m256i* xv = reinterpret_cast<const __m256i*>(xqm + 128 * pr);
          // q * x summed in pairs (int16, |.| <= 2 * 2 * 15 * 127), then in fours (int32, hi's sums
          // times 128): lanes 0-3 hold the first block's sums, 4-7 the second's.
          const __m256i p_hi = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(xv)),
                                                _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xv + 1)));
          const __m256i p_lo = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(xv + 2)),
                                                _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xv + 3)));
          const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(p_hi, x128), _mm256_madd_epi16(p_lo, ones));
          const __m256i lanes = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(sd, lanes), acc);
        }
      }
      yp[m * N + n] = hsum(_mm256_add_ps(acc, zacc));
    }
  }
  return y;
}

// x [M, K] float32 (K a multiple of 32); w int8 [N, K]; scales float32 [N]: W = w * scales[:, None].
// Returns y [M, N] float32. vpmaddubsw wants one unsigned operand: |w| times x with w's sign.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_linear: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), B = K / 32;
  TORCH_CHECK(K % 32 == 0 && w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == K,
              "int8_linear: w must be contiguous int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "int8_linear: scales must be contiguous float32 [N]");
  const QuantizedX xq = quantize_x(x, B, false);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
#pragma omp parallel for schedule(static) if (N * K >= 262144)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* wn = wp + n * K;
    const __m256i ones = _mm256_set1_epi16(1), x128 = _mm256_set1_epi16(128);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xqm = xq.q.data() + 2 * m * K;
      const float* xdm = xq.d.data() + m * B;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < B; ++b) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + 32 * b));
        const __m256i* xv = reinterpret_cast<const __m256i*>(xqm + 64 * b);  // hi, then lo
        const __m256i a = _mm256_abs_epi8(v);  // |w| <= 128: pairs of products fit int16 (2 * 128 * 127)
        const __m256i p = _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_loadu_si256(xv), v)), x128),
            _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_loadu_si256(xv + 1), v)), ones));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xdm[b]), acc);
      }
      yp[m * N + n] = sp[n] * hsum(acc);
    }
  }
  return y;
}

// Attention over a static cache that reads each query's keys up to its position only (the decode
// step then costs what its positions cost, not what the cache holds: one build serves every length).
// q [B, H, S, D] float32; k, v [B, Hkv, L, D] float32 or bf16 (a cache's first B rows); pos [S] or
// [B, S] int64, each < L: query s of row b sees keys 0..pos. Returns y [B, H, S, D] float32.
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
        for (t = 0; t < n; ++t) total += (p[t] = std::exp(p[t] - top));
        float* ys = y + ((b * H + h) * S + s) * D;  // sum of p[t] v[t], accumulated in place
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(ys + d, _mm256_setzero_ps());
        for (t = 0; t < n; ++t) {
          const __m256 pt = _mm256_set1_ps(p[t] / total);
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(ys + d, _mm256_fmadd_ps(pt, load8(vh + t * D + d), _mm256_loadu_ps(ys + d)));
        }
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

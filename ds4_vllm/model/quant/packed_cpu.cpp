// Packed GGUF rows times float32 activations on the CPU, the packed bytes read once
// (quant/fused.py): where Inductor's code for the tensor expressions is slow, and where several
// rows of activations share a matrix (a batch through a linear layer, a prefill's tokens through
// their routed expert).
//
// `segments`: rows of x [P, K] come in segments, the rows of segment s through matrix
// matrix[s] of data [E, N, row bytes] -> out [P, N] (no matrix and starts: all rows through data [N, row bytes]). A task is four weight rows of one segment's
// matrix: decoded once into float values (the values dequant.py computes, so the sums differ from
// "dequantize, then matmul" by summation order only), then multiplied with every row of the
// segment, four rows at a time. A segment of one row skips the decode where a format has a dot
// loop over its packed bytes (IQ2_XXS, Q8_0), which sums a block's products before its scale.
//
// Formats (codes as quant/fused.py's _NATIVE_FORMATS):
// - Q8_0 (34-byte blocks of 32: an fp16 scale, 32 int8 codes).
// - Q2_K (84-byte blocks of 256: 16 scale/min nibble pairs, 64 bytes of 2-bit codes, fp16 d, dmin).
// - Q4_K (144-byte blocks of 256: fp16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles).
// - IQ2_XXS (66-byte blocks of 256: an fp16 scale, then 8 groups of 32 values, each four
//   grid-row indices and a little-endian uint32 with four 7-bit sign patterns and a 4-bit group
//   scale). `grid` [256, 8] (magnitudes 8/25/43) and `ksigns` [128] (bit j: value j is
//   negative) are gguf-py's tables, small enough to stay in the L1 cache.
// - F16, BF16 (plain 16-bit floats stored as bytes).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

// AVX2 and FMA only: elsewhere the build stops here and quant/fused.py keeps Inductor's kernels.
#if !(defined(__AVX2__) && defined(__FMA__))
#error "packed_cpu.cpp needs AVX2 and FMA"
#endif
#include <immintrin.h>

namespace {

enum Format : int64_t { kQ8_0 = 0, kQ2_K = 1, kQ4_K = 2, kIQ2_XXS = 3, kF16 = 4, kBF16 = 5 };

struct Tables {
  const uint8_t* grid;
  const uint8_t* ksigns;
};

float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

float horizontal_sum(__m256 lanes) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// ---- decoders: one row of `blocks` blocks -> float values -------------------------------------

void decode_q8_0(const uint8_t* row, int64_t blocks, float* out, const Tables&) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 34;
    const __m256 d = _mm256_set1_ps(fp16_at(block));
    for (int q = 0; q < 4; ++q) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + q * 8));
      _mm256_storeu_ps(out + b * 32 + q * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), d));
    }
  }
}

// Value 128 h + 32 s + i is code (qs[32 h + i] >> 2 s) & 3 of sub-block 8 h + 2 s + i / 16:
// the 32 code bytes of a half shifted once per s, eight values widened at a time.
void decode_q2_k(const uint8_t* row, int64_t blocks, float* out, const Tables&) {
  const __m256i low_bits = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 84;
    const float d = fp16_at(block + 80), dmin = fp16_at(block + 82);
    float* y = out + b * 256;
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * h));
      for (int s = 0; s < 4; ++s) {
        alignas(32) uint8_t codes[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes),
                           _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(2 * s)), low_bits));
        for (int half = 0; half < 2; ++half) {
          const uint8_t sc = block[8 * h + 2 * s + half];
          const __m256 dl = _mm256_set1_ps(d * static_cast<float>(sc & 15));
          const __m256 ml = _mm256_set1_ps(dmin * static_cast<float>(sc >> 4));
          for (int q = 0; q < 2; ++q) {
            const int i = 16 * half + 8 * q;
            const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
            const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
            _mm256_storeu_ps(y + 128 * h + 32 * s + i, _mm256_fmsub_ps(values, dl, ml));
          }
        }
      }
    }
  }
}

// Sub-block 2 c holds the low nibbles of code bytes 32 c .. 32 c + 31, sub-block 2 c + 1 the high ones.
void decode_q4_k(const uint8_t* row, int64_t blocks, float* out, const Tables&) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 144;
    const float d = fp16_at(block), dmin = fp16_at(block + 2);
    const uint8_t *lo = block + 4, *mid = block + 8, *hi = block + 12, *codes = block + 16;
    float dl[8], ml[8];
    for (int j = 0; j < 4; ++j) {
      dl[j] = d * static_cast<float>(lo[j] & 0x3F);
      ml[j] = dmin * static_cast<float>(mid[j] & 0x3F);
      dl[j + 4] = d * static_cast<float>((hi[j] & 0x0F) | ((lo[j] >> 2) & 0x30));
      ml[j + 4] = dmin * static_cast<float>((hi[j] >> 4) | ((mid[j] >> 2) & 0x30));
    }
    float* y = out + b * 256;
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 32; ++i) {
        const uint8_t q = codes[32 * c + i];
        y[64 * c + i] = static_cast<float>(q & 15) * dl[2 * c] - ml[2 * c];
        y[64 * c + 32 + i] = static_cast<float>(q >> 4) * dl[2 * c + 1] - ml[2 * c + 1];
      }
    }
  }
}

// Eight lanes are one grid row: its magnitudes widened to float, the sign bits xor-ed in.
inline __m256 iq2_xxs_signed_row(const uint8_t* grid_row, uint8_t sign_pattern) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i sign_bit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(grid_row));
  const __m256 magnitudes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256i signs = _mm256_set1_epi32(sign_pattern);
  const __m256i negative = _mm256_cmpeq_epi32(_mm256_and_si256(signs, lane_bit), lane_bit);
  return _mm256_xor_ps(magnitudes, _mm256_castsi256_ps(_mm256_and_si256(negative, sign_bit)));
}

void decode_iq2_xxs(const uint8_t* row, int64_t blocks, float* out, const Tables& t) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 66;
    const float d = fp16_at(block);
    for (int g = 0; g < 8; ++g) {
      const uint8_t* group = block + 2 + g * 8;
      uint32_t aux;
      std::memcpy(&aux, group + 4, 4);
      const __m256 db = _mm256_set1_ps(d * (0.5f + static_cast<float>(aux >> 28)) * 0.25f);
      for (int l = 0; l < 4; ++l) {
        const __m256 signed_row = iq2_xxs_signed_row(t.grid + group[l] * 8, t.ksigns[(aux >> (7 * l)) & 127]);
        _mm256_storeu_ps(out + b * 256 + g * 32 + l * 8, _mm256_mul_ps(signed_row, db));
      }
    }
  }
}

void decode_f16(const uint8_t* row, int64_t values, float* out, const Tables&) {
  int64_t k = 0;
  for (; k + 8 <= values; k += 8) {
    _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
  }
  for (; k < values; ++k) out[k] = fp16_at(row + 2 * k);
}

void decode_bf16(const uint8_t* row, int64_t values, float* out, const Tables&) {
  for (int64_t k = 0; k < values; ++k) {
    uint16_t bits;
    std::memcpy(&bits, row + 2 * k, 2);
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    std::memcpy(out + k, &wide, 4);
  }
}

// ---- dot loops over packed bytes (a segment of one row) ---------------------------------------

float iq2_xxs_dot_row(const uint8_t* row, const float* x, int64_t blocks, const Tables& t) {
  __m256 total = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 66;
    const float d = fp16_at(block);
    const float* xb = x + b * 256;
    for (int g = 0; g < 8; ++g) {
      const uint8_t* group = block + 2 + g * 8;
      uint32_t aux;
      std::memcpy(&aux, group + 4, 4);
      __m256 sum = _mm256_setzero_ps();
      for (int l = 0; l < 4; ++l) {
        const __m256 signed_row = iq2_xxs_signed_row(t.grid + group[l] * 8, t.ksigns[(aux >> (7 * l)) & 127]);
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(xb + g * 32 + l * 8), signed_row, sum);
      }
      const float scale = d * (0.5f + static_cast<float>(aux >> 28)) * 0.25f;
      total = _mm256_fmadd_ps(sum, _mm256_set1_ps(scale), total);
    }
  }
  return horizontal_sum(total);
}

#if defined(__AVX512F__)
// Sixteen lanes: a block's 32 codes widened in two steps.
float q8_0_dot_row(const uint8_t* row, const float* x, int64_t blocks, const Tables&) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 34;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18))));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(x + b * 32), lo);
    sum = _mm512_fmadd_ps(_mm512_loadu_ps(x + b * 32 + 16), hi, sum);
    total = _mm512_fmadd_ps(sum, _mm512_set1_ps(fp16_at(block)), total);
  }
  return _mm512_reduce_add_ps(total);
}
#else
// Eight lanes: a block's 32 codes widened in four steps (tests/model/test_fused_kernels.py
// builds this variant too, with -mno-avx512f).
float q8_0_dot_row(const uint8_t* row, const float* x, int64_t blocks, const Tables&) {
  __m256 total = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 34;
    __m256 sum = _mm256_setzero_ps();
    for (int q = 0; q < 4; ++q) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + q * 8));
      const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(x + b * 32 + q * 8), values, sum);
    }
    total = _mm256_fmadd_ps(sum, _mm256_set1_ps(fp16_at(block)), total);
  }
  return horizontal_sum(total);
}
#endif

// ---- rows of x times four decoded weight rows --------------------------------------------------

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kRowTile = 4;  // 16 accumulators + 4 weight vectors of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kRowTile = 2;  // 8 accumulators + 4 weight vectors of 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return horizontal_sum(v); }
#endif

constexpr int kWeightTile = 4;
constexpr int64_t kTaskRows = 32;  // weight rows per task
// Segment rows up to which a format's dot loop runs once per row (the task's packed rows stay in
// the cache): faster than decoding for one or two rows (Q8_0 [4096, 4096], two rows: 1.8 against 4.1 ms).
constexpr int64_t kDotRows = 2;

// out[r * ldo + j] = dot(x + r * in, w + j * in) for r < ROWS, j < w_rows (the buffer holds
// kWeightTile rows; those past w_rows are zeros and not stored).
template <int ROWS>
void rows_times_weights(const float* x, const float* w, int64_t in, int w_rows, float* out, int64_t ldo) {
  Vec acc[ROWS][kWeightTile];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < kWeightTile; ++j) acc[r][j] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes) {
    Vec wv[kWeightTile];
    for (int j = 0; j < kWeightTile; ++j) wv[j] = vload(w + j * in + k);
    for (int r = 0; r < ROWS; ++r) {
      const Vec xv = vload(x + r * in + k);
      for (int j = 0; j < kWeightTile; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  // Reduced with constant bounds first: indexing acc by w_rows would keep it in memory.
  float sums[ROWS][kWeightTile];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < kWeightTile; ++j) sums[r][j] = vsum(acc[r][j]);
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < w_rows; ++j) {
      float sum = sums[r][j];
      for (int64_t t = k; t < in; ++t) sum += x[r * in + t] * w[j * in + t];
      out[r * ldo + j] = sum;
    }
  }
}

using Decoder = void (*)(const uint8_t*, int64_t, float*, const Tables&);
using DotRow = float (*)(const uint8_t*, const float*, int64_t, const Tables&);

struct FormatInfo {
  int64_t values_per_block, bytes_per_block;
  Decoder decode;
  DotRow dot;  // nullptr: decode, then multiply
  bool plain;  // decode takes the row's values rather than its blocks
};

FormatInfo format_info(int64_t format) {
  switch (format) {
    case kQ8_0: return {32, 34, decode_q8_0, q8_0_dot_row, false};
    case kQ2_K: return {256, 84, decode_q2_k, nullptr, false};
    case kQ4_K: return {256, 144, decode_q4_k, nullptr, false};
    case kIQ2_XXS: return {256, 66, decode_iq2_xxs, iq2_xxs_dot_row, false};
    case kF16: return {1, 2, decode_f16, nullptr, true};
    case kBF16: return {1, 2, decode_bf16, nullptr, true};
  }
  TORCH_CHECK(false, "packed_cpu: unknown format code ", format);
}

}  // namespace

torch::Tensor segments(int64_t format, torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> matrix_arg,
                       c10::optional<torch::Tensor> starts_arg, torch::Tensor grid, torch::Tensor ksigns) {
  const FormatInfo f = format_info(format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [P, K]");
  TORCH_CHECK((data.dim() == 3 || data.dim() == 2) && data.scalar_type() == torch::kUInt8 && data.is_contiguous(),
              "data: contiguous uint8 [E, N, row bytes] or one matrix [N, row bytes]");
  if (data.dim() == 2) data = data.unsqueeze(0);
  const int64_t rows = x.size(0), in = x.size(1), n_matrices = data.size(0), n_out = data.size(1);
  const int64_t row_bytes = data.size(2);
  TORCH_CHECK(in % f.values_per_block == 0 && row_bytes == in / f.values_per_block * f.bytes_per_block,
              "x and data disagree on K");
  // No matrix and starts: one segment, every row through matrix 0.
  TORCH_CHECK(matrix_arg.has_value() == starts_arg.has_value(), "matrix and starts come together");
  const torch::Tensor matrix = matrix_arg.has_value() ? *matrix_arg : torch::zeros({1}, torch::kInt64);
  const torch::Tensor starts = starts_arg.has_value() ? *starts_arg : torch::tensor({int64_t{0}, x.size(0)}, torch::kInt64);
  TORCH_CHECK(matrix.dim() == 1 && matrix.scalar_type() == torch::kInt64, "matrix: int64 [S]");
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == torch::kInt64 && starts.size(0) == matrix.size(0) + 1,
              "starts: int64 [S + 1]");
  const int64_t n_segments = matrix.size(0);
  const int64_t* mp = matrix.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  TORCH_CHECK(n_segments == 0 || (sp[0] == 0 && sp[n_segments] == rows), "starts must run from 0 to x's rows");
  for (int64_t s = 0; s < n_segments; ++s) {
    TORCH_CHECK(sp[s] <= sp[s + 1], "starts must not decrease");
    TORCH_CHECK(mp[s] >= 0 && mp[s] < n_matrices, "matrix ", mp[s], " is out of range for ", n_matrices);
  }
  Tables tables{nullptr, nullptr};
  if (format == kIQ2_XXS) {
    TORCH_CHECK(grid.numel() == 256 * 8 && ksigns.numel() == 128, "grid [256, 8] and ksigns [128] uint8");
    tables = {grid.data_ptr<uint8_t>(), ksigns.data_ptr<uint8_t>()};
  }
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* dp = data.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = f.plain ? in : in / f.values_per_block;
  const int64_t tiles = (n_out + kTaskRows - 1) / kTaskRows;
  // Task t: weight rows of tile t / S of segment t % S, so each thread gets its share of every segment.
  at::parallel_for(0, tiles * n_segments, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(kTaskRows * in, 0.0f);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = t % n_segments, n0 = (t / n_segments) * kTaskRows;
      const int64_t first = sp[s], count = sp[s + 1] - first;
      if (count == 0) continue;
      const int64_t task_rows = std::min<int64_t>(kTaskRows, n_out - n0);
      const uint8_t* weight = dp + (mp[s] * n_out + n0) * row_bytes;
      float* y = op + first * n_out + n0;
      if (count <= kDotRows && f.dot != nullptr) {
        for (int64_t r = 0; r < count; ++r) {
          for (int64_t j = 0; j < task_rows; ++j) {
            y[r * n_out + j] = f.dot(weight + j * row_bytes, xp + (first + r) * in, blocks, tables);
          }
        }
      } else {  // four weight rows at a time, each times every row of the segment
        for (int64_t j0 = 0; j0 < task_rows; j0 += kWeightTile) {
          const int w_rows = static_cast<int>(std::min<int64_t>(kWeightTile, task_rows - j0));
          for (int j = 0; j < w_rows; ++j) f.decode(weight + (j0 + j) * row_bytes, blocks, buffer.data() + j * in, tables);
          if (w_rows < kWeightTile) std::fill(buffer.begin() + w_rows * in, buffer.begin() + kWeightTile * in, 0.0f);
          int64_t r = 0;
          for (; r + kRowTile <= count; r += kRowTile) {
            rows_times_weights<kRowTile>(xp + (first + r) * in, buffer.data(), in, w_rows, y + r * n_out + j0, n_out);
          }
          for (; r < count; ++r) rows_times_weights<1>(xp + (first + r) * in, buffer.data(), in, w_rows, y + r * n_out + j0, n_out);
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("segments", &segments,
        "Segments of float32 rows, each through one packed matrix of a stack (format codes: Q8_0 0, "
        "Q2_K 1, Q4_K 2, IQ2_XXS 3, F16 4, BF16 5)");
}

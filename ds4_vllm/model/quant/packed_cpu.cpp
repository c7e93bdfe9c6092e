// Packed GGUF rows times float32 activations on the CPU, the packed bytes read once
// (quant/fused.py): where Inductor's code for the tensor expressions is slow.
//
// Row p of x [P, K] goes through matrix ids[p] of data [E, N, row bytes] -> out [P, N].
// - IQ2_XXS (66-byte blocks of 256: an fp16 scale, then 8 groups of 32 values, each four
//   grid-row indices and a little-endian uint32 with four 7-bit sign patterns and a 4-bit group
//   scale). `grid` [256, 8] (magnitudes 8/25/43) and `ksigns` [128] (bit j: value j is
//   negative) are gguf-py's tables, small enough to stay in the L1 cache. Inductor vectorizes
//   the table lookups poorly.
// - Q8_0 (34-byte blocks of 32: an fp16 scale, 32 int8 codes). Inductor's loop is 2-3x slower.
// A group's (block's) products are summed before its scale is applied, as the Inductor kernels do.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

// AVX2 and FMA only: elsewhere the build stops here and quant/fused.py keeps Inductor's kernels.
#if !(defined(__AVX2__) && defined(__FMA__))
#error "packed_cpu.cpp needs AVX2 and FMA"
#endif
#include <immintrin.h>

namespace {

constexpr int64_t kValuesPerBlock = 256;
constexpr int64_t kBytesPerBlock = 66;

float horizontal_sum(__m256 lanes) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

float block_scale(const uint8_t* block) {
  uint16_t bits;
  std::memcpy(&bits, block, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Eight lanes are one grid row: its magnitudes widened to float, the sign bits xor-ed in.
float iq2_xxs_dot_row(const uint8_t* row, const float* x, int64_t blocks, const uint8_t* grid, const uint8_t* ksigns) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i sign_bit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  __m256 total = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * kBytesPerBlock;
    const float d = block_scale(block);
    const float* xb = x + b * kValuesPerBlock;
    for (int g = 0; g < 8; ++g) {
      const uint8_t* group = block + 2 + g * 8;
      uint32_t aux;
      std::memcpy(&aux, group + 4, 4);
      __m256 sum = _mm256_setzero_ps();
      for (int l = 0; l < 4; ++l) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(grid + group[l] * 8));
        __m256 magnitudes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        const __m256i signs = _mm256_set1_epi32(ksigns[(aux >> (7 * l)) & 127]);
        const __m256i negative = _mm256_cmpeq_epi32(_mm256_and_si256(signs, lane_bit), lane_bit);
        magnitudes = _mm256_xor_ps(magnitudes, _mm256_castsi256_ps(_mm256_and_si256(negative, sign_bit)));
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(xb + g * 32 + l * 8), magnitudes, sum);
      }
      const float scale = d * (0.5f + static_cast<float>(aux >> 28)) * 0.25f;
      total = _mm256_fmadd_ps(sum, _mm256_set1_ps(scale), total);
    }
  }
  return horizontal_sum(total);
}

#if defined(__AVX512F__)
// Sixteen lanes: a block's 32 codes widened in two steps.
float q8_0_dot_row(const uint8_t* row, const float* x, int64_t blocks) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 34;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18))));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(x + b * 32), lo);
    sum = _mm512_fmadd_ps(_mm512_loadu_ps(x + b * 32 + 16), hi, sum);
    total = _mm512_fmadd_ps(sum, _mm512_set1_ps(block_scale(block)), total);
  }
  return _mm512_reduce_add_ps(total);
}
#else
// Eight lanes: a block's 32 codes widened in four steps (tests/model/test_fused_kernels.py
// builds this variant too, with -mno-avx512f).
float q8_0_dot_row(const uint8_t* row, const float* x, int64_t blocks) {
  __m256 total = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 34;
    __m256 sum = _mm256_setzero_ps();
    for (int q = 0; q < 4; ++q) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + q * 8));
      const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(x + b * 32 + q * 8), values, sum);
    }
    total = _mm256_fmadd_ps(sum, _mm256_set1_ps(block_scale(block)), total);
  }
  return horizontal_sum(total);
}
#endif

void check_pairs(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& ids,
                 int64_t values_per_block, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [P, K]");
  TORCH_CHECK(data.dim() == 3 && data.scalar_type() == torch::kUInt8 && data.is_contiguous(), "data: contiguous uint8 [E, N, row bytes]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.size(0) == x.size(0), "ids: int64 [P]");
  TORCH_CHECK(x.size(1) % values_per_block == 0 && data.size(2) == x.size(1) / values_per_block * bytes_per_block,
              "x and data disagree on K");
}

// out[p, n] = dot(row n of matrix ids[p], x[p]), weight rows split across threads. All rows of x
// take weight row n in turn, so a linear layer's weight (all ids equal) comes from memory once.
template <typename Dot>
torch::Tensor pairs_through(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& ids, Dot dot) {
  const int64_t rows = x.size(0), in = x.size(1), n_out = data.size(1), row_bytes = data.size(2);
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * n_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / rows, p = r % rows;
      op[p * n_out + n] = dot(dp + (ip[p] * n_out + n) * row_bytes, xp + p * in);
    }
  });
  return out;
}

}  // namespace

torch::Tensor iq2_xxs_pairs(
    torch::Tensor x, torch::Tensor data, torch::Tensor ids, torch::Tensor grid, torch::Tensor ksigns) {
  check_pairs(x, data, ids, kValuesPerBlock, kBytesPerBlock);
  TORCH_CHECK(grid.numel() == 256 * 8 && ksigns.numel() == 128, "grid [256, 8] and ksigns [128] uint8");
  const uint8_t* gp = grid.data_ptr<uint8_t>();
  const uint8_t* kp = ksigns.data_ptr<uint8_t>();
  const int64_t blocks = x.size(1) / kValuesPerBlock;
  return pairs_through(x, data, ids, [&](const uint8_t* row, const float* xr) { return iq2_xxs_dot_row(row, xr, blocks, gp, kp); });
}

torch::Tensor q8_0_pairs(torch::Tensor x, torch::Tensor data, torch::Tensor ids) {
  check_pairs(x, data, ids, 32, 34);
  const int64_t blocks = x.size(1) / 32;
  return pairs_through(x, data, ids, [&](const uint8_t* row, const float* xr) { return q8_0_dot_row(row, xr, blocks); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("iq2_xxs_pairs", &iq2_xxs_pairs, "IQ2_XXS rows through picked matrices, float32");
  m.def("q8_0_pairs", &q8_0_pairs, "Q8_0 rows through picked matrices, float32");
}

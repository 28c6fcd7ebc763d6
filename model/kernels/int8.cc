// The int8 variant's two operators (export/int8_ops.py) as onnxruntime CPU kernels: what onnxruntime runs for them
// when this library is registered (model/kernels/__init__.py builds it, service/engine.py registers it); without
// it, onnxruntime inlines their ONNX function bodies (standard operators). Same arithmetic, one pass each.
//
// ai.addnorm.RowQuantize(x (..., E) float, pick (E, F + 1), keep (E)) -> q (..., E) uint8, step (..., 1), side (..., F + 3)
//   per row, export/int8.py's "minmax" rows: c = x @ pick's last column (the other channels' mean), d = (x - c) *
//   keep (F's at 0), step = max(max(d) - min(d), TINY) / 254, z = clamp(round(-min(d) / step), 0, 255),
//   q = clamp(round(d / step) + z, 0, 255), side = [x[F], c, (128 - z) step, 1]  (round: half to even)
// ai.addnorm.QuantMatMul(q (..., K) uint8, step (..., 1), side (..., J), w (K, N) int8, w_scale (N), side_w (J, N))
//   -> ((q - 128) @ w) * (step * w_scale) + side @ side_w: an int8 GEMM whose epilogue scales each row and adds
//   its float side. On AMX (Linux grants the tiles per process), AVX-512 VNNI, or AVX2's VPMADDUBSW (exact on the
//   scheme's pair-bounded weights); w is packed for them at the first run. ADDNORM_KERNELS_ISA=avx2|vnni caps the
//   instructions used (tests compare every path a CPU has).
//
// Built for x86-64 with AVX2 and FMA against onnxruntime's C++ API header (lite custom ops); the C API is
// versioned, so a library built against an older header loads into a newer runtime.

#define ORT_API_MANUAL_INIT
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "onnxruntime_lite_custom_op.h"

namespace {
enum Isa { AVX2 = 0, VNNI = 1, AMX = 2 };

// The widest instructions this CPU has (and Linux grants: AMX's tiles are asked for per process), at most what
// ADDNORM_KERNELS_ISA allows.
int widest() {
  const char* cap = std::getenv("ADDNORM_KERNELS_ISA");
  const int most = !cap ? AMX : std::strcmp(cap, "avx2") == 0 ? AVX2 : std::strcmp(cap, "vnni") == 0 ? VNNI : AMX;
  if (most < VNNI || !__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return AVX2;
  if (most < AMX || !__builtin_cpu_supports("amx-int8")) return VNNI;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? AMX : VNNI;
}
const int ISA = widest();

constexpr float STEPS = 254.0f, TINY = 1e-30f, ZERO_POINT = 128.0f;  // model/schemes.py's
constexpr int64_t ROWS_PER_TASK = 32;

float lanes_sum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
float lanes_min(__m256 v) {
  __m128 a = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_min_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_min_ss(a, _mm_shuffle_ps(a, a, 1)));
}
float lanes_max(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// fn(data, task) for each task of ROWS_PER_TASK rows, on onnxruntime's intra-op threads.
void in_tasks(OrtKernelContext* context, void (*fn)(void*, size_t), int64_t rows, void* data) {
  const size_t tasks = (size_t)((rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  if (tasks) Ort::KernelContext(context).ParallelFor(fn, tasks, 0, data);
}

struct Rows {
  const float* x;
  const int64_t* channels;
  const float* keep;  // 0 at the float channels, 1 elsewhere
  const float* mean;  // pick's last column: keep / |keep|
  int64_t width, floats, rows;
  uint8_t* q;
  float* step;
  float* side;
};

// x @ mean, summed in one order on every CPU kind (so that every kind quantizes alike): blocks of 8 lanes, block b
// into partial sum b % 4, then (p0 + p1) + (p2 + p3) across its lanes, then what is left one value at a time.
float row_mean(const float* x, const float* mean, int64_t E) {
  __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
  int64_t i = 0;
  for (; i + 32 <= E; i += 32) {
    p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(mean + i), p0);
    p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(mean + i + 8), p1);
    p2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(mean + i + 16), p2);
    p3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(mean + i + 24), p3);
  }
  __m256* partial[4] = {&p0, &p1, &p2, &p3};
  for (int b = 0; i + 8 <= E; i += 8, ++b)
    *partial[b] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(mean + i), *partial[b]);
  float c = lanes_sum(_mm256_add_ps(_mm256_add_ps(p0, p1), _mm256_add_ps(p2, p3)));
  for (; i < E; ++i) c = std::fma(x[i], mean[i], c);
  return c;
}

// A row's step and zero point from its least and largest d (0 between them).
float step_of(float lo, float hi) { return std::max(hi - lo, TINY) / STEPS; }
float zero_of(float lo, float step) { return std::min(std::max(std::nearbyint(-(lo / step)), 0.f), 255.f); }

// A row's step and float side: [x[F], c, (128 - z) step, 1].
void finish_row(const Rows& a, int64_t r, const float* x, float c, float step, float zero) {
  a.step[r] = step;
  float* side = a.side + r * (a.floats + 3);
  for (int64_t k = 0; k < a.floats; ++k) side[k] = x[a.channels[k]];
  side[a.floats] = c;
  side[a.floats + 1] = (ZERO_POINT - zero) * step;
  side[a.floats + 2] = 1.f;
}

void quantize_rows(void* data, size_t task) {
  const Rows a = *static_cast<const Rows*>(data);
  const int64_t E = a.width, vec = E / 8 * 8, wide = E / 32 * 32;
  std::vector<float> buffer(E);
  float* __restrict d = buffer.data();
  const int64_t end = std::min<int64_t>(a.rows, (int64_t)(task + 1) * ROWS_PER_TASK);
  for (int64_t r = (int64_t)task * ROWS_PER_TASK; r < end; ++r) {
    const float* __restrict x = a.x + r * E;
    const float c = row_mean(x, a.mean, E);
    const __m256 cv = _mm256_set1_ps(c);
    __m256 lo8 = _mm256_setzero_ps(), hi8 = _mm256_setzero_ps();  // d holds 0 at every float channel
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), cv), _mm256_loadu_ps(a.keep + i));
      _mm256_storeu_ps(d + i, v);
      lo8 = _mm256_min_ps(lo8, v);
      hi8 = _mm256_max_ps(hi8, v);
    }
    float lo = lanes_min(lo8), hi = lanes_max(hi8);
    for (int64_t i = vec; i < E; ++i) {
      d[i] = (x[i] - c) * a.keep[i];
      lo = std::min(lo, d[i]);
      hi = std::max(hi, d[i]);
    }
    const float step = step_of(lo, hi), zero = zero_of(lo, step);
    const __m256 sv = _mm256_set1_ps(step), zv = _mm256_set1_ps(zero), floor = _mm256_setzero_ps(),
                 ceiling = _mm256_set1_ps(255.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
    uint8_t* __restrict q = a.q + r * E;
    for (int64_t i = 0; i < wide; i += 32) {
      __m256i levels[4];
      for (int j = 0; j < 4; ++j) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(d + i + 8 * j), sv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        levels[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, zv), floor), ceiling));
      }
      const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(levels[0], levels[1]),
                                                _mm256_packus_epi32(levels[2], levels[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    for (int64_t i = wide; i < E; ++i) q[i] = (uint8_t)std::min(std::max(std::nearbyint(d[i] / step) + zero, 0.f), 255.f);
    finish_row(a, r, x, c, step, zero);
  }
}

// quantize_rows in two passes of AVX-512 (E a multiple of 32), the same arithmetic: the first takes the row's
// mean (row_mean's partial sums: the low and high halves of two registers), least and largest kept value ((x - c)
// is monotonic in x, so min(x - c) = min(x) - c exactly); the second its levels straight from x, d / step by a
// product with the step's reciprocal (a few ulps off), divided where that could round to another level.
__attribute__((target("avx512f"))) __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

__attribute__((target("avx512f,avx512bw"))) void quantize_rows512(void* data, size_t task) {
  const Rows a = *static_cast<const Rows*>(data);
  const int64_t E = a.width;
  std::vector<__mmask16> kept((size_t)(E / 16));
  for (int64_t i = 0; i < E; i += 16)
    kept[i / 16] = _mm512_cmp_ps_mask(_mm512_loadu_ps(a.keep + i), _mm512_setzero_ps(), _CMP_NEQ_OQ);
  const int64_t end = std::min<int64_t>(a.rows, (int64_t)(task + 1) * ROWS_PER_TASK);
  for (int64_t r = (int64_t)task * ROWS_PER_TASK; r < end; ++r) {
    const float* __restrict x = a.x + r * E;
    __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY), p01 = _mm512_setzero_ps(), p23 = p01;
    for (int64_t i = 0; i < E; i += 32) {
      const __m512 v = _mm512_loadu_ps(x + i), w = _mm512_loadu_ps(x + i + 16);
      p01 = _mm512_fmadd_ps(v, _mm512_loadu_ps(a.mean + i), p01);
      p23 = _mm512_fmadd_ps(w, _mm512_loadu_ps(a.mean + i + 16), p23);
      lo = _mm512_mask_min_ps(lo, kept[i / 16], lo, v);
      hi = _mm512_mask_max_ps(hi, kept[i / 16], hi, v);
      lo = _mm512_mask_min_ps(lo, kept[i / 16 + 1], lo, w);
      hi = _mm512_mask_max_ps(hi, kept[i / 16 + 1], hi, w);
    }
    const __m256 p0p1 = _mm256_add_ps(_mm512_castps512_ps256(p01), high_half(p01));
    const __m256 p2p3 = _mm256_add_ps(_mm512_castps512_ps256(p23), high_half(p23));
    const float c = lanes_sum(_mm256_add_ps(p0p1, p2p3));
    // d holds 0 at every float channel, and (x - c) of the kept ones
    const float dlo = std::min(_mm512_reduce_min_ps(lo) - c, 0.f), dhi = std::max(_mm512_reduce_max_ps(hi) - c, 0.f);
    const float step = step_of(dlo, dhi), zero = zero_of(dlo, step);
    const __m512 cv = _mm512_set1_ps(c), sv = _mm512_set1_ps(step), zv = _mm512_set1_ps(zero),
                 ceiling = _mm512_set1_ps(255.f), inv = _mm512_set1_ps(1.f / step), half = _mm512_set1_ps(0.5f),
                 near = _mm512_set1_ps(1.f / 4096);  // |d / step| <= 255: the product is within 2^-14 of it
    uint8_t* __restrict q = a.q + r * E;
    for (int64_t i = 0; i < E; i += 16) {
      const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), cv), _mm512_loadu_ps(a.keep + i));
      const __m512 t = _mm512_mul_ps(d, inv);
      __m512 v = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 tie = _mm512_abs_ps(_mm512_sub_ps(_mm512_abs_ps(_mm512_sub_ps(t, v)), half));
      if (_mm512_cmp_ps_mask(tie, near, _CMP_LT_OQ))
        v = _mm512_roundscale_ps(_mm512_div_ps(d, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 level = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, zv), _mm512_setzero_ps()), ceiling);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(level)));
    }
    finish_row(a, r, x, c, step, zero);
  }
}

void RowQuantize(OrtKernelContext* context, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<float>& pick,
                 const Ort::Custom::Tensor<float>& keep, Ort::Custom::Tensor<uint8_t>& q, Ort::Custom::Tensor<float>& step,
                 Ort::Custom::Tensor<float>& side) {
  const std::vector<int64_t> shape = x.Shape(), picks = pick.Shape();
  const int64_t width = shape.back(), floats = picks[1] - 1;
  if (picks[0] != width || keep.NumberOfElement() != width)
    ORT_CXX_API_THROW("RowQuantize: pick must be (E, F + 1) and keep (E) for x (..., E)", ORT_INVALID_ARGUMENT);
  std::vector<int64_t> channels(floats);
  std::vector<float> mean(width);
  for (int64_t i = 0; i < width; ++i) {
    const float* row = pick.Data() + i * (floats + 1);
    for (int64_t k = 0; k < floats; ++k)
      if (row[k] == 1.f) channels[k] = i;  // one-hot columns
    mean[i] = row[floats];
  }
  std::vector<int64_t> one = shape, wide = shape;
  one.back() = 1;
  wide.back() = floats + 3;
  Rows a{x.Data(),         channels.data(),   keep.Data(),        mean.data(), width, floats,
         width ? x.NumberOfElement() / width : 0, q.Allocate(shape), step.Allocate(one), side.Allocate(wide)};
  in_tasks(context, ISA >= VNNI && width % 32 == 0 ? quantize_rows512 : quantize_rows, a.rows, &a);
}

// The packed weight: its first n columns (a multiple of 16) in panels of up to 64 columns, each [K / 4][width][4]
// bytes (4 consecutive k of a column in one 32-bit lane, as VPDPBUSD, VPMADDUBSW and AMX take them), and 128 x each
// column's sum (the product's zero point), for all N. Columns beyond n, or any K not a multiple of 4: plain C++.
struct Packed {
  int64_t k4 = 0, n = 0;
  const int8_t* source = nullptr;  // the weight packed (an initializer: the same buffer every run)
  std::vector<int8_t> b;
  std::vector<int32_t> zero;
  const int8_t* panel(int64_t c) const { return b.data() + c * k4 * 4; }  // c: a multiple of 64
};

Packed pack(const int8_t* w, int64_t K, int64_t N) {
  Packed p;
  p.source = w;
  p.k4 = K % 4 ? 0 : K / 4;
  p.n = p.k4 ? N / 16 * 16 : 0;
  p.b.assign((size_t)(K * p.n), 0);
  p.zero.assign((size_t)N, 0);
  for (int64_t c = 0; c < N; ++c)
    for (int64_t k = 0; k < K; ++k) p.zero[c] += 128 * w[k * N + c];
  for (int64_t c = 0; c < p.n; ++c) {
    const int64_t start = c / 64 * 64, width = std::min<int64_t>(64, p.n - start);
    int8_t* panel = p.b.data() + start * p.k4 * 4;
    for (int64_t k = 0; k < K; ++k) panel[(k / 4) * width * 4 + (c - start) * 4 + k % 4] = w[k * N + c];
  }
  return p;
}

struct Gemm {
  const uint8_t* q;
  const float* step;
  const float* side;
  const Packed* w;
  const int8_t* raw;  // w as given, (K, N)
  const float* w_scale;
  const float* side_w;
  int64_t k, n, j, rows;
  float* y;
};

constexpr int64_t GEMM_ROWS_PER_TASK = 24;

// y's rows [r, r + rows) x columns [c, c + cols) from their integer products acc (rows x ld int32): less the zero
// point's, times the row's step and the column's scale, plus the row's float side @ side_w.
__attribute__((target("avx512f"))) void epilogue512(const Gemm& g, int64_t r, int64_t c, int rows, int cols,
                                                    const int32_t* acc, int ld) {
  const int64_t N = g.n;
  for (int i = 0; i < rows; ++i) {
    const float* s = g.side + (r + i) * g.j;
    const __m512 st = _mm512_set1_ps(g.step[r + i]);
    for (int z = 0; z < cols; z += 16) {
      const int64_t col = c + z;
      const __m512i ints = _mm512_sub_epi32(_mm512_loadu_si512(acc + i * ld + z), _mm512_loadu_si512(g.w->zero.data() + col));
      const __m512 scaled =
          _mm512_mul_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(st, _mm512_loadu_ps(g.w_scale + col)));
      __m512 offset = _mm512_setzero_ps();
      for (int64_t k = 0; k < g.j; ++k)
        offset = _mm512_fmadd_ps(_mm512_set1_ps(s[k]), _mm512_loadu_ps(g.side_w + k * N + col), offset);
      _mm512_storeu_ps(g.y + (r + i) * N + col, _mm512_add_ps(scaled, offset));
    }
  }
}

void epilogue256(const Gemm& g, int64_t r, int64_t c, int rows, int cols, const int32_t* acc, int ld) {
  const int64_t N = g.n;
  for (int i = 0; i < rows; ++i) {
    const float* s = g.side + (r + i) * g.j;
    const __m256 st = _mm256_set1_ps(g.step[r + i]);
    for (int z = 0; z < cols; z += 8) {
      const int64_t col = c + z;
      const __m256i ints =
          _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + i * ld + z)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.w->zero.data() + col)));
      const __m256 scaled =
          _mm256_mul_ps(_mm256_cvtepi32_ps(ints), _mm256_mul_ps(st, _mm256_loadu_ps(g.w_scale + col)));
      __m256 offset = _mm256_setzero_ps();
      for (int64_t k = 0; k < g.j; ++k)
        offset = _mm256_fmadd_ps(_mm256_set1_ps(s[k]), _mm256_loadu_ps(g.side_w + k * N + col), offset);
      _mm256_storeu_ps(g.y + (r + i) * N + col, _mm256_add_ps(scaled, offset));
    }
  }
}

// rows [r, r + MR) x columns [c, c + 16 NZ) of y: the integer product over all of K (the accumulators stay in
// registers: every index a constant once unrolled), then the epilogue.
template <int MR, int NZ>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const Gemm& g, int64_t r, int64_t c,
                                                                       const int8_t* b, int64_t stride) {
  const int64_t K = g.k;
  __m512i acc[MR][NZ];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_setzero_si512();
  const uint8_t* a = g.q + r * K;
  for (int64_t k4 = 0; k4 < g.w->k4; ++k4, b += stride) {
    __m512i bv[NZ];
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) bv[z] = _mm512_loadu_si512(b + 64 * z);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i av = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + i * K + 4 * k4));
#pragma GCC unroll 4
      for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_dpbusd_epi32(acc[i][z], av, bv[z]);
    }
  }
  alignas(64) int32_t out[MR][16 * NZ];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) _mm512_store_si512(&out[i][16 * z], acc[i][z]);
  epilogue512(g, r, c, MR, 16 * NZ, &out[0][0], 16 * NZ);
}

template <int MR, int NY>
void tile_avx2(const Gemm& g, int64_t r, int64_t c, const int8_t* b, int64_t stride) {
  const int64_t K = g.k;
  __m256i acc[MR][NY];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int z = 0; z < NY; ++z) acc[i][z] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* a = g.q + r * K;
  for (int64_t k4 = 0; k4 < g.w->k4; ++k4, b += stride) {
    __m256i bv[NY];
#pragma GCC unroll 4
    for (int z = 0; z < NY; ++z) bv[z] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * z));
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256i av = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(a + i * K + 4 * k4));
#pragma GCC unroll 4
      for (int z = 0; z < NY; ++z)  // pairs in int16 (exact on pair-bounded weights), then in int32
        acc[i][z] = _mm256_add_epi32(acc[i][z], _mm256_madd_epi16(_mm256_maddubs_epi16(av, bv[z]), ones));
    }
  }
  alignas(32) int32_t out[MR][8 * NY];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int z = 0; z < NY; ++z) _mm256_store_si256(reinterpret_cast<__m256i*>(&out[i][8 * z]), acc[i][z]);
  epilogue256(g, r, c, MR, 8 * NY, &out[0][0], 8 * NY);
}


template <int MR>
void rows_vnni(const Gemm& g, int64_t r) {
  for (int64_t c = 0; c < g.w->n; c += 64) {
    const int8_t* b = g.w->panel(c);
    switch (std::min<int64_t>(64, g.w->n - c) / 16) {
      case 4: tile_vnni<MR, 4>(g, r, c, b, 256); break;
      case 3: tile_vnni<MR, 3>(g, r, c, b, 192); break;
      case 2: tile_vnni<MR, 2>(g, r, c, b, 128); break;
      default: tile_vnni<MR, 1>(g, r, c, b, 64);
    }
  }
}

template <int MR>
void rows_avx2(const Gemm& g, int64_t r) {
  for (int64_t c = 0; c < g.w->n; c += 64) {
    const int64_t width = std::min<int64_t>(64, g.w->n - c);
    const int8_t* b = g.w->panel(c);
    for (int64_t h = 0; h < width; h += 32) {
      if (width - h >= 32) tile_avx2<MR, 4>(g, r, c + h, b + 4 * h, 4 * width);
      else tile_avx2<MR, 2>(g, r, c + h, b + 4 * h, 4 * width);
    }
  }
}


// AMX: a block of 32 rows x 32 columns as four 16 x 16 int32 tiles, K in steps of 64 (a tile of A is 16 rows of 64
// levels as they lie in q; a tile of B is 16 rows of the packed panel, 16 columns x 4 k each); then the epilogue.

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"))) void block_amx(const Gemm& g, int64_t r,
                                                                                       int64_t c) {
  const int64_t K = g.k, start = c / 64 * 64, stride = 4 * std::min<int64_t>(64, g.w->n - start);
  const int8_t* b = g.w->panel(start) + 4 * (c - start);
  const uint8_t* a = g.q + r * K;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 64, b += 16 * stride) {
    _tile_loadd(4, a + k, K);
    _tile_loadd(5, a + 16 * K + k, K);
    _tile_loadd(6, b, stride);
    _tile_loadd(7, b + 64, stride);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  alignas(64) int32_t acc[32][32];
  _tile_stored(0, &acc[0][0], 128);
  _tile_stored(1, &acc[0][16], 128);
  _tile_stored(2, &acc[16][0], 128);
  _tile_stored(3, &acc[16][16], 128);
  epilogue512(g, r, c, 32, 32, &acc[0][0], 32);
}

constexpr int64_t AMX_ROWS = 32;

__attribute__((target("amx-tile,amx-int8"))) void gemm_amx(void* data, size_t task) {
  const Gemm& g = *static_cast<const Gemm*>(data);
  const int64_t r = (int64_t)task * AMX_ROWS;
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  for (int64_t c = 0; c < g.w->n; c += 32) block_amx(g, r, c);
  _tile_release();
}

void gemm_rows(void* data, size_t task) {
  const Gemm& g = *static_cast<const Gemm*>(data);
  const int64_t end = std::min<int64_t>(g.rows, (int64_t)(task + 1) * GEMM_ROWS_PER_TASK);
  int64_t r = (int64_t)task * GEMM_ROWS_PER_TASK;
  if (ISA >= VNNI) {
    for (; r + 6 <= end; r += 6) rows_vnni<6>(g, r);
    switch (end - r) {
      case 5: rows_vnni<5>(g, r); break;
      case 4: rows_vnni<4>(g, r); break;
      case 3: rows_vnni<3>(g, r); break;
      case 2: rows_vnni<2>(g, r); break;
      case 1: rows_vnni<1>(g, r); break;
    }
  } else {
    for (; r + 2 <= end; r += 2) rows_avx2<2>(g, r);
    if (end > r) rows_avx2<1>(g, r);
  }
}

// Columns [w->n, N) of a task's rows (all of them where K is not a multiple of 4), one value at a time.
void gemm_tail(void* data, size_t task) {
  const Gemm& g = *static_cast<const Gemm*>(data);
  const int64_t end = std::min<int64_t>(g.rows, (int64_t)(task + 1) * GEMM_ROWS_PER_TASK);
  for (int64_t r = (int64_t)task * GEMM_ROWS_PER_TASK; r < end; ++r) {
    const uint8_t* a = g.q + r * g.k;
    const float* s = g.side + r * g.j;
    for (int64_t c = g.w->n; c < g.n; ++c) {
      int32_t acc = -g.w->zero[c];
      for (int64_t k = 0; k < g.k; ++k) acc += (int32_t)a[k] * g.raw[k * g.n + c];
      float offset = 0.f;
      for (int64_t k = 0; k < g.j; ++k) offset = std::fma(s[k], g.side_w[k * g.n + c], offset);
      g.y[r * g.n + c] = (float)acc * (g.step[r] * g.w_scale[c]) + offset;
    }
  }
}

struct QuantMatMul {
  QuantMatMul(const OrtApi*, const OrtKernelInfo*) {}
  void Compute(OrtKernelContext* context, const Ort::Custom::Tensor<uint8_t>& q, const Ort::Custom::Tensor<float>& step,
               const Ort::Custom::Tensor<float>& side, const Ort::Custom::Tensor<int8_t>& w,
               const Ort::Custom::Tensor<float>& w_scale, const Ort::Custom::Tensor<float>& side_w,
               Ort::Custom::Tensor<float>& y) {
    const std::vector<int64_t> shape = q.Shape(), ws = w.Shape();
    const int64_t K = ws[0], N = ws[1], J = side_w.Shape()[0];
    if (shape.back() != K || side.Shape().back() != J || w_scale.NumberOfElement() != N || side_w.Shape()[1] != N)
      ORT_CXX_API_THROW("QuantMatMul: q (..., K), side (..., J), w (K, N), w_scale (N) and side_w (J, N) disagree",
                        ORT_INVALID_ARGUMENT);
    std::call_once(packed_once_, [&] { packed_ = pack(w.Data(), K, N); });
    Packed other;  // a weight that is not the initializer packed first (never in export/int8.py's graphs)
    const Packed* packed = &packed_;
    if (w.Data() != packed_.source) packed = &(other = pack(w.Data(), K, N));
    std::vector<int64_t> out = shape;
    out.back() = N;
    Gemm g{q.Data(),      step.Data(), side.Data(), packed, w.Data(), w_scale.Data(), side_w.Data(), K, N, J,
           K ? q.NumberOfElement() / K : 0, y.Allocate(out)};
    Ort::KernelContext kernel(context);
    const size_t tasks = (size_t)((g.rows + GEMM_ROWS_PER_TASK - 1) / GEMM_ROWS_PER_TASK);
    if (packed->n < N && tasks) kernel.ParallelFor(gemm_tail, tasks, 0, &g);
    if (!packed->n) return;
    if (ISA == AMX && K % 64 == 0 && packed->n % 32 == 0 && g.rows >= AMX_ROWS) {  // whole blocks on AMX
      const size_t blocks = (size_t)(g.rows / AMX_ROWS);
      kernel.ParallelFor(gemm_amx, blocks, 0, &g);
      g.q += blocks * AMX_ROWS * K, g.step += blocks * AMX_ROWS, g.side += blocks * AMX_ROWS * J;
      g.y += blocks * AMX_ROWS * N, g.rows -= blocks * AMX_ROWS;
    }
    const size_t rest = (size_t)((g.rows + GEMM_ROWS_PER_TASK - 1) / GEMM_ROWS_PER_TASK);
    if (rest) kernel.ParallelFor(gemm_rows, rest, 0, &g);
  }

 private:
  std::once_flag packed_once_;
  Packed packed_;
};
}  // namespace

// The instructions the kernels run here (what model.kernels.isa reports; the server logs it at load).
extern "C" const char* AddnormKernelsIsa() { return ISA == AMX ? "amx" : ISA == VNNI ? "vnni" : "avx2"; }

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));  // the header's version: a newer runtime serves it too
  static Ort::CustomOpDomain domain{"ai.addnorm"};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> rows{
      Ort::Custom::CreateLiteCustomOp("RowQuantize", "CPUExecutionProvider", RowQuantize)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> gemm{
      Ort::Custom::CreateLiteCustomOp<QuantMatMul>("QuantMatMul", "CPUExecutionProvider")};
  static const bool added = (domain.Add(rows.get()), domain.Add(gemm.get()), true);
  (void)added;
  Ort::UnownedSessionOptions(options).Add(domain);
  return nullptr;
}

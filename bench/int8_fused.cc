// bench/int8_fused.py's two kernels: int8's per-row quantization and its float side (export/int8.py) as custom
// onnxruntime operators, to measure what onnxruntime's standard operators leave on the table. A study, never
// part of an exported graph. Built by bench/int8_fused.py against onnxruntime's C++ API header (lite custom ops),
// for x86-64 with AVX2 and FMA.
//
// ai.addnorm.RowQuantize(x (..., E) float, channels (F) int64) -> q (..., E) uint8, step (..., 1), side (..., F + 3)
//   per row, export/int8.py's "minmax" rows: c = the mean of the channels not in F, d = (x - c) with F's at 0,
//   step = max(max(d) - min(d), TINY) / 254, z = clamp(round(-min(d) / step), 0, 255),
//   q = clamp(round(d / step) + z, 0, 255), side = [x[F], c, (128 - z) step, 1]  (round: half to even)
// ai.addnorm.AddSide(y (..., N), side (..., K), w (K, N)) -> y + side @ w

#define ORT_API_MANUAL_INIT
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "onnxruntime_lite_custom_op.h"

namespace {
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
  int64_t width, floats, rows;
  float inv_count;
  uint8_t* q;
  float* step;
  float* side;
};

void quantize_rows(void* data, size_t task) {
  const Rows a = *static_cast<const Rows*>(data);
  const int64_t E = a.width, vec = E / 8 * 8, wide = E / 32 * 32;
  std::vector<float> buffer(E);
  float* __restrict d = buffer.data();
  const int64_t end = std::min<int64_t>(a.rows, (int64_t)(task + 1) * ROWS_PER_TASK);
  for (int64_t r = (int64_t)task * ROWS_PER_TASK; r < end; ++r) {
    const float* __restrict x = a.x + r * E;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < vec; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(a.keep + i), acc);
    float sum = lanes_sum(acc);
    for (int64_t i = vec; i < E; ++i) sum += x[i] * a.keep[i];
    const float c = sum * a.inv_count;
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
    const float step = std::max(hi - lo, TINY) / STEPS;
    const float zero = std::min(std::max(std::nearbyint(-(lo / step)), 0.f), 255.f);
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
    a.step[r] = step;
    float* side = a.side + r * (a.floats + 3);
    for (int64_t k = 0; k < a.floats; ++k) side[k] = x[a.channels[k]];
    side[a.floats] = c;
    side[a.floats + 1] = (ZERO_POINT - zero) * step;
    side[a.floats + 2] = 1.f;
  }
}

void RowQuantize(OrtKernelContext* context, const Ort::Custom::Tensor<float>& x,
                 const Ort::Custom::Tensor<int64_t>& channels, Ort::Custom::Tensor<uint8_t>& q,
                 Ort::Custom::Tensor<float>& step, Ort::Custom::Tensor<float>& side) {
  const std::vector<int64_t> shape = x.Shape();
  const int64_t width = shape.back(), floats = channels.NumberOfElement();
  std::vector<float> keep(width, 1.f);
  for (int64_t k = 0; k < floats; ++k) keep[channels.Data()[k]] = 0.f;
  std::vector<int64_t> one = shape, wide = shape;
  one.back() = 1;
  wide.back() = floats + 3;
  Rows a{x.Data(),      channels.Data(),  keep.data(),       width,
         floats,        width ? x.NumberOfElement() / width : 0, 1.f / (float)(width - floats),
         q.Allocate(shape), step.Allocate(one), side.Allocate(wide)};
  in_tasks(context, quantize_rows, a.rows, &a);
}

struct Side {
  const float* y;
  const float* side;
  const float* w;
  int64_t k, n, rows;
  float* out;
};

void add_side(void* data, size_t task) {
  const Side a = *static_cast<const Side*>(data);
  const int64_t N = a.n, K = a.k, wide = N / 32 * 32;
  const int64_t end = std::min<int64_t>(a.rows, (int64_t)(task + 1) * ROWS_PER_TASK);
  for (int64_t r = (int64_t)task * ROWS_PER_TASK; r < end; ++r) {
    const float* __restrict y = a.y + r * N;
    const float* s = a.side + r * K;
    float* __restrict o = a.out + r * N;
    for (int64_t j = 0; j < wide; j += 32) {
      __m256 o0 = _mm256_loadu_ps(y + j), o1 = _mm256_loadu_ps(y + j + 8), o2 = _mm256_loadu_ps(y + j + 16),
             o3 = _mm256_loadu_ps(y + j + 24);
      for (int64_t k = 0; k < K; ++k) {
        const __m256 sk = _mm256_set1_ps(s[k]);
        const float* w = a.w + k * N + j;
        o0 = _mm256_fmadd_ps(sk, _mm256_loadu_ps(w), o0);
        o1 = _mm256_fmadd_ps(sk, _mm256_loadu_ps(w + 8), o1);
        o2 = _mm256_fmadd_ps(sk, _mm256_loadu_ps(w + 16), o2);
        o3 = _mm256_fmadd_ps(sk, _mm256_loadu_ps(w + 24), o3);
      }
      _mm256_storeu_ps(o + j, o0);
      _mm256_storeu_ps(o + j + 8, o1);
      _mm256_storeu_ps(o + j + 16, o2);
      _mm256_storeu_ps(o + j + 24, o3);
    }
    for (int64_t j = wide; j < N; ++j) {
      float v = y[j];
      for (int64_t k = 0; k < K; ++k) v += s[k] * a.w[k * N + j];
      o[j] = v;
    }
  }
}

void AddSide(OrtKernelContext* context, const Ort::Custom::Tensor<float>& y, const Ort::Custom::Tensor<float>& side,
             const Ort::Custom::Tensor<float>& w, Ort::Custom::Tensor<float>& out) {
  const std::vector<int64_t> shape = y.Shape();
  const int64_t n = shape.back();
  Side a{y.Data(), side.Data(), w.Data(), w.Shape()[0], n, n ? y.NumberOfElement() / n : 0, out.Allocate(shape)};
  in_tasks(context, add_side, a.rows, &a);
}
}  // namespace

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));  // the header's version: a newer runtime serves it too
  static Ort::CustomOpDomain domain{"ai.addnorm"};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> rows{
      Ort::Custom::CreateLiteCustomOp("RowQuantize", "CPUExecutionProvider", RowQuantize)};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> side{
      Ort::Custom::CreateLiteCustomOp("AddSide", "CPUExecutionProvider", AddSide)};
  static const bool added = (domain.Add(rows.get()), domain.Add(side.get()), true);
  (void)added;
  Ort::UnownedSessionOptions(options).Add(domain);
  return nullptr;
}

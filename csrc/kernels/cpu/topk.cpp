// CPU top-k sparsification (exact and threshold-sampled) with fused error
// feedback, and the sparse scatter-add that undoes it.
//
// The approximate selection reads the tensor once in the common case:
//   1. estimate the k-th largest magnitude from a sample, runs of 16
//      elements at hashed places, one in each stratum (../topk_sample.h);
//   2. one pass collects every index at or above that threshold (with error
//      feedback this pass also folds the gradient into the residual);
//   3. between k and k(1 + tolerance) candidates: done (a superset of the
//      exact top-k); more: cut them to exactly k in memory; fewer than k or
//      an overflowing candidate list: move the threshold by the observed
//      count and pass again (rare).
// torch.topk instead sorts partial heaps over the whole tensor.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../kernels.h"
#include "../quant.h"
#include "../topk_sample.h"
#include "dispatch.h"

namespace pycomm {
namespace kernels {
namespace {

// Elements checked together for "any at or above the threshold": hits are
// rare (about k/n), so the vectorised test skips most groups outright.
constexpr size_t kGroup = 16;
// Full passes of the approximate selection before it falls back to exact.
constexpr int kMaxPasses = 4;

template <typename T>
PYCOMM_MULTIVERSION size_t collect(const T* x, float* fold, size_t n, uint32_t thr, int32_t* cand, size_t cap) {
  size_t count = 0;
  size_t i = 0;
  for (; i + kGroup <= n; i += kGroup) {
    uint32_t any = 0;
    if (fold) {
      for (size_t j = 0; j < kGroup; ++j) {
        const float v = load_acc(x[i + j]) + fold[i + j];
        fold[i + j] = v;
        any |= topk_key(v) >= thr;
      }
    } else {
      for (size_t j = 0; j < kGroup; ++j) any |= topk_key(load_acc(x[i + j])) >= thr;
    }
    if (!any) continue;
    for (size_t j = 0; j < kGroup; ++j) {
      const float v = fold ? fold[i + j] : load_acc(x[i + j]);
      if (topk_key(v) >= thr) {
        if (count < cap) cand[count] = static_cast<int32_t>(i + j);
        ++count;
      }
    }
  }
  for (; i < n; ++i) {
    float v = load_acc(x[i]);
    if (fold) {
      v += fold[i];
      fold[i] = v;
    }
    if (topk_key(v) >= thr) {
      if (count < cap) cand[count] = static_cast<int32_t>(i);
      ++count;
    }
  }
  return count;
}

template <typename T>
float value_at(const T* x, const float* eff, size_t i) {
  return eff ? eff[i] : load_acc(x[i]);
}

// Keeps exactly k of the (index-ascending) candidates: the k largest keys,
// ties to the lower index, order preserved.
template <typename T>
size_t trim_to_k(const T* x, const float* eff, std::vector<int32_t>& cand, size_t count, size_t k) {
  std::vector<uint32_t> keys(count);
  for (size_t j = 0; j < count; ++j) keys[j] = topk_key(value_at(x, eff, cand[j]));
  std::vector<uint32_t> sorted(keys);
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<uint32_t>());
  const uint32_t kth = sorted[k - 1];
  size_t above = 0;
  for (uint32_t key : keys) above += key > kth;
  size_t ties = k - above, kept = 0;
  for (size_t j = 0; j < count; ++j) {
    if (keys[j] > kth || (keys[j] == kth && ties > 0)) {
      if (keys[j] == kth) --ties;
      cand[kept++] = cand[j];
    }
  }
  return kept;
}

template <typename T>
size_t select_exact(const T* x, const float* eff, size_t n, size_t k, std::vector<int32_t>& out) {
  std::vector<uint32_t> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = topk_key(value_at(x, eff, i));
  out.resize(n);
  std::iota(out.begin(), out.end(), 0);
  auto before = [&](int32_t a, int32_t b) { return keys[a] != keys[b] ? keys[a] > keys[b] : a < b; };
  std::nth_element(out.begin(), out.begin() + (k - 1), out.end(), before);
  out.resize(k);
  std::sort(out.begin(), out.end());
  return k;
}

// Threshold = the key of sample rank `rank` (0 = largest).
uint32_t sample_threshold(std::vector<uint32_t>& sample, size_t rank) {
  rank = std::min(rank, sample.size() - 1);
  std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<uint32_t>());
  return sample[rank];
}

template <typename T>
size_t select_approx(const TopK& s, const T* x, float* residual, size_t n, std::vector<int32_t>& cand) {
  const size_t k = s.k;
  // Never fewer than k: then the kept set contains the exact top-k (every
  // key at or above a threshold that k keys reach), so it keeps at least
  // the exact top-k's mass; the tolerance only allows extra entries.
  const size_t lo_ok = k;
  const size_t hi_ok = topk_capacity(k, n, false, s.tolerance);
  // 1. Sample. At least ~64 expected hits in the sample keeps the quantile's
  //    relative error near 1/8 even for a small sample fraction.
  const double ratio = static_cast<double>(k) / n;
  size_t m = static_cast<size_t>(n * s.sample_fraction);
  m = std::max<size_t>({m, static_cast<size_t>(std::ceil(64.0 / ratio)), 1024});
  m = std::min(n, (m + kSampleRun - 1) / kSampleRun * kSampleRun);  // whole runs, or the whole tensor
  const uint64_t key = mix64(s.seed);
  std::vector<uint32_t> sample(m);
  for (size_t j = 0; j < m; j += kSampleRun) {
    const size_t start = m == n ? j : sampled_run(j / kSampleRun, m / kSampleRun, n, key);
    for (size_t e = 0; e < kSampleRun && j + e < m; ++e) {
      const size_t i = start + e;
      sample[j + e] = topk_key(load_acc(x[i]) + (residual ? residual[i] : 0.f));
    }
  }
  // Aim halfway into the accepted window, so one pass usually suffices.
  double rank = k * (1.0 + s.tolerance / 2) * static_cast<double>(m) / n;
  const size_t cap = 4 * k + 64;
  cand.resize(cap);
  float* eff = nullptr;  // x + residual once folded
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    // 2. Collect everything at or above the threshold.
    const uint32_t thr = sample_threshold(sample, static_cast<size_t>(rank));
    size_t count;
    if (residual && !eff) {
      count = collect(x, residual, n, thr, cand.data(), cap);
      eff = residual;
    } else if (eff) {
      count = collect<float>(eff, nullptr, n, thr, cand.data(), cap);
    } else {
      count = collect(x, nullptr, n, thr, cand.data(), cap);
    }
    // 3. Accept, cut down, or move the threshold.
    if (count >= lo_ok && count <= hi_ok) return count;
    if (count > hi_ok && count <= cap) return trim_to_k(x, eff, cand, count, k);
    if (count < lo_ok && rank >= m - 1) break;  // even the smallest sampled key is too high
    rank = std::max(1.0, rank * k * (1.0 + s.tolerance / 2) / std::max<size_t>(count, 1));
  }
  return select_exact(x, eff, n, k, cand);
}

PYCOMM_MULTIVERSION void drop_non_finite(float* r, size_t n) {
  for (size_t i = 0; i < n; ++i) r[i] = is_finite_f(r[i]) ? r[i] : 0.f;
}

template <typename T>
size_t topk_typed(const TopK& s, const T* x, float* residual, size_t n, size_t cap, T* values, int32_t* indices) {
  const size_t k = std::min(s.k, n);
  // With error feedback the residual becomes x + residual, selected from and
  // sent from; the approximate selection folds it during its first pass.
  const bool approx = !s.exact && k > 0 && k < n;
  if (residual && !approx) {
    for (size_t i = 0; i < n; ++i) residual[i] += load_acc(x[i]);
  }
  std::vector<int32_t> idx;
  size_t count = 0;
  if (k == n) {
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    count = n;
  } else if (k > 0) {
    count = approx ? select_approx(s, x, residual, n, idx) : select_exact(x, residual, n, k, idx);
  }
  const float* eff = residual;
  if (count > cap)
    throw CommError("pycomm: top-k kept " + std::to_string(count) + " values but the output holds " +
                    std::to_string(cap));
  bool sent_finite = false;
  for (size_t j = 0; j < count; ++j) {
    const int32_t i = idx[j];
    const float v = value_at(x, eff, i);
    const T stored = store_acc<T>(v);
    values[j] = stored;
    indices[j] = i;
    if (residual) residual[i] = sent_residual(v, load_acc(stored));
    sent_finite = sent_finite || is_finite_f(v);
  }
  // Inf and NaN are not kept for later (sent_residual drops the sent ones):
  // an overflow step of a scaled loss puts them everywhere, and each step
  // would send k of them, its result non-finite again, until all had gone.
  // Unsent ones exist only when every sent value is non-finite (theirs are
  // the largest keys).
  if (residual && !sent_finite && count < n) drop_non_finite(residual, n);
  return count;
}

template <typename V, typename D>
PYCOMM_MULTIVERSION void scatter_typed(const V* values, const int32_t* indices, size_t count, D* dense) {
  for (size_t j = 0; j < count; ++j) dense[indices[j]] = store_acc<D>(load_acc(dense[indices[j]]) + load_acc(values[j]));
}

}  // namespace

size_t topk_cpu(const TopK& s, DType dtype, const void* x, float* residual, size_t n, size_t cap, void* values,
                int32_t* indices) {
  if (n > static_cast<size_t>(INT32_MAX))
    throw CommError("pycomm: top-k indexes with int32; tensors of more than 2^31-1 elements are not supported");
  if (!(s.tolerance >= 0 && s.tolerance < 1)) throw CommError("pycomm: top-k tolerance must be in [0, 1)");
  if (!(s.sample_fraction > 0 && s.sample_fraction <= 1))
    throw CommError("pycomm: top-k sample_fraction must be in (0, 1]");
  size_t kept = 0;
  with_float_type(dtype, "topk", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    kept = topk_typed(s, static_cast<const T*>(x), residual, n, cap, static_cast<T*>(values), indices);
  });
  return kept;
}

void scatter_add_cpu(DType val_dtype, const void* values, const int32_t* indices, size_t count, DType dense_dtype,
                     void* dense, size_t n) {
  for (size_t j = 0; j < count; ++j) {
    if (indices[j] < 0 || static_cast<size_t>(indices[j]) >= n)
      throw CommError("pycomm: scatter_add index " + std::to_string(indices[j]) + " is outside a tensor of " +
                      std::to_string(n) + " elements");
  }
  with_float_type(val_dtype, "scatter_add", [&](auto* vtag) {
    using V = std::remove_pointer_t<decltype(vtag)>;
    with_float_type(dense_dtype, "scatter_add", [&](auto* dtag) {
      using D = std::remove_pointer_t<decltype(dtag)>;
      scatter_typed(static_cast<const V*>(values), indices, count, static_cast<D*>(dense));
    });
  });
}

}  // namespace kernels
}  // namespace pycomm

// Batched Gram-Schmidt for PowerSGD: the columns of each of `batch` row-major
// rows x cols matrices become orthonormal, in place, column by column
// (modified Gram-Schmidt: column i is normalized, then removed from every
// later column), the procedure torch's PowerSGD hook runs as a Python loop of
// five tensor ops per column.
//
// Three passes over the rows per column, each reading rows contiguously:
// the norm, the dots with every later column, and the update. Sums are
// accumulated in double: a low-rank factor has thousands of rows, and a
// float32 sum of their squares loses digits the next column inherits.
#include <cmath>
#include <vector>

#include "../kernels.h"

namespace pycomm {
namespace kernels {
namespace {

template <typename T>
void orthogonalize_one(T* m, size_t rows, size_t cols, double epsilon, std::vector<double>& dots) {
  for (size_t i = 0; i < cols; ++i) {
    double norm2 = 0;
    for (size_t r = 0; r < rows; ++r) norm2 += static_cast<double>(m[r * cols + i]) * m[r * cols + i];
    const double norm = std::sqrt(norm2) + epsilon;
    // A column of zeros (a layer without gradient) stays zero instead of
    // turning into NaNs that would reach every rank's weights.
    const double inv = norm > 0 ? 1.0 / norm : 0.0;
    for (size_t r = 0; r < rows; ++r) m[r * cols + i] = static_cast<T>(m[r * cols + i] * inv);
    if (i + 1 == cols) break;
    dots.assign(cols, 0.0);
    for (size_t r = 0; r < rows; ++r) {
      const T* row = m + r * cols;
      const double c = row[i];
      for (size_t j = i + 1; j < cols; ++j) dots[j] += c * row[j];
    }
    for (size_t r = 0; r < rows; ++r) {
      T* row = m + r * cols;
      const double c = row[i];
      for (size_t j = i + 1; j < cols; ++j) row[j] = static_cast<T>(row[j] - dots[j] * c);
    }
  }
}

}  // namespace

void orthogonalize_cpu(DType dtype, void* data, size_t batch, size_t rows, size_t cols, double epsilon) {
  std::vector<double> dots;
  for (size_t b = 0; b < batch; ++b) {
    if (dtype == DType::kFloat64) {
      orthogonalize_one(static_cast<double*>(data) + b * rows * cols, rows, cols, epsilon, dots);
    } else if (dtype == DType::kFloat32) {
      orthogonalize_one(static_cast<float*>(data) + b * rows * cols, rows, cols, epsilon, dots);
    } else {
      throw CommError("pycomm: orthogonalize takes float32 or float64 matrices");
    }
  }
}

}  // namespace kernels
}  // namespace pycomm

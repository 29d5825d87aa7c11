// Sparse in-place updates of a table's rows: what ResourceScatterAdd / ResourceScatterSub do on
// the CPU, row by row in index order (so the same sums, bitwise), in one tight loop per row
// instead of a tensor expression evaluated per row.
#define EIGEN_USE_THREADS  // training_op_helpers.h copies on the CPU device

#include <algorithm>
#include <cstdint>

#include "row_prefetch.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tensorflow {
namespace nestpipe {

using CPUDevice = Eigen::ThreadPoolDevice;
using shape_inference::InferenceContext;

REGISTER_OP("NestpipeScatterRows")
    .Input("resource: resource")
    .Input("indices: Tindices")
    .Input("updates: dtype")
    .Attr("dtype: {float, double}")
    .Attr("Tindices: {int32, int64}")
    .Attr("subtract: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return absl::OkStatus(); })
    .Doc(R"doc(
Adds (`subtract`: subtracts) `updates[i]` to row `indices[i]` of the variable `resource`, for i
in order: ResourceScatterAdd's (ResourceScatterSub's) result, bitwise, on the CPU. Every index is
checked before any row changes: one outside [0, rows) fails the op and updates nothing. The
variable is updated in place under its lock, copied first if a reader still holds its buffer
(as TensorFlow's own sparse updates do).

indices: [N], rows of the variable.
updates: [N, ...], the variable's row shape after N.
)doc");

template <typename T, typename Index>
class ScatterRowsOp : public OpKernel {
 public:
  explicit ScatterRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("subtract", &subtract_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, T>(ctx, var.get()));
    mutex_lock lock(*var->mu());
    Tensor* table = var->tensor();
    const Tensor& indices_t = ctx->input(1);
    const Tensor& updates_t = ctx->input(2);
    OP_REQUIRES(ctx, table->dtype() == DataTypeToEnum<T>::v() && table->dims() >= 1,
                errors::InvalidArgument("the variable is ", table->DebugString(),
                                        ", expected ", DataTypeString(DataTypeToEnum<T>::v()),
                                        " of rank >= 1"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices_t.shape()),
                errors::InvalidArgument("indices must be a vector, got shape ",
                                        indices_t.shape().DebugString()));
    const int64_t n = indices_t.dim_size(0);
    TensorShape expected({n});
    for (int d = 1; d < table->dims(); ++d) {
      OP_REQUIRES_OK(ctx, expected.AddDimWithStatus(table->dim_size(d)));
    }
    OP_REQUIRES(ctx, updates_t.shape() == expected,
                errors::InvalidArgument("updates must be ", expected.DebugString(),
                                        " (indices' length, then the variable's row shape), got ",
                                        updates_t.shape().DebugString()));
    const int64_t rows = table->dim_size(0);
    const int64_t width = rows > 0 ? table->NumElements() / rows : 0;
    const auto indices = indices_t.vec<Index>();
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, indices(i) >= 0 && indices(i) < rows,
                  errors::InvalidArgument("indices[", i, "] = ", indices(i),
                                          " is not in [0, ", rows, ")"));
    }
    T* base = table->flat<T>().data();
    const T* updates = updates_t.flat<T>().data();
    if (subtract_) {
      Apply(base, updates, indices, n, width, [](T a, T b) { return a - b; });
    } else {
      Apply(base, updates, indices, n, width, [](T a, T b) { return a + b; });
    }
  }

 private:
  template <typename Indices, typename Combine>
  static void Apply(T* base, const T* updates, const Indices& indices, int64_t n, int64_t width,
                    Combine combine) {
    // The rows are scattered over a table far larger than the caches (row_prefetch.h).
    for (int64_t i = 0; i < std::min(n, kPrefetchAhead); ++i) {
      PrefetchRow(base + static_cast<int64_t>(indices(i)) * width, sizeof(T) * width);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) {
        PrefetchRow(base + static_cast<int64_t>(indices(i + kPrefetchAhead)) * width,
                    sizeof(T) * width);
      }
      T* row = base + static_cast<int64_t>(indices(i)) * width;
      const T* update = updates + i * width;
      for (int64_t d = 0; d < width; ++d) row[d] = combine(row[d], update[d]);
    }
  }

  bool subtract_;
};

#define NESTPIPE_REGISTER_SCATTER(T, Index)                                       \
  REGISTER_KERNEL_BUILDER(Name("NestpipeScatterRows")                             \
                              .Device(DEVICE_CPU)                                 \
                              .HostMemory("resource")                             \
                              .TypeConstraint<T>("dtype")                         \
                              .TypeConstraint<Index>("Tindices"),                 \
                          ScatterRowsOp<T, Index>);
NESTPIPE_REGISTER_SCATTER(float, int32)
NESTPIPE_REGISTER_SCATTER(float, int64_t)
NESTPIPE_REGISTER_SCATTER(double, int32)
NESTPIPE_REGISTER_SCATTER(double, int64_t)
#undef NESTPIPE_REGISTER_SCATTER

}  // namespace nestpipe
}  // namespace tensorflow

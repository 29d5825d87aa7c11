// Row gather and sparse-gradient segment-sum: the two halves of every embedding
// exchange. Index -1 marks padding: gathered as a zero row, skipped when summing.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace nestpipe {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("NestpipeGatherRows")
    .Input("params: T")
    .Input("indices: Tindices")
    .Output("output: T")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle params, indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &params));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      c->set_output(0, c->Matrix(c->Dim(indices, 0), c->Dim(params, 1)));
      return absl::OkStatus();
    })
    .Doc("output[i] = params[indices[i]], or a zero row where indices[i] == -1.");

template <typename T, typename Index>
class GatherRowsOp : public OpKernel {
 public:
  explicit GatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& params = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(params.shape()),
                errors::InvalidArgument("params must be a matrix, got ",
                                        params.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
                errors::InvalidArgument("indices must be a vector, got ",
                                        indices.shape().DebugString()));
    const int64_t rows = params.dim_size(0), dim = params.dim_size(1);
    const int64_t n = indices.dim_size(0);
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out_t));
    const T* p = params.flat<T>().data();
    const auto ix = indices.flat<Index>();
    T* o = out_t->flat<T>().data();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = static_cast<int64_t>(ix(i));
      OP_REQUIRES(ctx, r >= -1 && r < rows,
                  errors::InvalidArgument("gather index ", r, " at position ", i,
                                          " is out of range [-1, ", rows, ")"));
      if (r < 0) {
        std::fill(o + i * dim, o + (i + 1) * dim, T(0));
      } else {
        std::memcpy(o + i * dim, p + r * dim, sizeof(T) * dim);
      }
    }
  }
};

REGISTER_OP("NestpipeSegmentSum")
    .Input("data: T")
    .Input("segment_ids: Tindices")
    .Input("num_segments: int32")
    .Output("output: T")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle data, ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &data));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      DimensionHandle num;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &num));
      c->set_output(0, c->Matrix(num, c->Dim(data, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
output[s] = sum of data[i] over i with segment_ids[i] == s; ids of -1 are skipped.
Rows are summed in input order, so the result is deterministic.
)doc");

template <typename T, typename Index>
class SegmentSumOp : public OpKernel {
 public:
  explicit SegmentSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& data = ctx->input(0);
    const Tensor& ids = ctx->input(1);
    const int32 num = ctx->input(2).scalar<int32>()();
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(data.shape()),
                errors::InvalidArgument("data must be a matrix"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids.shape()) &&
                         ids.dim_size(0) == data.dim_size(0),
                errors::InvalidArgument("segment_ids must be a vector of length ",
                                        data.dim_size(0), ", got ",
                                        ids.shape().DebugString()));
    OP_REQUIRES(ctx, num >= 0, errors::InvalidArgument("num_segments must be >= 0"));
    const int64_t dim = data.dim_size(1), n = data.dim_size(0);
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num, dim}), &out_t));
    T* o = out_t->flat<T>().data();
    std::fill(o, o + static_cast<int64_t>(num) * dim, T(0));
    const T* d = data.flat<T>().data();
    const auto seg = ids.flat<Index>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = static_cast<int64_t>(seg(i));
      if (s < 0) continue;
      OP_REQUIRES(ctx, s < num,
                  errors::InvalidArgument("segment id ", s, " at position ", i,
                                          " is out of range [0, ", num, ")"));
      T* dst = o + s * dim;
      const T* src = d + i * dim;
      for (int64_t k = 0; k < dim; ++k) dst[k] += src[k];
    }
  }
};

#define NESTPIPE_REGISTER(T, I)                                          \
  REGISTER_KERNEL_BUILDER(Name("NestpipeGatherRows")                     \
                              .Device(DEVICE_CPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<I>("Tindices"),            \
                          GatherRowsOp<T, I>);                           \
  REGISTER_KERNEL_BUILDER(Name("NestpipeSegmentSum")                     \
                              .Device(DEVICE_CPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<I>("Tindices")             \
                              .HostMemory("num_segments"),               \
                          SegmentSumOp<T, I>);
#define NESTPIPE_REGISTER_ALL(T) \
  NESTPIPE_REGISTER(T, int32)    \
  NESTPIPE_REGISTER(T, int64_t)
NESTPIPE_REGISTER_ALL(float)
NESTPIPE_REGISTER_ALL(double)
NESTPIPE_REGISTER_ALL(bfloat16)
NESTPIPE_REGISTER_ALL(Eigen::half)
#undef NESTPIPE_REGISTER_ALL
#undef NESTPIPE_REGISTER

}  // namespace nestpipe
}  // namespace tensorflow

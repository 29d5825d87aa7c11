// Row gather and sparse-gradient segment-sum: the two halves of every embedding
// exchange. Index -1 marks padding: gathered as a zero row, skipped when summing.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "row_prefetch.h"
#include "table_groups.h"

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
    .Input("data: N * T")
    .Input("segment_ids: Tindices")
    .Input("num_segments: int32")
    .Output("output: T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      ShapeHandle data, ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &data));
      DimensionHandle dim = c->Dim(data, 1);
      for (int i = 1; i < n; ++i) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 2, &data));
        TF_RETURN_IF_ERROR(c->Merge(dim, c->Dim(data, 1), &dim));
      }
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n), 1, &ids));
      DimensionHandle num;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(n + 1, &num));
      c->set_output(0, c->Matrix(num, dim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
output[s] = sum of data[i] over i with segment_ids[i] == s; ids of -1 are skipped. `data` is
one matrix or several read as their concatenation along rows (so a gradient that arrives in
pieces is summed without first being concatenated). Rows are summed in input order, so the
result is deterministic.
)doc");

template <typename T, typename Index>
class SegmentSumOp : public OpKernel {
 public:
  explicit SegmentSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList data;
    OP_REQUIRES_OK(ctx, ctx->input_list("data", &data));
    const Tensor& ids = ctx->input(data.size());
    const int32 num = ctx->input(data.size() + 1).scalar<int32>()();
    int64_t n = 0;
    const int64_t dim = data[0].dims() == 2 ? data[0].dim_size(1) : -1;
    for (int p = 0; p < data.size(); ++p) {
      OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(data[p].shape()) && data[p].dim_size(1) == dim,
                  errors::InvalidArgument("data must be matrices of one width, got piece ", p,
                                          " of shape ", data[p].shape().DebugString()));
      n += data[p].dim_size(0);
    }
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids.shape()) && ids.dim_size(0) == n,
                errors::InvalidArgument("segment_ids must be a vector of length ", n,
                                        " (the data's rows), got ", ids.shape().DebugString()));
    OP_REQUIRES(ctx, num >= 0, errors::InvalidArgument("num_segments must be >= 0"));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num, dim}), &out_t));
    T* o = out_t->flat<T>().data();
    std::fill(o, o + static_cast<int64_t>(num) * dim, T(0));
    const auto seg = ids.flat<Index>();
    int64_t i = 0;  // row of the concatenated data
    for (int p = 0; p < data.size(); ++p) {
      const T* d = data[p].flat<T>().data();
      for (int64_t row = 0; row < data[p].dim_size(0); ++row, ++i) {
        const int64_t s = static_cast<int64_t>(seg(i));
        if (s < 0) continue;
        OP_REQUIRES(ctx, s < num,
                    errors::InvalidArgument("segment id ", s, " at position ", i,
                                            " is out of range [0, ", num, ")"));
        T* dst = o + s * dim;
        const T* src = d + row * dim;
        for (int64_t k = 0; k < dim; ++k) dst[k] += src[k];
      }
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

// Shape of an op over a group of tables (inputs: N table resources, local_rows, row_offsets):
// one row of `dim` entries per local row.
absl::Status TableRowsShape(InferenceContext* c) {
  int n, dim;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  ShapeHandle rows;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(n), 1, &rows));
  c->set_output(0, c->Matrix(c->Dim(rows, 0), dim));
  return absl::OkStatus();
}

REGISTER_OP("NestpipeReadTableRows")
    .Input("tables: N * resource")
    .Input("local_rows: int64")
    .Input("row_offsets: int64")
    .Output("rows: dtype")
    .Attr("N: int >= 1")
    .Attr("dtype: {float, double, bfloat16, half}")
    .Attr("dim: int >= 0")
    .SetShapeFn(TableRowsShape)
    .Doc(R"doc(
The rows of a group of tables at fused local rows (not differentiable): table t holds local rows
[row_offsets[t], row_offsets[t + 1]), so local row k is row k - row_offsets[t] of the last table t
with row_offsets[t] <= k. One op instead of a partition, a gather per table and a stitch; each
table is read under its variable's shared lock.
)doc");

template <typename T>
class ReadTableRowsOp : public OpKernel {
 public:
  explicit ReadTableRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_tables_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    const auto local_rows = ctx->input(num_tables_).flat<int64_t>();
    const auto offsets = ctx->input(num_tables_ + 1).flat<int64_t>();
    OP_REQUIRES(ctx, offsets.size() == num_tables_,
                errors::InvalidArgument("row_offsets has ", offsets.size(), " entries for ",
                                        num_tables_, " tables"));
    const int64_t n = local_rows.size();
    // The positions of each table's rows, table by table, so each table is read in one pass
    // over its own positions.
    TableGroups groups;
    OP_REQUIRES_OK(ctx, GroupRowsByTable(local_rows, n, offsets, num_tables_, &groups));
    const std::vector<int64_t>& start = groups.start;
    std::vector<int64_t> positions(n);
    for (int64_t i = 0; i < n; ++i) positions[groups.place[i]] = i;
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &out_t));
    T* out = out_t->flat<T>().data();
    for (int t = 0; t < num_tables_; ++t) {
      core::RefCountPtr<Var> var;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, t), &var));
      tf_shared_lock lock(*var->mu());
      const Tensor& table = *var->tensor();
      OP_REQUIRES(ctx, table.dtype() == DataTypeToEnum<T>::v() && table.dims() == 2 &&
                           table.dim_size(1) == dim_,
                  errors::InvalidArgument("table ", t, " is ", table.DebugString(),
                                          ", expected a matrix of ", dim_, " columns of ",
                                          DataTypeString(DataTypeToEnum<T>::v())));
      const int64_t rows = table.dim_size(0);
      const T* src = table.flat<T>().data();
      for (int64_t p = start[t]; p < start[t + 1]; ++p) {
        const int64_t i = positions[p];
        const int64_t r = local_rows(i) - offsets(t);
        OP_REQUIRES(ctx, r < rows,
                    errors::InvalidArgument("local row ", local_rows(i), " at position ", i,
                                            " is row ", r, " of table ", t, ", which has ",
                                            rows, " rows"));
        if (p + kPrefetchAhead < start[t + 1]) {
          const int64_t ahead = local_rows(positions[p + kPrefetchAhead]) - offsets(t);
          if (ahead < rows) PrefetchRow(src + ahead * dim_, sizeof(T) * dim_);
        }
        std::memcpy(out + i * dim_, src + r * dim_, sizeof(T) * dim_);
      }
    }
  }

 private:
  int num_tables_;
  int64_t dim_;
};

#define NESTPIPE_REGISTER_READ(T)                                                         \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("NestpipeReadTableRows").Device(DEVICE_CPU).TypeConstraint<T>("dtype"),        \
      ReadTableRowsOp<T>);
NESTPIPE_REGISTER_READ(float)
NESTPIPE_REGISTER_READ(double)
NESTPIPE_REGISTER_READ(bfloat16)
NESTPIPE_REGISTER_READ(Eigen::half)
#undef NESTPIPE_REGISTER_READ

REGISTER_OP("NestpipeGradientCarrier")
    .Input("tables: N * resource")
    .Input("local_rows: int64")
    .Input("row_offsets: int64")
    .Input("table_sizes: int32")
    .Output("carrier: dtype")
    .Attr("N: int >= 1")
    .Attr("dtype: {float, double, bfloat16, half}")
    .Attr("dim: int >= 0")
    .Attr("grouped: bool = false")
    .SetShapeFn(TableRowsShape)
    .Doc(R"doc(
Zeros `[len(local_rows), dim]` that carry a gradient to the tables' rows at fused local rows
`local_rows` (see NestpipeReadTableRows for the layout): its registered gradient is the
IndexedSlices a gather of those rows would get, per table. It reads no row and takes no lock: for
a lookup whose values come from elsewhere (a prefetch buffer), where a gather's values would be
computed only to be dropped.

table_sizes: with `grouped`, [N]: local_rows holds table 0's rows first, then table 1's, ...,
  table_sizes[t] of table t (NestpipeOwnerRounds' order), so the gradient splits per table
  without a partition; checked here. Without `grouped`, ignored (pass an empty vector).
)doc");

template <typename T>
class GradientCarrierOp : public OpKernel {
 public:
  explicit GradientCarrierOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_tables_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("grouped", &grouped_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t n = ctx->input(num_tables_).NumElements();
    if (grouped_) OP_REQUIRES_OK(ctx, CheckGrouped(ctx));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &out_t));
    if (n * dim_ > 0) std::memset(out_t->flat<T>().data(), 0, sizeof(T) * n * dim_);
  }

 private:
  // The gradient trusts table_sizes to cut local_rows per table: each table's run must lie in
  // its span of rows, [row_offsets[t], row_offsets[t + 1]).
  absl::Status CheckGrouped(OpKernelContext* ctx) const {
    const Tensor& rows_t = ctx->input(num_tables_);
    const Tensor& offsets_t = ctx->input(num_tables_ + 1);
    const Tensor& sizes_t = ctx->input(num_tables_ + 2);
    if (!TensorShapeUtils::IsVector(rows_t.shape()) ||
        offsets_t.NumElements() != num_tables_ || sizes_t.NumElements() != num_tables_) {
      return errors::InvalidArgument("a grouped gradient carrier needs local_rows [n] and ",
                                     num_tables_, " row_offsets and table_sizes, got ",
                                     rows_t.shape().DebugString(), ", ", offsets_t.NumElements(),
                                     ", ", sizes_t.NumElements());
    }
    const auto rows = rows_t.vec<int64_t>();
    const auto offsets = offsets_t.vec<int64_t>();
    const auto sizes = sizes_t.vec<int32>();
    int64_t k = 0;
    for (int t = 0; t < num_tables_; ++t) {
      const int64_t end = k + sizes(t);
      if (sizes(t) < 0 || end > rows.size()) {
        return errors::InvalidArgument("table_sizes ", sizes(t), " of table ", t,
                                       " runs past local_rows' ", rows.size(), " rows");
      }
      const int64_t low = offsets(t);
      const int64_t high = t + 1 < num_tables_ ? offsets(t + 1)
                                               : std::numeric_limits<int64_t>::max();
      for (; k < end; ++k) {
        if (rows(k) < low || rows(k) >= high) {
          return errors::InvalidArgument("local row ", rows(k), " at ", k, " is not in table ",
                                         t, "'s rows [", low, ", ", high,
                                         "): local_rows are not grouped by table_sizes");
        }
      }
    }
    if (k != rows.size()) {
      return errors::InvalidArgument("table_sizes sum to ", k, " but local_rows has ",
                                     rows.size());
    }
    return absl::OkStatus();
  }

  int num_tables_;
  int64_t dim_;
  bool grouped_;
};

#define NESTPIPE_REGISTER_CARRIER(T)                                                      \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("NestpipeGradientCarrier").Device(DEVICE_CPU).TypeConstraint<T>("dtype"),      \
      GradientCarrierOp<T>);
NESTPIPE_REGISTER_CARRIER(float)
NESTPIPE_REGISTER_CARRIER(double)
NESTPIPE_REGISTER_CARRIER(bfloat16)
NESTPIPE_REGISTER_CARRIER(Eigen::half)
#undef NESTPIPE_REGISTER_CARRIER

}  // namespace nestpipe
}  // namespace tensorflow

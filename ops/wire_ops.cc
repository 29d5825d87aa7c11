// Wire codecs of the compressed exchanges (DESIGN.md section 13): what a worker encodes before an
// embedding all-to-all and decodes after it.
//
// - NestpipeEncodeInt8Rows / NestpipeDecodeInt8Rows: per-row asymmetric 8-bit quantization. Each
//   row is sent as [scale f32][offset f32][dim uint8 codes][zero bytes up to a 4-byte word],
//   packed into int32 words (the all-to-all carries no 8-bit type). x ~ offset + code * scale with
//   offset = min(row), scale = (max(row) - min(row)) / 255: a constant row (the all-zero padding
//   rows included) has scale 0 and decodes exactly, with no division by zero. All-zero words
//   decode to an all-zero row, so a backend's zero fill of the received padding stays zero.
// - NestpipeSaturateToHalf: float32 -> float16 with finite values beyond +-65504 clamped to it
//   (they would round to inf and look like a loss-scale overflow); inf and NaN pass through.
//   Returns how many values were clamped.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace nestpipe {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

namespace {

constexpr int64_t kHeaderBytes = 8;  // scale and offset, float32 each

int64_t Int8Words(int64_t dim) { return (dim + kHeaderBytes + 3) / 4; }

// Runs fn(begin, end) over [0, n) rows (or values) on the op's CPU thread pool.
template <typename Fn>
void ForRows(OpKernelContext* ctx, int64_t n, int64_t cost_per_row, Fn fn) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  Shard(workers->num_threads, workers->workers, n, cost_per_row, fn);
}

}  // namespace

REGISTER_OP("NestpipeEncodeInt8Rows")
    .Input("rows: float")
    .Output("packed: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &rows));
      DimensionHandle dim = c->Dim(rows, 1);
      DimensionHandle words = c->UnknownDim();
      if (c->ValueKnown(dim)) words = c->MakeDim(Int8Words(c->Value(dim)));
      c->set_output(0, c->Matrix(c->Dim(rows, 0), words));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Per-row 8-bit quantization of float rows [n, dim] into int32 words [n, ceil((dim + 8) / 4)]:
bytes 0-3 the row's scale (max - min) / 255, bytes 4-7 its offset (min), then one uint8 code
per value, round((x - min) / scale) (ties up), then zero bytes. A constant row has scale 0 and codes 0.
)doc");

class EncodeInt8RowsOp : public OpKernel {
 public:
  explicit EncodeInt8RowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(rows_t.shape()),
                errors::InvalidArgument("rows must be a matrix, got ",
                                        rows_t.shape().DebugString()));
    const int64_t n = rows_t.dim_size(0), dim = rows_t.dim_size(1);
    const int64_t words = Int8Words(dim);
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, words}), &out_t));
    const float* in = rows_t.flat<float>().data();
    uint8_t* out = reinterpret_cast<uint8_t*>(out_t->flat<int32>().data());
    const int64_t row_bytes = words * 4;
    ForRows(ctx, n, 8 * dim, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* x = in + i * dim;
        uint8_t* o = out + i * row_bytes;
        float lo = dim > 0 ? x[0] : 0.f, hi = lo;
        for (int64_t k = 1; k < dim; ++k) {  // plain compares: the compiler vectorizes them
          lo = x[k] < lo ? x[k] : lo;
          hi = x[k] > hi ? x[k] : hi;
        }
        const float scale = (hi - lo) / 255.f;
        std::memcpy(o, &scale, 4);
        std::memcpy(o + 4, &lo, 4);
        uint8_t* codes = o + kHeaderBytes;
        if (scale > 0.f) {
          const float inverse = 1.f / scale;
          for (int64_t k = 0; k < dim; ++k) {
            // (x - lo) * inverse >= 0: adding 0.5 and truncating rounds to nearest (ties up).
            float q = (x[k] - lo) * inverse + 0.5f;
            q = q < 255.f ? q : 255.f;
            codes[k] = static_cast<uint8_t>(static_cast<int32_t>(q));
          }
        } else {
          std::fill(codes, codes + dim, uint8_t{0});
        }
        std::fill(codes + dim, o + row_bytes, uint8_t{0});
      }
    });
  }
};

REGISTER_OP("NestpipeDecodeInt8Rows")
    .Input("packed: int32")
    .Attr("dim: int >= 0")
    .Output("rows: float")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle packed;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &packed));
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      DimensionHandle words;
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(packed, 1), Int8Words(dim), &words));
      c->set_output(0, c->Matrix(c->Dim(packed, 0), dim));
      return absl::OkStatus();
    })
    .Doc("The float rows [n, dim] of NestpipeEncodeInt8Rows' words: offset + code * scale.");

class DecodeInt8RowsOp : public OpKernel {
 public:
  explicit DecodeInt8RowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed_t = ctx->input(0);
    const int64_t words = Int8Words(dim_);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(packed_t.shape()) &&
                         packed_t.dim_size(1) == words,
                errors::InvalidArgument("packed must be [n, ", words, "] for dim ", dim_,
                                        ", got ", packed_t.shape().DebugString()));
    const int64_t n = packed_t.dim_size(0), dim = dim_;
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out_t));
    const uint8_t* in = reinterpret_cast<const uint8_t*>(packed_t.flat<int32>().data());
    float* out = out_t->flat<float>().data();
    const int64_t row_bytes = words * 4;
    ForRows(ctx, n, 4 * dim, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint8_t* p = in + i * row_bytes;
        float scale, offset;
        std::memcpy(&scale, p, 4);
        std::memcpy(&offset, p + 4, 4);
        const uint8_t* codes = p + kHeaderBytes;
        float* o = out + i * dim;
        for (int64_t k = 0; k < dim; ++k) o[k] = offset + static_cast<float>(codes[k]) * scale;
      }
    });
  }

 private:
  int64_t dim_;
};

REGISTER_OP("NestpipeSaturateToHalf")
    .Input("x: float")
    .Output("y: half")
    .Output("clamped: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
float32 -> float16 (round to nearest even), finite values beyond +-65504 clamped to +-65504
instead of overflowing to inf; inf and NaN pass through. `clamped`: how many were clamped.
)doc");

class SaturateToHalfOp : public OpKernel {
 public:
  explicit SaturateToHalfOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    Tensor* y_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x_t.shape(), &y_t));
    Tensor* clamped_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &clamped_t));
    const float* x = x_t.flat<float>().data();
    Eigen::half* y = y_t->flat<Eigen::half>().data();
    constexpr float kMax = 65504.f;
    std::atomic<int64_t> clamped{0};
    ForRows(ctx, x_t.NumElements(), 4, [&](int64_t begin, int64_t end) {
      int64_t local = 0;
      for (int64_t i = begin; i < end; ++i) {
        float v = x[i];
        if (std::isfinite(v) && std::fabs(v) > kMax) {
          v = std::copysign(kMax, v);
          ++local;
        }
        y[i] = static_cast<Eigen::half>(v);
      }
      clamped += local;
    });
    clamped_t->scalar<int64_t>()() = clamped.load();
  }
};

REGISTER_KERNEL_BUILDER(Name("NestpipeEncodeInt8Rows").Device(DEVICE_CPU), EncodeInt8RowsOp);
REGISTER_KERNEL_BUILDER(Name("NestpipeDecodeInt8Rows").Device(DEVICE_CPU), DecodeInt8RowsOp);
REGISTER_KERNEL_BUILDER(Name("NestpipeSaturateToHalf").Device(DEVICE_CPU), SaturateToHalfOp);

}  // namespace nestpipe
}  // namespace tensorflow

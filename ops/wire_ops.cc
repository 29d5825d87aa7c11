// Wire codecs of the compressed exchanges (docs/design/design.md §13): what a worker encodes
// before an embedding all-to-all and decodes after it.
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
// - NestpipeToInt64Words / NestpipeFromInt64Words: a [W, ...] block of any dtype as [W, R] int64
//   words (each worker's entries' bytes, zero-padded to whole words) and back, so a block can
//   ride in an int64 exchange (the Dual-Buffer sync on the keys all-to-all): one op each way
//   instead of a reshape, pad and bitcast of a dozen.
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


REGISTER_OP("NestpipeToInt64Words")
    .Input("block: T")
    .Output("words: int64")
    .Attr("T: {float, double, half, bfloat16, int8, uint8, int16, int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle block;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &block));
      c->set_output(0, c->Matrix(c->Dim(block, 0), c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The [W, ...] block as [W, R] int64 words: row w holds the bytes of block[w] (row-major), then
zero bytes up to a whole word (R = ceil(bytes per row / 8)). Bit copies: see
NestpipeFromInt64Words.
)doc");

class ToInt64WordsOp : public OpKernel {
 public:
  explicit ToInt64WordsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& block = ctx->input(0);
    OP_REQUIRES(ctx, block.dims() >= 1,
                errors::InvalidArgument("block must have a worker dimension, got a scalar"));
    const int64_t w = block.dim_size(0);
    const int64_t row_bytes =
        w == 0 ? 0 : static_cast<int64_t>(block.TotalBytes()) / w;
    const int64_t words = (row_bytes + 7) / 8;
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({w, words}), &out_t));
    char* out = reinterpret_cast<char*>(out_t->flat<int64_t>().data());
    const char* in = static_cast<const char*>(block.tensor_data().data());
    for (int64_t b = 0; b < w; ++b) {
      char* dst = out + b * words * 8;
      std::memcpy(dst, in + b * row_bytes, row_bytes);
      std::memset(dst + row_bytes, 0, words * 8 - row_bytes);
    }
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeToInt64Words").Device(DEVICE_CPU), ToInt64WordsOp);

REGISTER_OP("NestpipeFromInt64Words")
    .Input("words: int64")
    .Input("shape: int32")
    .Output("block: T")
    .Attr("T: {float, double, half, bfloat16, int8, uint8, int16, int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle words, shape;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &words));
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(1, &shape));
      c->set_output(0, shape);
      return absl::OkStatus();
    })
    .Doc(R"doc(
The block of NestpipeToInt64Words: words [W, R] back to a T block of `shape` ([W, ...]): row w's
first bytes, the rest (the padding) dropped. The words must hold a whole row of `shape`.
)doc");

class FromInt64WordsOp : public OpKernel {
 public:
  explicit FromInt64WordsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& words_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(words_t.shape()),
                errors::InvalidArgument("words must be [W, R], got ",
                                        words_t.shape().DebugString()));
    TensorShape shape;
    const Tensor& shape_t = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(shape_t.shape()),
                errors::InvalidArgument("shape must be a vector, got ",
                                        shape_t.shape().DebugString()));
    OP_REQUIRES_OK(ctx, TensorShapeUtils::MakeShape(shape_t.flat<int32>().data(),
                                                    shape_t.NumElements(), &shape));
    const int64_t w = words_t.dim_size(0), words = words_t.dim_size(1);
    OP_REQUIRES(ctx, shape.dims() >= 1 && shape.dim_size(0) == w,
                errors::InvalidArgument("shape ", shape.DebugString(), " must start with the ",
                                        w, " workers of words"));
    const int64_t row_bytes =
        w == 0 ? 0 : shape.num_elements() * DataTypeSize(ctx->expected_output_dtype(0)) / w;
    OP_REQUIRES(ctx, row_bytes <= words * 8,
                errors::InvalidArgument("a row of ", shape.DebugString(), " is ", row_bytes,
                                        " bytes; the words hold ", words * 8));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out_t));
    char* out = const_cast<char*>(out_t->tensor_data().data());
    const char* in = reinterpret_cast<const char*>(words_t.flat<int64_t>().data());
    for (int64_t b = 0; b < w; ++b) {
      std::memcpy(out + b * row_bytes, in + b * words * 8, row_bytes);
    }
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeFromInt64Words").Device(DEVICE_CPU), FromInt64WordsOp);

}  // namespace nestpipe
}  // namespace tensorflow

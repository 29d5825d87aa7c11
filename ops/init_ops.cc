// Stateless row initialization: the values that tf.random.stateless_{uniform,
// normal,truncated_normal} would produce for the given rows of a full
// [vocab, dim] tensor, computed without materializing the full tensor.
// Element e = row * dim + col of the full tensor is output e % 4 of Philox
// group e / 4, exactly as in TensorFlow's CPU kernels (random_op_cpu.h).
// keyed_by="id" (dynamic tables, any int64 id): row k is instead the first dim
// samples of the Philox stream whose counter's high word is xor-ed with k's bits
// (a function of (seed, id) only, for ids of no fixed vocabulary).
#include <cstdint>
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/random_ops_util.h"
#include "tensorflow/core/lib/random/philox_random.h"
#include "tensorflow/core/lib/random/random_distributions.h"
#include "philox_group_sampler.h"

namespace tensorflow {
namespace nestpipe {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("NestpipeStatelessRowInit")
    .Input("key: uint64")
    .Input("counter: uint64")
    .Input("rows: int64")
    .Attr("dim: int >= 1")
    .Attr("distribution: {'uniform', 'normal', 'truncated_normal'}")
    .Attr("keyed_by: {'row', 'id'} = 'row'")
    .Output("output: float")
    .SetShapeFn([](InferenceContext* c) {
      int dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &rows));
      c->set_output(0, c->Matrix(c->Dim(rows, 0), dim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Rows `rows` of the [vocab, dim] float tensor that StatelessRandom*V2 with the
Philox key/counter would produce (raw distribution: U[0,1), N(0,1) or the
truncated N(0,1)). keyed_by="id": `rows` are any int64 ids, row of id k = the
first `dim` raw samples of the stream with the counter's high word xor k.
)doc");


class StatelessRowInitOp : public OpKernel {
 public:
  explicit StatelessRowInitOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("distribution", &dist_));
    std::string keyed_by;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("keyed_by", &keyed_by));
    by_id_ = keyed_by == "id";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& key = ctx->input(0);
    const Tensor& counter = ctx->input(1);
    const Tensor& rows_t = ctx->input(2);
    OP_REQUIRES(ctx, key.NumElements() >= 1 && counter.NumElements() >= 2,
                errors::InvalidArgument("key needs 1 element and counter 2 (Philox)"));
    const uint64_t* k = key.flat<uint64_t>().data();
    const uint64_t* c = counter.flat<uint64_t>().data();
    const auto rows = rows_t.flat<int64_t>();
    const int64_t n = rows.size();
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &out_t));
    float* out = out_t->flat<float>().data();
    if (by_id_) {
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t mixed[2] = {c[0], c[1] ^ static_cast<uint64_t>(rows(i))};
        GroupSampler sampler(GetPhiloxRandomFromCounterKeyMem(mixed, k), dist_);
        for (int64_t d = 0; d < dim_; ++d) out[i * dim_ + d] = sampler.Group(d / 4)[d % 4];
      }
      return;
    }
    GroupSampler sampler(GetPhiloxRandomFromCounterKeyMem(c, k), dist_);
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, rows(i) >= 0, errors::InvalidArgument("negative row ", rows(i)));
      const int64_t first = rows(i) * dim_;
      for (int64_t c = 0; c < dim_; ++c) {
        const int64_t e = first + c;
        out[i * dim_ + c] = sampler.Group(e / 4)[e % 4];
      }
    }
  }

 private:
  int dim_;
  std::string dist_;
  bool by_id_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeStatelessRowInit").Device(DEVICE_CPU)
                            .HostMemory("key").HostMemory("counter"),
                        StatelessRowInitOp);

}  // namespace nestpipe
}  // namespace tensorflow

// Dual-Buffer Pipeline ops. After batch i's sparse update, the rows that batch i+1 prefetched
// and batch i updated are stale in the prefetch buffer. The owner plans which slots of each
// requester's prefetch to refresh (SyncPlan, computable before the update finishes); the
// requester copies the fresh rows it receives into its prefetch buffer (BufferSync).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_set>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace nestpipe {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("NestpipeSyncPlan")
    .Input("slot_to_unique: int32")
    .Input("local_rows: int64")
    .Input("updated_rows: int64")
    .Attr("num_requesters: int >= 1")
    .Attr("all_updated: bool = false")
    .Output("sync_slots: int32")
    .Output("sync_counts: int32")
    .SetShapeFn([](InferenceContext* c) {
      int w;
      TF_RETURN_IF_ERROR(c->GetAttr("num_requesters", &w));
      ShapeHandle slots;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &slots));
      auto cap = c->UnknownDim();
      if (c->ValueKnown(c->Dim(slots, 0))) {
        TF_RETURN_IF_ERROR(c->Divide(c->Dim(slots, 0), w, /*evenly_divisible=*/true, &cap));
      }
      c->set_output(0, c->Matrix(w, cap));
      c->set_output(1, c->Vector(w));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner side: for each requester w, the slot positions p (of its [capacity] prefetch slots) whose
local row is in `updated_rows` (every valid slot if all_updated), compacted to the left of row w
of `sync_slots` and padded with -1; `sync_counts[w]` is how many.
)doc");

class SyncPlanOp : public OpKernel {
 public:
  explicit SyncPlanOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_requesters", &num_requesters_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("all_updated", &all_updated_));
  }

  void Compute(OpKernelContext* ctx) override {
    const auto slots = ctx->input(0).flat<int32>();
    const auto local_rows = ctx->input(1).flat<int64_t>();
    const auto updated = ctx->input(2).flat<int64_t>();
    const int64_t n = slots.size();
    OP_REQUIRES(ctx, n % num_requesters_ == 0,
                errors::InvalidArgument("slot_to_unique has ", n, " entries, not a multiple of ",
                                        num_requesters_, " requesters"));
    const int64_t capacity = n / num_requesters_;
    std::unordered_set<int64_t> updated_set;
    if (!all_updated_) {
      updated_set.reserve(updated.size() * 2 + 1);
      for (int64_t i = 0; i < updated.size(); ++i) updated_set.insert(updated(i));
    }
    Tensor *plan_t, *counts_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_requesters_, capacity}), &plan_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_requesters_}), &counts_t));
    auto plan = plan_t->matrix<int32>();
    auto counts = counts_t->flat<int32>();
    for (int w = 0; w < num_requesters_; ++w) {
      int32 count = 0;
      for (int64_t p = 0; p < capacity; ++p) {
        const int32 u = slots(w * capacity + p);
        if (u < 0) continue;
        OP_REQUIRES(ctx, u < local_rows.size(),
                    errors::InvalidArgument("slot_to_unique entry ", u, " out of range [0, ",
                                            local_rows.size(), ")"));
        if (all_updated_ || updated_set.count(local_rows(u))) plan(w, count++) = static_cast<int32>(p);
      }
      counts(w) = count;
      for (int64_t p = count; p < capacity; ++p) plan(w, p) = -1;
    }
  }

 private:
  int num_requesters_;
  bool all_updated_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSyncPlan").Device(DEVICE_CPU), SyncPlanOp);

REGISTER_OP("NestpipeBufferSync")
    .Input("buffer: T")
    .Input("positions: int32")
    .Input("fresh_rows: T")
    .Output("synced: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle buffer, positions, fresh;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &buffer));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &positions));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &fresh));
      c->set_output(0, buffer);
      return absl::OkStatus();
    })
    .Doc("synced = buffer with synced[positions[k]] = fresh_rows[k] (positions of -1 skipped).");

template <typename T>
class BufferSyncOp : public OpKernel {
 public:
  explicit BufferSyncOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& buffer = ctx->input(0);
    const auto positions = ctx->input(1).flat<int32>();
    const Tensor& fresh = ctx->input(2);
    const int64_t rows = buffer.dim_size(0), dim = buffer.dim_size(1);
    OP_REQUIRES(ctx, fresh.dim_size(0) == positions.size() && fresh.dim_size(1) == dim,
                errors::InvalidArgument("fresh_rows must be [", positions.size(), ", ", dim,
                                        "], got ", fresh.shape().DebugString()));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, buffer.shape(), &out_t));
    T* out = out_t->flat<T>().data();
    std::memcpy(out, buffer.flat<T>().data(), sizeof(T) * rows * dim);
    const T* src = fresh.flat<T>().data();
    for (int64_t k = 0; k < positions.size(); ++k) {
      const int64_t p = positions(k);
      if (p < 0) continue;
      OP_REQUIRES(ctx, p < rows, errors::InvalidArgument("position ", p, " at ", k,
                                                         " is out of range [0, ", rows, ")"));
      std::memcpy(out + p * dim, src + k * dim, sizeof(T) * dim);
    }
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeBufferSync").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        BufferSyncOp<float>);
REGISTER_KERNEL_BUILDER(Name("NestpipeBufferSync").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        BufferSyncOp<double>);

}  // namespace nestpipe
}  // namespace tensorflow

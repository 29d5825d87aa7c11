// Dual-Buffer Pipeline ops. After batch i's sparse update, the rows that batch i+1 prefetched
// and batch i updated are stale in the prefetch buffer. The owner plans which slots of each
// requester's prefetch to refresh (SyncPlan, computable before the update finishes); the
// requester copies the fresh rows it receives into its prefetch buffer (BufferSync).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "capacities.h"
#include "flat_hash.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace nestpipe {

using shape_inference::DimensionHandle;
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
    .Output("kept_slot_to_unique: int32")
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
      c->set_output(2, slots);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner side: for each requester w, the slot positions p (of its [capacity] prefetch slots) whose
local row is in `updated_rows` (every valid slot if all_updated), compacted to the left of row w
of `sync_slots` and padded with -1; `sync_counts[w]` is how many. `kept_slot_to_unique` is
`slot_to_unique` without those slots: each requester's other entries in slot order, compacted
to the left of its [capacity] part and padded with -1 (the rows the prefetch sends now; the
planned ones travel once, fresh, in the sync).
)doc");

// The set of a step's updated local rows, for membership tests: a bitmap over [0, max] when
// that range is at most a few words per row (no hashing; the usual case, as local rows are
// dense indices into a shard), else a hash set.
class UpdatedRows {
 public:
  UpdatedRows(const int64_t* rows, int64_t n) {
    int64_t lo = 0, hi = -1;
    if (n > 0) lo = hi = rows[0];
    for (int64_t i = 1; i < n; ++i) {
      lo = std::min(lo, rows[i]);
      hi = std::max(hi, rows[i]);
    }
    if (lo >= 0 && hi / 64 + 1 <= std::max<int64_t>(1024, 8 * n)) {
      bits_.assign(static_cast<size_t>(hi / 64 + 1), 0);
      for (int64_t i = 0; i < n; ++i) bits_[rows[i] >> 6] |= uint64_t{1} << (rows[i] & 63);
    } else {
      hashed_ = std::make_unique<FlatInt64Map>(n);
      for (int64_t i = 0; i < n; ++i) hashed_->emplace(rows[i], 0);
    }
  }

  bool contains(int64_t row) const {
    if (hashed_) return hashed_->contains(row);
    const uint64_t word = static_cast<uint64_t>(row) >> 6;
    return row >= 0 && word < bits_.size() && ((bits_[word] >> (row & 63)) & 1);
  }

 private:
  std::vector<uint64_t> bits_;
  std::unique_ptr<FlatInt64Map> hashed_;
};

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
    const UpdatedRows updated_set(updated.data(), all_updated_ ? 0 : updated.size());
    Tensor *plan_t, *counts_t, *kept_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_requesters_, capacity}), &plan_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_requesters_}), &counts_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &kept_t));
    auto plan = plan_t->matrix<int32>();
    auto counts = counts_t->flat<int32>();
    auto kept = kept_t->flat<int32>();
    for (int w = 0; w < num_requesters_; ++w) {
      int32 count = 0;
      int64_t kept_count = 0;
      for (int64_t p = 0; p < capacity; ++p) {
        const int32 u = slots(w * capacity + p);
        if (u < 0) continue;
        OP_REQUIRES(ctx, u < local_rows.size(),
                    errors::InvalidArgument("slot_to_unique entry ", u, " out of range [0, ",
                                            local_rows.size(), ")"));
        if (all_updated_ || updated_set.contains(local_rows(u))) {
          plan(w, count++) = static_cast<int32>(p);
        } else {
          kept(w * capacity + kept_count++) = u;
        }
      }
      counts(w) = count;
      for (int64_t p = count; p < capacity; ++p) plan(w, p) = -1;
      for (int64_t p = kept_count; p < capacity; ++p) kept(w * capacity + p) = -1;
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

// Output 0 as a copy of `buffer` (input 0) to patch: the buffer itself when no other op holds it
// (the usual case: the prefetch's output, consumed only by the patch), otherwise a copy.
template <typename T>
Status PatchableBuffer(OpKernelContext* ctx, const Tensor& buffer, T** out) {
  Tensor* out_t;
  TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output({0}, 0, buffer.shape(), &out_t));
  *out = out_t->flat<T>().data();
  if (*out != buffer.flat<T>().data()) {
    std::memcpy(*out, buffer.flat<T>().data(), sizeof(T) * buffer.NumElements());
  }
  return absl::OkStatus();
}

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
    T* out;
    OP_REQUIRES_OK(ctx, PatchableBuffer(ctx, buffer, &out));
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

REGISTER_OP("NestpipeGatherBlocks")
    .Input("params: T")
    .Input("indices: int32")
    .Input("header: T")
    .Output("blocks: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle params, indices, header;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &params));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 3, &header));
      DimensionHandle w = c->Dim(header, 0), h = c->Dim(header, 1), cap = c->UnknownDim(),
                      rows = c->UnknownDim();
      if (c->ValueKnown(w) && c->ValueKnown(c->Dim(indices, 0))) {
        TF_RETURN_IF_ERROR(c->Divide(c->Dim(indices, 0), w, /*evenly_divisible=*/true, &cap));
        TF_RETURN_IF_ERROR(c->Add(cap, h, &rows));
      }
      c->set_output(0, c->MakeShape({w, rows, c->Dim(params, 1)}));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner side of a prefetch: the rows params[indices] (a zero row for -1) cut into one block of
capacity = len(indices) / W rows per requester, each block behind its requester's header rows:
blocks[w] = concat(header[w], params[indices[w * capacity : (w + 1) * capacity]]), written
once (no concat of the gathered rows).
)doc");

template <typename T>
class GatherBlocksOp : public OpKernel {
 public:
  explicit GatherBlocksOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& params = ctx->input(0);
    const auto indices = ctx->input(1).flat<int32>();
    const Tensor& header = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(params.shape()),
                errors::InvalidArgument("params must be a matrix, got ",
                                        params.shape().DebugString()));
    OP_REQUIRES(ctx, header.dims() == 3 && header.dim_size(0) > 0 &&
                         header.dim_size(2) == params.dim_size(1),
                errors::InvalidArgument("header must be [W > 0, rows, ", params.dim_size(1),
                                        "], got ", header.shape().DebugString()));
    const int64_t w = header.dim_size(0), h = header.dim_size(1), dim = params.dim_size(1);
    const int64_t rows = params.dim_size(0), n = indices.size();
    OP_REQUIRES(ctx, n % w == 0,
                errors::InvalidArgument("indices has ", n, " entries, not a multiple of ", w,
                                        " blocks"));
    const int64_t capacity = n / w;
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({w, h + capacity, dim}), &out_t));
    T* out = out_t->flat<T>().data();
    const T* p = params.flat<T>().data();
    const T* head = header.flat<T>().data();
    for (int64_t b = 0; b < w; ++b) {
      T* block = out + b * (h + capacity) * dim;
      std::memcpy(block, head + b * h * dim, sizeof(T) * h * dim);
      for (int64_t k = 0; k < capacity; ++k) {
        const int64_t r = indices(b * capacity + k);
        OP_REQUIRES(ctx, r >= -1 && r < rows,
                    errors::InvalidArgument("gather index ", r, " at position ",
                                            b * capacity + k, " is out of range [-1, ", rows,
                                            ")"));
        T* dst = block + (h + k) * dim;
        if (r < 0) {
          std::fill(dst, dst + dim, T(0));
        } else {
          std::memcpy(dst, p + r * dim, sizeof(T) * dim);
        }
      }
    }
  }
};

REGISTER_OP("NestpipeGatherFromBlocks")
    .Input("blocks: T")
    .Input("indices: int32")
    .Attr("header_rows: int >= 0")
    .Output("rows: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle blocks, indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &blocks));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      c->set_output(0, c->Matrix(c->Dim(indices, 0), c->Dim(blocks, 2)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Requester side of a prefetch: rows[i] = the row at flat position indices[i] of the blocks' data
rows (position p is row header_rows + p % capacity of block p / capacity, capacity = the
blocks' rows minus header_rows), a zero row for -1; the header rows are skipped, not sliced off.
)doc");

template <typename T>
class GatherFromBlocksOp : public OpKernel {
 public:
  explicit GatherFromBlocksOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("header_rows", &header_rows_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& blocks = ctx->input(0);
    const auto indices = ctx->input(1).flat<int32>();
    OP_REQUIRES(ctx, blocks.dims() == 3 && blocks.dim_size(1) >= header_rows_,
                errors::InvalidArgument("blocks must be [W, >= ", header_rows_,
                                        " rows, dim], got ", blocks.shape().DebugString()));
    const int64_t w = blocks.dim_size(0), dim = blocks.dim_size(2);
    const int64_t capacity = blocks.dim_size(1) - header_rows_, n = indices.size();
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out_t));
    T* out = out_t->flat<T>().data();
    const T* src = blocks.flat<T>().data();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = indices(i);
      OP_REQUIRES(ctx, p >= -1 && p < w * capacity,
                  errors::InvalidArgument("position ", p, " at ", i, " is out of range [-1, ",
                                          w * capacity, ")"));
      if (p < 0) {
        std::fill(out + i * dim, out + (i + 1) * dim, T(0));
      } else {
        const int64_t row = (p / capacity) * (header_rows_ + capacity) + header_rows_ +
                            p % capacity;
        std::memcpy(out + i * dim, src + row * dim, sizeof(T) * dim);
      }
    }
  }

 private:
  int64_t header_rows_;
};

#define NESTPIPE_REGISTER_BLOCKS(T)                                                        \
  REGISTER_KERNEL_BUILDER(Name("NestpipeGatherBlocks").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          GatherBlocksOp<T>);                                              \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("NestpipeGatherFromBlocks").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
      GatherFromBlocksOp<T>);
NESTPIPE_REGISTER_BLOCKS(float)
NESTPIPE_REGISTER_BLOCKS(double)
#undef NESTPIPE_REGISTER_BLOCKS

REGISTER_OP("NestpipeSyncRows")
    .Input("sync_slots: int32")
    .Input("slot_to_unique: int32")
    .Input("local_rows: int64")
    .Output("rows: int64")
    .Output("sync_counts: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle slots;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &slots));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->Dim(slots, 0)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner side of the buffer sync, after the update: the local rows to send, fresh. sync_slots is a
sync plan ([W, cap_s], each row's slot positions compacted left, -1 padded); requester w's prefetch
slots are slot_to_unique[w * capacity : (w + 1) * capacity] with capacity = len(slot_to_unique) / W.
rows lists local_rows[slot_to_unique[w * capacity + p]] for every planned position p, requester by
requester in plan order; sync_counts[w] is how many are requester w's.
)doc");

class SyncRowsOp : public OpKernel {
 public:
  explicit SyncRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& slots_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(slots_t.shape()),
                errors::InvalidArgument("sync_slots must be a matrix, got ",
                                        slots_t.shape().DebugString()));
    const auto slots = slots_t.matrix<int32>();
    const auto slot_to_unique = ctx->input(1).flat<int32>();
    const auto local_rows = ctx->input(2).flat<int64_t>();
    const int64_t w = slots_t.dim_size(0), cap_s = slots_t.dim_size(1);
    OP_REQUIRES(ctx, w > 0 && slot_to_unique.size() % w == 0,
                errors::InvalidArgument("slot_to_unique has ", slot_to_unique.size(),
                                        " entries, not a multiple of ", w, " requesters"));
    const int64_t capacity = slot_to_unique.size() / w;
    Tensor* counts_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({w}), &counts_t));
    auto counts = counts_t->flat<int32>();
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < w; ++r) {
      int32 count = 0;
      for (int64_t j = 0; j < cap_s; ++j) {
        const int64_t p = slots(r, j);
        if (p < 0) continue;
        OP_REQUIRES(ctx, p < capacity,
                    errors::InvalidArgument("sync slot ", p, " of requester ", r,
                                            " is out of range [0, ", capacity, ")"));
        const int64_t u = slot_to_unique(r * capacity + p);
        OP_REQUIRES(ctx, u >= 0 && u < local_rows.size(),
                    errors::InvalidArgument("slot ", r * capacity + p, " holds unique index ", u,
                                            ", out of range [0, ", local_rows.size(), ")"));
        rows.push_back(local_rows(u));
        ++count;
      }
      counts(r) = count;
    }
    Tensor* rows_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(rows.size())}), &rows_t));
    std::copy(rows.begin(), rows.end(), rows_t->flat<int64_t>().data());
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSyncRows").Device(DEVICE_CPU), SyncRowsOp);

REGISTER_OP("NestpipeSyncPayload")
    .Input("fresh_rows: T")
    .Input("sync_slots: int32")
    .Output("payload: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle fresh, slots;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &fresh));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &slots));
      DimensionHandle width;
      TF_RETURN_IF_ERROR(c->Add(c->Dim(fresh, 1), 1, &width));
      c->set_output(0, c->MakeShape({c->Dim(slots, 0), c->Dim(slots, 1), width}));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner side of the buffer sync: payload[w, j] = fresh_rows[(rows of requesters before w) + j]
followed by sync_slots[w, j] as a float (exact below 2**24), for each planned position (j below
requester w's count, the non-negative entries compacted left); padding entries are zero rows with
position -1. fresh_rows are the rows of NestpipeSyncRows, read after the update.
)doc");

template <typename T>
class SyncPayloadOp : public OpKernel {
 public:
  explicit SyncPayloadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& fresh = ctx->input(0);
    const Tensor& slots_t = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(fresh.shape()) &&
                         TensorShapeUtils::IsMatrix(slots_t.shape()),
                errors::InvalidArgument("fresh_rows and sync_slots must be matrices"));
    const auto slots = slots_t.matrix<int32>();
    const int64_t w = slots_t.dim_size(0), cap_s = slots_t.dim_size(1);
    const int64_t dim = fresh.dim_size(1), width = dim + 1;
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({w, cap_s, width}), &out_t));
    T* out = out_t->flat<T>().data();
    const T* src = fresh.flat<T>().data();
    int64_t next = 0;
    for (int64_t r = 0; r < w; ++r) {
      for (int64_t j = 0; j < cap_s; ++j) {
        T* entry = out + (r * cap_s + j) * width;
        const int32 p = slots(r, j);
        if (p < 0) {
          std::fill(entry, entry + dim, T(0));
          entry[dim] = T(-1);
          continue;
        }
        OP_REQUIRES(ctx, next < fresh.dim_size(0),
                    errors::InvalidArgument("sync_slots plan more rows than the ",
                                            fresh.dim_size(0), " fresh_rows given"));
        std::memcpy(entry, src + next * dim, sizeof(T) * dim);
        entry[dim] = static_cast<T>(p);
        ++next;
      }
    }
    OP_REQUIRES(ctx, next == fresh.dim_size(0),
                errors::InvalidArgument("sync_slots plan ", next, " rows but ",
                                        fresh.dim_size(0), " fresh_rows were given"));
  }
};

REGISTER_OP("NestpipeApplySyncPayload")
    .Input("buffer: T")
    .Input("received: T")
    .Input("splits: int32")
    .Output("synced: T")
    .Output("rows_received: int64")
    .Attr("T: {float, double}")
    .Attr("kept_first: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle buffer, received, splits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &buffer));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &received));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &splits));
      c->set_output(0, buffer);
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Requester side of the buffer sync: received[o, j] is owner o's j-th fresh row followed by its slot
position p among the slots this worker asked of o (-1: padding); the row replaces
buffer[(splits[0] + ... + splits[o - 1]) + p]. The buffer is patched in place when nothing else
holds it. rows_received counts the rows copied.
With kept_first, owner o's part of the buffer holds only the rows it did not sync, in slot order,
first (the prefetch sent only those): they are moved to the slots the fresh rows leave free, so
o's positions must ascend and be at most splits[o] of them.
)doc");

template <typename T>
class ApplySyncPayloadOp : public OpKernel {
 public:
  explicit ApplySyncPayloadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kept_first", &kept_first_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& buffer = ctx->input(0);
    const Tensor& received = ctx->input(1);
    const auto splits = ctx->input(2).flat<int32>();
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(buffer.shape()) && received.dims() == 3,
                errors::InvalidArgument("buffer must be a matrix and received [W, cap, dim + 1]"));
    const int64_t rows = buffer.dim_size(0), dim = buffer.dim_size(1);
    const int64_t w = received.dim_size(0), cap_s = received.dim_size(1);
    OP_REQUIRES(ctx, received.dim_size(2) == dim + 1 && splits.size() == w,
                errors::InvalidArgument("received must be [", splits.size(), ", cap, ", dim + 1,
                                        "], got ", received.shape().DebugString()));
    T* out;
    OP_REQUIRES_OK(ctx, PatchableBuffer(ctx, buffer, &out));
    const T* src = received.flat<T>().data();
    int64_t offset = 0, copied = 0;
    for (int64_t o = 0; o < w && kept_first_; ++o) {
      OP_REQUIRES(ctx, splits(o) >= 0 && offset + splits(o) <= rows,
                  errors::InvalidArgument("splits exceed the buffer's ", rows, " rows"));
      // Owner o's fresh rows, by ascending position.
      std::vector<const T*> fresh;
      std::vector<int64_t> at;
      for (int64_t j = 0; j < cap_s; ++j) {
        const T* entry = src + (o * cap_s + j) * (dim + 1);
        const int64_t p = static_cast<int64_t>(entry[dim]);
        if (p < 0) continue;
        OP_REQUIRES(ctx, p < splits(o) && (at.empty() || p > at.back()),
                    errors::InvalidArgument("owner ", o, " sent slot position ", p, " (after ",
                                            at.empty() ? -1 : at.back(), "), not ascending in [0, ",
                                            splits(o), ")"));
        fresh.push_back(entry);
        at.push_back(p);
      }
      // From the last slot down: slot p takes the next fresh row or kept row p - (fresh rows
      // before it), which sits at or before p, so nothing is overwritten before it is moved.
      int64_t next = static_cast<int64_t>(at.size()) - 1;
      for (int64_t p = splits(o) - 1; p >= 0; --p) {
        T* target = out + (offset + p) * dim;
        if (next >= 0 && at[next] == p) {
          std::memcpy(target, fresh[next], sizeof(T) * dim);
          --next;
          ++copied;
        } else if (next + 1 > 0) {
          std::memmove(target, out + (offset + p - (next + 1)) * dim, sizeof(T) * dim);
        }
      }
      offset += splits(o);
    }
    for (int64_t o = 0; o < w && !kept_first_; ++o) {
      for (int64_t j = 0; j < cap_s; ++j) {
        const T* entry = src + (o * cap_s + j) * (dim + 1);
        const int64_t p = static_cast<int64_t>(entry[dim]);
        if (p < 0) continue;
        OP_REQUIRES(ctx, p < splits(o) && offset + p < rows,
                    errors::InvalidArgument("owner ", o, " sent slot position ", p,
                                            ", out of range [0, ", splits(o), ")"));
        std::memcpy(out + (offset + p) * dim, entry, sizeof(T) * dim);
        ++copied;
      }
      offset += splits(o);
    }
    Tensor* count_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &count_t));
    count_t->scalar<int64_t>()() = copied;
  }

 private:
  bool kept_first_;
};

#define NESTPIPE_REGISTER_SYNC(T)                                                          \
  REGISTER_KERNEL_BUILDER(Name("NestpipeSyncPayload").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
                          SyncPayloadOp<T>);                                               \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("NestpipeApplySyncPayload").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
      ApplySyncPayloadOp<T>);
NESTPIPE_REGISTER_SYNC(float)
NESTPIPE_REGISTER_SYNC(double)
#undef NESTPIPE_REGISTER_SYNC

REGISTER_OP("NestpipePackPerPeer")
    .Input("blocks: rounds * T")
    .Input("lengths: rounds * Tlen")
    .Input("capacity: int32")
    .Attr("rounds: int >= 1")
    .Attr("T: type")
    .Attr("Tlen: {int32, int64}")
    .Output("packed: T")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle first;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 2, &first));
      ShapeHandle inner;
      TF_RETURN_IF_ERROR(c->Subshape(first, 2, &inner));
      ShapeHandle head = c->Matrix(c->Dim(first, 0), c->UnknownDim());
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(head, inner, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Per worker j: the first lengths[r][j] entries of blocks[r][j] (each [W, capacity_r, ...]), round
after round, then entries of -1, in a [W, capacity, ...] tensor.
)doc");

template <typename T, typename Tlen>
class PackPerPeerOp : public OpKernel {
 public:
  explicit PackPerPeerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList blocks, lengths;
    OP_REQUIRES_OK(ctx, ctx->input_list("blocks", &blocks));
    OP_REQUIRES_OK(ctx, ctx->input_list("lengths", &lengths));
    const Tensor& capacity_t = ctx->input(2 * blocks.size());
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(capacity_t.shape()),
                errors::InvalidArgument("capacity must be a scalar"));
    const int64_t capacity = capacity_t.scalar<int32>()();
    const TensorShape& first = blocks[0].shape();
    OP_REQUIRES(ctx, first.dims() >= 2,
                errors::InvalidArgument("blocks must be [W, capacity_r, ...]"));
    const int64_t workers = first.dim_size(0);
    int64_t inner = 1;
    for (int d = 2; d < first.dims(); ++d) inner *= first.dim_size(d);
    for (int r = 0; r < blocks.size(); ++r) {
      const TensorShape& shape = blocks[r].shape();
      bool same = shape.dims() == first.dims() && shape.dim_size(0) == workers;
      for (int d = 2; same && d < first.dims(); ++d) same = shape.dim_size(d) == first.dim_size(d);
      OP_REQUIRES(ctx, same,
                  errors::InvalidArgument("block ", r, " has shape ", shape.DebugString(),
                                          ", the first ", first.DebugString()));
      OP_REQUIRES(ctx, lengths[r].NumElements() == workers,
                  errors::InvalidArgument("lengths ", r, " must have one entry per worker"));
    }
    TensorShape out_shape({workers, capacity});
    for (int d = 2; d < first.dims(); ++d) out_shape.AddDim(first.dim_size(d));
    Tensor* packed_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &packed_t));
    T* packed = packed_t->flat<T>().data();
    std::fill(packed, packed + packed_t->NumElements(), static_cast<T>(-1));
    for (int64_t j = 0; j < workers; ++j) {
      int64_t filled = 0;
      for (int r = 0; r < blocks.size(); ++r) {
        const int64_t width = blocks[r].dim_size(1);
        const int64_t length = static_cast<int64_t>(lengths[r].flat<Tlen>()(j));
        OP_REQUIRES(ctx, length >= 0 && length <= width,
                    errors::InvalidArgument("round ", r, " keeps ", length, " entries for worker ",
                                            j, ", outside [0, ", width, "]"));
        OP_REQUIRES(ctx, filled + length <= capacity,
                    errors::InvalidArgument("worker ", j, "'s entries exceed the capacity ",
                                            capacity));
        if (length > 0) {
          const T* source = blocks[r].flat<T>().data() + j * width * inner;
          std::copy(source, source + length * inner, packed + (j * capacity + filled) * inner);
        }
        filled += length;
      }
    }
  }
};

#define NESTPIPE_REGISTER_PACK(T)                                                          \
  REGISTER_KERNEL_BUILDER(Name("NestpipePackPerPeer")                                      \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<int32>("Tlen")                               \
                              .HostMemory("capacity"),                                     \
                          PackPerPeerOp<T, int32>);                                        \
  REGISTER_KERNEL_BUILDER(Name("NestpipePackPerPeer")                                      \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<int64_t>("Tlen")                             \
                              .HostMemory("capacity"),                                     \
                          PackPerPeerOp<T, int64_t>);
NESTPIPE_REGISTER_PACK(float)
NESTPIPE_REGISTER_PACK(double)
NESTPIPE_REGISTER_PACK(Eigen::half)
NESTPIPE_REGISTER_PACK(bfloat16)
NESTPIPE_REGISTER_PACK(int8)
NESTPIPE_REGISTER_PACK(int32)
NESTPIPE_REGISTER_PACK(int64_t)
#undef NESTPIPE_REGISTER_PACK


REGISTER_OP("NestpipeSyncHeader")
    .Input("sync_counts: int32")
    .Attr("dim: int >= 1")
    .Attr("T: {float, double}")
    .Output("header: T")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle counts;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &counts));
      int dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(0, c->MakeShape({c->Dim(counts, 0), 2, dim}));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner side of a prefetch with a sync plan: the [W, 2, dim] header rows of each requester's block
(NestpipeGatherBlocks): row 0 holds the owner's sync count for that requester, row 1 its largest
count over all requesters, each in column 0 as a float (exact below 2**24); the rest is zero.
)doc");

template <typename T>
class SyncHeaderOp : public OpKernel {
 public:
  explicit SyncHeaderOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    const auto counts = ctx->input(0).flat<int32>();
    const int64_t w = counts.size();
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({w, 2, dim_}), &out_t));
    T* out = out_t->flat<T>().data();
    std::fill(out, out + w * 2 * dim_, T(0));
    int32 largest = 0;
    for (int64_t b = 0; b < w; ++b) largest = std::max(largest, counts(b));
    for (int64_t b = 0; b < w; ++b) {
      out[(b * 2) * dim_] = static_cast<T>(counts(b));
      out[(b * 2 + 1) * dim_] = static_cast<T>(largest);
    }
  }

 private:
  int64_t dim_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSyncHeader").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        SyncHeaderOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("NestpipeSyncHeader").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    SyncHeaderOp<double>);

REGISTER_OP("NestpipeSyncPlanPad")
    .Input("sync_slots: int32")
    .Input("largest: T")
    .Input("sync_counts: int32")
    .Attr("capacities: list(int)")
    .Attr("max_slots: int = 0")
    .Attr("T: {float, double, int32}")
    .Output("slots: int32")
    .Output("bucket: int32")
    .Output("capacity: int32")
    .Output("rows_sent: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle slots;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &slots));
      c->set_output(0, c->Matrix(c->Dim(slots, 0), c->UnknownDim()));
      c->set_output(1, c->Scalar());
      c->set_output(2, c->Scalar());
      c->set_output(3, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Finishes an owner's sync plan once every owner's largest sync count is known (from the rows
all-to-all's headers): the sync's padded size is the bucketed capacity of max(largest, 1)
(`capacities`, as NestpipeCapacityBucket); `slots` is sync_slots ([W, S], from NestpipeSyncPlan)
cut or padded with -1 to that many columns; `rows_sent` the sum of sync_counts. With max_slots
> 0, S (the prefetch's capacity) must be below it (the sync's positions travel as floats).
)doc");

template <typename T>
class SyncPlanPadOp : public OpKernel {
 public:
  explicit SyncPlanPadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacities", &capacities_));
    OP_REQUIRES_OK(ctx, CheckCapacities(capacities_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_slots", &max_slots_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& slots_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(slots_t.shape()),
                errors::InvalidArgument("sync_slots must be [W, S], got ",
                                        slots_t.shape().DebugString()));
    const int64_t w = slots_t.dim_size(0), width = slots_t.dim_size(1);
    OP_REQUIRES(ctx, max_slots_ <= 0 || width < max_slots_,
                errors::InvalidArgument("prefetch capacity ", width, " too large for the float "
                                        "position column (must be below ", max_slots_, ")"));
    const auto largest_values = ctx->input(1).flat<T>();
    int64_t largest = 1;
    for (int64_t i = 0; i < largest_values.size(); ++i) {
      largest = std::max(largest, static_cast<int64_t>(largest_values(i)));
    }
    int32 bucket, capacity;
    OP_REQUIRES_OK(ctx, BucketOfSize(capacities_, largest, &bucket, &capacity));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({w, capacity}), &out_t));
    const int32* slots = slots_t.flat<int32>().data();
    int32* out = out_t->flat<int32>().data();
    const int64_t kept = std::min<int64_t>(capacity, width);
    for (int64_t b = 0; b < w; ++b) {
      std::copy(slots + b * width, slots + b * width + kept, out + b * capacity);
      std::fill(out + b * capacity + kept, out + (b + 1) * capacity, -1);
    }
    const auto counts = ctx->input(2).flat<int32>();
    int64_t sent = 0;
    for (int64_t i = 0; i < counts.size(); ++i) sent += counts(i);
    Tensor* scalar;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &scalar));
    scalar->scalar<int32>()() = bucket;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &scalar));
    scalar->scalar<int32>()() = capacity;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &scalar));
    scalar->scalar<int32>()() = static_cast<int32>(sent);
  }

 private:
  std::vector<int64_t> capacities_;
  int64_t max_slots_;
};
#define NESTPIPE_REGISTER_PLAN_PAD(T)                                                 \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("NestpipeSyncPlanPad").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
      SyncPlanPadOp<T>);
NESTPIPE_REGISTER_PLAN_PAD(float)
NESTPIPE_REGISTER_PLAN_PAD(double)
NESTPIPE_REGISTER_PLAN_PAD(int32)
#undef NESTPIPE_REGISTER_PLAN_PAD

}  // namespace nestpipe
}  // namespace tensorflow

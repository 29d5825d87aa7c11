// Key routing ops: fused dedup + bucket-by-owner on the requester side, and the
// second-level dedup of received keys on the owner side.
//
// Ownership rule (documented in tf_nestpipe/sharding/layout.py): id k is owned by
// shard k mod num_shards and lives there at local row k / num_shards.
#include <cstdint>
#include <string>
#include <vector>

#include "flat_hash.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace nestpipe {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// The error every out-of-range id of a table raises, naming the table, the id and the fix.
template <typename Ids>
absl::Status CheckIdRange(const Ids& ids, int64_t vocab_size, const std::string& table_name) {
  const int64_t n = ids.size();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = ids(i);
    if (k < 0 || k >= vocab_size) {
      return errors::InvalidArgument(
          "ShardedEmbedding '", table_name, "': id ", k, " at position ", i,
          " is out of range [0, ", vocab_size,
          "). Fix the input pipeline (hash or clip ids into the vocabulary), "
          "or construct the layer with invalid_id_policy='zero' to map "
          "invalid ids to a zero vector.");
    }
  }
  return absl::OkStatus();
}

REGISTER_OP("NestpipeCheckIds")
    .Input("ids: int64")
    .Attr("vocab_size: int >= 1")
    .Attr("table_name: string = ''")
    .Output("checked: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Passes ids through after checking each lies in [0, vocab_size) (the error names the table).
)doc");

class CheckIdsOp : public OpKernel {
 public:
  explicit CheckIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab_size", &vocab_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckIdRange(ids.flat<int64_t>(), vocab_size_, table_name_));
    ctx->set_output(0, ids);
  }

 private:
  int64_t vocab_size_;
  std::string table_name_;
};

REGISTER_KERNEL_BUILDER(Name("NestpipeCheckIds").Device(DEVICE_CPU), CheckIdsOp);

REGISTER_OP("NestpipeRouteKeys")
    .Input("ids: int64")
    .Attr("num_shards: int >= 1")
    .Attr("vocab_size: int >= 1")
    .Attr("table_name: string = ''")
    .Output("bucketed_keys: int64")
    .Output("split_sizes: int32")
    .Output("inverse: int32")
    .SetShapeFn([](InferenceContext* c) {
      int num_shards;
      TF_RETURN_IF_ERROR(c->GetAttr("num_shards", &num_shards));
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(num_shards));
      c->set_output(2, ids);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Deduplicates ids and groups the unique ids by owner shard (id mod num_shards).

bucketed_keys: unique ids, ordered by owner shard, first-seen order within a shard.
split_sizes: number of unique ids owned by each shard.
inverse: for each input position, the index of its id in bucketed_keys.
)doc");

class RouteKeysOp : public OpKernel {
 public:
  explicit RouteKeysOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shards", &num_shards_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab_size", &vocab_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_t.shape()),
                errors::InvalidArgument("ids must be a vector, got shape ",
                                        ids_t.shape().DebugString()));
    const auto ids = ids_t.flat<int64_t>();
    const int64_t n = ids.size();
    OP_REQUIRES(ctx, n < (int64_t{1} << 31),
                errors::InvalidArgument("too many ids in one batch: ", n));
    OP_REQUIRES_OK(ctx, CheckIdRange(ids, vocab_size_, table_name_));
    // First pass: dedup in first-seen order.
    FlatInt64Map first_pos(n);
    std::vector<int64_t> uniq;
    std::vector<int32> uniq_of_input(n);
    for (int64_t i = 0; i < n; ++i) {
      const auto it = first_pos.emplace(ids(i), static_cast<int32>(uniq.size()));
      if (it.second) uniq.push_back(ids(i));
      uniq_of_input[i] = it.first;
    }
    const int64_t u = uniq.size();
    std::vector<int32> counts(num_shards_, 0), offsets(num_shards_, 0);
    for (int64_t j = 0; j < u; ++j) counts[uniq[j] % num_shards_]++;
    for (int s = 1; s < num_shards_; ++s) offsets[s] = offsets[s - 1] + counts[s - 1];

    Tensor *keys_t, *splits_t, *inv_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({u}), &keys_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_shards_}), &splits_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, ids_t.shape(), &inv_t));
    auto keys = keys_t->flat<int64_t>();
    auto splits = splits_t->flat<int32>();
    auto inv = inv_t->flat<int32>();
    for (int s = 0; s < num_shards_; ++s) splits(s) = counts[s];
    std::vector<int32> bucket_pos(u);
    for (int64_t j = 0; j < u; ++j) {
      const int s = static_cast<int>(uniq[j] % num_shards_);
      const int32 p = offsets[s]++;
      keys(p) = uniq[j];
      bucket_pos[j] = p;
    }
    for (int64_t i = 0; i < n; ++i) inv(i) = bucket_pos[uniq_of_input[i]];
  }

 private:
  int num_shards_;
  int64_t vocab_size_;
  std::string table_name_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeRouteKeys").Device(DEVICE_CPU), RouteKeysOp);

REGISTER_OP("NestpipeOwnerDedup")
    .Input("received_keys: int64")
    .Attr("num_shards: int >= 1")
    .Attr("shard_index: int >= 0")
    .Output("local_rows: int64")
    .Output("slot_to_unique: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &keys));
      c->set_output(0, c->Vector(c->UnknownDim()));
      auto n = c->UnknownDim();
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(keys, 0), c->Dim(keys, 1), &n));
      c->set_output(1, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner-side dedup of the padded [num_requesters, capacity] key matrix (-1 = padding).

local_rows: the distinct local row indices (key / num_shards) in first-seen order.
slot_to_unique: for each flattened slot, the index into local_rows, or -1 for padding.
)doc");

class OwnerDedupOp : public OpKernel {
 public:
  explicit OwnerDedupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shards", &num_shards_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shard_index", &shard_index_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(keys_t.shape()),
                errors::InvalidArgument("received_keys must be a matrix"));
    const auto keys = keys_t.flat<int64_t>();
    const int64_t n = keys.size();
    Tensor* slot_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &slot_t));
    auto slot = slot_t->flat<int32>();
    FlatInt64Map pos(n);
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = keys(i);
      if (k < 0) {
        slot(i) = -1;
        continue;
      }
      OP_REQUIRES(ctx, k % num_shards_ == shard_index_,
                  errors::Internal("key ", k, " routed to shard ", shard_index_,
                                   " but is owned by shard ", k % num_shards_));
      const auto it = pos.emplace(k / num_shards_, static_cast<int32>(rows.size()));
      if (it.second) rows.push_back(k / num_shards_);
      slot(i) = it.first;
    }
    Tensor* rows_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(rows.size())}), &rows_t));
    std::copy(rows.begin(), rows.end(), rows_t->flat<int64_t>().data());
  }

 private:
  int num_shards_;
  int shard_index_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeOwnerDedup").Device(DEVICE_CPU), OwnerDedupOp);

}  // namespace nestpipe
}  // namespace tensorflow

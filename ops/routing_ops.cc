// Key routing ops: fused dedup + bucket-by-owner on the requester side, the second-level
// dedup of received keys on the owner side (round by round for a frozen window routed as one),
// and the requester's layout of such a window.
//
// Ownership rule (documented in tf_nestpipe/sharding/layout.py): id k is owned by
// shard k mod num_shards and lives there at local row k / num_shards.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "capacities.h"
#include "flat_hash.h"
#include "table_groups.h"
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

REGISTER_OP("NestpipeFuseIds")
    .Input("ids: N * int64")
    .Attr("N: int >= 1")
    .Attr("vocab_sizes: list(int)")
    .Attr("offsets: list(int)")
    .Attr("table_names: list(string)")
    .Attr("segment_ends: list(int)")
    .Output("fused: int64")
    .Output("sizes: int32")
    .Output("segment_sizes: int32")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> ends;
      TF_RETURN_IF_ERROR(c->GetAttr("segment_ends", &ends));
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(n));
      c->set_output(2, c->Vector(static_cast<int64_t>(ends.size())));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The lookups of one exchange in one fused id space: input i's ids (any shape, read flat) checked
against [0, vocab_sizes[i]) (0: not checked; the error names table_names[i]), plus offsets[i],
all inputs one after another; sizes[i] counts input i's ids. segment_ends: the inputs are cut
into segments (rounds) ending after input segment_ends[s] - 1 (nondecreasing, the last N);
segment_sizes[s] counts the ids of segment s.
)doc");

class FuseIdsOp : public OpKernel {
 public:
  explicit FuseIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int n;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab_sizes", &vocab_sizes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("offsets", &offsets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &table_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("segment_ends", &segment_ends_));
    OP_REQUIRES(ctx, static_cast<int>(vocab_sizes_.size()) == n &&
                         static_cast<int>(offsets_.size()) == n &&
                         static_cast<int>(table_names_.size()) == n,
                errors::InvalidArgument("vocab_sizes, offsets and table_names need one entry "
                                        "per input (", n, ")"));
    OP_REQUIRES(ctx, !segment_ends_.empty() && segment_ends_.back() == n,
                errors::InvalidArgument("segment_ends must end at the number of inputs (", n,
                                        ")"));
    int64_t last = 0;
    for (int64_t end : segment_ends_) {
      OP_REQUIRES(ctx, end >= last, errors::InvalidArgument("segment_ends must not decrease"));
      last = end;
    }
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    int64_t total = 0;
    for (int i = 0; i < ids.size(); ++i) {
      if (vocab_sizes_[i] > 0) {
        OP_REQUIRES_OK(ctx,
                       CheckIdRange(ids[i].flat<int64_t>(), vocab_sizes_[i], table_names_[i]));
      }
      total += ids[i].NumElements();
    }
    Tensor* fused_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &fused_t));
    Tensor* input_sizes_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({ids.size()}), &input_sizes_t));
    Tensor* sizes_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            2, TensorShape({static_cast<int64_t>(segment_ends_.size())}),
                            &sizes_t));
    auto fused = fused_t->vec<int64_t>();
    auto input_sizes = input_sizes_t->vec<int32>();
    auto sizes = sizes_t->vec<int32>();
    int64_t p = 0;
    size_t segment = 0;
    int64_t segment_start = 0;
    for (int i = 0; i < ids.size(); ++i) {
      while (segment < segment_ends_.size() && segment_ends_[segment] <= i) {
        sizes(segment++) = static_cast<int32>(p - segment_start);
        segment_start = p;
      }
      const auto in = ids[i].flat<int64_t>();
      input_sizes(i) = static_cast<int32>(in.size());
      const int64_t offset = offsets_[i];
      for (int64_t k = 0; k < in.size(); ++k) fused(p++) = in(k) + offset;
    }
    while (segment < segment_ends_.size()) {
      sizes(segment++) = static_cast<int32>(p - segment_start);
      segment_start = p;
    }
  }

 private:
  std::vector<int64_t> vocab_sizes_;
  std::vector<int64_t> offsets_;
  std::vector<std::string> table_names_;
  std::vector<int64_t> segment_ends_;
};

REGISTER_KERNEL_BUILDER(Name("NestpipeFuseIds").Device(DEVICE_CPU), FuseIdsOp);

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

REGISTER_OP("NestpipeOwnerRounds")
    .Input("received_keys: int64")
    .Input("sent: int32")
    .Input("capacities: int32")
    .Input("row_offsets: int64")
    .Attr("num_shards: int >= 1")
    .Attr("shard_index: int >= 0")
    .Attr("rounds: int >= 1")
    .Output("local_rows: rounds * int64")
    .Output("slot_to_unique: rounds * int32")
    .Output("table_sizes: rounds * int32")
    .SetShapeFn([](InferenceContext* c) {
      int rounds;
      TF_RETURN_IF_ERROR(c->GetAttr("rounds", &rounds));
      ShapeHandle keys, sent, capacities, offsets;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &sent));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &capacities));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &offsets));
      for (int r = 0; r < 2 * rounds; ++r) c->set_output(r, c->Vector(c->UnknownDim()));
      for (int r = 0; r < rounds; ++r) c->set_output(2 * rounds + r, offsets);
      return absl::OkStatus();
    })
    .Doc(R"doc(
The owner's side of one keys exchange carrying `rounds` rounds (one round: a plain route).

received_keys: [W, n], requester i's keys for this owner, round after round, then -1.
sent: [W, rounds], the keys of round r requester i sent (its count header).
capacities: [rounds], the slots per requester of round r's rows exchange.

row_offsets: [T], ascending: the first local row of each of the T tables sharing the local row
  space (NestpipeReadTableRows' layout; [0] for one table). A row belongs to the last table
  starting at or before it.

local_rows[r]: round r's distinct local rows (key / num_shards), grouped by table in table order,
  first-seen in slot order within a table: each table's rows are one contiguous run, so the
  gradient of a gather of them splits per table without a partition.
slot_to_unique[r]: [W * capacities[r]], slot i * capacities[r] + k (requester i's k-th key of
the round) -> its index into local_rows[r]; -1 for an empty slot.
table_sizes[r]: [T], the rows of local_rows[r] in each table.
)doc");

// Writes `rows` to `out` grouped by table (table_groups.h), the count of each table to `sizes`,
// and renumbers `slot`'s indices into `rows` to the rows' new places.
template <typename SlotMap>
absl::Status WriteGroupedRows(const std::vector<int64_t>& rows,
                              const TTypes<int64_t>::ConstVec& offsets, int64_t* out,
                              int32* sizes, SlotMap* slot) {
  TableGroups groups;
  TF_RETURN_IF_ERROR(GroupRowsByTable([&rows](int64_t i) { return rows[i]; },
                                      static_cast<int64_t>(rows.size()), offsets, offsets.size(),
                                      &groups));
  for (int64_t t = 0; t < offsets.size(); ++t) {
    sizes[t] = static_cast<int32>(groups.start[t + 1] - groups.start[t]);
  }
  for (size_t k = 0; k < rows.size(); ++k) out[groups.place[k]] = rows[k];
  for (int64_t i = 0; i < slot->size(); ++i) {
    if ((*slot)(i) >= 0) (*slot)(i) = static_cast<int32>(groups.place[(*slot)(i)]);
  }
  return absl::OkStatus();
}

class OwnerRoundsOp : public OpKernel {
 public:
  explicit OwnerRoundsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shards", &num_shards_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shard_index", &shard_index_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rounds", &rounds_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    const Tensor& sent_t = ctx->input(1);
    const Tensor& cap_t = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(keys_t.shape()),
                errors::InvalidArgument("received_keys must be a matrix, got shape ",
                                        keys_t.shape().DebugString()));
    const int64_t requesters = keys_t.dim_size(0), width = keys_t.dim_size(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(sent_t.shape()) &&
                         sent_t.dim_size(0) == requesters && sent_t.dim_size(1) == rounds_,
                errors::InvalidArgument("sent must be [", requesters, ", ", rounds_, "], got ",
                                        sent_t.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(cap_t.shape()) && cap_t.dim_size(0) == rounds_,
                errors::InvalidArgument("capacities must be [", rounds_, "], got ",
                                        cap_t.shape().DebugString()));
    const Tensor& offsets_t = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(offsets_t.shape()) && offsets_t.NumElements() > 0,
                errors::InvalidArgument("row_offsets must be a non-empty vector, got shape ",
                                        offsets_t.shape().DebugString()));
    const auto offsets = offsets_t.vec<int64_t>();
    OP_REQUIRES(ctx, offsets(0) == 0 && std::is_sorted(offsets.data(),
                                                       offsets.data() + offsets.size()),
                errors::InvalidArgument("row_offsets must ascend from 0"));
    const auto keys = keys_t.matrix<int64_t>();
    const auto sent = sent_t.matrix<int32>();
    const auto capacities = cap_t.vec<int32>();
    // Where each requester's keys of round r start in its row.
    std::vector<int64_t> first(requesters * rounds_);
    for (int64_t i = 0; i < requesters; ++i) {
      int64_t offset = 0;
      for (int r = 0; r < rounds_; ++r) {
        const int32 count = sent(i, r);
        OP_REQUIRES(ctx, count >= 0 && count <= capacities(r),
                    errors::InvalidArgument("requester ", i, " sent ", count, " keys in round ",
                                            r, ", outside [0, capacity ", capacities(r), "]"));
        first[i * rounds_ + r] = offset;
        offset += count;
      }
      OP_REQUIRES(ctx, offset <= width,
                  errors::InvalidArgument("requester ", i, " counted ", offset,
                                          " keys but its row holds ", width));
    }
    OpOutputList rows_out, slots_out, sizes_out;
    OP_REQUIRES_OK(ctx, ctx->output_list("local_rows", &rows_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("slot_to_unique", &slots_out));
    OP_REQUIRES_OK(ctx, ctx->output_list("table_sizes", &sizes_out));
    for (int r = 0; r < rounds_; ++r) {
      const int64_t capacity = capacities(r);
      Tensor* slot_t;
      OP_REQUIRES_OK(ctx, slots_out.allocate(r, TensorShape({requesters * capacity}), &slot_t));
      auto slot = slot_t->flat<int32>();
      slot.setConstant(-1);
      int64_t total = 0;
      for (int64_t i = 0; i < requesters; ++i) total += sent(i, r);
      FlatInt64Map pos(total);
      std::vector<int64_t> rows;
      for (int64_t i = 0; i < requesters; ++i) {
        const int64_t start = first[i * rounds_ + r];
        for (int64_t k = 0; k < sent(i, r); ++k) {
          const int64_t key = keys(i, start + k);
          OP_REQUIRES(ctx, key >= 0,
                      errors::Internal("requester ", i, " counted ", sent(i, r),
                                       " keys in round ", r, " but key ", k, " is padding"));
          OP_REQUIRES(ctx, key % num_shards_ == shard_index_,
                      errors::Internal("key ", key, " routed to shard ", shard_index_,
                                       " but is owned by shard ", key % num_shards_));
          const auto it = pos.emplace(key / num_shards_, static_cast<int32>(rows.size()));
          if (it.second) rows.push_back(key / num_shards_);
          slot(i * capacity + k) = it.first;
        }
      }
      Tensor* rows_t;
      OP_REQUIRES_OK(ctx, rows_out.allocate(
                              r, TensorShape({static_cast<int64_t>(rows.size())}), &rows_t));
      Tensor* sizes_t;
      OP_REQUIRES_OK(ctx, sizes_out.allocate(r, offsets_t.shape(), &sizes_t));
      OP_REQUIRES_OK(ctx, WriteGroupedRows(rows, offsets, rows_t->flat<int64_t>().data(),
                                           sizes_t->flat<int32>().data(), &slot));
    }
  }

 private:
  int num_shards_;
  int shard_index_;
  int rounds_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeOwnerRounds").Device(DEVICE_CPU), OwnerRoundsOp);

REGISTER_OP("NestpipeWindowLayout")
    .Input("inverse: int32")
    .Input("split_sizes: int32")
    .Input("round_sizes: int32")
    .Output("counts: int32")
    .Output("window_inverse: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle inverse, splits, sizes;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &inverse));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &sizes));
      c->set_output(0, c->Matrix(c->Dim(splits, 0), c->Dim(sizes, 0)));
      c->set_output(1, inverse);
      return absl::OkStatus();
    })
    .Doc(R"doc(
The requester's layout of a frozen window routed as one keys exchange.

inverse: each looked-up id (the rounds' ids one after another) -> its key (NestpipeRouteKeys).
split_sizes: keys per owner (NestpipeRouteKeys: an owner's keys in first-seen order).
round_sizes: ids of each round.

counts: [W, rounds], the keys first read in round r owned by shard j.
window_inverse: each looked-up id's row in the window: the rounds' new keys one round after
another, a round's keys in key (owner) order.
)doc");

class WindowLayoutOp : public OpKernel {
 public:
  explicit WindowLayoutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& inv_t = ctx->input(0);
    const Tensor& splits_t = ctx->input(1);
    const Tensor& sizes_t = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(inv_t.shape()) &&
                         TensorShapeUtils::IsVector(splits_t.shape()) &&
                         TensorShapeUtils::IsVector(sizes_t.shape()),
                errors::InvalidArgument("inverse, split_sizes and round_sizes must be vectors"));
    const auto inverse = inv_t.vec<int32>();
    const auto splits = splits_t.vec<int32>();
    const auto sizes = sizes_t.vec<int32>();
    const int64_t shards = splits.size(), rounds = sizes.size(), n = inverse.size();
    int64_t keys = 0, ids = 0;
    for (int64_t j = 0; j < shards; ++j) {
      OP_REQUIRES(ctx, splits(j) >= 0, errors::InvalidArgument("negative split size"));
      keys += splits(j);
    }
    for (int64_t r = 0; r < rounds; ++r) {
      OP_REQUIRES(ctx, sizes(r) >= 0, errors::InvalidArgument("negative round size"));
      ids += sizes(r);
    }
    OP_REQUIRES(ctx, ids == n,
                errors::InvalidArgument("round_sizes sum to ", ids, " but there are ", n,
                                        " ids"));
    // The first round that reads each key (rounds are visited in order: the first write wins).
    const int32 unread = static_cast<int32>(rounds);
    std::vector<int32> round_of_key(keys, unread);
    const int32* inv = inverse.data();
    int64_t i = 0;
    for (int64_t r = 0; r < rounds; ++r) {
      for (const int64_t end = i + sizes(r); i < end; ++i) {
        const int32 key = inv[i];
        OP_REQUIRES(ctx, key >= 0 && key < keys,
                    errors::InvalidArgument("inverse[", i, "] = ", key, " outside [0, ", keys,
                                            ")"));
        if (round_of_key[key] == unread) round_of_key[key] = static_cast<int32>(r);
      }
    }
    Tensor *counts_t, *window_inverse_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({shards, rounds}), &counts_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &window_inverse_t));
    auto counts = counts_t->matrix<int32>();
    counts.setZero();
    // Each key's index among its round's keys, then its round's start: its row in the window.
    std::vector<int32> row(keys);
    std::vector<int64_t> per_round(rounds, 0);
    int64_t key = 0;
    for (int64_t j = 0; j < shards; ++j) {
      for (const int64_t end = key + splits(j); key < end; ++key) {
        const int32 r = round_of_key[key];
        OP_REQUIRES(ctx, r < unread, errors::InvalidArgument("key ", key, " is read by no id"));
        counts(j, r) += 1;
        row[key] = static_cast<int32>(per_round[r]++);
      }
    }
    std::vector<int32> start(rounds, 0);
    for (int64_t r = 1; r < rounds; ++r) start[r] = start[r - 1] + per_round[r - 1];
    for (int64_t k = 0; k < keys; ++k) row[k] += start[round_of_key[k]];
    int32* window_inverse = window_inverse_t->flat<int32>().data();
    for (int64_t id = 0; id < n; ++id) window_inverse[id] = row[inv[id]];
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeWindowLayout").Device(DEVICE_CPU), WindowLayoutOp);

REGISTER_OP("NestpipeCapacityBucket")
    .Input("capacity: int32")
    .Attr("capacities: list(int)")
    .Output("bucket: int32")
    .Output("padded: int32")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Each capacity's bucket: the index of the smallest entry of capacities (ascending) >= it, and
that entry (the padded capacity). A capacity above the largest entry is an error.
)doc");

class CapacityBucketOp : public OpKernel {
 public:
  explicit CapacityBucketOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacities", &capacities_));
    OP_REQUIRES_OK(ctx, CheckCapacities(capacities_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& capacity_t = ctx->input(0);
    Tensor* bucket_t;
    Tensor* padded_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, capacity_t.shape(), &bucket_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, capacity_t.shape(), &padded_t));
    const auto capacity = capacity_t.flat<int32>();
    auto bucket = bucket_t->flat<int32>();
    auto padded = padded_t->flat<int32>();
    for (int64_t i = 0; i < capacity.size(); ++i) {
      OP_REQUIRES_OK(ctx, BucketOfSize(capacities_, capacity(i), &bucket(i), &padded(i)));
    }
  }

 private:
  std::vector<int64_t> capacities_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeCapacityBucket").Device(DEVICE_CPU), CapacityBucketOp);

REGISTER_OP("NestpipeKeysBlock")
    .Input("keys: int64")
    .Input("splits: int32")
    .Input("header: int64")
    .Input("rider: int64")
    .Input("hint_bucket: int32")
    .Attr("capacities: list(int)")
    .Output("block: int64")
    .Output("send_counts: int32")
    .Output("bucket: int32")
    .Output("key_capacity: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle splits, rider;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &rider));
      c->set_output(0, c->Matrix(c->Dim(splits, 0), c->UnknownDim()));
      c->set_output(1, c->Vector(c->Dim(splits, 0)));
      c->set_output(2, c->Scalar());
      c->set_output(3, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
The first keys all-to-all of a route, in one op. `keys` are bucketed by owner (splits[j] for
owner j); the exchange's padded width is the bucketed capacity (`capacities`) of R + the hint's
capacity (capacities[hint_bucket]), R = rider's width (0: no rider), so `key_capacity` = that
capacity - R keys per owner travel in it. Block row j: `header` (H entries), rider[j] (R), owner
j's first min(splits[j], key_capacity) keys, then -1 up to key_capacity. `send_counts[j]` =
H + R + min(splits[j], key_capacity) (the entries that carry data); `bucket` the capacity's
index (the exchange's instance-key offset). Keys beyond key_capacity go in an overflow round.
)doc");

class KeysBlockOp : public OpKernel {
 public:
  explicit KeysBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacities", &capacities_));
    OP_REQUIRES_OK(ctx, CheckCapacities(capacities_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rider_t = ctx->input(3);
    OP_REQUIRES(ctx, rider_t.dims() == 2 && TensorShapeUtils::IsScalar(ctx->input(4).shape()),
                errors::InvalidArgument("rider must be a matrix and hint_bucket a scalar, got ",
                                        rider_t.shape().DebugString(), " and ",
                                        ctx->input(4).shape().DebugString()));
    const auto keys = ctx->input(0).flat<int64_t>();
    const auto splits = ctx->input(1).flat<int32>();
    const auto header = ctx->input(2).flat<int64_t>();
    const int32 hint_bucket = ctx->input(4).scalar<int32>()();
    const int64_t w = splits.size(), h = header.size(), r = rider_t.dim_size(1);
    OP_REQUIRES(ctx, rider_t.dim_size(0) == w || (r == 0 && rider_t.dim_size(0) == 0),
                errors::InvalidArgument("rider must be [", w, ", R], got ",
                                        rider_t.shape().DebugString()));
    OP_REQUIRES(ctx, hint_bucket >= 0 && hint_bucket < static_cast<int64_t>(capacities_.size()),
                errors::InvalidArgument("hint bucket ", hint_bucket, " is out of range [0, ",
                                        capacities_.size(), ")"));
    int64_t total = 0;
    for (int64_t j = 0; j < w; ++j) {
      OP_REQUIRES(ctx, splits(j) >= 0, errors::InvalidArgument("negative split ", splits(j)));
      total += splits(j);
    }
    OP_REQUIRES(ctx, total == keys.size(),
                errors::InvalidArgument("splits sum to ", total, " but there are ", keys.size(),
                                        " keys"));
    int32 bucket, padded;
    OP_REQUIRES_OK(ctx, BucketOfSize(capacities_, r + capacities_[hint_bucket], &bucket, &padded));
    const int64_t key_capacity = padded - r, width = h + padded;
    Tensor *block_t, *counts_t, *bucket_t, *capacity_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({w, width}), &block_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({w}), &counts_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &bucket_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &capacity_t));
    int64_t* block = block_t->flat<int64_t>().data();
    const int64_t* rider = r ? rider_t.flat<int64_t>().data() : nullptr;
    auto counts = counts_t->flat<int32>();
    int64_t start = 0;
    for (int64_t j = 0; j < w; ++j) {
      int64_t* row = block + j * width;
      std::copy(header.data(), header.data() + h, row);
      if (r) std::copy(rider + j * r, rider + (j + 1) * r, row + h);
      const int64_t sent = std::min<int64_t>(splits(j), key_capacity);
      std::copy(keys.data() + start, keys.data() + start + sent, row + h + r);
      std::fill(row + h + r + sent, row + width, -1);
      counts(j) = static_cast<int32>(h + r + sent);
      start += splits(j);
    }
    bucket_t->scalar<int32>()() = bucket;
    capacity_t->scalar<int32>()() = static_cast<int32>(key_capacity);
  }

 private:
  std::vector<int64_t> capacities_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeKeysBlock").Device(DEVICE_CPU), KeysBlockOp);

REGISTER_OP("NestpipeRouteCounts")
    .Input("received: int64")
    .Input("counts: int32")
    .Input("rider_width: int32")
    .Attr("shard_index: int >= 0")
    .Attr("rounds: int >= 1")
    .Attr("capacities: list(int)")
    .Output("largest: int32")
    .Output("sent: int32")
    .Output("round_capacities: int32")
    .Output("shares: int32")
    .Output("splits: rounds * int32")
    .Output("received_counts: rounds * int32")
    .Output("buckets: rounds * int32")
    .Output("capacity: rounds * int32")
    .Output("keys: rounds * int32")
    .Output("rider: int64")
    .Output("keys_received: int64")
    .SetShapeFn([](InferenceContext* c) {
      int rounds;
      TF_RETURN_IF_ERROR(c->GetAttr("rounds", &rounds));
      ShapeHandle received, counts, rider_width;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &received));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &counts));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &rider_width));
      auto w = c->Dim(counts, 0);
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Matrix(w, rounds));
      c->set_output(2, c->Vector(rounds));
      c->set_output(3, c->Vector(w));
      for (int r = 0; r < rounds; ++r) {
        c->set_output(4 + r, c->Vector(w));
        c->set_output(4 + rounds + r, c->Vector(w));
        c->set_output(4 + 2 * rounds + r, c->Scalar());
        c->set_output(4 + 3 * rounds + r, c->Scalar());
        c->set_output(4 + 4 * rounds + r, c->Scalar());
      }
      c->set_output(4 + 5 * rounds, c->Matrix(c->Dim(received, 0), c->UnknownDim()));
      c->set_output(5 + 5 * rounds, c->Matrix(c->Dim(received, 0), c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
What a worker learns from a route's keys all-to-all, in one op. Row i of `received` starts with
sender i's header: its counts [W owners, rounds] flattened owner-major (keys it sends owner j in
round r), then its share of the batch; `counts` [W, rounds] is this worker's own.

largest: max over requester i and owner j of the keys i sent j, all rounds (every worker gets
  the same: it decides the overflow round).
sent: [W, rounds], the keys requester i sent this worker (shard_index) in round r.
round_capacities[r] / capacity[r]: round r's rows exchange slots per requester, the bucketed
  capacity (`capacities`) of max(1, the most keys any requester sent any owner in round r);
  buckets[r] its index.
shares: each sender's share entry. splits[r]: counts[:, r]; received_counts[r]: sent[:, r];
keys[r]: the sum of splits[r] (this worker's distinct keys of round r).
rider: [W, rider_width], the columns right behind each header (row i: sender i's rider);
keys_received: [W, n - header - rider_width], the columns after them (sender i's keys).
)doc");

class RouteCountsOp : public OpKernel {
 public:
  explicit RouteCountsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shard_index", &shard_index_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rounds", &rounds_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacities", &capacities_));
    OP_REQUIRES_OK(ctx, CheckCapacities(capacities_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& received_t = ctx->input(0);
    const Tensor& counts_t = ctx->input(1);
    const Tensor& rider_width_t = ctx->input(2);
    const int64_t rounds = rounds_;
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(rider_width_t.shape()),
                errors::InvalidArgument("rider_width must be a scalar, got ",
                                        rider_width_t.shape().DebugString()));
    OP_REQUIRES(ctx, counts_t.dims() == 2 && counts_t.dim_size(1) == rounds,
                errors::InvalidArgument("counts must be [W, ", rounds, "], got ",
                                        counts_t.shape().DebugString()));
    const int64_t w = counts_t.dim_size(0);
    OP_REQUIRES(ctx, shard_index_ < w,
                errors::InvalidArgument("shard_index ", shard_index_, " of ", w, " workers"));
    const int64_t header = w * rounds + 1;
    OP_REQUIRES(ctx, received_t.dims() == 2 && received_t.dim_size(0) == w &&
                         received_t.dim_size(1) >= header,
                errors::InvalidArgument("received must be [", w, ", >= ", header,
                                        "] (each row headed by its sender's counts), got ",
                                        received_t.shape().DebugString()));
    const int64_t n = received_t.dim_size(1);
    const int64_t rider_width = rider_width_t.scalar<int32>()();
    OP_REQUIRES(ctx, rider_width >= 0 && header + rider_width <= n,
                errors::InvalidArgument("rider_width ", rider_width, " does not fit behind the ",
                                        header, "-column header in ", n, " columns"));
    const int64_t* rec = received_t.flat<int64_t>().data();
    const int32* own = counts_t.flat<int32>().data();
    Tensor *largest_t, *sent_t, *caps_t, *shares_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &largest_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({w, rounds}), &sent_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({rounds}), &caps_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({w}), &shares_t));
    int32* sent = sent_t->flat<int32>().data();
    std::vector<int64_t> round_max(rounds, 0);
    int64_t largest = 0;
    for (int64_t i = 0; i < w; ++i) {
      const int64_t* row = rec + i * n;
      for (int64_t j = 0; j < w; ++j) {
        int64_t pair = 0;
        for (int64_t r = 0; r < rounds; ++r) {
          const int64_t k = row[j * rounds + r];
          OP_REQUIRES(ctx, k >= 0 && k <= std::numeric_limits<int32>::max(),
                      errors::InvalidArgument("sender ", i, "'s header counts ", k,
                                              " keys for owner ", j, " in round ", r));
          pair += k;
          round_max[r] = std::max(round_max[r], k);
          if (j == shard_index_) sent[i * rounds + r] = static_cast<int32>(k);
        }
        largest = std::max(largest, pair);
      }
      shares_t->flat<int32>()(i) = static_cast<int32>(row[header - 1]);
    }
    largest_t->scalar<int32>()() = static_cast<int32>(
        std::min<int64_t>(largest, std::numeric_limits<int32>::max()));
    OpOutputList splits, received_counts, buckets, capacity, keys;
    OP_REQUIRES_OK(ctx, ctx->output_list("splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->output_list("received_counts", &received_counts));
    OP_REQUIRES_OK(ctx, ctx->output_list("buckets", &buckets));
    OP_REQUIRES_OK(ctx, ctx->output_list("capacity", &capacity));
    OP_REQUIRES_OK(ctx, ctx->output_list("keys", &keys));
    for (int64_t r = 0; r < rounds; ++r) {
      int32 bucket, padded;
      OP_REQUIRES_OK(ctx, BucketOfSize(capacities_, std::max<int64_t>(round_max[r], 1), &bucket,
                                       &padded));
      caps_t->flat<int32>()(r) = padded;
      Tensor *split_t, *rec_t, *bucket_t, *cap_t, *keys_t;
      OP_REQUIRES_OK(ctx, splits.allocate(r, TensorShape({w}), &split_t));
      OP_REQUIRES_OK(ctx, received_counts.allocate(r, TensorShape({w}), &rec_t));
      OP_REQUIRES_OK(ctx, buckets.allocate(r, TensorShape({}), &bucket_t));
      OP_REQUIRES_OK(ctx, capacity.allocate(r, TensorShape({}), &cap_t));
      OP_REQUIRES_OK(ctx, keys.allocate(r, TensorShape({}), &keys_t));
      int64_t total = 0;
      for (int64_t j = 0; j < w; ++j) {
        split_t->flat<int32>()(j) = own[j * rounds + r];
        rec_t->flat<int32>()(j) = sent[j * rounds + r];
        total += own[j * rounds + r];
      }
      bucket_t->scalar<int32>()() = bucket;
      cap_t->scalar<int32>()() = padded;
      keys_t->scalar<int32>()() = static_cast<int32>(total);
    }
    // The rider and the keys, each one copy of its columns (no slice ops around the op).
    const int64_t lead = header + rider_width;
    Tensor *rider_t, *keys_in_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4 + 5 * rounds, TensorShape({w, rider_width}),
                                             &rider_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5 + 5 * rounds, TensorShape({w, n - lead}),
                                             &keys_in_t));
    int64_t* rider_out = rider_t->flat<int64_t>().data();
    int64_t* keys_out = keys_in_t->flat<int64_t>().data();
    for (int64_t i = 0; i < w; ++i) {
      const int64_t* row = rec + i * n;
      std::copy(row + header, row + lead, rider_out + i * rider_width);
      std::copy(row + lead, row + n, keys_out + i * (n - lead));
    }
  }

 private:
  int64_t shard_index_;
  int64_t rounds_;
  std::vector<int64_t> capacities_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeRouteCounts").Device(DEVICE_CPU), RouteCountsOp);

REGISTER_OP("NestpipeBucketSlots")
    .Input("split_sizes: int32")
    .Input("capacity: int32")
    .Output("slots: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle splits, capacity;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &capacity));
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The slot of each bucketed key in a rows exchange: owner j's split_sizes[j] keys (bucketed
order) at slots j * capacity + 0, 1, ....
)doc");

class BucketSlotsOp : public OpKernel {
 public:
  explicit BucketSlotsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& splits_t = ctx->input(0);
    const Tensor& capacity_t = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(splits_t.shape()) &&
                         TensorShapeUtils::IsScalar(capacity_t.shape()),
                errors::InvalidArgument("split_sizes must be a vector and capacity a scalar"));
    const auto splits = splits_t.vec<int32>();
    const int64_t capacity = capacity_t.scalar<int32>()();
    int64_t total = 0;
    for (int64_t j = 0; j < splits.size(); ++j) {
      OP_REQUIRES(ctx, splits(j) >= 0 && splits(j) <= capacity,
                  errors::InvalidArgument("owner ", j, " has ", splits(j),
                                          " keys, outside [0, capacity ", capacity, "]"));
      total += splits(j);
    }
    Tensor* slots_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &slots_t));
    auto slots = slots_t->vec<int32>();
    int64_t p = 0;
    for (int64_t j = 0; j < splits.size(); ++j) {
      for (int32 k = 0; k < splits(j); ++k) slots(p++) = static_cast<int32>(j * capacity + k);
    }
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeBucketSlots").Device(DEVICE_CPU), BucketSlotsOp);

REGISTER_OP("NestpipeWindowGradIndex")
    .Input("slot_of_bucket_pos: rounds * int32")
    .Input("split_sizes: rounds * int32")
    .Input("slot_to_unique: rounds * int32")
    .Input("received: rounds * int32")
    .Input("local_rows: rounds * int64")
    .Input("table_sizes: rounds * int32")
    .Input("capacities: int32")
    .Input("capacity: int32")
    .Attr("rounds: int >= 1")
    .Output("targets: int32")
    .Output("send_counts: int32")
    .Output("receive_index: int32")
    .Output("window_rows: int64")
    .Output("window_table_sizes: int32")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The layout of a frozen window's one reverse all-to-all (the gradients of all its rounds).

Round r's exchange put owner j's split_sizes[r][j] keys at slots j * capacities[r] + k
(slot_of_bucket_pos[r] maps each bucketed key to its slot, -1 none); the reverse exchange
packs, per owner j at `capacity` slots, its rows of round 0, then of round 1, ....
As the owner, round r's distinct rows are local_rows[r], grouped by table (table_sizes[r][t]
of table t, table 0's first); a row two requesters first read in different rounds is in both.

targets: each round's bucketed keys, one round after another -> its packed slot (-1 none).
send_counts: [W], the rows sent to each owner (the rounds' splits summed).
receive_index: [W * capacity], as the owner: each packed slot of requester i -> its row of
window_rows, -1 for padding.
window_rows: the distinct rows of all rounds, grouped by table (table 0's first), first seen
in round order within a table.
window_table_sizes: [T], the rows of window_rows in each table.
)doc");

class WindowGradIndexOp : public OpKernel {
 public:
  explicit WindowGradIndexOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rounds", &rounds_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList slot_of_pos, splits, slot_to_unique, received, local_rows, table_sizes;
    OP_REQUIRES_OK(ctx, ctx->input_list("slot_of_bucket_pos", &slot_of_pos));
    OP_REQUIRES_OK(ctx, ctx->input_list("split_sizes", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("slot_to_unique", &slot_to_unique));
    OP_REQUIRES_OK(ctx, ctx->input_list("received", &received));
    OP_REQUIRES_OK(ctx, ctx->input_list("local_rows", &local_rows));
    OP_REQUIRES_OK(ctx, ctx->input_list("table_sizes", &table_sizes));
    const auto capacities = ctx->input(6 * rounds_).vec<int32>();
    const int64_t capacity = ctx->input(6 * rounds_ + 1).scalar<int32>()();
    OP_REQUIRES(ctx, capacities.size() == rounds_,
                errors::InvalidArgument("capacities needs one entry per round"));
    const int64_t shards = splits[0].NumElements();
    const int64_t tables = table_sizes[0].NumElements();
    int64_t keys = 0, round_rows = 0;
    std::vector<int64_t> sent(shards, 0), got(shards, 0);
    for (int r = 0; r < rounds_; ++r) {
      OP_REQUIRES(ctx, splits[r].NumElements() == shards && received[r].NumElements() == shards &&
                           slot_to_unique[r].NumElements() == shards * capacities(r),
                  errors::InvalidArgument("round ", r, "'s routing does not match ", shards,
                                          " shards at capacity ", capacities(r)));
      OP_REQUIRES(ctx, table_sizes[r].NumElements() == tables,
                  errors::InvalidArgument("round ", r, " has ", table_sizes[r].NumElements(),
                                          " table sizes, round 0 has ", tables));
      int64_t grouped = 0;
      for (int64_t t = 0; t < tables; ++t) {
        const int32 size = table_sizes[r].vec<int32>()(t);
        OP_REQUIRES(ctx, size >= 0, errors::InvalidArgument("round ", r, " gives table ", t,
                                                            " ", size, " rows"));
        grouped += size;
      }
      OP_REQUIRES(ctx, grouped == local_rows[r].NumElements(),
                  errors::InvalidArgument("round ", r, "'s table sizes sum to ", grouped,
                                          ", its local rows are ",
                                          local_rows[r].NumElements()));
      round_rows += grouped;
      keys += slot_of_pos[r].NumElements();
      for (int64_t j = 0; j < shards; ++j) {
        const int32 out = splits[r].vec<int32>()(j), in = received[r].vec<int32>()(j);
        OP_REQUIRES(ctx, out >= 0 && out <= capacities(r) && in >= 0 && in <= capacities(r),
                    errors::InvalidArgument("round ", r, " sends ", out, " and receives ", in,
                                            " rows for worker ", j, ", outside [0, capacity ",
                                            capacities(r), "]"));
        sent[j] += out;
        got[j] += in;
      }
    }
    for (int64_t j = 0; j < shards; ++j) {
      OP_REQUIRES(ctx, sent[j] <= capacity && got[j] <= capacity,
                  errors::InvalidArgument("the window's rows for worker ", j, " (", sent[j],
                                          " sent, ", got[j], " received) exceed capacity ",
                                          capacity));
    }
    // The window's distinct rows, table by table, each table's in round order: round r's k-th
    // local row -> its window row (`window_of[r][k]`).
    std::vector<std::vector<int32>> window_of(rounds_);
    for (int r = 0; r < rounds_; ++r) window_of[r].resize(local_rows[r].NumElements());
    std::vector<int64_t> rows;
    rows.reserve(round_rows);
    std::vector<int32> window_sizes(tables, 0);
    FlatInt64Map seen(round_rows);
    std::vector<int64_t> table_start(rounds_, 0);
    for (int64_t t = 0; t < tables; ++t) {
      const size_t before = rows.size();
      for (int r = 0; r < rounds_; ++r) {
        const auto round_local = local_rows[r].vec<int64>();
        const int32 size = table_sizes[r].vec<int32>()(t);
        for (int64_t k = table_start[r]; k < table_start[r] + size; ++k) {
          const auto placed = seen.emplace(round_local(k), static_cast<int32>(rows.size()));
          if (placed.second) rows.push_back(round_local(k));
          window_of[r][k] = placed.first;
        }
        table_start[r] += size;
      }
      window_sizes[t] = static_cast<int32>(rows.size() - before);
    }
    Tensor *targets_t, *counts_t, *receive_t, *rows_t, *sizes_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({keys}), &targets_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({shards}), &counts_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({shards * capacity}), &receive_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({static_cast<int64_t>(rows.size())}),
                                             &rows_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({tables}), &sizes_t));
    std::copy(rows.begin(), rows.end(), rows_t->vec<int64>().data());
    std::copy(window_sizes.begin(), window_sizes.end(), sizes_t->vec<int32>().data());
    auto targets = targets_t->vec<int32>();
    auto counts = counts_t->vec<int32>();
    auto receive = receive_t->vec<int32>();
    receive.setConstant(-1);
    std::vector<int64_t> earlier_sent(shards, 0), earlier_got(shards, 0);
    int64_t p = 0;
    for (int r = 0; r < rounds_; ++r) {
      const int64_t cap = capacities(r);
      const auto pos = slot_of_pos[r].vec<int32>();
      for (int64_t i = 0; i < pos.size(); ++i, ++p) {
        const int32 slot = pos(i);
        if (slot < 0) {
          targets(p) = -1;
          continue;
        }
        const int64_t owner = slot / cap;
        OP_REQUIRES(ctx, owner < shards,
                    errors::InvalidArgument("slot ", slot, " of round ", r, " outside ", shards,
                                            " x ", cap, " slots"));
        targets(p) = static_cast<int32>(owner * capacity + earlier_sent[owner] + slot % cap);
      }
      const auto to_unique = slot_to_unique[r].vec<int32>();
      const auto got_r = received[r].vec<int32>();
      const int64_t unique = static_cast<int64_t>(window_of[r].size());
      for (int64_t j = 0; j < shards; ++j) {
        for (int32 k = 0; k < got_r(j); ++k) {
          const int32 u = to_unique(j * cap + k);
          OP_REQUIRES(ctx, u < unique,
                      errors::InvalidArgument("round ", r, "'s slot ", j * cap + k,
                                              " names local row ", u, " of ", unique));
          receive(j * capacity + earlier_got[j] + k) = u < 0 ? -1 : window_of[r][u];
        }
        earlier_sent[j] += splits[r].vec<int32>()(j);
        earlier_got[j] += got_r(j);
      }
    }
    for (int64_t j = 0; j < shards; ++j) counts(j) = static_cast<int32>(sent[j]);
  }

 private:
  int rounds_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeWindowGradIndex").Device(DEVICE_CPU), WindowGradIndexOp);

}  // namespace nestpipe
}  // namespace tensorflow

// Dynamic embedding tables: a thread-safe hash map from raw int64 ids to slots
// of a fixed-capacity row variable, with admission (after N steps seen, counted
// in a bounded map), eviction when full (LRU or LFU) and a time-to-live in steps.
//
// Semantics of one training step (NestpipeDynamicTableAdmit), independent of the
// order of the ids given:
//  1. step += 1.
//  2. TTL (ttl > 0): every id whose last step + ttl < step is removed (expired).
//  3. Every present id of the input is touched: last step = step, freq += 1.
//  4. Absent ids, in ascending id order: their pending count += 1 (steps seen);
//     once it reaches admit_after the id needs a slot: the smallest free slot,
//     else the victim of the policy among ids not touched in this step (LRU:
//     smallest (last step, id); LFU: smallest (freq, last step, id)), else it
//     is refused (counted; its pending count is kept). An admitted id starts
//     with freq = its pending count and last step = step; its slot is "fresh"
//     (the caller initializes the row).
// The pending map holds at most counter_capacity ids; a new pending id beyond it
// first drops the pending id seen least recently (smallest (last step, id)).
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace nestpipe {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

namespace {

enum Stat { kSize = 0, kStep, kAdmitted, kEvicted, kExpired, kRefused, kPending,
            kPendingDropped, kNumStats };

struct Entry {
  int64_t slot;
  int64_t last_step;
  int64_t freq;
};

struct Pending {
  int64_t count;
  int64_t last_step;
};

}  // namespace

class DynamicTable : public ResourceBase {
 public:
  DynamicTable(int64_t capacity, int64_t admit_after, bool lfu, int64_t ttl,
               int64_t counter_capacity)
      : capacity_(capacity), admit_after_(admit_after), lfu_(lfu), ttl_(ttl),
        counter_capacity_(counter_capacity) {
    for (int64_t s = 0; s < capacity_; ++s) free_.insert(s);
  }

  std::string DebugString() const override {
    return strings::StrCat("NestpipeDynamicTable(capacity=", capacity_, ")");
  }

  bool SameConfig(int64_t capacity, int64_t admit_after, bool lfu, int64_t ttl,
                  int64_t counter_capacity) const {
    return capacity == capacity_ && admit_after == admit_after_ && lfu == lfu_ &&
           ttl == ttl_ && counter_capacity == counter_capacity_;
  }

  // Slots of `ids` (-1 where absent); no state changes.
  void Find(const int64_t* ids, int64_t n, int64_t* slots) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < n; ++i) {
      auto it = map_.find(ids[i]);
      slots[i] = it == map_.end() ? -1 : it->second.slot;
    }
  }

  // One training step over `ids` (see the file comment): slots (-1 where not
  // admitted) and fresh (the slot was assigned in this step).
  void Admit(const int64_t* ids, int64_t n, int64_t* slots, bool* fresh) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t step = ++step_;
    if (ttl_ > 0) {
      while (!recency_.empty() && recency_.begin()->first + ttl_ < step) {
        const int64_t id = recency_.begin()->second;
        Remove(id);
        ++stats_[kExpired];
      }
    }
    std::vector<int64_t> unique(ids, ids + n);
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    std::vector<int64_t> absent;
    for (int64_t id : unique) {
      auto it = map_.find(id);
      if (it == map_.end()) {
        absent.push_back(id);
        continue;
      }
      Unindex(id, it->second);
      it->second.last_step = step;
      it->second.freq += 1;
      Index(id, it->second);
    }
    std::unordered_map<int64_t, int64_t> fresh_slots;
    for (int64_t id : absent) {
      int64_t count = 1;
      auto p = pending_.find(id);
      if (p != pending_.end()) {
        pending_order_.erase({p->second.last_step, id});
        count = p->second.count + 1;
        pending_.erase(p);
      }
      if (count < admit_after_) {
        KeepPending(id, count, step);
        continue;
      }
      int64_t slot = -1;
      if (!free_.empty()) {
        slot = *free_.begin();
        free_.erase(free_.begin());
      } else if (Victim(step, &slot)) {
        ++stats_[kEvicted];
      } else {
        ++stats_[kRefused];
        KeepPending(id, count, step);
        continue;
      }
      Entry entry{slot, step, count};
      map_[id] = entry;
      Index(id, entry);
      fresh_slots[id] = slot;
      ++stats_[kAdmitted];
    }
    for (int64_t i = 0; i < n; ++i) {
      auto it = map_.find(ids[i]);
      slots[i] = it == map_.end() ? -1 : it->second.slot;
      fresh[i] = fresh_slots.count(ids[i]) > 0;
    }
  }

  void Stats(int64_t* out) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int k = 0; k < kNumStats; ++k) out[k] = stats_[k];
    out[kSize] = static_cast<int64_t>(map_.size());
    out[kStep] = step_;
    out[kPending] = static_cast<int64_t>(pending_.size());
  }

  // The whole state, in ascending id order.
  void Export(std::vector<int64_t>* ids, std::vector<int64_t>* entries,
              std::vector<int64_t>* pending_ids, std::vector<int64_t>* pending,
              std::vector<int64_t>* stats) {
    std::lock_guard<std::mutex> lock(mu_);
    std::map<int64_t, Entry> sorted(map_.begin(), map_.end());
    for (const auto& kv : sorted) {
      ids->push_back(kv.first);
      entries->insert(entries->end(), {kv.second.slot, kv.second.last_step, kv.second.freq});
    }
    std::map<int64_t, Pending> sorted_pending(pending_.begin(), pending_.end());
    for (const auto& kv : sorted_pending) {
      pending_ids->push_back(kv.first);
      pending->insert(pending->end(), {kv.second.count, kv.second.last_step});
    }
    stats->assign(stats_, stats_ + kNumStats);
    (*stats)[kStep] = step_;
    (*stats)[kSize] = static_cast<int64_t>(map_.size());
    (*stats)[kPending] = static_cast<int64_t>(pending_.size());
  }

  Status Import(const int64_t* ids, const int64_t* entries, int64_t n,
                const int64_t* pending_ids, const int64_t* pending, int64_t m,
                const int64_t* stats) {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
    pending_.clear();
    recency_.clear();
    frequency_.clear();
    pending_order_.clear();
    free_.clear();
    for (int64_t s = 0; s < capacity_; ++s) free_.insert(s);
    for (int64_t i = 0; i < n; ++i) {
      Entry e{entries[3 * i], entries[3 * i + 1], entries[3 * i + 2]};
      if (e.slot < 0 || e.slot >= capacity_ || free_.erase(e.slot) != 1 || map_.count(ids[i])) {
        return errors::InvalidArgument(
            "restored dynamic table state is inconsistent: id ", ids[i], " at slot ", e.slot,
            " (capacity ", capacity_, "): was it saved with another capacity_per_worker?");
      }
      map_[ids[i]] = e;
      Index(ids[i], e);
    }
    for (int64_t i = 0; i < m; ++i) {
      pending_[pending_ids[i]] = Pending{pending[2 * i], pending[2 * i + 1]};
      pending_order_.insert({pending[2 * i + 1], pending_ids[i]});
    }
    for (int k = 0; k < kNumStats; ++k) stats_[k] = stats[k];
    step_ = stats[kStep];
    return absl::OkStatus();
  }

 private:
  void Index(int64_t id, const Entry& e) {
    recency_.insert({e.last_step, id});
    if (lfu_) frequency_.insert(std::make_tuple(e.freq, e.last_step, id));
  }

  void Unindex(int64_t id, const Entry& e) {
    recency_.erase({e.last_step, id});
    if (lfu_) frequency_.erase(std::make_tuple(e.freq, e.last_step, id));
  }

  void Remove(int64_t id) {
    auto it = map_.find(id);
    Unindex(id, it->second);
    free_.insert(it->second.slot);
    map_.erase(it);
  }

  // Takes the policy's victim among ids last touched before `step`.
  bool Victim(int64_t step, int64_t* slot) {
    int64_t id;
    if (lfu_) {
      auto it = std::find_if(frequency_.begin(), frequency_.end(),
                             [step](const std::tuple<int64_t, int64_t, int64_t>& t) {
                               return std::get<1>(t) < step;
                             });
      if (it == frequency_.end()) return false;
      id = std::get<2>(*it);
    } else {
      if (recency_.empty() || recency_.begin()->first >= step) return false;
      id = recency_.begin()->second;
    }
    auto e = map_.find(id);
    *slot = e->second.slot;
    Unindex(id, e->second);
    map_.erase(e);
    return true;
  }

  void KeepPending(int64_t id, int64_t count, int64_t step) {
    if (static_cast<int64_t>(pending_.size()) >= counter_capacity_ && !pending_order_.empty()) {
      const int64_t oldest = pending_order_.begin()->second;
      pending_order_.erase(pending_order_.begin());
      pending_.erase(oldest);
      ++stats_[kPendingDropped];
    }
    pending_[id] = Pending{count, step};
    pending_order_.insert({step, id});
  }

  const int64_t capacity_, admit_after_;
  const bool lfu_;
  const int64_t ttl_, counter_capacity_;
  std::mutex mu_;
  int64_t step_ = 0;
  int64_t stats_[kNumStats] = {0};
  std::unordered_map<int64_t, Entry> map_;
  std::set<int64_t> free_;
  std::set<std::pair<int64_t, int64_t>> recency_;                 // (last step, id)
  std::set<std::tuple<int64_t, int64_t, int64_t>> frequency_;     // (freq, last step, id)
  std::unordered_map<int64_t, Pending> pending_;
  std::set<std::pair<int64_t, int64_t>> pending_order_;           // (last step, id)
};

REGISTER_OP("NestpipeDynamicTableHandle")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("A handle to a dynamic table resource (created by NestpipeDynamicTableCreate).");

REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicTableHandle").Device(DEVICE_CPU),
                        ResourceHandleOp<DynamicTable>);

REGISTER_OP("NestpipeDynamicTableCreate")
    .Input("table: resource")
    .Attr("capacity: int >= 1")
    .Attr("admit_after: int >= 1")
    .Attr("policy: {'lru', 'lfu'}")
    .Attr("ttl: int >= 0")
    .Attr("counter_capacity: int >= 1")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Creates the table behind `table` (again with the same config: a no-op).");

class DynamicTableCreateOp : public OpKernel {
 public:
  explicit DynamicTableCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacity", &capacity_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("admit_after", &admit_after_));
    std::string policy;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("policy", &policy));
    lfu_ = policy == "lfu";
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ttl", &ttl_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("counter_capacity", &counter_capacity_));
  }

  void Compute(OpKernelContext* ctx) override {
    DynamicTable* table = nullptr;
    OP_REQUIRES_OK(ctx, LookupOrCreateResource<DynamicTable>(
                            ctx, HandleFromInput(ctx, 0), &table, [this](DynamicTable** t) {
                              *t = new DynamicTable(capacity_, admit_after_, lfu_, ttl_,
                                                    counter_capacity_);
                              return absl::OkStatus();
                            }));
    core::ScopedUnref unref(table);
    OP_REQUIRES(ctx, table->SameConfig(capacity_, admit_after_, lfu_, ttl_, counter_capacity_),
                errors::AlreadyExists("a dynamic table of another configuration already "
                                      "exists under this name: give the layer another name"));
  }

 private:
  int64_t capacity_, admit_after_, ttl_, counter_capacity_;
  bool lfu_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicTableCreate").Device(DEVICE_CPU),
                        DynamicTableCreateOp);

static Status LookupTable(OpKernelContext* ctx, DynamicTable** table) {
  Status s = LookupResource(ctx, HandleFromInput(ctx, 0), table);
  if (!s.ok()) {
    return errors::FailedPrecondition("dynamic table not created (run its create op first): ",
                                      s.message());
  }
  return s;
}

REGISTER_OP("NestpipeDynamicTableFind")
    .Input("table: resource")
    .Input("ids: int64")
    .Output("slots: int64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      c->set_output(0, ids);
      return absl::OkStatus();
    })
    .Doc("slots[i]: the slot of ids[i], -1 if absent. Changes nothing.");

class DynamicTableFindOp : public OpKernel {
 public:
  explicit DynamicTableFindOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    DynamicTable* table;
    OP_REQUIRES_OK(ctx, LookupTable(ctx, &table));
    core::ScopedUnref unref(table);
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids.shape()),
                errors::InvalidArgument("ids must be a vector"));
    Tensor* slots;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &slots));
    table->Find(ids.flat<int64_t>().data(), ids.NumElements(), slots->flat<int64_t>().data());
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicTableFind").Device(DEVICE_CPU), DynamicTableFindOp);

REGISTER_OP("NestpipeDynamicTableAdmit")
    .Input("table: resource")
    .Input("ids: int64")
    .Output("slots: int64")
    .Output("fresh: bool")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      c->set_output(0, ids);
      c->set_output(1, ids);
      return absl::OkStatus();
    })
    .Doc("One training step of the table over `ids` (see dynamic_table_ops.cc).");

class DynamicTableAdmitOp : public OpKernel {
 public:
  explicit DynamicTableAdmitOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    DynamicTable* table;
    OP_REQUIRES_OK(ctx, LookupTable(ctx, &table));
    core::ScopedUnref unref(table);
    const Tensor& ids = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids.shape()),
                errors::InvalidArgument("ids must be a vector"));
    Tensor *slots, *fresh;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &slots));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, ids.shape(), &fresh));
    table->Admit(ids.flat<int64_t>().data(), ids.NumElements(), slots->flat<int64_t>().data(),
                 fresh->flat<bool>().data());
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicTableAdmit").Device(DEVICE_CPU),
                        DynamicTableAdmitOp);

REGISTER_OP("NestpipeDynamicTableStats")
    .Input("table: resource")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc("[size, step, admitted, evicted, expired, refused, pending, pending_dropped].");

class DynamicTableStatsOp : public OpKernel {
 public:
  explicit DynamicTableStatsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    DynamicTable* table;
    OP_REQUIRES_OK(ctx, LookupTable(ctx, &table));
    core::ScopedUnref unref(table);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({kNumStats}), &out));
    table->Stats(out->flat<int64_t>().data());
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicTableStats").Device(DEVICE_CPU),
                        DynamicTableStatsOp);

REGISTER_OP("NestpipeDynamicTableExport")
    .Input("table: resource")
    .Output("ids: int64")
    .Output("entries: int64")
    .Output("pending_ids: int64")
    .Output("pending: int64")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->UnknownDim(), 3));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Matrix(c->UnknownDim(), 2));
      c->set_output(4, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc("The table's state: ids ascending with [slot, last_step, freq], the pending ids "
         "with [count, last_step], and the stats.");

static void OutputVector(OpKernelContext* ctx, int index, const std::vector<int64_t>& v,
                         int64_t width) {
  Tensor* out;
  TensorShape shape = width == 0 ? TensorShape({static_cast<int64_t>(v.size())})
                                 : TensorShape({static_cast<int64_t>(v.size()) / width, width});
  OP_REQUIRES_OK(ctx, ctx->allocate_output(index, shape, &out));
  std::copy(v.begin(), v.end(), out->flat<int64_t>().data());
}

class DynamicTableExportOp : public OpKernel {
 public:
  explicit DynamicTableExportOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    DynamicTable* table;
    OP_REQUIRES_OK(ctx, LookupTable(ctx, &table));
    core::ScopedUnref unref(table);
    std::vector<int64_t> ids, entries, pending_ids, pending, stats;
    table->Export(&ids, &entries, &pending_ids, &pending, &stats);
    OutputVector(ctx, 0, ids, 0);
    OutputVector(ctx, 1, entries, 3);
    OutputVector(ctx, 2, pending_ids, 0);
    OutputVector(ctx, 3, pending, 2);
    OutputVector(ctx, 4, stats, 0);
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicTableExport").Device(DEVICE_CPU),
                        DynamicTableExportOp);

REGISTER_OP("NestpipeDynamicTableImport")
    .Input("table: resource")
    .Input("ids: int64")
    .Input("entries: int64")
    .Input("pending_ids: int64")
    .Input("pending: int64")
    .Input("stats: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Replaces the table's state with one NestpipeDynamicTableExport returned.");

class DynamicTableImportOp : public OpKernel {
 public:
  explicit DynamicTableImportOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    DynamicTable* table;
    OP_REQUIRES_OK(ctx, LookupTable(ctx, &table));
    core::ScopedUnref unref(table);
    const Tensor &ids = ctx->input(1), &entries = ctx->input(2), &pending_ids = ctx->input(3),
                 &pending = ctx->input(4), &stats = ctx->input(5);
    const int64_t n = ids.NumElements(), m = pending_ids.NumElements();
    OP_REQUIRES(ctx, entries.NumElements() == 3 * n && pending.NumElements() == 2 * m &&
                         stats.NumElements() == kNumStats,
                errors::InvalidArgument("dynamic table state of inconsistent sizes"));
    OP_REQUIRES_OK(ctx, table->Import(ids.flat<int64_t>().data(), entries.flat<int64_t>().data(),
                                      n, pending_ids.flat<int64_t>().data(),
                                      pending.flat<int64_t>().data(), m,
                                      stats.flat<int64_t>().data()));
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicTableImport").Device(DEVICE_CPU),
                        DynamicTableImportOp);

// Owner of an id: the splitmix64 finalizer of the id's bits, mod num_shards.
static inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

REGISTER_OP("NestpipeDynamicOwner")
    .Input("ids: int64")
    .Output("owners: int32")
    .Attr("num_shards: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc("owners[i] = splitmix64_finalizer(uint64(ids[i])) mod num_shards.");

class DynamicOwnerOp : public OpKernel {
 public:
  explicit DynamicOwnerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shards", &num_shards_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &out));
    const auto in = ids.flat<int64_t>();
    auto o = out->flat<int32_t>();
    for (int64_t i = 0; i < in.size(); ++i) {
      o(i) = static_cast<int32_t>(Mix64(static_cast<uint64_t>(in(i))) %
                                  static_cast<uint64_t>(num_shards_));
    }
  }

 private:
  int num_shards_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeDynamicOwner").Device(DEVICE_CPU), DynamicOwnerOp);

}  // namespace nestpipe
}  // namespace tensorflow

// An open-addressing hash map from int64 keys to int32 values, for the per-step dedup and
// membership tests of the routing and pipeline ops. It is sized once for the number of keys an
// op will insert (at most half full), probes linearly and never erases, so an insert or a lookup
// touches one or two adjacent cache lines, where std::unordered_map allocates a node per key.
#ifndef TF_NESTPIPE_OPS_FLAT_HASH_H_
#define TF_NESTPIPE_OPS_FLAT_HASH_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace tensorflow {
namespace nestpipe {

class FlatInt64Map {
 public:
  // Room for `expected_keys` distinct keys (more still work, at more probes per key: the table
  // never grows, so callers pass an upper bound).
  explicit FlatInt64Map(int64_t expected_keys) {
    uint64_t size = 16;
    while (size < static_cast<uint64_t>(expected_keys) * 2) size <<= 1;
    mask_ = size - 1;
    slots_.assign(size, Slot{0, kEmpty});
  }

  // The value stored for `key`, inserting `value` first if `key` is absent; `.second` is true
  // when it inserted. Fails (returns {-1, false}) only if every slot is taken.
  std::pair<int32_t, bool> emplace(int64_t key, int32_t value) {
    uint64_t i = Mix(key) & mask_;
    for (uint64_t probes = 0; probes <= mask_; ++probes, i = (i + 1) & mask_) {
      Slot& slot = slots_[i];
      if (slot.value == kEmpty) {
        slot.key = key;
        slot.value = value;
        return {value, true};
      }
      if (slot.key == key) return {slot.value, false};
    }
    return {-1, false};
  }

  // Whether `key` was inserted.
  bool contains(int64_t key) const {
    uint64_t i = Mix(key) & mask_;
    for (uint64_t probes = 0; probes <= mask_; ++probes, i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.value == kEmpty) return false;
      if (slot.key == key) return true;
    }
    return false;
  }

 private:
  // Values are indices (>= 0); this marks a free slot.
  static constexpr int32_t kEmpty = -1;

  struct Slot {
    int64_t key;
    int32_t value;
  };

  // splitmix64's finalizer: consecutive ids (rows of one table) spread over the whole table.
  static uint64_t Mix(int64_t key) {
    uint64_t x = static_cast<uint64_t>(key);
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
  }

  uint64_t mask_;
  std::vector<Slot> slots_;
};

}  // namespace nestpipe
}  // namespace tensorflow

#endif  // TF_NESTPIPE_OPS_FLAT_HASH_H_

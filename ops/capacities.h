// The padded-capacity rule of an exchange whose size changes from step to step: each size is
// padded to the smallest entry of a strictly increasing list of capacities (an attr of the ops
// that bucket a size; tf_nestpipe.collectives.communication holds the list), and the entry's
// index is the exchange's bucket (its instance-key offset). Written once for every such op.
#ifndef TF_NESTPIPE_OPS_CAPACITIES_H_
#define TF_NESTPIPE_OPS_CAPACITIES_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace nestpipe {

// Checks a capacities attr: non-empty and strictly increasing.
inline absl::Status CheckCapacities(const std::vector<int64_t>& capacities) {
  if (capacities.empty()) return errors::InvalidArgument("capacities is empty");
  for (size_t i = 1; i < capacities.size(); ++i) {
    if (capacities[i] <= capacities[i - 1]) {
      return errors::InvalidArgument("capacities must be strictly increasing");
    }
  }
  return absl::OkStatus();
}

// `size`'s bucket and padded capacity: the index of the smallest entry >= size, and that entry.
// A size above the largest entry is an error naming the fix.
inline absl::Status BucketOfSize(const std::vector<int64_t>& capacities, int64_t size,
                                 int32* bucket, int32* padded) {
  const auto it = std::lower_bound(capacities.begin(), capacities.end(), size);
  if (it == capacities.end()) {
    return errors::InvalidArgument("a padded exchange of ", size,
                                   " entries per worker exceeds the largest capacity ",
                                   capacities.back(),
                                   ": split the batch (smaller global batch or more workers)");
  }
  *bucket = static_cast<int32>(it - capacities.begin());
  *padded = static_cast<int32>(*it);
  return absl::OkStatus();
}

}  // namespace nestpipe
}  // namespace tensorflow

#endif  // TF_NESTPIPE_OPS_CAPACITIES_H_

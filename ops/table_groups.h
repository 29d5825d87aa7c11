// The tables of one dim and dtype share one local row space: table t holds local rows from
// offsets[t] (ascending; a table reserving no rows here shares its start with the next one), so a
// row belongs to the last table starting at or before it. This is that rule, and the stable
// grouping of rows by it, for every op that reads or orders such rows.
#ifndef TF_NESTPIPE_OPS_TABLE_GROUPS_H_
#define TF_NESTPIPE_OPS_TABLE_GROUPS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace nestpipe {

// Rows grouped by table, each table's in their given order.
struct TableGroups {
  std::vector<int64_t> start;  // [T + 1]: table t's rows take places [start[t], start[t + 1])
  std::vector<int64_t> place;  // each row's place once grouped
};

// Groups `n` rows (`rows[i]`, any order) by the tables starting at `offsets[0..tables)`; a row
// below the first table's start is an error naming it and its position.
template <typename Rows, typename Offsets>
absl::Status GroupRowsByTable(const Rows& rows, int64_t n, const Offsets& offsets, int64_t tables,
                              TableGroups* groups) {
  std::vector<int32> table(n);  // each row's table
  groups->start.assign(tables + 1, 0);
  groups->place.resize(n);
  const int64_t* first = &offsets(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows(i);
    if (row < first[0]) {
      return errors::InvalidArgument("local row ", row, " at position ", i,
                                     " is below the first table's start ", first[0]);
    }
    table[i] = static_cast<int32>(std::upper_bound(first, first + tables, row) - first) - 1;
    ++groups->start[table[i] + 1];
  }
  for (int64_t t = 0; t < tables; ++t) groups->start[t + 1] += groups->start[t];
  std::vector<int64_t> next(groups->start.begin(), groups->start.end() - 1);
  for (int64_t i = 0; i < n; ++i) groups->place[i] = next[table[i]]++;
  return absl::OkStatus();
}

}  // namespace nestpipe
}  // namespace tensorflow

#endif  // TF_NESTPIPE_OPS_TABLE_GROUPS_H_

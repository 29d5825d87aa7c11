// Reading or updating rows scattered over a table far larger than the caches: every row's first
// touch is a miss waited for. The ops that walk such rows ask the memory system for the row
// kPrefetchAhead places ahead of the one they work on, so several misses are in flight at once.
#ifndef TF_NESTPIPE_OPS_ROW_PREFETCH_H_
#define TF_NESTPIPE_OPS_ROW_PREFETCH_H_

#include <cstdint>

namespace tensorflow {
namespace nestpipe {

// How many rows ahead a walk over a table's rows asks for (NestpipeReadTableRows,
// NestpipeScatterRows).
constexpr int64_t kPrefetchAhead = 16;

// Asks for every cache line of a row of `bytes` bytes at `row`.
inline void PrefetchRow(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

}  // namespace nestpipe
}  // namespace tensorflow

#endif  // TF_NESTPIPE_OPS_ROW_PREFETCH_H_

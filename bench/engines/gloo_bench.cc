// Gloo CPU collectives micro-benchmark: alltoallv and allreduce (sum, float32) over Gloo's TCP
// transport, rendezvous through a FileStore directory shared by the ranks (no mpirun).
//
//   gloo_bench RANK SIZE STORE_DIR PREFIX CASE...     CASE = OP:BYTES:ITERS:WARMUP
//                                                      OP   = alltoall | allreduce
//
// Every case starts after a barrier; each rank times each call (wall clock, steady_clock) and
// rank 0 prints one JSON line per case: {"op", "bytes", "seconds": [...]} on stdout.
// Built by bench/transport_engines.py against Debian's libgloo-dev headers (-lgloo).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

namespace {

using Clock = std::chrono::steady_clock;

struct Case {
  std::string op;
  long bytes;
  int iters;
  int warmup;
};

Case ParseCase(const char* text) {
  Case c;
  char op[32];
  if (std::sscanf(text, "%31[a-z]:%ld:%d:%d", op, &c.bytes, &c.iters, &c.warmup) != 4) {
    std::fprintf(stderr, "bad case %s (want OP:BYTES:ITERS:WARMUP)\n", text);
    std::exit(2);
  }
  c.op = op;
  return c;
}

// One alltoallv of `bytes` float32 bytes per rank in total, split equally over the ranks.
void AllToAll(const std::shared_ptr<gloo::Context>& ctx, std::vector<float>& in,
              std::vector<float>& out, int tag) {
  const int64_t per_peer = static_cast<int64_t>(in.size()) / ctx->size;
  std::vector<int64_t> counts(ctx->size, per_peer);
  gloo::AlltoallvOptions opts(ctx);
  opts.setInput(in.data(), counts);
  opts.setOutput(out.data(), counts);
  opts.setTag(tag);
  gloo::alltoallv(opts);
}

void AllReduce(const std::shared_ptr<gloo::Context>& ctx, std::vector<float>& in,
               std::vector<float>& out, int tag) {
  gloo::AllreduceOptions opts(ctx);
  opts.setInput(in.data(), in.size());
  opts.setOutput(out.data(), out.size());
  opts.setReduceFunction(
      static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
  opts.setTag(tag);
  gloo::allreduce(opts);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s RANK SIZE STORE_DIR PREFIX OP:BYTES:ITERS:WARMUP...\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int size = std::atoi(argv[2]);
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore file_store(argv[3]);
  gloo::rendezvous::PrefixStore store(argv[4], file_store);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(std::chrono::seconds(120));
  context->connectFullMesh(store, device);
  std::shared_ptr<gloo::Context> ctx = context;

  int tag = 0;
  for (int i = 5; i < argc; ++i) {
    const Case c = ParseCase(argv[i]);
    const size_t elements = (c.bytes / 4 / size) * size;
    std::vector<float> in(elements, static_cast<float>(rank + 1)), out(elements, 0.f);
    std::vector<double> seconds;
    gloo::BarrierOptions barrier(ctx);
    barrier.setTag(++tag);
    gloo::barrier(barrier);
    for (int k = 0; k < c.warmup + c.iters; ++k) {
      const auto start = Clock::now();
      if (c.op == "alltoall") {
        AllToAll(ctx, in, out, ++tag);
      } else if (c.op == "allreduce") {
        AllReduce(ctx, in, out, ++tag);
      } else {
        std::fprintf(stderr, "unknown op %s\n", c.op.c_str());
        return 2;
      }
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (k >= c.warmup) seconds.push_back(elapsed);
    }
    // Check the result so a broken exchange cannot pass as a fast one.
    const float expect_reduce = size * (size + 1) / 2.0f;
    for (int r = 0; r < size; ++r) {
      const float got = out[r * (elements / size)];
      const float want = c.op == "alltoall" ? static_cast<float>(r + 1) : expect_reduce;
      if (got != want) {
        std::fprintf(stderr, "rank %d: %s result %g != %g\n", rank, c.op.c_str(), got, want);
        return 3;
      }
    }
    if (rank == 0) {
      std::printf("{\"op\": \"%s\", \"bytes\": %ld, \"seconds\": [", c.op.c_str(), c.bytes);
      for (size_t k = 0; k < seconds.size(); ++k) std::printf(k ? ", %.9f" : "%.9f", seconds[k]);
      std::printf("]}\n");
      std::fflush(stdout);
    }
  }
  return 0;
}

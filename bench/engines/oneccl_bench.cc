// Intel oneCCL CPU collectives micro-benchmark: alltoallv and allreduce (sum, float32) through
// oneCCL's C++ API (the CPU wheel `oneccl-cpu-devel` has no C API symbols), transport OFI
// (libfabric's tcp provider). Rendezvous: rank 0 creates the main KVS and writes its address
// to STORE_DIR/kvs; the other ranks read it (no mpirun).
//
//   oneccl_bench RANK SIZE STORE_DIR CASE...     CASE = OP:BYTES:ITERS:WARMUP
//                                                 OP   = alltoall | allreduce
//
// Every case starts after a barrier; each rank times each call and rank 0 prints one JSON line
// per case: {"op", "bytes", "seconds": [...]} on stdout. Built and run by
// bench/transport_engines.py (static libccl.a plus oneccl_shim.c; see there).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <oneapi/ccl.hpp>

namespace {

using Clock = std::chrono::steady_clock;

ccl::shared_ptr_class<ccl::kvs> Rendezvous(int rank, const std::string& dir) {
  const std::string path = dir + "/kvs";
  ccl::kvs::address_type address;
  if (rank == 0) {
    auto kvs = ccl::create_main_kvs();
    address = kvs->get_address();
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(reinterpret_cast<const char*>(address.data()),
                                                address.size());
    std::rename(tmp.c_str(), path.c_str());
    return kvs;
  }
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in.good()) {
      in.read(reinterpret_cast<char*>(address.data()), address.size());
      return ccl::create_kvs(address);
    }
    if (Clock::now() > deadline) {
      std::fprintf(stderr, "rank %d: no KVS address in %s after 120 s\n", rank, path.c_str());
      std::exit(4);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s RANK SIZE STORE_DIR OP:BYTES:ITERS:WARMUP...\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int size = std::atoi(argv[2]);
  ccl::init();
  auto kvs = Rendezvous(rank, argv[3]);
  auto comm = ccl::create_communicator(size, rank, kvs);

  for (int i = 4; i < argc; ++i) {
    char op_text[32];
    long bytes;
    int iters, warmup;
    if (std::sscanf(argv[i], "%31[a-z]:%ld:%d:%d", op_text, &bytes, &iters, &warmup) != 4) {
      std::fprintf(stderr, "bad case %s\n", argv[i]);
      return 2;
    }
    const std::string op = op_text;
    if (op != "alltoall" && op != "allreduce") {
      std::fprintf(stderr, "unknown op %s\n", op_text);
      return 2;
    }
    const size_t per_peer = bytes / 4 / size, elements = per_peer * size;
    std::vector<float> in(elements, static_cast<float>(rank + 1)), out(elements, 0.f);
    const std::vector<size_t> counts(size, per_peer);
    std::vector<double> seconds;
    ccl::barrier(comm).wait();
    for (int k = 0; k < warmup + iters; ++k) {
      const auto start = Clock::now();
      if (op == "alltoall") {
        ccl::alltoallv(in.data(), counts, out.data(), counts, comm).wait();
      } else {
        ccl::allreduce(in.data(), out.data(), elements, ccl::reduction::sum, comm).wait();
      }
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (k >= warmup) seconds.push_back(elapsed);
    }
    // Check the result so a broken exchange cannot pass as a fast one.
    for (int r = 0; r < size; ++r) {
      const float got = out[r * per_peer];
      const float want = op == "alltoall" ? r + 1.0f : size * (size + 1) / 2.0f;
      if (got != want) {
        std::fprintf(stderr, "rank %d: %s result %g != %g\n", rank, op_text, got, want);
        return 3;
      }
    }
    if (rank == 0) {
      std::printf("{\"op\": \"%s\", \"bytes\": %ld, \"seconds\": [", op_text, bytes);
      for (size_t k = 0; k < seconds.size(); ++k) std::printf(k ? ", %.9f" : "%.9f", seconds[k]);
      std::printf("]}\n");
      std::fflush(stdout);
    }
  }
  return 0;
}

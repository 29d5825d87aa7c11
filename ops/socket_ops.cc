// A direct TCP mesh between the workers for the embedding exchange's all-to-alls (DESIGN.md
// section 10): TensorFlow's CPU collectives cost ~1-3 ms each whatever their size (a gRPC round
// trip through the collective executor), a message on an open socket a few tens of microseconds.
//
// - NestpipeSocketListen(host) -> port: binds a listening socket on this worker's address (port 0:
//   the kernel picks a free one) and starts accepting peers. Called once per process.
// - NestpipeSocketConnect(index, hosts, ports, nonce, timeout_seconds, stall_seconds): dials every
//   lower-index worker, waits for every higher-index one, each side checking a hello (magic, the
//   cluster's nonce, sender index, worker count), then starts one receiver thread per peer and a
//   heartbeat thread. Fails within `timeout_seconds`, naming the workers it could not reach.
// - NestpipeSocketAllToAll(input [W, n, ...], send_counts [W], fill, key) -> (output, recv_counts):
//   sends the first send_counts[j] entries of input[j] to worker j (queued for that peer's sender
//   thread: the op never blocks on the network), returns [W, n, ...] whose row i
//   holds the entries worker i sent (recv_counts[i] of them, then `fill`). Messages are matched by
//   (key, sequence number of this key's calls in this process): every worker issues a key's calls
//   in the same order (the Python layer chains each stream's exchanges), so the i-th call of a
//   key pairs with the i-th call of the same key on every peer, and a call never takes another
//   call's data: a mismatch waits and then fails, it never mixes.
//
// Faults: a peer whose socket closes (its process died) fails every pending and later exchange at
// once (Unavailable, naming the worker and its address). A peer that is alive but sends nothing,
// not even the heartbeat every 0.5 s, for `stall_seconds` while an exchange waits on it (stopped,
// or its machine gone) fails that exchange (DeadlineExceeded). After a failure the mesh stays
// failed: a half-done exchange cannot be repaired, the process must restart, as with TensorFlow's
// collectives.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace nestpipe {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x4E50534Bu;  // "NPSK"
constexpr uint32_t kData = 1;
constexpr uint32_t kHeartbeat = 2;
constexpr double kHeartbeatSeconds = 0.5;

struct Hello {
  uint32_t magic;
  uint32_t index;
  uint32_t num_workers;
  uint32_t reserved;
  uint64_t nonce;
};

struct MessageHeader {
  uint32_t magic;
  uint32_t type;
  int64_t key;
  int64_t seq;
  int64_t count;   // entries
  int64_t nbytes;  // payload bytes
};

bool WriteAll(int fd, const struct iovec* iov_in, int iovcnt) {
  std::vector<struct iovec> iov(iov_in, iov_in + iovcnt);
  size_t first = 0;
  while (first < iov.size()) {
    struct msghdr message = {};
    message.msg_iov = &iov[first];
    message.msg_iovlen = iov.size() - first;
    // MSG_NOSIGNAL: a peer that died gives EPIPE here, not a SIGPIPE that kills this process.
    ssize_t sent = ::sendmsg(fd, &message, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t left = static_cast<size_t>(sent);
    while (first < iov.size() && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t size) {
  char* out = static_cast<char*>(data);
  while (size > 0) {
    ssize_t got = ::recv(fd, out, size, 0);
    if (got == 0) return false;
    if (got < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    out += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

// Reads exactly `size` bytes before `deadline` (used for the hello only).
bool ReadAllBefore(int fd, void* data, size_t size, Clock::time_point deadline) {
  char* out = static_cast<char*>(data);
  while (size > 0) {
    int wait_ms = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (wait_ms <= 0) return false;
    struct pollfd p = {fd, POLLIN, 0};
    int ready = ::poll(&p, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    ssize_t got = ::recv(fd, out, size, 0);
    if (got <= 0) return false;
    out += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

void TuneSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int buffer = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
}

// One pending all-to-all: where its received rows go and what is still missing.
struct Exchange {
  char* output = nullptr;        // [W, capacity, entry_bytes]
  int32_t* recv_counts = nullptr;
  int64_t capacity = 0;
  int64_t entry_bytes = 0;
  std::vector<char> fill;        // one entry of `fill`
  std::vector<bool> received;
  int missing = 0;         // peers whose row has not arrived
  bool self_done = false;  // this worker's own row written and its messages queued
  Status status;
  std::function<void(Status)> done;
};

// A message waiting in a peer's send queue; `keep` holds its payload's memory (the op's input
// tensor) alive until it is written.
struct Outgoing {
  MessageHeader header;
  const char* data;
  size_t size;
  std::shared_ptr<const void> keep;
};

class Peer {
 public:
  Peer(int index, int fd, std::string address)
      : index_(index), fd_(fd), address_(std::move(address)), last_heard_(Clock::now()) {}
  ~Peer() { ::close(fd_); }

  int index() const { return index_; }
  int fd() const { return fd_; }
  const std::string& address() const { return address_; }

  // Starts the thread that writes the queued messages in order; `on_failure(errno)` is called
  // once if a write fails (the peer's process died, or the mesh was shut down).
  void StartSender(std::function<void(int)> on_failure) {
    std::thread([this, on_failure] {
      while (true) {
        Outgoing message;
        {
          std::unique_lock<std::mutex> lock(queue_mu_);
          queue_cv_.wait(lock, [this] { return !queue_.empty(); });
          message = std::move(queue_.front());
          queue_.pop_front();
        }
        struct iovec iov[2] = {{&message.header, sizeof(message.header)},
                               {const_cast<char*>(message.data), message.size}};
        if (!WriteAll(fd_, iov, message.size > 0 ? 2 : 1)) {
          on_failure(errno);
          return;
        }
      }
    }).detach();
  }

  // Queues a message for the sender thread and returns at once: the op that posts it never
  // blocks its (TensorFlow inter-op) thread on the network, so ops keep running while a large
  // message drains through a slow link. Messages to a peer are written in posting order.
  void Post(const MessageHeader& header, const char* data, size_t size,
            std::shared_ptr<const void> keep) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queue_.push_back(Outgoing{header, data, size, std::move(keep)});
    }
    queue_cv_.notify_one();
  }

  void Heard() { last_heard_.store(Clock::now()); }
  double SilentSeconds() const {
    return std::chrono::duration<double>(Clock::now() - last_heard_.load()).count();
  }
  void Shutdown() { ::shutdown(fd_, SHUT_RDWR); }

 private:
  int index_;
  int fd_;
  std::string address_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Outgoing> queue_;
  std::atomic<Clock::time_point> last_heard_;
};

// The process's mesh (one per process: a worker belongs to one cluster).
class Mesh {
 public:
  static Mesh* Get() {
    static Mesh* mesh = new Mesh();  // never destroyed: threads may outlive static destruction
    return mesh;
  }

  Status Listen(const std::string& host, int* port) {
    std::lock_guard<std::mutex> lock(setup_mu_);
    if (listen_fd_ >= 0) {
      *port = listen_port_;
      return absl::OkStatus();
    }
    struct addrinfo hints = {}, *found = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int rc = ::getaddrinfo(host.c_str(), "0", &hints, &found);
    if (rc != 0 || found == nullptr) {
      return errors::InvalidArgument("nestpipe sockets: cannot resolve this worker's host '",
                                     host, "': ", gai_strerror(rc));
    }
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, found->ai_addr, found->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
      int err = errno;
      ::freeaddrinfo(found);
      ::close(fd);
      return errors::Unavailable("nestpipe sockets: cannot listen on ", host, ": ",
                                 strerror(err));
    }
    ::freeaddrinfo(found);
    struct sockaddr_in bound = {};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<struct sockaddr*>(&bound), &len);
    listen_fd_ = fd;
    listen_port_ = ntohs(bound.sin_port);
    *port = listen_port_;
    return absl::OkStatus();
  }

  Status Connect(int index, const std::vector<std::string>& hosts, const std::vector<int>& ports,
                 uint64_t nonce, double timeout_seconds, double stall_seconds) {
    std::lock_guard<std::mutex> lock(setup_mu_);
    const int num_workers = static_cast<int>(hosts.size());
    if (connected_) {
      // A second strategy in the process: TensorFlow's server (so the cluster) cannot change in
      // a process, so the mesh is reused (every worker creates its strategies in the same order,
      // so the per-key call counts stay paired).
      if (num_workers == num_workers_ && index == index_) return absl::OkStatus();
      return errors::FailedPrecondition(
          "nestpipe sockets: this process is already connected to a cluster of ", num_workers_,
          " workers as worker ", index_, "; a process belongs to one cluster");
    }
    if (listen_fd_ < 0) {
      return errors::FailedPrecondition("nestpipe sockets: Listen must come before Connect");
    }
    if (index < 0 || index >= num_workers || ports.size() != hosts.size()) {
      return errors::InvalidArgument("nestpipe sockets: bad worker index ", index, " of ",
                                     num_workers);
    }
    auto deadline = Clock::now() + std::chrono::milliseconds(
                                       static_cast<int64_t>(timeout_seconds * 1000.0));
    std::vector<std::unique_ptr<Peer>> peers(num_workers);
    auto address = [&](int j) { return hosts[j] + ":" + std::to_string(ports[j]); };
    Hello mine = {kMagic, static_cast<uint32_t>(index), static_cast<uint32_t>(num_workers), 0,
                  nonce};
    // Dial the lower indices (retrying until the deadline: a peer may still be starting).
    for (int j = 0; j < index; ++j) {
      while (true) {
        int fd = DialOnce(hosts[j], ports[j]);
        if (fd >= 0) {
          struct iovec iov = {&mine, sizeof(mine)};
          Hello answer;
          if (WriteAll(fd, &iov, 1) && ReadAllBefore(fd, &answer, sizeof(answer), deadline) &&
              answer.magic == kMagic && answer.nonce == nonce &&
              static_cast<int>(answer.index) == j &&
              static_cast<int>(answer.num_workers) == num_workers) {
            peers[j] = std::make_unique<Peer>(j, fd, address(j));
            break;
          }
          ::close(fd);
        }
        if (Clock::now() >= deadline) {
          return errors::DeadlineExceeded("nestpipe sockets: worker ", index,
                                          " could not reach worker ", j, " at ", address(j),
                                          " within ", timeout_seconds,
                                          " s (is a firewall or network policy blocking it?)");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    // Accept the higher indices.
    int expected = num_workers - 1 - index;
    while (expected > 0) {
      int wait_ms = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      struct pollfd p = {listen_fd_, POLLIN, 0};
      int ready = wait_ms > 0 ? ::poll(&p, 1, wait_ms) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) {
        std::string missing;
        for (int j = index + 1; j < num_workers; ++j) {
          if (!peers[j]) missing += " " + std::to_string(j) + " (" + address(j) + ")";
        }
        return errors::DeadlineExceeded("nestpipe sockets: worker ", index,
                                        " heard nothing within ", timeout_seconds,
                                        " s from workers", missing);
      }
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      Hello theirs;
      if (!ReadAllBefore(fd, &theirs, sizeof(theirs), deadline) || theirs.magic != kMagic ||
          theirs.nonce != nonce || static_cast<int>(theirs.num_workers) != num_workers ||
          static_cast<int>(theirs.index) <= index ||
          static_cast<int>(theirs.index) >= num_workers || peers[theirs.index]) {
        ::close(fd);  // not one of ours (or a stale connection from an earlier cluster)
        continue;
      }
      struct iovec iov = {&mine, sizeof(mine)};
      if (!WriteAll(fd, &iov, 1)) {
        ::close(fd);
        continue;
      }
      TuneSocket(fd);
      peers[theirs.index] = std::make_unique<Peer>(theirs.index, fd, address(theirs.index));
      --expected;
    }
    index_ = index;
    num_workers_ = num_workers;
    nonce_ = nonce;
    stall_seconds_ = stall_seconds;
    peers_ = std::move(peers);
    connected_ = true;
    for (int j = 0; j < num_workers; ++j) {
      if (j == index) continue;
      Peer* peer = peers_[j].get();
      std::thread([this, peer] { Receive(peer); }).detach();
      peer->StartSender([this, peer](int err) {
        Fail(errors::Unavailable("nestpipe sockets: worker ", index_, " could not send to worker ",
                                 peer->index(), " (", peer->address(), "): ", strerror(err),
                                 "; that worker has probably failed (see its log)"));
      });
    }
    std::thread([this] { Watch(); }).detach();
    return absl::OkStatus();
  }

  bool connected() const { return connected_; }
  int num_workers() const { return num_workers_; }
  int index() const { return index_; }

  // Starts the exchange of `input` (see the op's doc; `keep` holds its memory until every
  // message is written); calls ex->done(status) when this worker's row is written, its
  // messages queued and every peer's row has arrived.
  void AllToAll(int64_t key, const char* input, std::shared_ptr<const void> keep,
                const int32_t* send_counts, std::unique_ptr<Exchange> exchange) {
    Exchange* ex = exchange.get();
    const int64_t row_bytes = ex->capacity * ex->entry_bytes;
    int64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) {
        Status failure = failure_;
        ex->done(failure);
        return;
      }
      seq = next_seq_[key]++;
      ex->received.assign(num_workers_, false);
      ex->received[index_] = true;
      ex->missing = num_workers_ - 1;
      for (int j = 0; j < num_workers_; ++j) {
        if (j == index_) continue;
        auto it = early_.find(std::make_tuple(key, seq, j));
        if (it != early_.end()) {
          Deliver(ex, j, it->second.first, it->second.second.data(), it->second.second.size());
          early_.erase(it);
        }
      }
      pending_[{key, seq}] = std::move(exchange);
    }
    // This worker's own row, then its rows for the peers (ex stays alive: it completes only
    // once self_done is set below).
    std::memcpy(ex->output + index_ * row_bytes, input + index_ * row_bytes,
                send_counts[index_] * ex->entry_bytes);
    FillAfter(ex, index_, send_counts[index_]);
    ex->recv_counts[index_] = send_counts[index_];
    for (int step = 1; step < num_workers_; ++step) {
      int j = (index_ + step) % num_workers_;
      MessageHeader header = {kMagic, kData, key, seq, send_counts[j],
                              send_counts[j] * ex->entry_bytes};
      peers_[j]->Post(header, input + j * row_bytes, header.nbytes, keep);
    }
    std::unique_ptr<Exchange> complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ex->self_done = true;
      complete = TakeIfReady(key, seq);
    }
    if (complete) complete->done(complete->status);
  }

 private:
  Mesh() = default;

  int DialOnce(const std::string& host, int port) {
    struct addrinfo hints = {}, *found = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 ||
        found == nullptr) {
      return -1;
    }
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    } else {
      TuneSocket(fd);
    }
    ::freeaddrinfo(found);
    return fd;
  }

  // Copies a peer's row into `ex` (mu_ held).
  void Deliver(Exchange* ex, int peer, int64_t count, const char* data, size_t nbytes) {
    if (ex->received[peer]) return;
    ex->received[peer] = true;
    --ex->missing;
    if (count < 0 || count > ex->capacity ||
        static_cast<int64_t>(nbytes) != count * ex->entry_bytes) {
      ex->status = errors::Internal(
          "nestpipe sockets: worker ", peer, " sent ", count, " entries (", nbytes,
          " bytes) into an exchange of capacity ", ex->capacity, " x ", ex->entry_bytes,
          " bytes: the workers traced different programs");
      return;
    }
    std::memcpy(ex->output + peer * ex->capacity * ex->entry_bytes, data, nbytes);
    FillAfter(ex, peer, count);
    ex->recv_counts[peer] = static_cast<int32_t>(count);
  }

  // Removes and returns the exchange (key, seq) if it can complete (mu_ held).
  std::unique_ptr<Exchange> TakeIfReady(int64_t key, int64_t seq) {
    auto it = pending_.find({key, seq});
    if (it == pending_.end()) return nullptr;
    Exchange* ex = it->second.get();
    if (!ex->self_done || (ex->missing > 0 && ex->status.ok())) return nullptr;
    std::unique_ptr<Exchange> ready = std::move(it->second);
    pending_.erase(it);
    return ready;
  }

  static void FillAfter(Exchange* ex, int row, int64_t count) {
    char* out = ex->output + (row * ex->capacity + count) * ex->entry_bytes;
    const int64_t entries = ex->capacity - count;
    bool zero = true;
    for (char c : ex->fill) zero = zero && c == 0;
    if (zero) {
      std::memset(out, 0, entries * ex->entry_bytes);
      return;
    }
    const size_t element = ex->fill.size();
    const int64_t elements = entries * ex->entry_bytes / static_cast<int64_t>(element);
    for (int64_t e = 0; e < elements; ++e) std::memcpy(out + e * element, ex->fill.data(), element);
  }

  void Receive(Peer* peer) {
    while (true) {
      MessageHeader header;
      if (!ReadAll(peer->fd(), &header, sizeof(header)) || header.magic != kMagic) {
        Fail(errors::Unavailable(
            "nestpipe sockets: worker ", peer->index(), " (", peer->address(),
            ") closed its connection to worker ", index_,
            ": it failed or was stopped (see its log); restart the job"));
        return;
      }
      peer->Heard();
      if (header.type == kHeartbeat) continue;
      if (header.nbytes < 0 || header.count < 0) {
        Fail(errors::Internal("nestpipe sockets: worker ", peer->index(), " (",
                              peer->address(), ") sent a malformed message header"));
        return;
      }
      std::vector<char> payload(header.nbytes);
      if (!ReadAll(peer->fd(), payload.data(), payload.size())) {
        Fail(errors::Unavailable("nestpipe sockets: the connection to worker ", peer->index(),
                                 " (", peer->address(), ") broke in the middle of a message"));
        return;
      }
      peer->Heard();
      std::unique_ptr<Exchange> complete;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find({header.key, header.seq});
        if (it == pending_.end()) {
          early_[std::make_tuple(header.key, header.seq, peer->index())] =
              std::make_pair(header.count, std::move(payload));
          continue;
        }
        Deliver(it->second.get(), peer->index(), header.count, payload.data(), payload.size());
        complete = TakeIfReady(header.key, header.seq);
      }
      if (complete) complete->done(complete->status);
    }
  }

  void Fail(const Status& status) {
    std::vector<std::unique_ptr<Exchange>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.ok()) failure_ = status;
      for (auto it = pending_.begin(); it != pending_.end();) {
        it->second->status = failure_;
        if (it->second->self_done) {  // else its AllToAll call completes it after its sends
          failed.push_back(std::move(it->second));
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& ex : failed) ex->done(ex->status);
    for (auto& peer : peers_) {
      if (peer) peer->Shutdown();
    }
  }

  // Sends heartbeats and fails exchanges waiting on a peer that has gone silent.
  void Watch() {
    while (true) {
      std::this_thread::sleep_for(
          std::chrono::milliseconds(static_cast<int>(kHeartbeatSeconds * 1000)));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!failure_.ok()) return;
      }
      MessageHeader beat = {kMagic, kHeartbeat, 0, 0, 0, 0};
      for (auto& peer : peers_) {
        if (peer) peer->Post(beat, nullptr, 0, nullptr);
      }
      int silent = -1;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& item : pending_) {
          for (int j = 0; j < num_workers_ && silent < 0; ++j) {
            if (!item.second->received[j] && peers_[j]->SilentSeconds() > stall_seconds_) {
              silent = j;
            }
          }
        }
      }
      if (silent >= 0) {
        Fail(errors::DeadlineExceeded(
            "nestpipe sockets: worker ", silent, " (", peers_[silent]->address(),
            ") has sent nothing, not even a heartbeat, for ", stall_seconds_,
            " s while worker ", index_,
            " waits for its part of an exchange: it is stopped or its machine is gone"));
        return;
      }
    }
  }

  std::mutex setup_mu_;
  int listen_fd_ = -1;
  int listen_port_ = 0;
  std::atomic<bool> connected_{false};
  int index_ = 0;
  int num_workers_ = 0;
  uint64_t nonce_ = 0;
  double stall_seconds_ = 20;
  std::vector<std::unique_ptr<Peer>> peers_;

  std::mutex mu_;
  Status failure_;
  std::map<int64_t, int64_t> next_seq_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Exchange>> pending_;
  std::map<std::tuple<int64_t, int64_t, int>, std::pair<int64_t, std::vector<char>>> early_;
};

}  // namespace

REGISTER_OP("NestpipeSocketListen")
    .Input("host: string")
    .Output("port: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Binds this process's mesh socket on `host` (a free port) and returns the port (idempotent).
)doc");

REGISTER_OP("NestpipeSocketConnect")
    .Input("index: int32")
    .Input("hosts: string")
    .Input("ports: int32")
    .Input("nonce: int64")
    .Attr("timeout_seconds: float = 60")
    .Attr("stall_seconds: float = 20")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Connects this process (worker `index`) to every worker of `hosts`/`ports` (this worker's own entry
included), checking the cluster's `nonce`; fails within `timeout_seconds` naming the workers it
could not reach. An exchange waiting on a peer silent for `stall_seconds` fails.
)doc");

REGISTER_OP("NestpipeSocketAllToAll")
    .Input("input: T")
    .Input("send_counts: int32")
    .Input("fill: T")
    .Input("key: int64")
    .Input("ordering_token: resource")
    .Output("output: T")
    .Output("recv_counts: int32")
    .Attr("T: {float, double, half, bfloat16, int8, int32, int64, uint8}")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle input;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 2, &input));
      c->set_output(0, input);
      c->set_output(1, c->Vector(c->Dim(input, 0)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
All-to-all over the socket mesh: sends the first send_counts[j] entries of input[j] to worker j;
output[i] holds the recv_counts[i] entries worker i sent, then `fill`. Calls are paired across
workers by (key, how many calls of key this process made before). `ordering_token` (unread) is the
stream's token: TensorFlow's automatic control dependencies order one stream's calls in program
order and leave different streams free to overlap, as for its own collectives.
)doc");

class SocketListenOp : public OpKernel {
 public:
  explicit SocketListenOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    int port = 0;
    OP_REQUIRES_OK(ctx, Mesh::Get()->Listen(ctx->input(0).scalar<tstring>()(), &port));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32>()() = port;
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSocketListen").Device(DEVICE_CPU), SocketListenOp);

class SocketConnectOp : public OpKernel {
 public:
  explicit SocketConnectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("timeout_seconds", &timeout_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stall_seconds", &stall_));
  }
  void Compute(OpKernelContext* ctx) override {
    const auto hosts = ctx->input(1).flat<tstring>();
    const auto ports = ctx->input(2).flat<int32>();
    OP_REQUIRES(ctx, hosts.size() == ports.size() && hosts.size() >= 2,
                errors::InvalidArgument("nestpipe sockets: hosts and ports must be two equal "
                                        "lists of at least 2 workers"));
    std::vector<std::string> host_list;
    std::vector<int> port_list;
    for (int64_t j = 0; j < hosts.size(); ++j) {
      host_list.emplace_back(hosts(j));
      port_list.push_back(ports(j));
    }
    OP_REQUIRES_OK(ctx, Mesh::Get()->Connect(ctx->input(0).scalar<int32>()(), host_list,
                                             port_list,
                                             static_cast<uint64_t>(ctx->input(3).scalar<int64>()()),
                                             timeout_, stall_));
  }

 private:
  float timeout_;
  float stall_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSocketConnect").Device(DEVICE_CPU), SocketConnectOp);

class SocketAllToAllOp : public AsyncOpKernel {
 public:
  explicit SocketAllToAllOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  // Starting an exchange copies this worker's own row and queues the messages (the peers'
  // sender threads write them): cheap, so TensorFlow's executor starts it inline as soon as its
  // input is ready instead of queueing it behind the compute ops that are ready (with one
  // inter-op thread per worker those would delay every message, and the overlap, by their run).
  bool IsExpensive() override { return false; }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Mesh* mesh = Mesh::Get();
    OP_REQUIRES_ASYNC(ctx, mesh->connected(),
                      errors::FailedPrecondition("nestpipe sockets: the mesh is not connected "
                                                 "(NestPipeStrategy connects it at start-up)"),
                      done);
    const Tensor& input = ctx->input(0);
    const Tensor& counts = ctx->input(1);
    const Tensor& fill = ctx->input(2);
    const int64_t num_workers = mesh->num_workers();
    OP_REQUIRES_ASYNC(ctx, input.dims() >= 2 && input.dim_size(0) == num_workers,
                      errors::InvalidArgument("nestpipe socket all-to-all needs [", num_workers,
                                              ", n, ...], got ", input.shape().DebugString()),
                      done);
    OP_REQUIRES_ASYNC(ctx, counts.NumElements() == num_workers && fill.NumElements() == 1,
                      errors::InvalidArgument("send_counts must hold ", num_workers,
                                              " counts and fill one value"),
                      done);
    const int64_t capacity = input.dim_size(1);
    const auto send = counts.flat<int32>();
    for (int64_t j = 0; j < num_workers; ++j) {
      OP_REQUIRES_ASYNC(ctx, send(j) >= 0 && send(j) <= capacity,
                        errors::InvalidArgument("send_counts[", j, "] = ", send(j),
                                                " outside [0, ", capacity, "]"),
                        done);
    }
    Tensor* output = nullptr;
    Tensor* received = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, input.shape(), &output), done);
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(1, TensorShape({num_workers}), &received),
                         done);
    auto ex = std::make_unique<Exchange>();
    const int64_t element = DataTypeSize(input.dtype());
    ex->output = static_cast<char*>(const_cast<char*>(output->tensor_data().data()));
    ex->recv_counts = received->flat<int32>().data();
    ex->capacity = capacity;
    ex->entry_bytes = capacity > 0 ? input.NumElements() / (num_workers * capacity) * element
                                   : element;
    const char* fill_bytes = fill.tensor_data().data();
    ex->fill.assign(fill_bytes, fill_bytes + element);
    ex->done = [ctx, done](Status status) {
      ctx->SetStatus(status);
      done();
    };
    // The messages may be written after the op is done: they keep the input's buffer alive.
    auto keep = std::make_shared<const Tensor>(input);
    mesh->AllToAll(ctx->input(3).scalar<int64>()(), input.tensor_data().data(), keep, send.data(),
                   std::move(ex));
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSocketAllToAll").Device(DEVICE_CPU), SocketAllToAllOp);

}  // namespace nestpipe
}  // namespace tensorflow

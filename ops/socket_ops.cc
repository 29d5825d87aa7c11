// The data plane of the socket transport (docs/transport.md): all-to-alls between the workers on
// TCP connections that the Python layer (tf_nestpipe/collectives/mesh_handshake.py) opened and
// authenticated at start-up. A TensorFlow CPU collective costs a gRPC round trip through the
// collective executor; a frame on an open connection costs a system call or two.
//
// - NestpipeSocketAdopt(index, fds, addresses): takes ownership of one connected, authenticated
//   socket per peer and starts the two I/O threads of the process (one sends, one receives, for
//   any number of peers). Called once per process.
// - NestpipeSocketAllToAll(input [G, n, ...], send_counts [G], fill, key, ordering_token)
//   -> (output, recv_counts): sends the first send_counts[j] entries of input[j] to the j-th
//   member of the exchange's group (every worker unless the `group` attr lists them), returns
//   [G, n, ...] whose row i holds the entries member i sent (recv_counts[i] of them, then
//   `fill`). Calls pair across workers by (key, how many calls of key this process made
//   before): every worker issues a key's calls in the same order (the Python layer chains each
//   stream's exchanges), so a call never takes another call's data.
// - NestpipeSocketFinish(stall_seconds): at the program's end, a goodbye to every peer after
//   everything still queued, and this side of the connections closed once it is delivered.
// - NestpipeSocketStats() -> [bytes sent, bytes received, frames sent, frames received, peers,
//   I/O threads].
//
// Wire format: every frame starts with a 40-byte little-endian header (magic "NPS2", protocol
// version, frame type, key, sequence number, entry count, payload bytes). A frame's payload is
// checked against what the receiver expects before any memory is given to it: a data frame for
// an exchange this worker already started lands directly in the op's output (its row's
// capacity bounds it); one that arrives before its exchange starts is buffered, up to
// `max_buffered_bytes` for the whole process.
//
// Faults, every one failing every pending and later exchange of this process with the reason,
// which is also sent to every peer (an abort frame) so that every worker names the same cause:
// - a peer whose connection closes or breaks: Unavailable, naming it;
// - a peer that sends nothing at all (no data, no heartbeat: heartbeats go out every 0.5 s on an
//   idle connection) for `stall_seconds` while an exchange waits on it: DeadlineExceeded. Any
//   byte of any frame counts, so a long message on a slow link keeps the peer alive;
// - a peer that is alive but does not make a call this worker waits in for `call_timeout_seconds`
//   (no data byte from it meanwhile): DeadlineExceeded, naming the peer and the call;
// - a malformed frame, a frame larger than `max_message_bytes`, or early frames beyond
//   `max_buffered_bytes`: DataLoss / ResourceExhausted, naming the peer;
// - TensorFlow cancelling a pending exchange (its step was aborted): Cancelled.
// After a failure the mesh stays failed: a half-done exchange cannot be repaired, the process
// must restart, as with TensorFlow's collectives.
#include <arpa/inet.h>
#include <endian.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
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

constexpr uint32_t kFrameMagic = 0x3253504Eu;  // "NPS2" as little-endian bytes
constexpr uint16_t kProtocolVersion = 2;
constexpr uint16_t kData = 1;
constexpr uint16_t kHeartbeat = 2;
constexpr uint16_t kAbort = 3;
constexpr uint16_t kBye = 4;  // the sender's program ended normally; it sends nothing more
constexpr size_t kHeaderBytes = 40;
constexpr int64_t kMaxAbortBytes = 4096;
constexpr double kHeartbeatSeconds = 0.5;
constexpr int kWatchMillis = 100;

struct Frame {
  uint16_t type = 0;
  int64_t key = 0;
  int64_t seq = 0;
  int64_t count = 0;
  int64_t nbytes = 0;
};

void EncodeHeader(const Frame& frame, char* out) {
  uint32_t magic = htole32(kFrameMagic);
  uint16_t version = htole16(kProtocolVersion), type = htole16(frame.type);
  uint64_t fields[4] = {htole64(static_cast<uint64_t>(frame.key)),
                        htole64(static_cast<uint64_t>(frame.seq)),
                        htole64(static_cast<uint64_t>(frame.count)),
                        htole64(static_cast<uint64_t>(frame.nbytes))};
  std::memcpy(out, &magic, 4);
  std::memcpy(out + 4, &version, 2);
  std::memcpy(out + 6, &type, 2);
  std::memcpy(out + 8, fields, 32);
}

// Decodes a header; an empty string when it is well formed, else what is wrong with it.
std::string DecodeHeader(const char* in, Frame* frame) {
  uint32_t magic;
  uint16_t version, type;
  uint64_t fields[4];
  std::memcpy(&magic, in, 4);
  std::memcpy(&version, in + 4, 2);
  std::memcpy(&type, in + 6, 2);
  std::memcpy(fields, in + 8, 32);
  if (le32toh(magic) != kFrameMagic) return "a frame without the tf_nestpipe magic";
  if (le16toh(version) != kProtocolVersion) {
    return "a frame of protocol version " + std::to_string(le16toh(version)) + " (this worker "
           "speaks " + std::to_string(kProtocolVersion) + "): every worker must run the same "
           "tf_nestpipe";
  }
  frame->type = le16toh(type);
  frame->key = static_cast<int64_t>(le64toh(fields[0]));
  frame->seq = static_cast<int64_t>(le64toh(fields[1]));
  frame->count = static_cast<int64_t>(le64toh(fields[2]));
  frame->nbytes = static_cast<int64_t>(le64toh(fields[3]));
  if (frame->type != kData && frame->type != kHeartbeat && frame->type != kAbort &&
      frame->type != kBye) {
    return "a frame of unknown type " + std::to_string(frame->type);
  }
  if (frame->count < 0 || frame->nbytes < 0 || frame->seq < 0) {
    return "a frame header with a negative count or length";
  }
  return "";
}

int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

double SecondsSince(int64_t nanos) { return (NowNanos() - nanos) * 1e-9; }

// One pending all-to-all: where its received rows go and what is still missing.
struct Exchange {
  std::string label;               // the call's name, for errors
  int64_t key = 0, seq = 0;
  int64_t started_nanos = 0;
  std::vector<int> members;        // worker index of each row
  std::vector<int> row_of;         // worker index -> row, -1 for non-members
  char* output = nullptr;          // [G, capacity, entry_bytes]
  int32_t* recv_counts = nullptr;
  // The outputs' buffers, kept alive while a receive may still write into them.
  std::shared_ptr<Tensor> output_keep, counts_keep;
  int64_t capacity = 0;
  int64_t entry_bytes = 0;
  std::vector<char> fill;          // one element of `fill`
  std::vector<bool> received;      // by row
  std::vector<bool> arriving;      // by row: its frame is being read into `output`
  int missing = 0;                 // rows that have not fully arrived
  bool self_done = false;          // this worker's own row written and its frames queued
  Status status;
  std::function<void(Status)> done;
  CancellationManager* cancellation = nullptr;
  CancellationToken token = CancellationManager::kInvalidToken;
};

// A frame waiting in a peer's send queue; `keep` holds its payload's memory (the op's input
// tensor) alive until it is written.
struct Outgoing {
  char header[kHeaderBytes];
  const char* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> keep;
};

struct Peer {
  int index = -1;
  int fd = -1;
  std::string address;

  // Send side: `queue` under `send_mu`; `written` (bytes of the front frame already sent) and
  // `watching_out` belong to the send thread.
  std::mutex send_mu;
  std::deque<Outgoing> queue;
  size_t written = 0;
  bool watching_out = false;
  int64_t last_sent_nanos = 0;

  // Receive side, the receive thread's alone.
  char header[kHeaderBytes];
  size_t header_got = 0;
  bool in_payload = false;
  Frame frame;
  char* target = nullptr;          // where the payload goes
  int64_t payload_got = 0;
  std::vector<char> buffered;      // an early frame's payload, or an abort's reason
  std::shared_ptr<Tensor> target_keep;
  Exchange* target_exchange = nullptr;  // a pending exchange being written directly

  std::atomic<int64_t> last_heard_nanos{0};  // any byte
  std::atomic<int64_t> last_data_nanos{0};   // any byte of a data frame
  std::atomic<bool> said_bye{false};         // its program ended normally
  bool closed = false;                       // the receive thread's: no longer read
};

struct EarlyFrame {
  int64_t count;
  std::vector<char> payload;
};

// The process's mesh (one per process: a worker belongs to one cluster).
class Mesh {
 public:
  static Mesh* Get() {
    static Mesh* mesh = new Mesh();  // never destroyed: its threads may outlive static destruction
    return mesh;
  }

  struct Options {
    double call_timeout_seconds = 600;
    double stall_seconds = 20;
    int64_t max_message_bytes = int64_t{1} << 32;
    int64_t max_buffered_bytes = int64_t{1} << 30;
  };

  Status Adopt(int index, const std::vector<int>& fds, const std::vector<std::string>& addresses,
               const Options& options) {
    std::lock_guard<std::mutex> setup(setup_mu_);
    const int num_workers = static_cast<int>(fds.size());
    if (connected_) {
      // A second strategy in the process: TensorFlow's server (so the cluster) cannot change in
      // a process, so the mesh is reused; the new sockets are not needed.
      for (int fd : fds) {
        if (fd >= 0) ::close(fd);
      }
      if (num_workers == num_workers_ && index == index_) return absl::OkStatus();
      return errors::FailedPrecondition(
          "nestpipe sockets: this process is already connected to a cluster of ", num_workers_,
          " workers as worker ", index_, "; a process belongs to one cluster");
    }
    if (index < 0 || index >= num_workers || addresses.size() != fds.size()) {
      return errors::InvalidArgument("nestpipe sockets: bad worker index ", index, " of ",
                                     num_workers, " or address list");
    }
    for (int j = 0; j < num_workers; ++j) {
      if ((j == index) != (fds[j] < 0)) {
        return errors::InvalidArgument("nestpipe sockets: worker ", index, " needs one socket "
                                       "for each other worker and none for itself");
      }
    }
    options_ = options;
    index_ = index;
    num_workers_ = num_workers;
    peers_.resize(num_workers);
    const int64_t now = NowNanos();
    recv_epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    send_epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (recv_epoll_ < 0 || send_epoll_ < 0 || wake_fd_ < 0) {
      return errors::Internal("nestpipe sockets: cannot create the event loop: ",
                              strerror(errno));
    }
    struct epoll_event wake = {};
    wake.events = EPOLLIN;
    wake.data.ptr = nullptr;
    ::epoll_ctl(send_epoll_, EPOLL_CTL_ADD, wake_fd_, &wake);
    for (int j = 0; j < num_workers; ++j) {
      if (j == index) continue;
      auto peer = std::make_unique<Peer>();
      peer->index = j;
      peer->fd = fds[j];
      peer->address = addresses[j];
      peer->last_heard_nanos = now;
      peer->last_data_nanos = now;
      peer->last_sent_nanos = now;
      int flags = ::fcntl(peer->fd, F_GETFL, 0);
      ::fcntl(peer->fd, F_SETFL, flags | O_NONBLOCK);
      int one = 1;
      ::setsockopt(peer->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ::setsockopt(peer->fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
      int buffer = 4 << 20;
      ::setsockopt(peer->fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
      ::setsockopt(peer->fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
      struct epoll_event in = {};
      in.events = EPOLLIN | EPOLLRDHUP;
      in.data.ptr = peer.get();
      ::epoll_ctl(recv_epoll_, EPOLL_CTL_ADD, peer->fd, &in);
      struct epoll_event out = {};
      out.events = 0;  // EPOLLOUT only while its queue cannot be written at once
      out.data.ptr = peer.get();
      ::epoll_ctl(send_epoll_, EPOLL_CTL_ADD, peer->fd, &out);
      peers_[j] = std::move(peer);
    }
    connected_ = true;
    // Named so that `top -H`, profilers and debuggers tell the mesh's threads from the
    // Python thread they would otherwise inherit their name from (at most 15 characters).
    std::thread([this] {
      ::pthread_setname_np(::pthread_self(), "nestpipe_recv");
      ReceiveLoop();
    }).detach();
    std::thread([this] {
      ::pthread_setname_np(::pthread_self(), "nestpipe_send");
      SendLoop();
    }).detach();
    return absl::OkStatus();
  }

  bool connected() const { return connected_; }
  int num_workers() const { return num_workers_; }
  int index() const { return index_; }

  void Stats(int64_t* out) const {
    out[0] = bytes_sent_.load();
    out[1] = bytes_received_.load();
    out[2] = frames_sent_.load();
    out[3] = frames_received_.load();
    out[4] = connected_ ? num_workers_ - 1 : 0;
    out[5] = connected_ ? 2 : 0;
  }

  // Starts the exchange `ex` (see the op's doc; `keep` holds the input's memory until every
  // frame is written); calls ex->done(status) once this worker's row is written, its frames
  // queued and every member's row has arrived, or once the mesh fails.
  void AllToAll(const char* input, std::shared_ptr<const void> keep, const int32_t* send_counts,
                std::unique_ptr<Exchange> exchange) {
    Exchange* ex = exchange.get();
    const int64_t row_bytes = ex->capacity * ex->entry_bytes;
    const int me = ex->row_of[index_];
    const int rows = static_cast<int>(ex->members.size());
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (failure_.ok() && finished_.load()) {
        failure_ = errors::FailedPrecondition(
            "nestpipe sockets: an exchange after this worker's program said goodbye");
      }
      if (!failure_.ok()) {
        exchange->status = failure_;
        lock.unlock();
        Complete(std::move(exchange));
        return;
      }
      ex->seq = next_seq_[ex->key]++;
      ex->started_nanos = NowNanos();
      ex->received.assign(rows, false);
      ex->arriving.assign(rows, false);
      ex->received[me] = true;
      ex->missing = rows - 1;
      for (int r = 0; r < rows; ++r) {
        if (r == me) continue;
        auto it = early_.find(std::make_tuple(ex->key, ex->seq, ex->members[r]));
        if (it != early_.end()) {
          DeliverCopy(ex, r, it->second.count, it->second.payload);
          buffered_bytes_ -= static_cast<int64_t>(it->second.payload.size());
          early_.erase(it);
        }
      }
      pending_[{ex->key, ex->seq}] = std::move(exchange);
    }
    std::memcpy(ex->output + me * row_bytes, input + me * row_bytes,
                send_counts[me] * ex->entry_bytes);
    FillAfter(ex, me, send_counts[me]);
    ex->recv_counts[me] = send_counts[me];
    for (int step = 1; step < rows; ++step) {
      const int r = (me + step) % rows;
      Frame frame;
      frame.type = kData;
      frame.key = ex->key;
      frame.seq = ex->seq;
      frame.count = send_counts[r];
      frame.nbytes = send_counts[r] * ex->entry_bytes;
      Post(peers_[ex->members[r]].get(), frame, input + r * row_bytes, keep);
    }
    Wake();
    std::unique_ptr<Exchange> complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ex->self_done = true;
      complete = TakeIfReady(ex->key, ex->seq);
    }
    if (complete) Complete(std::move(complete));
  }

  // The program ended: tells every peer (a goodbye frame after everything queued), waits for
  // the queues to drain and the peers to acknowledge every byte (closing a socket that holds
  // unread input resets it, and a reset discards what the peer has not read yet), then closes
  // this side of every connection. Gives up after `stall_seconds` without progress. Returns
  // whether everything was delivered.
  bool Finish(double stall_seconds) {
    if (!connected_ || failed_.load() || finished_.exchange(true)) return false;
    Frame bye;
    bye.type = kBye;
    for (auto& peer : peers_) {
      if (peer) Post(peer.get(), bye, nullptr, nullptr);
    }
    Wake();
    auto unsent = [this](bool queued_only) {
      int64_t total = 0;
      for (auto& peer : peers_) {
        if (!peer) continue;
        {
          std::lock_guard<std::mutex> lock(peer->send_mu);
          total += static_cast<int64_t>(peer->queue.size());
        }
        int in_kernel = 0;
        if (!queued_only && ::ioctl(peer->fd, SIOCOUTQ, &in_kernel) == 0) total += in_kernel;
      }
      return total;
    };
    bool delivered = false;
    for (bool queued_only : {true, false}) {
      int64_t last = -1;
      auto progress = Clock::now();
      while (!failed_.load()) {
        const int64_t left = unsent(queued_only);
        if (left == 0) break;
        const int64_t sent = bytes_sent_.load() + left;
        if (sent != last) {
          last = sent;
          progress = Clock::now();
        } else if (std::chrono::duration<double>(Clock::now() - progress).count() >
                   stall_seconds) {
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      if (queued_only) {
        for (auto& peer : peers_) {
          if (peer) ::shutdown(peer->fd, SHUT_WR);
        }
      } else {
        delivered = unsent(false) == 0;
      }
    }
    return delivered;
  }

  // Fails the mesh (every pending and later exchange) with `status`, tells the peers why.
  void Fail(const Status& status, bool tell_peers = true) {
    std::vector<std::unique_ptr<Exchange>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) return;
      failure_ = status;
      tell_peers_ = tell_peers;
      for (auto it = pending_.begin(); it != pending_.end();) {
        it->second->status = failure_;
        if (it->second->self_done) {  // else its AllToAll call completes it after its sends
          failed.push_back(std::move(it->second));
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
      early_.clear();
      buffered_bytes_ = 0;
    }
    failed_.store(true);
    Wake();  // the send thread sends the aborts and closes the connections
    for (auto& ex : failed) Complete(std::move(ex));
  }

 private:
  Mesh() = default;

  void Wake() {
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_, &one, sizeof(one));
    (void)ignored;
  }

  void Post(Peer* peer, const Frame& frame, const char* data, std::shared_ptr<const void> keep) {
    Outgoing message;
    EncodeHeader(frame, message.header);
    message.data = data;
    message.size = static_cast<size_t>(frame.nbytes);
    message.keep = std::move(keep);
    std::lock_guard<std::mutex> lock(peer->send_mu);
    peer->queue.push_back(std::move(message));
  }

  static void Complete(std::unique_ptr<Exchange> ex) {
    if (ex->cancellation != nullptr) ex->cancellation->TryDeregisterCallback(ex->token);
    ex->done(ex->status);
  }

  // --- receiving -------------------------------------------------------------------------

  void ReceiveLoop() {
    std::vector<struct epoll_event> events(64);
    while (!failed_.load()) {
      int n = ::epoll_wait(recv_epoll_, events.data(), static_cast<int>(events.size()),
                           kWatchMillis);
      if (n < 0 && errno != EINTR) {
        Fail(errors::Internal("nestpipe sockets: the receive loop failed: ", strerror(errno)));
        return;
      }
      for (int i = 0; i < n && !failed_.load(); ++i) {
        Status status = ReadFrom(static_cast<Peer*>(events[i].data.ptr));
        // A peer that stopped the job told every worker itself: no need to tell them again.
        if (!status.ok()) Fail(status, !abort_received_.load());
      }
      Watch();
    }
  }

  Status Closed(Peer* peer, const char* what) {
    return errors::Unavailable("nestpipe sockets: worker ", peer->index, " (", peer->address,
                               ") ", what, " its connection to worker ", index_,
                               ": it failed or was stopped (see its log); restart the job");
  }

  Status Malformed(Peer* peer, const std::string& what) {
    return errors::DataLoss("nestpipe sockets: worker ", peer->index, " (", peer->address,
                            ") sent ", what, "; worker ", index_, " stops the job");
  }

  // Reads whatever `peer` has sent until the socket would block.
  Status ReadFrom(Peer* peer) {
    while (true) {
      ssize_t got;
      if (!peer->in_payload) {
        got = ::recv(peer->fd, peer->header + peer->header_got, kHeaderBytes - peer->header_got,
                     0);
      } else {
        got = ::recv(peer->fd, peer->target + peer->payload_got,
                     peer->frame.nbytes - peer->payload_got, 0);
      }
      if (got == 0 || (got < 0 && errno == ECONNRESET && peer->said_bye.load())) {
        if (!peer->said_bye.load() || peer->in_payload || peer->header_got > 0) {
          return Closed(peer, "closed");
        }
        // It finished normally; an exchange still waiting on it fails in Watch.
        ::epoll_ctl(recv_epoll_, EPOLL_CTL_DEL, peer->fd, nullptr);
        peer->closed = true;
        return absl::OkStatus();
      }
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
        return errors::Unavailable("nestpipe sockets: the connection from worker ", peer->index,
                                   " (", peer->address, ") to worker ", index_, " broke: ",
                                   strerror(errno), "; that worker has probably failed");
      }
      bytes_received_ += got;
      const int64_t now = NowNanos();
      peer->last_heard_nanos.store(now);
      if (!peer->in_payload) {
        peer->header_got += static_cast<size_t>(got);
        if (peer->header_got < kHeaderBytes) continue;
        peer->header_got = 0;
        TF_RETURN_IF_ERROR(StartFrame(peer));
      } else {
        peer->payload_got += got;
        if (peer->frame.type == kData) peer->last_data_nanos.store(now);
        if (peer->payload_got == peer->frame.nbytes) TF_RETURN_IF_ERROR(EndFrame(peer));
      }
    }
  }

  // A header arrived: checks it and says where its payload goes.
  Status StartFrame(Peer* peer) {
    std::string wrong = DecodeHeader(peer->header, &peer->frame);
    if (!wrong.empty()) return Malformed(peer, wrong);
    Frame& frame = peer->frame;
    ++frames_received_;
    if (frame.type == kHeartbeat) return absl::OkStatus();
    if (frame.type == kBye) {
      if (frame.nbytes != 0) return Malformed(peer, "a goodbye frame with a payload");
      peer->said_bye.store(true);
      return absl::OkStatus();
    }
    peer->payload_got = 0;
    peer->target_exchange = nullptr;
    peer->target_keep.reset();
    if (frame.type == kAbort) {
      if (frame.nbytes > kMaxAbortBytes) return Malformed(peer, "an oversized abort frame");
      peer->buffered.assign(frame.nbytes, 0);
      peer->target = peer->buffered.data();
    } else {
      peer->last_data_nanos.store(NowNanos());
      if (frame.nbytes > options_.max_message_bytes) {
        return errors::ResourceExhausted(
            "nestpipe sockets: worker ", peer->index, " (", peer->address, ") announced a ",
            frame.nbytes, "-byte frame, over this worker's limit of ",
            options_.max_message_bytes, " bytes (TF_NESTPIPE_TRANSPORT_MAX_MESSAGE_BYTES)");
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) return failure_;
      auto it = pending_.find({frame.key, frame.seq});
      if (it != pending_.end()) {
        Exchange* ex = it->second.get();
        const int row = ex->row_of[peer->index];
        if (row < 0 || ex->received[row] || ex->arriving[row]) {
          return Malformed(peer, "a frame for call '" + ex->label + "' that it takes no part in");
        }
        if (frame.count > ex->capacity || frame.nbytes != frame.count * ex->entry_bytes) {
          return errors::Internal(
              "nestpipe sockets: worker ", peer->index, " sent ", frame.count, " entries (",
              frame.nbytes, " bytes) into call '", ex->label, "' of capacity ", ex->capacity,
              " x ", ex->entry_bytes, " bytes: the workers traced different programs");
        }
        ex->arriving[row] = true;
        peer->target_exchange = ex;
        peer->target_keep = ex->output_keep;
        peer->target = ex->output + row * ex->capacity * ex->entry_bytes;
      } else {
        if (buffered_bytes_ + frame.nbytes > options_.max_buffered_bytes) {
          return errors::ResourceExhausted(
              "nestpipe sockets: worker ", peer->index, " (", peer->address, ") sent ",
              buffered_bytes_ + frame.nbytes, " bytes for exchanges worker ", index_,
              " has not started, over its limit of ", options_.max_buffered_bytes,
              " bytes (TF_NESTPIPE_TRANSPORT_MAX_BUFFERED_BYTES): the workers run different "
              "programs, or raise the limit");
        }
        buffered_bytes_ += frame.nbytes;
        peer->buffered.assign(frame.nbytes, 0);
        peer->target = peer->buffered.data();
      }
    }
    peer->in_payload = true;
    if (frame.nbytes == 0) return EndFrame(peer);
    return absl::OkStatus();
  }

  // A frame's payload has fully arrived.
  Status EndFrame(Peer* peer) {
    peer->in_payload = false;
    const Frame& frame = peer->frame;
    if (frame.type == kAbort) {
      // The peer failed and says why; this worker fails with its reason (and tells nobody:
      // the peer told every worker itself).
      abort_received_.store(true);
      return errors::Unavailable("nestpipe sockets: worker ", peer->index, " (", peer->address,
                                 ") stopped the job: ",
                                 std::string(peer->buffered.begin(), peer->buffered.end()));
    }
    std::unique_ptr<Exchange> complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // After a failure the exchanges are finished or finishing: never touch them again.
      if (!failure_.ok()) return failure_;
      if (peer->target_exchange != nullptr) {
        Exchange* ex = peer->target_exchange;
        const int row = ex->row_of[peer->index];
        ex->arriving[row] = false;
        ex->received[row] = true;
        --ex->missing;
        FillAfter(ex, row, frame.count);
        ex->recv_counts[row] = static_cast<int32_t>(frame.count);
        peer->target_exchange = nullptr;
        complete = TakeIfReady(frame.key, frame.seq);
      } else {
        auto it = pending_.find({frame.key, frame.seq});
        if (it != pending_.end()) {  // its exchange started while the payload arrived
          Exchange* ex = it->second.get();
          const int row = ex->row_of[peer->index];
          if (row < 0 || ex->received[row]) {
            return Malformed(peer, "a frame for call '" + ex->label + "' that it takes no "
                             "part in");
          }
          buffered_bytes_ -= frame.nbytes;
          if (frame.count > ex->capacity || frame.nbytes != frame.count * ex->entry_bytes) {
            return errors::Internal("nestpipe sockets: worker ", peer->index, " sent ",
                                    frame.count, " entries into call '", ex->label,
                                    "' of capacity ", ex->capacity,
                                    ": the workers traced different programs");
          }
          DeliverCopy(ex, row, frame.count, peer->buffered);
          complete = TakeIfReady(frame.key, frame.seq);
        } else {
          early_[std::make_tuple(frame.key, frame.seq, peer->index)] =
              EarlyFrame{frame.count, std::move(peer->buffered)};
        }
      }
    }
    peer->buffered = std::vector<char>();
    peer->target_keep.reset();
    if (complete) Complete(std::move(complete));
    return absl::OkStatus();
  }

  // Copies a buffered row into `ex` (mu_ held).
  void DeliverCopy(Exchange* ex, int row, int64_t count, const std::vector<char>& payload) {
    ex->received[row] = true;
    --ex->missing;
    if (count > ex->capacity ||
        static_cast<int64_t>(payload.size()) != count * ex->entry_bytes) {
      ex->status = errors::Internal(
          "nestpipe sockets: worker ", ex->members[row], " sent ", count, " entries (",
          payload.size(), " bytes) into call '", ex->label, "' of capacity ", ex->capacity,
          " x ", ex->entry_bytes, " bytes: the workers traced different programs");
      return;
    }
    std::memcpy(ex->output + row * ex->capacity * ex->entry_bytes, payload.data(),
                payload.size());
    FillAfter(ex, row, count);
    ex->recv_counts[row] = static_cast<int32_t>(count);
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

  // Fails the mesh when a pending exchange waits on a peer that is silent (no byte at all for
  // stall_seconds) or alive but not making the call (no data byte for call_timeout_seconds).
  void Watch() {
    Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& item : pending_) {
        Exchange* ex = item.second.get();
        for (size_t r = 0; r < ex->members.size() && status.ok(); ++r) {
          if (ex->received[r]) continue;
          Peer* peer = peers_[ex->members[r]].get();
          if (peer->said_bye.load() && !ex->arriving[r]) {
            status = errors::Unavailable(
                "nestpipe sockets: worker ", peer->index, " (", peer->address,
                ") finished its program normally while worker ", index_,
                " waits for its part of call '", ex->label, "' (call ", ex->seq,
                " of its key): the workers ran different numbers of steps or calls");
            break;
          }
          const double silent = SecondsSince(peer->last_heard_nanos.load());
          if (silent > options_.stall_seconds) {
            status = errors::DeadlineExceeded(
                "nestpipe sockets: worker ", peer->index, " (", peer->address,
                ") has sent nothing, not even a heartbeat, for ", options_.stall_seconds,
                " s while worker ", index_, " waits for its part of call '", ex->label,
                "': it is stopped or its machine is gone");
            break;
          }
          const int64_t since = std::max(ex->started_nanos, peer->last_data_nanos.load());
          if (SecondsSince(since) > options_.call_timeout_seconds) {
            status = errors::DeadlineExceeded(
                "nestpipe sockets: worker ", peer->index, " (", peer->address,
                ") did not make call '", ex->label, "' (call ", ex->seq,
                " of its key) within ", options_.call_timeout_seconds, " s while worker ",
                index_, " waited in it; it is alive (its heartbeats arrive), so it runs a "
                "different program or is stuck in other work (raise collective_timeout_seconds "
                "if a step can legitimately take longer)");
            break;
          }
        }
        if (!status.ok()) break;
      }
    }
    if (!status.ok()) Fail(status);
  }

  // --- sending ----------------------------------------------------------------------------

  void SendLoop() {
    std::vector<struct epoll_event> events(64);
    while (true) {
      int n = ::epoll_wait(send_epoll_, events.data(), static_cast<int>(events.size()),
                           static_cast<int>(kHeartbeatSeconds * 1000 / 2));
      uint64_t drained;
      while (::read(wake_fd_, &drained, sizeof(drained)) > 0) {
      }
      if (failed_.load()) {
        SendAborts();
        return;
      }
      (void)n;
      // Level-triggered and cheap: try every peer with queued frames (a peer whose socket is
      // full returns at once and is watched for EPOLLOUT).
      const int64_t now = NowNanos();
      for (auto& peer : peers_) {
        if (!peer) continue;
        bool idle;
        {
          std::lock_guard<std::mutex> lock(peer->send_mu);
          idle = peer->queue.empty();
        }
        // After the goodbye nothing more is sent (its side of the connection may be closed).
        if (idle && !finished_.load() &&
            (now - peer->last_sent_nanos) * 1e-9 >= kHeartbeatSeconds) {
          Frame beat;
          beat.type = kHeartbeat;
          Post(peer.get(), beat, nullptr, nullptr);
          idle = false;
        }
        if (!idle) {
          Status status = WriteTo(peer.get());
          if (!status.ok()) {
            Fail(status);
            SendAborts();
            return;
          }
        }
      }
    }
  }

  // Writes `peer`'s queued frames until its socket would block.
  Status WriteTo(Peer* peer) {
    while (true) {
      Outgoing* message;
      {
        std::lock_guard<std::mutex> lock(peer->send_mu);
        if (peer->queue.empty()) break;
        message = &peer->queue.front();  // deque: stable while others push at the back
      }
      const size_t total = kHeaderBytes + message->size;
      struct iovec iov[2];
      int count = 0;
      if (peer->written < kHeaderBytes) {
        iov[count++] = {message->header + peer->written, kHeaderBytes - peer->written};
        if (message->size > 0) iov[count++] = {const_cast<char*>(message->data), message->size};
      } else {
        const size_t done = peer->written - kHeaderBytes;
        iov[count++] = {const_cast<char*>(message->data) + done, message->size - done};
      }
      struct msghdr hdr = {};
      hdr.msg_iov = iov;
      hdr.msg_iovlen = count;
      // MSG_NOSIGNAL: a peer that died gives EPIPE here, not a SIGPIPE that kills the process.
      ssize_t sent = ::sendmsg(peer->fd, &hdr, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          WatchOut(peer, true);
          return absl::OkStatus();
        }
        return errors::Unavailable("nestpipe sockets: worker ", index_, " could not send to "
                                   "worker ", peer->index, " (", peer->address, "): ",
                                   strerror(errno), "; that worker has probably failed (see "
                                   "its log)");
      }
      bytes_sent_ += sent;
      peer->written += static_cast<size_t>(sent);
      peer->last_sent_nanos = NowNanos();
      if (peer->written == total) {
        peer->written = 0;
        ++frames_sent_;
        std::lock_guard<std::mutex> lock(peer->send_mu);
        peer->queue.pop_front();
      }
    }
    WatchOut(peer, false);
    return absl::OkStatus();
  }

  void WatchOut(Peer* peer, bool on) {
    if (peer->watching_out == on) return;
    struct epoll_event out = {};
    out.events = on ? EPOLLOUT : 0;
    out.data.ptr = peer;
    ::epoll_ctl(send_epoll_, EPOLL_CTL_MOD, peer->fd, &out);
    peer->watching_out = on;
  }

  // After a failure: tells every peer why (where no frame is half written), then closes.
  void SendAborts() {
    std::string reason;
    bool tell;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reason = std::string(failure_.message()).substr(0, kMaxAbortBytes);
      tell = tell_peers_;
    }
    for (auto& peer : peers_) {
      if (!peer) continue;
      if (tell && peer->written == 0) {
        char header[kHeaderBytes];
        Frame frame;
        frame.type = kAbort;
        frame.nbytes = static_cast<int64_t>(reason.size());
        EncodeHeader(frame, header);
        struct iovec iov[2] = {{header, kHeaderBytes},
                               {const_cast<char*>(reason.data()), reason.size()}};
        struct msghdr hdr = {};
        hdr.msg_iov = iov;
        hdr.msg_iovlen = 2;
        ::sendmsg(peer->fd, &hdr, MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort
      }
      ::shutdown(peer->fd, SHUT_RDWR);
      std::lock_guard<std::mutex> lock(peer->send_mu);
      peer->queue.clear();
    }
  }

  std::mutex setup_mu_;
  std::atomic<bool> connected_{false};
  std::atomic<bool> failed_{false};
  std::atomic<bool> abort_received_{false};
  std::atomic<bool> finished_{false};
  int index_ = 0;
  int num_workers_ = 0;
  Options options_;
  std::vector<std::unique_ptr<Peer>> peers_;
  int recv_epoll_ = -1, send_epoll_ = -1, wake_fd_ = -1;

  std::mutex mu_;
  Status failure_;
  bool tell_peers_ = true;
  std::map<int64_t, int64_t> next_seq_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Exchange>> pending_;
  std::map<std::tuple<int64_t, int64_t, int>, EarlyFrame> early_;
  int64_t buffered_bytes_ = 0;

  std::atomic<int64_t> bytes_sent_{0}, bytes_received_{0}, frames_sent_{0},
      frames_received_{0};
};

}  // namespace

REGISTER_OP("NestpipeSocketAdopt")
    .Input("index: int32")
    .Input("fds: int32")
    .Input("addresses: string")
    .Attr("call_timeout_seconds: float = 600")
    .Attr("stall_seconds: float = 20")
    .Attr("max_message_bytes: int = 4294967296")
    .Attr("max_buffered_bytes: int = 1073741824")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Takes ownership of worker `index`'s connected, authenticated sockets (`fds[j]` to worker j, -1
for itself; `addresses[j]` names worker j in errors) and starts the mesh's two I/O threads.
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
    .Attr("label: string = ''")
    .Attr("group: list(int) = []")
    .SetIsStateful()
    // A failed peer is an UnavailableError, as for TensorFlow's own collectives (not turned
    // into an InternalError as for ops that do not communicate).
    .SetIsDistributedCommunication()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle input;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 2, &input));
      c->set_output(0, input);
      c->set_output(1, c->Vector(c->Dim(input, 0)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
All-to-all over the socket mesh among `group` (worker indices, this worker's among them; empty:
every worker, in index order): sends the first send_counts[j] entries of input[j] to the j-th
member; output[i] holds the recv_counts[i] entries member i sent, then `fill`. Calls are paired
across workers by (key, how many calls of key this process made before); `label` names the call
in errors. `ordering_token` (unread) is the stream's token: TensorFlow's automatic control
dependencies order one stream's calls in program order and leave different streams free to
overlap, as for its own collectives.
)doc");

REGISTER_OP("NestpipeSocketFinish")
    .Attr("stall_seconds: float = 20")
    .Output("delivered: bool")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
The program ended: sends every peer a goodbye after the frames still queued, waits for them to
be delivered (giving up after `stall_seconds` without progress), then closes this side of the
connections. `delivered` says whether everything arrived.
)doc");

REGISTER_OP("NestpipeSocketStats")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(6));
      return absl::OkStatus();
    })
    .Doc(R"doc(
[bytes sent, bytes received, frames sent, frames received, peers, I/O threads] of this process's
mesh since it opened.
)doc");

class SocketAdoptOp : public OpKernel {
 public:
  explicit SocketAdoptOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    float call_timeout, stall;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("call_timeout_seconds", &call_timeout));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stall_seconds", &stall));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_message_bytes", &options_.max_message_bytes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_buffered_bytes", &options_.max_buffered_bytes));
    options_.call_timeout_seconds = call_timeout;
    options_.stall_seconds = stall;
  }
  void Compute(OpKernelContext* ctx) override {
    const auto fds = ctx->input(1).flat<int32>();
    const auto addresses = ctx->input(2).flat<tstring>();
    OP_REQUIRES(ctx, fds.size() == addresses.size() && fds.size() >= 2,
                errors::InvalidArgument("nestpipe sockets: fds and addresses must be two equal "
                                        "lists of at least 2 workers"));
    std::vector<int> fd_list(fds.data(), fds.data() + fds.size());
    std::vector<std::string> address_list;
    for (int64_t j = 0; j < addresses.size(); ++j) address_list.emplace_back(addresses(j));
    OP_REQUIRES_OK(ctx, Mesh::Get()->Adopt(ctx->input(0).scalar<int32>()(), fd_list,
                                           address_list, options_));
  }

 private:
  Mesh::Options options_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSocketAdopt").Device(DEVICE_CPU), SocketAdoptOp);

class SocketStatsOp : public OpKernel {
 public:
  explicit SocketStatsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({6}), &out));
    Mesh::Get()->Stats(out->flat<int64>().data());
  }
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSocketStats").Device(DEVICE_CPU), SocketStatsOp);

class SocketFinishOp : public OpKernel {
 public:
  explicit SocketFinishOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stall_seconds", &stall_));
  }
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<bool>()() = Mesh::Get()->Finish(stall_);
  }

 private:
  float stall_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSocketFinish").Device(DEVICE_CPU), SocketFinishOp);

class SocketAllToAllOp : public AsyncOpKernel {
 public:
  explicit SocketAllToAllOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("group", &group_));
  }

  // Starting an exchange copies this worker's own row and queues the frames (the send thread
  // writes them): cheap, so TensorFlow's executor starts it inline as soon as its input is
  // ready instead of queueing it behind the compute ops that are ready (with one inter-op
  // thread per worker those would delay every frame, and the overlap, by their run).
  bool IsExpensive() override { return false; }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Mesh* mesh = Mesh::Get();
    OP_REQUIRES_ASYNC(ctx, mesh->connected(),
                      errors::FailedPrecondition("nestpipe sockets: the mesh is not connected "
                                                 "(NestPipeStrategy connects it at start-up)"),
                      done);
    const int num_workers = mesh->num_workers();
    std::vector<int> members;
    if (group_.empty()) {
      for (int j = 0; j < num_workers; ++j) members.push_back(j);
    } else {
      members.assign(group_.begin(), group_.end());
    }
    std::vector<int> row_of(num_workers, -1);
    for (size_t r = 0; r < members.size(); ++r) {
      OP_REQUIRES_ASYNC(ctx, members[r] >= 0 && members[r] < num_workers &&
                                 row_of[members[r]] < 0,
                        errors::InvalidArgument("nestpipe sockets: group ", members.size(),
                                                " lists a worker twice or outside [0, ",
                                                num_workers, ")"),
                        done);
      row_of[members[r]] = static_cast<int>(r);
    }
    OP_REQUIRES_ASYNC(ctx, row_of[mesh->index()] >= 0,
                      errors::InvalidArgument("nestpipe sockets: worker ", mesh->index(),
                                              " is not in the group of call '", label_, "'"),
                      done);
    const int64_t rows = static_cast<int64_t>(members.size());
    const Tensor& input = ctx->input(0);
    const Tensor& counts = ctx->input(1);
    const Tensor& fill = ctx->input(2);
    OP_REQUIRES_ASYNC(ctx, input.dims() >= 2 && input.dim_size(0) == rows,
                      errors::InvalidArgument("nestpipe socket all-to-all needs [", rows,
                                              ", n, ...], got ", input.shape().DebugString()),
                      done);
    OP_REQUIRES_ASYNC(ctx, counts.NumElements() == rows && fill.NumElements() == 1,
                      errors::InvalidArgument("send_counts must hold ", rows,
                                              " counts and fill one value"),
                      done);
    const int64_t capacity = input.dim_size(1);
    const auto send = counts.flat<int32>();
    for (int64_t j = 0; j < rows; ++j) {
      OP_REQUIRES_ASYNC(ctx, send(j) >= 0 && send(j) <= capacity,
                        errors::InvalidArgument("send_counts[", j, "] = ", send(j),
                                                " outside [0, ", capacity, "]"),
                        done);
    }
    Tensor* output = nullptr;
    Tensor* received = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, input.shape(), &output), done);
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(1, TensorShape({rows}), &received), done);
    auto ex = std::make_unique<Exchange>();
    const int64_t element = DataTypeSize(input.dtype());
    ex->label = label_;
    ex->key = ctx->input(3).scalar<int64>()();
    ex->members = std::move(members);
    ex->row_of = std::move(row_of);
    ex->output_keep = std::make_shared<Tensor>(*output);
    ex->counts_keep = std::make_shared<Tensor>(*received);
    ex->output = static_cast<char*>(const_cast<char*>(output->tensor_data().data()));
    ex->recv_counts = received->flat<int32>().data();
    ex->capacity = capacity;
    ex->entry_bytes = capacity > 0 ? input.NumElements() / (rows * capacity) * element : element;
    const char* fill_bytes = fill.tensor_data().data();
    ex->fill.assign(fill_bytes, fill_bytes + element);
    ex->done = [ctx, done](Status status) {
      ctx->SetStatus(status);
      done();
    };
    CancellationManager* cancellation = ctx->cancellation_manager();
    if (cancellation != nullptr) {
      CancellationToken token = cancellation->get_cancellation_token();
      const std::string label = label_;
      const bool registered = cancellation->RegisterCallback(token, [mesh, label] {
        mesh->Fail(errors::Cancelled("nestpipe sockets: call '", label, "' was cancelled "
                                     "(its step was aborted); the mesh is closed"));
      });
      if (!registered) {
        ctx->SetStatus(errors::Cancelled("nestpipe sockets: call '", label_,
                                         "' was cancelled before it started"));
        done();
        return;
      }
      ex->cancellation = cancellation;
      ex->token = token;
    }
    // The frames may be written after the op is done: they keep the input's buffer alive.
    auto keep = std::make_shared<const Tensor>(input);
    mesh->AllToAll(input.tensor_data().data(), keep, send.data(), std::move(ex));
  }

 private:
  std::string label_;
  std::vector<int32> group_;
};
REGISTER_KERNEL_BUILDER(Name("NestpipeSocketAllToAll").Device(DEVICE_CPU), SocketAllToAllOp);

}  // namespace nestpipe
}  // namespace tensorflow

#include "fs/transport/uring_loop.h"
#include "fs/transport/kernel_order.h"

#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "dnvme/log.h"

namespace dnvme::fs {
namespace {

// The 7.42 ring ABI, which Debian 12's <linux/fuse.h> (7.38) does not declare.
constexpr uint32_t kCmdRegister = 1;        // FUSE_IO_URING_CMD_REGISTER
constexpr uint32_t kCmdCommitAndFetch = 2;  // FUSE_IO_URING_CMD_COMMIT_AND_FETCH
struct EntInOut {                           // fuse_uring_ent_in_out
  uint64_t flags;
  uint64_t commit_id;
  uint32_t payload_sz;
  uint32_t padding;
  uint64_t reserved;
};
struct ReqHeader {  // fuse_uring_req_header
  char in_out[128];
  char op_in[128];
  EntInOut ent;
};
static_assert(sizeof(ReqHeader) == 288);
struct CmdReq {  // fuse_uring_cmd_req, in the SQE's 80-byte command area
  uint64_t flags;
  uint64_t commit_id;
  uint16_t qid;
  uint8_t padding[6];
};

// Room in front of the payload for the fuse_in_header and the op's header (at most 128 bytes),
// a page so the payload itself stays page-aligned.
constexpr size_t kPrefix = 4096;
constexpr std::chrono::milliseconds kPoll{100};

struct FreeDeleter {
  void operator()(void* p) const { free(p); }
};

}  // namespace

struct UringLoop::Entry {
  std::unique_ptr<ReqHeader, FreeDeleter> header;
  std::unique_ptr<char, FreeDeleter> buf;  // kPrefix + payload
  char* payload = nullptr;
  size_t payload_bytes = 0;
  int qid = 0;
  io_uring ring{};
  bool ring_ok = false;
  iovec iov[2]{};
  // The request being served (its fuse_in_header::unique), 0 between requests: what names the
  // entry a reply belongs to (TakeReply) -- the kernel's uniques are distinct while in flight.
  std::atomic<uint64_t> serving{0};
  uint64_t commit_id = 0;
  std::atomic<bool> replied{false};
  std::optional<uint32_t> write_flags;

  ~Entry() {
    if (ring_ok) io_uring_queue_exit(&ring);
  }
};

bool KernelUringEnabled() {
  std::ifstream f("/sys/module/fuse/parameters/enable_uring");
  std::string v;
  return f && (f >> v) && (v == "Y" || v == "1");
}

int PossibleCpus() {
  // "0-3" or "0-3,6-7": the kernel numbers queues 0..num_possible_cpus()-1.
  std::ifstream f("/sys/devices/system/cpu/possible");
  std::string s;
  if (!(f >> s)) return static_cast<int>(sysconf(_SC_NPROCESSORS_CONF));
  int count = 0;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    std::string part = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t dash = part.find('-');
    count += dash == std::string::npos
                 ? 1
                 : std::atoi(part.c_str() + dash + 1) - std::atoi(part.c_str()) + 1;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return count > 0 ? count : 1;
}

UringLoop::UringLoop(fuse_session* se, int threads_per_queue, int64_t max_request)
    : se_(se),
      threads_per_queue_(threads_per_queue),
      queues_(PossibleCpus()),
      // The kernel refuses a payload buffer below max(8 KiB, max_write, max_pages pages).
      payload_bytes_(static_cast<size_t>(max_request) + 4096),
      entries_(new std::atomic<Entry*>[static_cast<size_t>(queues_ * threads_per_queue)]) {
  for (int i = 0; i < queues_ * threads_per_queue; ++i) entries_[i].store(nullptr);
}

UringLoop::~UringLoop() {
  stop_.store(true);
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

Result<std::unique_ptr<UringLoop>> UringLoop::Create(fuse_session* se, int threads_per_queue,
                                                     int dev_threads, int64_t max_request) {
  if (!KernelUringEnabled()) {
    return Status::FromErrno(EOPNOTSUPP,
                             "FUSE over io_uring is off in this kernel (echo Y > "
                             "/sys/module/fuse/parameters/enable_uring, as root, before mounting)");
  }
  std::unique_ptr<UringLoop> loop(new UringLoop(se, threads_per_queue, max_request));
  DNVME_ASSIGN_OR_RETURN(loop->dev_loop_, ReadLoop::Create(se, dev_threads, 0, max_request));
  return loop;
}

std::string UringLoop::Describe() const {
  return "FUSE over io_uring: " + std::to_string(queues_) + " queues (one per possible CPU), " +
         std::to_string(threads_per_queue_) +
         " threads each, pinned; INIT, FORGET and INTERRUPT read(2) from /dev/fuse; no "
         "spliced or adopted payloads";
}

std::string UringLoop::StatsJson() const {
  auto dev = nlohmann::json::parse(dev_loop_->StatsJson());
  return nlohmann::json{{"kind", TransportKindName(kind())},
                        {"queues", queues_},
                        {"threads_per_queue", threads_per_queue_},
                        {"entries_serving", registered_.load(std::memory_order_relaxed)},
                        {"requests_ring", requests_ring_.load(std::memory_order_relaxed)},
                        {"ring_errors", ring_errors_.load(std::memory_order_relaxed)},
                        {"requests_read", dev["requests_read"]},
                        {"threads", dev["threads"]}}
      .dump();
}

UringLoop::Entry* UringLoop::EntryServing(uint64_t unique) const {
  if (unique == 0) return nullptr;  // a notification
  auto match = [&](int slot) {
    Entry* e = entries_[slot].load(std::memory_order_acquire);
    return e != nullptr && e->serving.load(std::memory_order_acquire) == unique ? e : nullptr;
  };
  // A reply comes from the ring thread serving it, pinned to its queue's CPU: look there first,
  // so a reply costs threads_per_queue compares, not one per ring thread of the machine.
  const int cpu = sched_getcpu();
  const int first = cpu >= 0 && cpu < queues_ ? cpu * threads_per_queue_ : 0;
  for (int i = 0; i < queues_ * threads_per_queue_; ++i) {
    const int slot = (first + i) % (queues_ * threads_per_queue_);
    if (Entry* e = match(slot)) return e;
  }
  return nullptr;
}

std::optional<uint32_t> UringLoop::WriteFlags(const fuse_bufvec& bufv) const {
  if (bufv.count == 0 || (bufv.buf[0].flags & FUSE_BUF_IS_FD)) return std::nullopt;
  // The payload lies in the entry's buffer it was delivered into.
  const char* p = static_cast<const char*>(bufv.buf[0].mem);
  for (int i = 0; i < queues_ * threads_per_queue_; ++i) {
    Entry* e = entries_[i].load(std::memory_order_acquire);
    if (e != nullptr && p >= e->buf.get() && p < e->payload + e->payload_bytes) {
      return e->write_flags;
    }
  }
  return dev_loop_->WriteFlags(bufv);
}

bool UringLoop::TakeReply(const iovec* iov, int count, ssize_t* written) {
  if (count < 1 || iov[0].iov_len != sizeof(fuse_out_header)) return false;
  fuse_out_header out;
  std::memcpy(&out, iov[0].iov_base, sizeof(out));
  Entry* e = EntryServing(out.unique);
  if (e == nullptr) return false;  // a notification or a /dev/fuse request's reply
  size_t total = 0;
  for (int i = 1; i < count; ++i) total += iov[i].iov_len;
  if (total > e->payload_bytes) {
    Logger().error("reply of {} bytes to request {} exceeds the ring payload ({})", total,
                   out.unique, e->payload_bytes);
    errno = EINVAL;
    *written = -1;
    return true;
  }
  size_t at = 0;
  for (int i = 1; i < count; ++i) {
    std::memmove(e->payload + at, iov[i].iov_base, iov[i].iov_len);
    at += iov[i].iov_len;
  }
  std::memcpy(e->header->in_out, &out, sizeof(out));
  e->header->ent.payload_sz = static_cast<uint32_t>(total);
  e->replied.store(true, std::memory_order_release);
  *written = static_cast<ssize_t>(sizeof(out) + total);
  return true;
}

bool UringLoop::Serve(Entry& e) {
  fuse_in_header in;
  std::memcpy(&in, e.header->in_out, sizeof(in));
  const uint32_t payload = e.header->ent.payload_sz;
  e.commit_id = e.header->ent.commit_id;
  e.replied.store(false, std::memory_order_relaxed);
  e.write_flags.reset();
  // The request as the kernel built it: header, the op's own header (in op_in), the payload.
  const bool sane = in.len >= sizeof(in) + payload && payload <= e.payload_bytes &&
                    in.len - sizeof(in) - payload <= sizeof(e.header->op_in);
  if (sane) {
    const size_t op = in.len - sizeof(in) - payload;
    char* start = e.payload - sizeof(in) - op;
    std::memcpy(start, &in, sizeof(in));
    std::memcpy(start + sizeof(in), e.header->op_in, op);
    if (in.opcode == FUSE_WRITE && op >= sizeof(fuse_write_in)) {
      fuse_write_in w;
      std::memcpy(&w, e.header->op_in, sizeof(w));
      e.write_flags = w.write_flags;
    }
    fuse_buf buf{};
    buf.size = in.len;
    buf.mem = start;
    e.serving.store(in.unique, std::memory_order_release);
    KernelOrderAfterRequest();
    fuse_session_process_buf(se_, &buf);
    e.serving.store(0, std::memory_order_release);
    requests_ring_.fetch_add(1, std::memory_order_relaxed);
  } else {
    Logger().error("malformed ring request {} (opcode {}, len {}, payload {})", in.unique,
                   in.opcode, in.len, payload);
  }
  if (!e.replied.load(std::memory_order_acquire)) {
    // Every fetched request is committed before the entry fetches again: one libfuse did not
    // answer gets EIO rather than leaving its caller waiting.
    fuse_out_header out{};
    out.len = sizeof(out);
    out.error = -EIO;
    out.unique = in.unique;
    std::memcpy(e.header->in_out, &out, sizeof(out));
    e.header->ent.payload_sz = 0;
  }
  return !fuse_session_exited(se_);
}

void UringLoop::RingThread(int qid, int index) {
  BlockShutdownSignals();  // they end the session on the main thread
  // Requests of CPU `qid` come to this queue: serve them there.
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  CPU_SET(qid, &cpus);
  if (pthread_setaffinity_np(pthread_self(), sizeof(cpus), &cpus) != 0) {
    Logger().debug("ring thread {}.{}: not pinned to CPU {}", qid, index, qid);
  }

  Entry e;
  e.qid = qid;
  e.payload_bytes = payload_bytes_;
  void* h = nullptr;
  void* b = nullptr;
  if (posix_memalign(&h, 4096, sizeof(ReqHeader)) != 0 ||
      posix_memalign(&b, 4096, kPrefix + payload_bytes_) != 0) {
    free(h);
    Logger().error("ring thread {}.{}: no memory for its entry", qid, index);
    ring_errors_.fetch_add(1);
    return;
  }
  e.header.reset(static_cast<ReqHeader*>(h));
  e.buf.reset(static_cast<char*>(b));
  std::memset(e.header.get(), 0, sizeof(ReqHeader));
  e.payload = e.buf.get() + kPrefix;
  e.iov[0] = {e.header.get(), sizeof(ReqHeader)};
  e.iov[1] = {e.payload, payload_bytes_};
  if (int rc = io_uring_queue_init(4, &e.ring, IORING_SETUP_SQE128); rc < 0) {
    Logger().error("ring thread {}.{}: io_uring_queue_init: {}", qid, index, std::strerror(-rc));
    ring_errors_.fetch_add(1);
    return;
  }
  e.ring_ok = true;
  const int slot = qid * threads_per_queue_ + index;
  entries_[slot].store(&e, std::memory_order_release);
  struct Unlist {  // before `e` goes: TakeReply and WriteFlags must not find it any more
    std::atomic<Entry*>& at;
    ~Unlist() { at.store(nullptr, std::memory_order_release); }
  } unlist{entries_[slot]};

  // The ring exists only once INIT is answered with FUSE_OVER_IO_URING.
  while (!stop_.load() && !(protocol_ && protocol_->init_replied())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (stop_.load() || !protocol_->uring()) return;

  auto submit = [&](uint32_t cmd_op) -> int {
    io_uring_sqe* sqe = io_uring_get_sqe(&e.ring);
    if (sqe == nullptr) return -EBUSY;
    std::memset(sqe, 0, 2 * sizeof(io_uring_sqe));  // SQE128: the command area too
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = fuse_session_fd(se_);
    sqe->cmd_op = cmd_op;
    if (cmd_op == kCmdRegister) {
      sqe->addr = reinterpret_cast<uint64_t>(e.iov);
      sqe->len = 2;
    }
    CmdReq req{};
    req.qid = static_cast<uint16_t>(qid);
    req.commit_id = cmd_op == kCmdCommitAndFetch ? e.commit_id : 0;
    std::memcpy(sqe->cmd, &req, sizeof(req));
    int rc;
    do {
      rc = io_uring_submit(&e.ring);
    } while (rc == -EINTR);
    return rc < 0 ? rc : 0;
  };

  bool serving = false;
  int rc = submit(kCmdRegister);
  while (rc == 0 && !stop_.load()) {
    io_uring_cqe* cqe = nullptr;
    __kernel_timespec ts{0, std::chrono::nanoseconds(kPoll).count()};
    int w = io_uring_wait_cqe_timeout(&e.ring, &cqe, &ts);
    if (w == -ETIME || w == -EINTR) continue;
    if (w < 0) {
      rc = w;
      break;
    }
    const int res = cqe->res;
    io_uring_cqe_seen(&e.ring, cqe);
    if (res == -EAGAIN && !serving) {  // the connection is not initialized yet
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      rc = submit(kCmdRegister);
      continue;
    }
    if (res < 0) {
      rc = res;
      break;
    }
    if (!serving) {
      serving = true;
      registered_.fetch_add(1);
    }
    if (!Serve(e)) break;
    rc = submit(kCmdCommitAndFetch);
  }
  // ENOTCONN/ECONNABORTED/ECANCELED: the connection ended (unmount, abort).
  if (rc < 0 && rc != -ENOTCONN && rc != -ECONNABORTED && rc != -ECANCELED && !stop_.load()) {
    Logger().error("ring thread {}.{}: {}", qid, index, std::strerror(-rc));
    ring_errors_.fetch_add(1);
  }
  if (serving) registered_.fetch_sub(1);
}

int UringLoop::Run() {
  dev_loop_->set_protocol(protocol_);
  for (int q = 0; q < queues_; ++q) {
    for (int i = 0; i < threads_per_queue_; ++i)
      threads_.emplace_back(&UringLoop::RingThread, this, q, i);
  }
  const int rc = dev_loop_->Run();
  stop_.store(true);
  for (auto& t : threads_) t.join();
  threads_.clear();
  return rc;
}

}  // namespace dnvme::fs

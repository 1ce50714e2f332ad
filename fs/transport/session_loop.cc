#include "fs/transport/session_loop.h"

#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "dnvme/log.h"
#include "fs/options.h"
#include "fs/transport/kernel_order.h"

namespace dnvme::fs {
namespace {

void WakeHandler(int) {}

}  // namespace

std::optional<fuse_write_in> WriteHeaderOf(const char* head, size_t n) {
  if (n < kWriteHeaderBytes) return std::nullopt;
  fuse_in_header in;
  std::memcpy(&in, head, sizeof(in));
  if (in.opcode != FUSE_WRITE) return std::nullopt;
  fuse_write_in write;
  std::memcpy(&write, head + sizeof(in), sizeof(write));
  return write;
}

SessionLoop::SessionLoop(fuse_session* se, int threads, size_t adoptable, int64_t max_request)
    : se_(se),
      threads_(threads),
      receive_bytes_(static_cast<size_t>(max_request) + 4096),
      adoptable_(adoptable) {}

Status SessionLoop::Init() {
  if (threads_ < 1) return Status::InvalidArgument("session loop needs at least one thread");
  // Each buffer takes a request read at kRequestReadOffset.
  buffers_ = RequestBufferPool::Create(kRequestReadOffset + receive_bytes_,
                                       static_cast<size_t>(threads_) + adoptable_);
  if (!buffers_) return Status::FromErrno(errno, "reserving the request buffers");
  struct sigaction sa {};
  sa.sa_handler = WakeHandler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: the blocked splice/read must return EINTR
  if (sigaction(kWakeSignal, &sa, nullptr) != 0) {
    return Status::FromErrno(errno, "sigaction for the loop's wake signal");
  }
  return Status::Ok();
}

SessionLoop::~SessionLoop() {
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

std::optional<Result<SessionLoop::Received>> SessionLoop::NoRequest(ssize_t n) {
  if (n < 0) {
    const int err = errno;
    // EINTR: a signal (maybe our wake-up); ENOENT: the request was interrupted before we got
    // it; EAGAIN: nothing to read after all. All mean: look again. ENODEV: unmounted.
    if (err == EINTR || err == ENOENT || err == EAGAIN) return Received::kAgain;
    if (err == ENODEV) return Received::kEnded;
    return Status::FromErrno(err, "receiving a FUSE request");
  }
  if (static_cast<size_t>(n) < sizeof(fuse_in_header)) {
    return Status::IoError(EIO, "short FUSE request (" + std::to_string(n) + " bytes)");
  }
  return std::nullopt;
}

Result<SessionLoop::Received> SessionLoop::ReadRequest(Receiver& r, fuse_buf* buf) {
  char* const mem = r.buffer.data() + kRequestReadOffset;
  ssize_t n = read(fuse_session_fd(se_), mem, receive_bytes_);
  if (auto no = NoRequest(n)) return *no;
  requests_read_.fetch_add(1, std::memory_order_relaxed);
  const auto w = WriteHeaderOf(mem, static_cast<size_t>(n));
  r.write_flags = w ? std::optional<uint32_t>(w->write_flags) : std::nullopt;
  buf->size = static_cast<size_t>(n);
  buf->mem = mem;
  return Received::kRequest;
}

std::optional<uint32_t> SessionLoop::WriteFlags(const fuse_bufvec& bufv) const {
  if (bufv.count == 0 || (bufv.buf[0].flags & FUSE_BUF_IS_FD)) return std::nullopt;
  const Receiver* r =
      buffers_->HolderOf(static_cast<const char*>(bufv.buf[0].mem), bufv.buf[0].size);
  return r != nullptr ? r->write_flags : std::nullopt;
}

std::string SessionLoop::StatsJson() const {
  return nlohmann::json{{"kind", TransportKindName(kind())},
                        {"threads", threads_},
                        {"requests_read", requests_read_.load(std::memory_order_relaxed)},
                        {"request_buffers", buffers_->allocated()},
                        {"request_buffers_limit", buffers_->limit()},
                        {"uid_thread_share", share_},
                        {"handed_over", handed_over_.load(std::memory_order_relaxed)}}
      .dump();
}

void SessionLoop::ShareLoopThreads(int reserve, Overflow overflow) {
  if (reserve <= 0 || reserve >= threads_ || !overflow) return;
  share_ = threads_ - reserve;
  overflow_ = std::move(overflow);
  busy_ = std::make_unique<std::atomic<int>[]>(kBusyBuckets);
}

std::optional<uid_t> SessionLoop::SharedUidOf(const Receiver& r, const fuse_buf& buf) const {
  if (share_ == 0) return std::nullopt;
  if (buf.flags & FUSE_BUF_IS_FD) {
    if (r.piped_uid && *r.piped_uid != 0) return r.piped_uid;
    return std::nullopt;
  }
  if (buf.size < sizeof(fuse_in_header)) return std::nullopt;
  fuse_in_header h;
  std::memcpy(&h, buf.mem, sizeof(h));
  if (h.uid == 0) return std::nullopt;
  switch (h.opcode) {
    case FUSE_INIT:
    case FUSE_DESTROY:
    case FUSE_INTERRUPT:
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
      return std::nullopt;
    default:
      return h.uid;
  }
}

bool SessionLoop::HandOver(size_t index, Receiver& r, uid_t uid, fuse_buf* buf) {
  const bool piped = (buf->flags & FUSE_BUF_IS_FD) != 0;
  if (piped && !ToMemory(index, r, buf)) {
    // Part of the request may have left its pipe: as when a request cannot be read back from
    // it (SpliceLoop::Receive), the session ends.
    Logger().error("reading a request out of its pipe to hand it over failed: {}",
                   std::strerror(errno));
    error_.store(-EIO);
    fuse_session_exit(se_);
    return true;
  }
  auto held = std::make_shared<RequestBuffer>(
      buffers_->Adopt(static_cast<const char*>(buf->mem), buf->size));
  if (!*held) {
    // No spare buffer: the request runs here, as received (or, read out of its pipe, from
    // memory), counted.
    if (!piped) return false;
    Process(uid, buf);
    return true;
  }
  const size_t n = buf->size;
  auto job = [this, held, n] {
    fuse_buf b{};
    b.mem = const_cast<char*>(held->payload());
    b.size = n;
    fuse_session_process_buf(se_, &b);
  };
  handed_over_.fetch_add(1, std::memory_order_relaxed);
  if (overflow_(uid, job)) return true;
  // Refused (the uid's own queue is full, or shutting down): here after all, counted.
  fuse_buf b{};
  b.mem = const_cast<char*>(held->payload());
  b.size = n;
  Process(uid, &b);
  return true;
}

void SessionLoop::Process(std::optional<uid_t> uid, fuse_buf* buf) {
  if (uid) Busy(*uid).fetch_add(1, std::memory_order_relaxed);
  fuse_session_process_buf(se_, buf);
  if (uid) Busy(*uid).fetch_sub(1, std::memory_order_relaxed);
}

void BlockShutdownSignals() {
  sigset_t block;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &block, nullptr);
}

void SessionLoop::Worker(size_t index) {
  // Process-directed SIGTERM/SIGINT/SIGHUP go to the main thread (or an engine thread); this
  // one only takes the targeted wake-up.
  BlockShutdownSignals();
  sigset_t wake;
  sigemptyset(&wake);
  sigaddset(&wake, kWakeSignal);
  pthread_sigmask(SIG_UNBLOCK, &wake, nullptr);

  // A handler may adopt the buffer (RequestBufferPool::Adopt); the Receiver then holds the
  // replacement the pool lent it.
  Receiver& r = *receivers_[index];
  if (!buffers_->Lend(&r)) {
    Logger().error("loop thread {}: no request buffer", index);
    error_.store(-ENOMEM);
    fuse_session_exit(se_);
  }
  while (r.buffer && !fuse_session_exited(se_)) {
    fuse_buf buf{};
    Result<Received> got = Receive(index, r, &buf);
    if (!got.ok()) {
      Logger().error("{}", got.status().ToString());
      error_.store(-got.status().ErrnoOr());
      fuse_session_exit(se_);
      break;
    }
    if (got.value() == Received::kAgain) continue;
    if (got.value() == Received::kEnded) {
      fuse_session_exit(se_);
      break;
    }
    KernelOrderAfterRequest();
    if (protocol_ != nullptr && !(buf.flags & FUSE_BUF_IS_FD)) {
      protocol_->ObserveRequest(buf.mem, buf.size);  // INIT is small: always in memory
    }
    const std::optional<uid_t> uid = SharedUidOf(r, buf);
    if (uid && Busy(*uid).load(std::memory_order_relaxed) >= share_ &&
        HandOver(index, r, *uid, &buf)) {
      continue;  // the request was read out whole: nothing of it is left to drop
    }
    Process(uid, &buf);
    if (Status st = AfterDispatch(index, buf); !st.ok()) {
      Logger().error("{}", st.ToString());
      error_.store(-EIO);
      fuse_session_exit(se_);
      break;
    }
  }
  r.buffer.Reset();
  std::lock_guard lock(mu_);
  --running_;
  cv_.notify_all();
}

int SessionLoop::Run() {
  {
    std::lock_guard lock(mu_);
    running_ = threads_;
  }
  receivers_.clear();
  for (int i = 0; i < threads_; ++i) receivers_.push_back(std::make_unique<Receiver>());
  for (int i = 0; i < threads_; ++i) {
    workers_.emplace_back([this, i] { Worker(static_cast<size_t>(i)); });
  }
  // libfuse's signal handlers only set the session's exit flag, so poll it. A loop thread that
  // stops (unmount, error) notifies at once.
  {
    std::unique_lock lock(mu_);
    while (!fuse_session_exited(se_) && running_ == threads_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
    }
  }
  fuse_session_exit(se_);
  // Threads blocked in /dev/fuse wake only for a request or a signal. Repeat the signal: one
  // that lands just before a thread enters splice/read is lost.
  for (;;) {
    {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return running_ == 0; })) break;
    }
    for (auto& t : workers_) pthread_kill(t.native_handle(), kWakeSignal);
  }
  for (auto& t : workers_) t.join();
  workers_.clear();
  return error_.load();
}

Result<std::unique_ptr<ReadLoop>> ReadLoop::Create(fuse_session* se, int threads, size_t adoptable,
                                                   int64_t max_request) {
  std::unique_ptr<ReadLoop> loop(new ReadLoop(se, threads, adoptable, max_request));
  DNVME_RETURN_IF_ERROR(loop->Init());
  return loop;
}

Result<SessionLoop::Received> ReadLoop::Receive(size_t /*index*/, Receiver& r, fuse_buf* buf) {
  return ReadRequest(r, buf);
}

std::string ReadLoop::Describe() const {
  return std::to_string(threads_) +
         " loop threads, requests read(2) into page-aligned buffers write-behind may adopt";
}

}  // namespace dnvme::fs

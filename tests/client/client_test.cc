// dnvme::CtlClient (include/dnvme/client.h) against a stand-in daemon: the requests each call
// writes, how it reads the answers (errors named after the op, protocol breaks as EPROTO) and the
// calls deepnvme.Mount needs (hello, handle.open with some keys, handle.close's count, CUDA IPC
// registration). The real daemon answers the same requests in tests/fs/test_ctl.py (`dnvme ctl`)
// and tests/python/test_mount_client.py (deepnvme.Mount, which goes through this client).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dnvme/client.h"

namespace dnvme {
namespace {

using nlohmann::json;

// The daemon's side of one session, played by a thread at the other end of a SOCK_SEQPACKET pair:
// it records each request (one message, as one write() is one request on the ctl file) and sends
// answer(request), then an empty message, which makes the client's read() return 0 as the end of
// an answer does on the ctl file.
class StandInDaemon {
 public:
  using Answerer = std::function<json(const json& request)>;

  explicit StandInDaemon(Answerer answer) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
      ADD_FAILURE() << "socketpair: errno " << errno;
      return;
    }
    client_fd_ = sv[0];
    ours_ = sv[1];
    thread_ = std::thread([this, answer = std::move(answer)] { Serve(answer); });
  }
  ~StandInDaemon() {
    if (ours_ < 0) return;
    shutdown(ours_, SHUT_RDWR);  // ends Serve's recv whether or not the client is gone
    thread_.join();
    close(ours_);
  }

  // The session, once: the client owns the fd from then on.
  CtlClient Client() { return CtlClient::Adopt(std::exchange(client_fd_, -1)); }

  std::vector<json> requests() {
    std::lock_guard lock(mu_);
    return requests_;
  }
  std::vector<std::string> raw() {
    std::lock_guard lock(mu_);
    return raw_;
  }

 private:
  void Serve(const Answerer& answer) {
    std::vector<char> buf(1 << 20);
    while (true) {
      const ssize_t n = recv(ours_, buf.data(), buf.size(), 0);
      if (n <= 0) return;  // the client closed its end, or the destructor shut ours
      std::string text(buf.data(), static_cast<size_t>(n));
      json request = json::parse(text, nullptr, false);
      {
        std::lock_guard lock(mu_);
        raw_.push_back(text);
        requests_.push_back(request);
      }
      const json a = answer(request);
      const std::string out = a.is_string() ? a.get<std::string>() : a.dump();
      if (send(ours_, out.data(), out.size(), MSG_NOSIGNAL) < 0) return;
      if (send(ours_, "", 0, MSG_NOSIGNAL) < 0) return;
    }
  }

  int client_fd_ = -1;
  int ours_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::vector<json> requests_;  // guarded by mu_
  std::vector<std::string> raw_;
};

json Ok(json fields = json::object()) {
  fields["ok"] = true;
  return fields;
}

json Refused(int err, const std::string& code, const std::string& message) {
  return {{"ok", false}, {"error", {{"code", code}, {"errno", err}, {"message", message}}}};
}

TEST(CtlClientTest, TransfersWriteOneCompactRequestAndReadTheirCount) {
  StandInDaemon daemon([](const json& r) {
    return r["async"].get<bool>() ? Ok({{"op_id", 5}, {"async", true}})
                                  : Ok({{"bytes", r["length"]}, {"op_id", 4}});
  });
  {
    CtlClient c = daemon.Client();
    auto n = c.Pwrite(3, 8, 40, 100, "ckpt/x.bin", 4096);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(n.value(), 100);
    auto id = c.Pread(3, 8, 0, 64, "ckpt/x.bin", 0, /*async=*/true);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    EXPECT_EQ(id.value(), 5);
  }
  const std::vector<json> r = daemon.requests();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0], json({{"op", "pwrite"},
                        {"handle", 3},
                        {"buffer", 8},
                        {"buffer_offset", 40},
                        {"length", 100},
                        {"path", "ckpt/x.bin"},
                        {"file_offset", 4096},
                        {"async", false}}));
  EXPECT_EQ(r[1]["op"], "pread");
  EXPECT_EQ(r[1]["async"], true);
  // Compact, keys in order, no id: what deepnvme.Mount's test checks to know the request came
  // from here.
  EXPECT_EQ(daemon.raw()[0],
            R"({"async":false,"buffer":8,"buffer_offset":40,"file_offset":4096,"handle":3,)"
            R"("length":100,"op":"pwrite","path":"ckpt/x.bin"})");
}

TEST(CtlClientTest, RefusalsCarryTheErrnoAndTheMessageNamedAfterTheOp) {
  StandInDaemon daemon([](const json& r) {
    if (r["op"] == "fsync") return Refused(EACCES, "EACCES", "open 'a.bin': Permission denied");
    if (r["op"] == "pread") return Refused(ENOENT, "ENOENT", "open 'b.bin': No such file");
    return Refused(EBADF, "EBADF", "no handle 9 in this session");
  });
  CtlClient c = daemon.Client();
  Status st = c.Fsync("a.bin");
  EXPECT_EQ(st.error_number(), EACCES);
  EXPECT_EQ(st.message(), "fsync: open 'a.bin': Permission denied");
  auto n = c.Pread(1, 1, 0, 10, "b.bin", 0);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().error_number(), ENOENT);
  EXPECT_EQ(n.status().code(), Status::Code::kNotFound);
  EXPECT_EQ(n.status().message(), "pread: open 'b.bin': No such file");
  // A raw request is named by its own op.
  auto a = c.Call(R"({"op": "wait", "handle": 9})");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().error_number(), EBADF);
  EXPECT_EQ(a.status().message(), "wait: no handle 9 in this session");
}

TEST(CtlClientTest, AnswersThatBreakTheProtocolAreEproto) {
  int calls = 0;
  StandInDaemon daemon([&calls](const json&) -> json {
    switch (calls++) {
      case 0:
        return "not json";
      case 1:
        return json{{"handle", 1}};  // no "ok"
      default:
        return Ok({{"handel", 1}});  // no "handle"
    }
  });
  CtlClient c = daemon.Client();
  for (int i = 0; i < 3; ++i) {
    auto h = c.OpenHandle(std::string("{}"));
    ASSERT_FALSE(h.ok()) << i;
    EXPECT_EQ(h.status().error_number(), EPROTO) << i << ": " << h.status().ToString();
  }
}

TEST(CtlClientTest, HelloChecksTheProtocol) {
  int protocol = CtlClient::kProtocol;
  StandInDaemon daemon([&protocol](const json&) {
    return Ok({{"protocol", protocol}, {"version", "test"}, {"mountpoint", "/mnt"}});
  });
  CtlClient c = daemon.Client();
  auto hello = c.Hello();
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(json::parse(hello.value())["mountpoint"], "/mnt");
  protocol = 2;
  hello = c.Hello();
  ASSERT_FALSE(hello.ok());
  EXPECT_EQ(hello.status().error_number(), EPROTO);
  EXPECT_NE(hello.status().message().find("unsupported control protocol 2"), std::string::npos)
      << hello.status().message();
  EXPECT_EQ(daemon.requests()[0], json({{"op", "hello"}}));
}

TEST(CtlClientTest, OpenHandleWithSomeKeysLeavesTheOthersToTheLiveConfiguration) {
  StandInDaemon daemon([](const json& r) {
    if (r["op"] == "handle.close") return Ok({{"uncollected", 2}});
    return Ok({{"handle", 7}});
  });
  CtlClient c = daemon.Client();
  auto h = c.OpenHandle(std::string(R"({"queue_depth": 8, "block_size": "1M"})"));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h.value(), 7);
  auto live = c.OpenHandle(std::string("{}"));
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  // Not an object: refused here, nothing sent.
  auto bad = c.OpenHandle(std::string("[1]"));
  EXPECT_EQ(bad.status().error_number(), EINVAL);
  auto uncollected = c.CloseHandle(7);
  ASSERT_TRUE(uncollected.ok()) << uncollected.status().ToString();
  EXPECT_EQ(uncollected.value(), 2);

  const std::vector<json> r = daemon.requests();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], json({{"op", "handle.open"}, {"queue_depth", 8}, {"block_size", "1M"}}));
  EXPECT_EQ(r[1], json({{"op", "handle.open"}}));
  EXPECT_EQ(r[2], json({{"op", "handle.close"}, {"handle", 7}}));
}

TEST(CtlClientTest, RegisterCudaIpcSendsTheHandleAndChecksTheSize) {
  int calls = 0;
  StandInDaemon daemon([&calls](const json& r) {
    ++calls;
    if (calls == 1) {
      return Ok({{"buffer", 4}, {"size", r["size"]}, {"writable", false}, {"gpu", true}});
    }
    return Ok({{"buffer", 5}, {"size", 4096}, {"writable", true}});  // not what was asked
  });
  CtlClient c = daemon.Client();
  const std::string handle(128, 'a');
  auto b = c.RegisterCudaIpc(handle, 1, 512, 8192);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->buffer, 4);
  EXPECT_EQ(b->size, 8192);
  EXPECT_FALSE(b->writable);
  auto shrunk = c.RegisterCudaIpc(handle, 0, 0, 8192);
  ASSERT_FALSE(shrunk.ok());
  EXPECT_EQ(shrunk.status().error_number(), EPROTO);
  EXPECT_NE(shrunk.status().message().find("answered size 4096"), std::string::npos);
  auto empty = c.RegisterCudaIpc(handle, 0, 0, 0);
  EXPECT_EQ(empty.status().error_number(), EINVAL);  // refused here

  const std::vector<json> r = daemon.requests();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0], json({{"op", "buffer.register"},
                        {"cuda_ipc", handle},
                        {"device", 1},
                        {"offset", 512},
                        {"size", 8192}}));
}

TEST(CtlClientTest, WaitReportsEachOutcomeWithTheDaemonsOwnMessage) {
  StandInDaemon daemon([](const json&) {
    json ok = {{"op_id", 1},     {"op", "pwrite"}, {"path", "a.bin"}, {"file_offset", 0},
               {"length", 4096}, {"bytes", 4096},  {"ok", true}};
    json failed = {{"op_id", 2},     {"op", "pread"}, {"path", "b.bin"}, {"file_offset", 8192},
                   {"length", 4096}, {"bytes", 100},  {"ok", false}};
    failed["error"] = {{"code", "ENODATA"}, {"errno", ENODATA}, {"message", "short read"}};
    return Ok({{"completed", 2}, {"failed", 1}, {"ops", {ok, failed}}});
  });
  CtlClient c = daemon.Client();
  auto ops = c.Wait(3);
  ASSERT_TRUE(ops.ok()) << ops.status().ToString();
  ASSERT_EQ(ops->size(), 2u);
  const CtlOpOutcome& a = (*ops)[0];
  EXPECT_TRUE(a.status.ok());
  EXPECT_TRUE(a.write);
  EXPECT_EQ(a.bytes, 4096);
  const CtlOpOutcome& b = (*ops)[1];
  EXPECT_FALSE(b.write);
  EXPECT_EQ(b.op_id, 2u);
  EXPECT_EQ(b.path, "b.bin");
  EXPECT_EQ(b.file_offset, 8192);
  EXPECT_EQ(b.bytes, 100);
  EXPECT_EQ(b.status.error_number(), ENODATA);
  EXPECT_EQ(b.status.message(), "short read");  // an outcome, not a refused request: no op name
}

TEST(CtlClientTest, OpenSaysWhenThereIsNoMount) {
  auto c = CtlClient::Open("/proc/self");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().error_number(), ENOENT);
  EXPECT_NE(c.status().message().find("not a dnvmefs mount"), std::string::npos);
  EXPECT_NE(c.status().message().find("No such file"), std::string::npos);
}

TEST(CtlClientTest, AClosedSessionRefusesRequests) {
  CtlClient c;  // never opened (or moved from)
  EXPECT_EQ(c.Stats().status().error_number(), EINVAL);
}

}  // namespace
}  // namespace dnvme

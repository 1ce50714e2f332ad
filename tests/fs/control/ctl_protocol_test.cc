// The control-file request parser (fs/control/ctl_protocol.h): every op's fields, every refusal and
// its errno, path normalisation, answers. No mount needed.
#include "fs/control/ctl_protocol.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace dnvme::fs {
namespace {

using nlohmann::json;

const std::string kMnt = "/mnt/dnvme";

int ErrnoOf(const std::string& text) {
  auto r = ParseCtlRequest(text, kMnt);
  EXPECT_FALSE(r.ok()) << "accepted: " << text;
  if (r.ok()) return 0;
  EXPECT_FALSE(r.status().message().empty());
  return r.status().error_number();
}

TEST(CtlProtocolTest, ParsesEveryOp) {
  auto r = ParseCtlRequest(
      R"({"op":"pread","handle":1,"buffer":2,"length":4096,"path":"a/./b//c","buffer_offset":8,
          "file_offset":12288,"async":true,"id":"x"})",
      kMnt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->op, CtlOp::kPread);
  EXPECT_EQ(r->handle, 1);
  EXPECT_EQ(r->buffer, 2);
  EXPECT_EQ(r->length, 4096);
  EXPECT_EQ(r->buffer_offset, 8);
  EXPECT_EQ(r->file_offset, 12288);
  EXPECT_TRUE(r->async);
  EXPECT_EQ(r->path, "a/b/c");
  EXPECT_EQ(r->id_json, "\"x\"");

  for (const char* text :
       {R"({"op":"hello"})", R"({"op":"config.get"})", R"({"op":"stats","id":3})",
        R"({"op":"config.set","config":{"queue_depth":64}})",
        R"({"op":"handle.open","block_size":"256K","queue_depth":8})",
        R"({"op":"handle.close","handle":1})", R"({"op":"buffer.register","shm":"x"})",
        R"({"op":"buffer.register","source":"/proc/1/fd/3","offset":4096,"size":8192})",
        R"({"op":"buffer.unregister","buffer":1})", R"({"op":"wait","handle":1})",
        R"({"op":"fsync","path":"/mnt/dnvme/a"})",
        R"({"op":"pwrite","handle":1,"buffer":1,"length":0,"path":"z"})"}) {
    auto p = ParseCtlRequest(text, kMnt);
    EXPECT_TRUE(p.ok()) << text << ": " << p.status().ToString();
  }
  auto open = ParseCtlRequest(R"({"op":"handle.open","queue_depth":8})", kMnt);
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(json::parse(open->config_json), json::parse(R"({"queue_depth":8})"));
}

TEST(CtlProtocolTest, ParsesCudaIpcRegistrations) {
  const std::string hex = std::string(64, '0') + std::string(64, 'F');
  auto r = ParseCtlRequest(
      R"({"op":"buffer.register","cuda_ipc":")" + hex + R"(","device":1,"offset":100,"size":4096})",
      kMnt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->cuda_ipc, hex);
  EXPECT_EQ(r->cuda_device, 1);
  EXPECT_EQ(r->region_offset, 100) << "a GPU range may start at any byte";
  EXPECT_EQ(r->region_size, 4096);
  EXPECT_TRUE(r->shm.empty() && r->source.empty());
  auto d = ParseCtlRequest(R"({"op":"buffer.register","cuda_ipc":")" + hex + "\"}", kMnt);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->cuda_device, 0);
}

TEST(CtlProtocolTest, RefusesMalformedInputWithItsErrno) {
  EXPECT_EQ(ErrnoOf(""), EBADMSG);
  EXPECT_EQ(ErrnoOf("{"), EBADMSG);
  EXPECT_EQ(ErrnoOf("[]"), EBADMSG);
  EXPECT_EQ(ErrnoOf("null"), EBADMSG);
  EXPECT_EQ(ErrnoOf("{\"op\":\"stats\"} trailing"), EBADMSG);
  EXPECT_EQ(ErrnoOf("{\"op\":\"st\xff\"}"), EBADMSG);  // not UTF-8
  EXPECT_EQ(ErrnoOf(R"({"op":"nope"})"), EOPNOTSUPP);
  EXPECT_EQ(ErrnoOf(R"({})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":1})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"stats","extra":1})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"stats","id":1.5})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"wait"})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"wait","handle":-1})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"wait","handle":"1"})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"wait","handle":1e3})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"wait","handle":18446744073709551615})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"wait","handle":99999999999999999999999})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"pread","handle":1,"buffer":1,"length":1,"path":"a","async":1})"),
            EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"config.set","config":[]})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"config.set","config":{"num_threads":8}})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"handle.open","single_submit":"true"})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register"})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","shm":"a","source":"b"})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","shm":"a/b"})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","shm":".."})"), EINVAL);
  // CUDA IPC registrations: exactly 128 hex digits, alone, device only with them.
  const std::string hex(128, 'a');
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","cuda_ipc":")" + hex.substr(1) + "\"}"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","cuda_ipc":")" + hex + "0\"}"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","cuda_ipc":")" + std::string(127, 'a') + "x\"}"),
            EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","cuda_ipc":7})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","shm":"a","cuda_ipc":")" + hex + "\"}"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","shm":"a","device":0})"), EINVAL);
  EXPECT_EQ(ErrnoOf(R"({"op":"buffer.register","cuda_ipc":")" + hex + R"(","device":-1})"), EINVAL);
  EXPECT_EQ(ErrnoOf(std::string(R"({"op":"stats","x":")") + std::string(70000, 'a') + "\"}"),
            E2BIG);
  EXPECT_EQ(ErrnoOf(R"({"op":"stats","x":)" + std::string(100, '[') + std::string(100, ']') + "}"),
            EINVAL);
}

TEST(CtlProtocolTest, BracketsInsideStringsDoNotCountAsNesting) {
  const std::string deep_string = R"({"op":"fsync","path":")" + std::string(100, '[') + "\"}";
  auto r = ParseCtlRequest(deep_string, kMnt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->path, std::string(100, '['));
}

TEST(CtlProtocolTest, NormalisesPathsAndRefusesEscapes) {
  EXPECT_EQ(NormaliseCtlPath("a//b/./c/", kMnt).value(), "a/b/c");
  EXPECT_EQ(NormaliseCtlPath("/mnt/dnvme/x/y", kMnt).value(), "x/y");
  EXPECT_EQ(NormaliseCtlPath("/mnt/dnvme", kMnt).value(), "");
  EXPECT_EQ(NormaliseCtlPath("/mnt/dnvme/", kMnt).value(), "");
  EXPECT_EQ(NormaliseCtlPath("x/.dnvme", kMnt).value(), "x/.dnvme");  // only the root's is special
  EXPECT_EQ(NormaliseCtlPath("/mnt/dnvmeX/a", kMnt).status().error_number(), EXDEV);
  EXPECT_EQ(NormaliseCtlPath("/etc/passwd", kMnt).status().error_number(), EXDEV);
  EXPECT_EQ(NormaliseCtlPath("..", kMnt).status().error_number(), EINVAL);
  EXPECT_EQ(NormaliseCtlPath("a/../b", kMnt).status().error_number(), EINVAL);
  EXPECT_EQ(NormaliseCtlPath("/mnt/dnvme/../x", kMnt).status().error_number(), EINVAL);
  EXPECT_EQ(NormaliseCtlPath(".dnvme/ctl", kMnt).status().error_number(), EPERM);
  EXPECT_EQ(NormaliseCtlPath("./.dnvme", kMnt).status().error_number(), EPERM);
  EXPECT_EQ(NormaliseCtlPath("", kMnt).status().error_number(), EINVAL);
  EXPECT_EQ(NormaliseCtlPath(std::string("a\0b", 3), kMnt).status().error_number(), EINVAL);
  EXPECT_EQ(NormaliseCtlPath(std::string(5000, 'a'), kMnt).status().error_number(), ENAMETOOLONG);
  // A transfer needs a file, not the root.
  EXPECT_EQ(ErrnoOf(R"({"op":"pread","handle":1,"buffer":1,"length":1,"path":"/mnt/dnvme"})"),
            EISDIR);
}

TEST(CtlProtocolTest, AnswersAreOneJsonObjectWithIdAndErrorCode) {
  json ok = json::parse(CtlOkResponse("7", R"({"bytes":5})"));
  EXPECT_EQ(ok["ok"], true);
  EXPECT_EQ(ok["id"], 7);
  EXPECT_EQ(ok["bytes"], 5);
  json err = json::parse(CtlErrorResponse("\"q\"", Status::IoError(EBADF, "no handle 3")));
  EXPECT_EQ(err["ok"], false);
  EXPECT_EQ(err["id"], "q");
  EXPECT_EQ(err["error"]["code"], "EBADF");
  EXPECT_EQ(err["error"]["errno"], EBADF);
  EXPECT_EQ(err["error"]["message"], "no handle 3");
  // Invalid UTF-8 in a message (a path) does not break the answer.
  json bad = json::parse(CtlErrorResponse("", Status::InvalidArgument("path \xff")));
  EXPECT_FALSE(bad.contains("id"));
  EXPECT_EQ(ExtractCtlId(R"({"op":"nope","id":"abc"})"), "\"abc\"");
  EXPECT_EQ(ExtractCtlId(R"({"op":"nope","id":[1]})"), "");
  EXPECT_EQ(ExtractCtlId("garbage"), "");
  EXPECT_EQ(ErrnoName(EACCES), "EACCES");
}

}  // namespace
}  // namespace dnvme::fs

// Status and Result<T>: factories, the errno mapping, context wrapping and the early-return macros.
#include "dnvme/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "tests/engine/test_util.h"

namespace dnvme {
namespace {

using Code = Status::Code;

TEST(StatusTest, DefaultIsOk) {
  const Status st;
  EXPECT_TRUE(st.ok());
  EXPECT_EQ(st.code(), Code::kOk);
  EXPECT_EQ(st.error_number(), 0);
  EXPECT_EQ(st.message(), "");
  EXPECT_EQ(st.ToString(), "OK");
  EXPECT_TRUE(Status::Ok().ok());
}

TEST(StatusTest, FactoriesSetCodeErrnoAndMessage) {
  struct Case {
    Status st;
    Code code;
    int err;
  };
  const Case cases[] = {
      {Status::InvalidArgument("m1"), Code::kInvalidArgument, EINVAL},
      {Status::NotFound("m2"), Code::kNotFound, ENOENT},
      {Status::IoError(EIO, "m3"), Code::kIoError, EIO},
      {Status::EndOfFile("m4"), Code::kEndOfFile, ENODATA},
      {Status::ResourceExhausted(ENOMEM, "m5"), Code::kResourceExhausted, ENOMEM},
      {Status::Unsupported(EOPNOTSUPP, "m6"), Code::kUnsupported, EOPNOTSUPP},
      {Status::DataMismatch("m7"), Code::kDataMismatch, EIO},
      {Status::Internal("m8"), Code::kInternal, EFAULT},
  };
  int i = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(Status::CodeName(c.code));
    EXPECT_FALSE(c.st.ok());
    EXPECT_EQ(c.st.code(), c.code);
    EXPECT_EQ(c.st.error_number(), c.err);
    EXPECT_NE(c.st.error_number(), 0) << "an error must always carry an errno";
    EXPECT_EQ(c.st.message(), "m" + std::to_string(i));
    // "<CodeName>: <message>"
    EXPECT_EQ(c.st.ToString(), std::string(Status::CodeName(c.code)) + ": " + c.st.message());
    ++i;
  }
}

TEST(StatusTest, CodeNamesAreDistinctAndNonEmpty) {
  const Code codes[] = {
      Code::kOk,           Code::kInvalidArgument, Code::kNotFound,          Code::kIoError,
      Code::kEndOfFile,    Code::kNoSpace,         Code::kResourceExhausted, Code::kUnsupported,
      Code::kDataMismatch, Code::kInternal};
  std::set<std::string> names;
  for (Code c : codes) {
    const char* name = Status::CodeName(c);
    ASSERT_NE(name, nullptr);
    EXPECT_STRNE(name, "");
    names.insert(name);
  }
  EXPECT_EQ(names.size(), std::size(codes));
}

struct ErrnoCase {
  int err;
  Code code;
};

class FromErrnoTest : public ::testing::TestWithParam<ErrnoCase> {};

TEST_P(FromErrnoTest, MapsCodeAndFormatsMessage) {
  const ErrnoCase c = GetParam();
  const Status st = Status::FromErrno(c.err, "open /data/file at offset 4096");
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.code(), c.code) << st.ToString();
  EXPECT_EQ(st.error_number(), c.err);
  // "<context>: <strerror> (errno N)"
  EXPECT_NE(st.message().find("open /data/file at offset 4096"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(std::strerror(c.err)), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(std::to_string(c.err)), std::string::npos) << st.message();
  EXPECT_EQ(st.message().rfind("open /data/file at offset 4096", 0), 0u)
      << "context should come first: " << st.message();
}

INSTANTIATE_TEST_SUITE_P(
    Errnos, FromErrnoTest,
    ::testing::Values(ErrnoCase{ENOENT, Code::kNotFound}, ErrnoCase{ENOSPC, Code::kNoSpace},
                      ErrnoCase{EDQUOT, Code::kNoSpace}, ErrnoCase{EINVAL, Code::kInvalidArgument},
                      ErrnoCase{EIO, Code::kIoError}, ErrnoCase{EBADF, Code::kIoError},
                      ErrnoCase{EACCES, Code::kIoError}),
    [](const ::testing::TestParamInfo<ErrnoCase>& info) {
      return "errno" + std::to_string(info.param.err);
    });

TEST(StatusTest, WithContextPrefixesMessageAndKeepsCode) {
  const Status st = Status::IoError(EIO, "pwrite /x offset 8192: Input/output error");
  const Status wrapped = st.WithContext("write op 7");
  EXPECT_EQ(wrapped.code(), Code::kIoError);
  EXPECT_EQ(wrapped.error_number(), EIO);
  EXPECT_EQ(wrapped.message(), "write op 7: pwrite /x offset 8192: Input/output error");
  // The original is untouched (WithContext returns a copy).
  EXPECT_EQ(st.message(), "pwrite /x offset 8192: Input/output error");
  // Chaining nests prefixes outermost-first.
  EXPECT_EQ(wrapped.WithContext("outer").message(),
            "outer: write op 7: pwrite /x offset 8192: Input/output error");
}

TEST(StatusTest, WithContextOnOkStaysOk) {
  const Status st = Status::Ok().WithContext("anything");
  EXPECT_TRUE(st.ok());
  EXPECT_EQ(st.code(), Code::kOk);
  EXPECT_EQ(st.error_number(), 0);
}

// ErrnoOr is what every edge (FUSE reply, control file, broker, Python) answers with.
TEST(StatusTest, ErrnoOrIsZeroForOk) {
  EXPECT_EQ(Status::Ok().ErrnoOr(), 0);
  EXPECT_EQ(Status::Ok().ErrnoOr(EPERM), 0);  // a fallback never turns success into an error
}

TEST(StatusTest, ErrnoOrKeepsTheErrorsOwnErrno) {
  EXPECT_EQ(Status::FromErrno(ENOSPC, "w").ErrnoOr(), ENOSPC);
  EXPECT_EQ(Status::IoError(EACCES, "x").ErrnoOr(EPERM), EACCES);
  EXPECT_EQ(Status::NotFound("x").ErrnoOr(), ENOENT);
  EXPECT_EQ(Status::InvalidArgument("x").WithContext("ctx").ErrnoOr(), EINVAL);
}

TEST(StatusTest, ErrnoOrFallsBackWhenTheErrorCarriesNone) {
  // A hand-built error without an errno must still read as a failure at the edge: EIO by
  // default, the caller's fallback otherwise.
  const Status none = Status::IoError(0, "no errno");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error_number(), 0);
  EXPECT_EQ(none.ErrnoOr(), EIO);
  EXPECT_EQ(none.ErrnoOr(EPERM), EPERM);
  EXPECT_EQ(Status::ResourceExhausted(0, "pool").ErrnoOr(), EIO);
}

TEST(ResultTest, HoldsValue) {
  Result<int> r = 42;
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.status().ok());
  EXPECT_EQ(r.value(), 42);
  EXPECT_EQ(*r, 42);
  r.value() = 7;
  EXPECT_EQ(r.value(), 7);
}

TEST(ResultTest, HoldsError) {
  Result<std::string> r = Status::NotFound("no such thing");
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_EQ(r.status().message(), "no such thing");
}

TEST(ResultTest, ConstructedFromOkStatusBecomesInternalError) {
  Result<int> r = Status::Ok();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInternal);
}

TEST(ResultTest, MoveOnlyValueAndArrow) {
  Result<std::unique_ptr<std::string>> r = std::make_unique<std::string>("abc");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->get()->size(), 3u);
  std::unique_ptr<std::string> owned = std::move(r).value();
  ASSERT_NE(owned, nullptr);
  EXPECT_EQ(*owned, "abc");
}

TEST(ResultDeathTest, ValueOfErrorAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Result<int> r = Status::IoError(EIO, "disk on fire");
  EXPECT_DEATH({ (void)r.value(); }, "disk on fire");
}

// ---- Macros
// ---------------------------------------------------------------------------------------

Status Step(bool fail, int* calls) {
  ++*calls;
  return fail ? Status::IoError(EIO, "step failed") : Status::Ok();
}

Status TwoSteps(bool fail_first, int* calls, bool* reached_end) {
  DNVME_RETURN_IF_ERROR(Step(fail_first, calls));
  DNVME_RETURN_IF_ERROR(Step(false, calls));
  *reached_end = true;
  return Status::Ok();
}

TEST(MacroTest, ReturnIfErrorPassesOkThrough) {
  int calls = 0;
  bool end = false;
  DNVME_EXPECT_OK(TwoSteps(false, &calls, &end));
  EXPECT_EQ(calls, 2);
  EXPECT_TRUE(end);
}

TEST(MacroTest, ReturnIfErrorReturnsEarly) {
  int calls = 0;
  bool end = false;
  const Status st = TwoSteps(true, &calls, &end);
  EXPECT_EQ(st.code(), Code::kIoError);
  EXPECT_EQ(st.message(), "step failed");
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(end);
}

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x, bool* reached_end) {
  DNVME_ASSIGN_OR_RETURN(int h, Half(x));
  DNVME_ASSIGN_OR_RETURN(int q, Half(h));  // two on different lines: distinct temporaries
  *reached_end = true;
  return q;
}

TEST(MacroTest, AssignOrReturnAssignsValue) {
  bool end = false;
  Result<int> r = Quarter(12, &end);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, 3);
  EXPECT_TRUE(end);
}

TEST(MacroTest, AssignOrReturnPropagatesError) {
  bool end = false;
  Result<int> r = Quarter(6, &end);  // 6 -> 3 -> odd
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "odd: 3");
  EXPECT_FALSE(end);
}

Status MoveOnlyAssign(bool fail, std::unique_ptr<int>* out) {
  auto make = [fail]() -> Result<std::unique_ptr<int>> {
    if (fail) return Status::NotFound("none");
    return std::make_unique<int>(5);
  };
  DNVME_ASSIGN_OR_RETURN(*out, make());
  return Status::Ok();
}

TEST(MacroTest, AssignOrReturnWorksWithMoveOnlyTypesInStatusFunctions) {
  std::unique_ptr<int> p;
  DNVME_EXPECT_OK(MoveOnlyAssign(false, &p));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(*p, 5);
  std::unique_ptr<int> q;
  const Status st = MoveOnlyAssign(true, &q);
  EXPECT_EQ(st.code(), Code::kNotFound);
  EXPECT_EQ(q, nullptr);
}

}  // namespace
}  // namespace dnvme

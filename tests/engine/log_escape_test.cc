// LogEscape (dnvme/log.h): untrusted text made safe for one log line, and the logger's
// own backstop that keeps every record on one line.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "dnvme/fd.h"
#include "dnvme/log.h"

namespace dnvme {
namespace {

TEST(LogEscape, PrintableTextIsKept) {
  EXPECT_EQ(LogEscape(""), "");
  EXPECT_EQ(LogEscape("dir/file name.bin"), "dir/file name.bin");
  EXPECT_EQ(LogEscape("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"),
            "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80");  // valid UTF-8 stays
}

TEST(LogEscape, LineBreaksAndControlsAreEscaped) {
  EXPECT_EQ(LogEscape("a\nb\rc\td"), "a\\nb\\rc\\td");
  EXPECT_EQ(LogEscape(std::string("nul\0x", 5)), "nul\\x00x");
  EXPECT_EQ(LogEscape("\x1b[31mred\x7f"), "\\x1b[31mred\\x7f");
  // C1 controls (U+0085 NEL, U+009B CSI) and U+2028/U+2029, byte by byte.
  EXPECT_EQ(LogEscape("a\xc2\x85"
                      "b\xc2\x9b"
                      "c"),
            "a\\xc2\\x85b\\xc2\\x9bc");
  EXPECT_EQ(LogEscape("a\xe2\x80\xa8"
                      "b\xe2\x80\xa9"),
            "a\\xe2\\x80\\xa8b\\xe2\\x80\\xa9");
  EXPECT_EQ(LogEscape("\xc2\xa0"), "\xc2\xa0");  // U+00A0 is printable
}

TEST(LogEscape, InvalidUtf8IsShownByteByByte) {
  EXPECT_EQ(LogEscape("\xff\xfe"), "\\xff\\xfe");
  EXPECT_EQ(LogEscape("a\xc3"), "a\\xc3");                           // truncated sequence
  EXPECT_EQ(LogEscape("\xc0\xaf"), "\\xc0\\xaf");                    // overlong '/'
  EXPECT_EQ(LogEscape("\xe0\x80\xaf"), "\\xe0\\x80\\xaf");           // overlong, 3 bytes
  EXPECT_EQ(LogEscape("\xed\xa0\x80"), "\\xed\\xa0\\x80");           // a UTF-16 surrogate
  EXPECT_EQ(LogEscape("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // past U+10FFFF
  EXPECT_EQ(LogEscape("\x80ok"), "\\x80ok");                         // a lone continuation byte
}

TEST(LogEscape, BackslashesAreEscapedUnlessControlOnly) {
  // Otherwise "a\\nb" (a backslash and an n) would read like an escaped newline.
  EXPECT_EQ(LogEscape("a\\nb"), "a\\\\nb");
  EXPECT_EQ(LogEscape("a\\nb", LogEscapeMode::kControlOnly), "a\\nb");
  // The backstop over text escaped at the call site changes nothing.
  const std::string once = LogEscape("x\ny\\\xff");
  EXPECT_EQ(LogEscape(once, LogEscapeMode::kControlOnly), once);
}

TEST(LogEscape, ForgedLineStaysOnItsLine) {
  const std::string path = "a\n[2099-01-01 00:00:00.000] [critical] FORGED";
  const std::string shown = LogEscape(path);
  EXPECT_EQ(shown.find('\n'), std::string::npos);
  EXPECT_EQ(shown, "a\\n[2099-01-01 00:00:00.000] [critical] FORGED");
}

TEST(LogEscape, TheLoggerKeepsEveryRecordOnOneLine) {
  // The backstop: a call site that forgot LogEscape still writes one line.
  const char* base = std::getenv("DNVME_TEST_DIR");
  const std::string dir = base != nullptr && *base != '\0' ? base : "/tmp";
  const std::string path = dir + "/log_escape_test." + std::to_string(getpid()) + ".log";
  ASSERT_TRUE(SetLogFile(path).ok());
  Logger().info("refused: '{}'", "x\n[2099-01-01 00:00:00.000] [critical] FORGED\xff");
  Logger().info("escaped at the call site: '{}'", LogEscape("y\\z\n"));
  Logger().flush();
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  unlink(path.c_str());
  std::string line;
  int lines = 0;
  std::istringstream all(text.str());
  while (std::getline(all, line)) {
    ++lines;
    EXPECT_EQ(line.rfind("[20", 0), 0u) << "a line not written by the logger: " << line;
  }
  EXPECT_EQ(lines, 2) << text.str();
  EXPECT_NE(text.str().find("refused: 'x\\n[2099-01-01 00:00:00.000] [critical] FORGED\\xff'"),
            std::string::npos)
      << text.str();
  EXPECT_NE(text.str().find("escaped at the call site: 'y\\\\z\\n'"), std::string::npos)
      << text.str();
}

// LogThrottle: one line a second from one place, with the count of calls left out.
TEST(LogThrottle, OneLineASecondAndTheCountLeftOut) {
  LogThrottle t;
  uint64_t skipped = 99;
  ASSERT_TRUE(t.Allow(&skipped));
  EXPECT_EQ(skipped, 0u);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(t.Allow(&skipped));
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ASSERT_TRUE(t.Allow(&skipped));
  EXPECT_EQ(skipped, 5u);
  EXPECT_FALSE(t.Allow(&skipped));
}

std::string TestPath(const std::string& leaf) {
  const char* base = std::getenv("DNVME_TEST_DIR");
  const std::string dir = base != nullptr && *base != '\0' ? base : "/tmp";
  return dir + "/log_test." + std::to_string(getpid()) + "." + leaf;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A flood through one call site writes one line a second, the next one saying how many it left.
TEST(LogThrottled, OneCallSiteWritesOneLineASecond) {
  const std::string path = TestPath("throttled.log");
  ASSERT_TRUE(SetLogFile(path).ok());
  auto flood = [](int n) {
    for (int i = 0; i < n; ++i) DNVME_LOG_THROTTLED(info, "refused request {}", i);
  };
  flood(1000);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  flood(1);
  const std::string text = ReadAll(path);
  unlink(path.c_str());
  EXPECT_NE(text.find("refused request 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("refused request 0 (999 more like it not logged)"), std::string::npos)
      << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
}

// A root daemon's log_file in a directory others may write: a symlink planted there, another
// user's file, a hard link or a FIFO is refused, never followed or appended to.
TEST(SetLogFile, RefusesASymlinkAFifoAndAFileWithTwoLinks) {
  const std::string target = TestPath("target");
  const std::string link = TestPath("link.log");
  ASSERT_TRUE(SetLogFile(target).ok());  // created (and used) by us
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  Status st = SetLogFile(link);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find("symlink"), std::string::npos) << st.ToString();
  unlink(link.c_str());
  ASSERT_EQ(::link(target.c_str(), link.c_str()), 0);
  st = SetLogFile(link);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find("one link"), std::string::npos) << st.ToString();
  unlink(link.c_str());
  ASSERT_EQ(mkfifo(link.c_str(), 0600), 0);
  EXPECT_FALSE(SetLogFile(link).ok()) << "a FIFO with no reader: refused, not waited on";
  UniqueFd reader(open(link.c_str(), O_RDONLY | O_NONBLOCK));
  ASSERT_TRUE(reader.valid());
  st = SetLogFile(link);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find("not a regular file"), std::string::npos) << st.ToString();
  reader.Reset();
  unlink(link.c_str());
  if (geteuid() == 0) {
    UniqueFd f(open(link.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600));
    ASSERT_TRUE(f.valid());
    ASSERT_EQ(fchown(f.get(), 65534, 65534), 0);
    st = SetLogFile(link);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.ToString().find("belongs to uid 65534"), std::string::npos) << st.ToString();
    unlink(link.c_str());
  }
  unlink(target.c_str());
}

}  // namespace
}  // namespace dnvme

// Helpers shared by the C++ tests: temp dirs, free ports, plain HTTP/1.0 requests, promtool, and
// waiting for a condition with a deadline (never a fixed sleep).
#ifndef RANKSCOPE_TESTS_TESTING_TEST_UTIL_H_
#define RANKSCOPE_TESTS_TESTING_TEST_UTIL_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rankscope::testing {

// A fresh directory under the test temp dir.
inline std::string MakeTempDir() {
  std::string tmpl = absl::StrCat(::testing::TempDir(), "/rankscope-XXXXXX");
  char* dir = mkdtemp(tmpl.data());
  return dir == nullptr ? std::string() : std::string(dir);
}

// A TCP port on 127.0.0.1 that was free a moment ago (for servers that must be restarted on the
// same port; everything else binds port 0 directly).
inline int PickFreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

struct HttpResponse {
  int status = 0;
  std::string headers;  // lower-cased
  std::string body;
};

// One HTTP/1.0 exchange with 127.0.0.1:port; status 0 when the connection failed.
inline HttpResponse Http(int port, const std::string& method, const std::string& target,
                         const std::string& extra_headers = "") {
  HttpResponse out;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return out;
  }
  const std::string req = absl::StrCat(method, " ", target, " HTTP/1.0\r\nHost: 127.0.0.1\r\n",
                                       extra_headers, "Connection: close\r\n\r\n");
  (void)!write(fd, req.data(), req.size());
  std::string resp;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t split = resp.find("\r\n\r\n");
  if (split == std::string::npos) return out;
  out.headers = absl::AsciiStrToLower(resp.substr(0, split));
  out.body = resp.substr(split + 4);
  std::vector<std::string> first = absl::StrSplit(resp.substr(0, resp.find("\r\n")), ' ');
  if (first.size() >= 2) (void)absl::SimpleAtoi(first[1], &out.status);
  return out;
}

// GET http://127.0.0.1:port/path; returns the body ("" on error).
inline std::string HttpGet(int port, const std::string& path) {
  return Http(port, "GET", path).body;
}

// Runs `promtool check metrics` on `text`; returns its exit status and fills *output.
inline int PromtoolCheckMetrics(const std::string& text, std::string* output) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/metrics.txt";
  FILE* f = std::fopen(path.c_str(), "w");
  std::fwrite(text.data(), 1, text.size(), f);
  std::fclose(f);
  const std::string cmd = absl::StrCat("promtool check metrics < ", path, " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  output->clear();
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Polls `condition` until it holds or `timeout` passes; returns whether it held. For waiting on
// asynchronous delivery; the deadline is a failure bound, not an expected duration.
inline bool WaitFor(const std::function<bool()>& condition,
                    absl::Duration timeout = absl::Seconds(60)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

}  // namespace rankscope::testing

#endif  // RANKSCOPE_TESTS_TESTING_TEST_UTIL_H_

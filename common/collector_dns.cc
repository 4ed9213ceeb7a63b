#include "common/collector_dns.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rankscope {

std::vector<std::string> ExpandCollectorName(std::vector<std::string> shards) {
  if (shards.size() != 1) return shards;
  const std::string& entry = shards[0];
  const size_t colon = entry.rfind(':');
  if (colon == std::string::npos || colon == 0 || absl::StrContains(entry, "/") ||
      absl::StartsWith(entry, "[")) {
    return shards;  // no port, a gRPC URI, or a bracketed IPv6 literal
  }
  const std::string host = entry.substr(0, colon);
  const std::string port = entry.substr(colon + 1);
  uint32_t port_number;
  if (!absl::SimpleAtoi(port, &port_number) || port_number > 65535 ||
      absl::StrContains(host, ":")) {
    return shards;  // "unix:path", "ipv4:...", a scheme of another kind
  }
  in6_addr v6;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1 || inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return shards;  // an IP literal is one collector
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return shards;
  std::set<std::string> ipv4, ipv6;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof(text));
      ipv4.insert(absl::StrCat(text, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof(text));
      ipv6.insert(absl::StrCat("[", text, "]:", port));
    }
  }
  freeaddrinfo(found);
  if (ipv4.size() > 1) return {ipv4.begin(), ipv4.end()};
  if (ipv4.empty() && ipv6.size() > 1) return {ipv6.begin(), ipv6.end()};
  return shards;
}

}  // namespace rankscope

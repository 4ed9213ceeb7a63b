// A collector list given as one DNS name that resolves to several addresses (a Kubernetes
// headless service's name): the addresses it stands for, as common/collector_shard.h hashes them.
//
// Thread-safe. Blocks in getaddrinfo(3) (the resolver's timeout, seconds at worst): called once
// when an agent or the CLI starts, never on a training step.
#ifndef RANKSCOPE_COMMON_COLLECTOR_DNS_H_
#define RANKSCOPE_COMMON_COLLECTOR_DNS_H_

#include <string>
#include <vector>

namespace rankscope {

// `shards` unchanged unless it is one "name:port" entry whose name (not an IP literal, no gRPC
// scheme such as "dns:///" or "unix:") resolves to several IPv4 addresses, or to none of IPv4 and
// several of IPv6: then those addresses as "ip:port" ("[ip]:port" for IPv6), sorted. A name of one
// address per family ("localhost") or that does not resolve (yet) stays a single collector that
// gRPC resolves and retries as before.
std::vector<std::string> ExpandCollectorName(std::vector<std::string> shards);

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_COLLECTOR_DNS_H_

#include "common/keepalive.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace rankscope::keepalive {

void ApplyToChannel(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kPingIntervalMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kPingTimeoutMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // default 2: an idle stream goes blind
}

void ApplyToServer(grpc::ServerBuilder* builder, absl::Duration ping_interval,
                   absl::Duration ping_timeout, const AgentPingPolicy& policy) {
  if (ping_interval > absl::ZeroDuration()) {
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                                static_cast<int>(absl::ToInt64Milliseconds(ping_interval)));
    builder->AddChannelArgument(
        GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
        static_cast<int>(absl::ToInt64Milliseconds(std::max(ping_timeout, absl::Milliseconds(1)))));
  }
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                              policy.permit_without_calls ? 1 : 0);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder->AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(policy.min_interval),
                                         std::numeric_limits<int>::max())));
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, std::max(0, policy.max_strikes));
  builder->AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kServerHandshakeTimeoutMs);
}

}  // namespace rankscope::keepalive

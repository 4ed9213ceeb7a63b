// ParseErrorInterceptorFactory: says what is wrong with a request gRPC could not parse.
//
// gRPC's callback API answers a unary (or streaming) request whose bytes do not parse as the
// method's request message with UNIMPLEMENTED and an empty message (server_callback_handlers.h:
// "if deserialization or reactor creator failed"), which reads as "this collector has no such
// method". For the methods of the services given, this interceptor rewrites exactly that status
// (UNIMPLEMENTED with no message) into INVALID_ARGUMENT naming the method and the message type it
// expected. None of those handlers returns UNIMPLEMENTED itself; a method the service does not
// have (not in the generated descriptors) gets no interceptor and keeps gRPC's UNIMPLEMENTED.
//
// Calls to other services get no interceptor at all (the factory returns none), so the Ingest
// stream's hot path pays nothing.
//
// Thread safety: the factory is called by gRPC on any thread and holds no state but the
// constant service prefixes; each interceptor belongs to one call.
#ifndef RANKSCOPE_COLLECTOR_QUERY_PARSE_ERROR_INTERCEPTOR_H_
#define RANKSCOPE_COLLECTOR_QUERY_PARSE_ERROR_INTERCEPTOR_H_

#include <string>
#include <vector>

#include "grpcpp/support/server_interceptor.h"

namespace rankscope::collector {

class ParseErrorInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `services`: full service names ("rankscope.v1.Query") whose calls are intercepted.
  explicit ParseErrorInterceptorFactory(std::vector<std::string> services);

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  const std::vector<std::string> prefixes_;  // "/rankscope.v1.Query/"
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_QUERY_PARSE_ERROR_INTERCEPTOR_H_

#include "collector/query/parse_error_interceptor.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "google/protobuf/descriptor.h"

namespace rankscope::collector {
namespace {

// "/rankscope.v1.Query/ListJobs" -> "rankscope.v1.ListJobsRequest" (from the generated
// descriptors); "" when the method is unknown to them.
std::string RequestTypeOf(const std::string& method) {
  std::string dotted = absl::StrReplaceAll(method.substr(1), {{"/", "."}});
  const google::protobuf::MethodDescriptor* m =
      google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(dotted);
  return m == nullptr ? "" : m->input_type()->full_name();
}

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  ParseErrorInterceptor(std::string method, std::string request_type)
      : method_(std::move(method)), request_type_(std::move(request_type)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
          status.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("the request to ", method_, " could not be parsed as a ", request_type_,
                         " (truncated, corrupted, or not rankscope's protocol: use the rankscope "
                         "CLI, or a client generated from proto/rankscope/v1/rankscope.proto)")));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  const std::string request_type_;
};

}  // namespace

ParseErrorInterceptorFactory::ParseErrorInterceptorFactory(std::vector<std::string> services)
    : prefixes_([&] {
        std::vector<std::string> prefixes;
        for (const std::string& s : services) prefixes.push_back(absl::StrCat("/", s, "/"));
        return prefixes;
      }()) {}

grpc::experimental::Interceptor* ParseErrorInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  const char* method = info->method();
  if (method == nullptr) return nullptr;
  for (const std::string& prefix : prefixes_) {
    if (!absl::StartsWith(method, prefix)) continue;
    // A method the service does not have keeps gRPC's own UNIMPLEMENTED.
    std::string request_type = RequestTypeOf(method);
    if (request_type.empty()) return nullptr;
    return new ParseErrorInterceptor(method, std::move(request_type));
  }
  return nullptr;
}

}  // namespace rankscope::collector

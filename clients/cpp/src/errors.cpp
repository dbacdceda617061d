// The error table on the client side: a failed status becomes ferrum::Error with the
// reason of its google.rpc.ErrorInfo (domain ferrum.executor.v1) and, where the server
// sent one, the delay of its google.rpc.RetryInfo and (REQUEST_ID_EXISTS) the live
// sequence's KvCacheHandle.
#include <map>

#include "google/rpc/error_details.pb.h"
#include "internal.hpp"

namespace ferrum {

namespace {
const char kDomain[] = "ferrum.executor.v1";
const char kErrorInfo[] = "type.googleapis.com/google.rpc.ErrorInfo";
const char kRetryInfo[] = "type.googleapis.com/google.rpc.RetryInfo";
const char kHandle[] = "type.googleapis.com/ferrum.executor.v1.KvCacheHandle";

// One row of the error table: the proto's ErrorReason value options.
struct Row {
  bool retryable;
  bool outcome_unknown;
};

// The error table, read once from the generated descriptor of ErrorReason (the
// proto is its one definition); an ErrorInfo naming anything else (the server names
// the code for statuses outside the table) gives an Error without a reason, as in Python.
const std::map<std::string, Row>& table() {
  static const std::map<std::string, Row> rows = [] {
    namespace v1 = ferrum::executor::v1;
    std::map<std::string, Row> out;
    const auto* reasons = v1::ErrorReason_descriptor();
    for (int i = 0; i < reasons->value_count(); ++i) {
      const auto* value = reasons->value(i);
      if (value->number() == 0) continue;
      const auto& options = value->options();
      out.emplace(std::string(value->name()),
                  Row{options.GetExtension(v1::retryable), options.GetExtension(v1::outcome_unknown)});
    }
    return out;
  }();
  return rows;
}
}  // namespace

Error::Error(StatusCode code, std::string reason, std::string message,
             std::optional<std::chrono::milliseconds> retry_delay, std::optional<Handle> existing)
    : std::runtime_error((reason.empty() ? std::string(code_name(code)) : reason) + ": " + message),
      code_(code), reason_(std::move(reason)), message_(std::move(message)), retry_delay_(retry_delay),
      existing_(std::move(existing)) {}

bool Error::retryable() const {
  if (!reason_.empty()) return table().at(reason_).retryable;
  return code_ == StatusCode::UNAVAILABLE;  // no reason: the connection, not the server's table
}

// A status with no reason: the rule the proto states beside the outcome_unknown option.
bool Error::outcome_unknown() const {
  if (!reason_.empty()) return table().at(reason_).outcome_unknown;
  switch (code_) {
    case StatusCode::CANCELLED:
    case StatusCode::DEADLINE_EXCEEDED:
    case StatusCode::UNAVAILABLE:
    case StatusCode::UNKNOWN:
    case StatusCode::INTERNAL:
      return true;
    default:
      return false;
  }
}

const char* Error::code_name(StatusCode code) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  int i = static_cast<int>(code);
  return (i >= 0 && i <= 16) ? names[i] : "UNKNOWN";
}

Error error_from_rpc_status(const google::rpc::Status& status) {
  std::string reason;
  std::optional<std::chrono::milliseconds> delay;
  std::optional<Handle> existing;
  for (const auto& detail : status.details()) {
    if (detail.type_url() == kErrorInfo) {
      google::rpc::ErrorInfo info;
      if (info.ParseFromString(detail.value()) && info.domain() == kDomain && table().count(info.reason()))
        reason = info.reason();
    } else if (detail.type_url() == kRetryInfo) {
      google::rpc::RetryInfo retry;
      if (retry.ParseFromString(detail.value()) && retry.has_retry_delay()) {
        const auto& d = retry.retry_delay();
        delay = std::chrono::milliseconds(d.seconds() * 1000 + d.nanos() / 1000000);
      }
    } else if (detail.type_url() == kHandle) {
      pb::KvCacheHandle handle;
      if (handle.ParseFromString(detail.value())) existing = detail::Convert::handle(handle);
    }
  }
  // The server's message starts with "REASON: "; the reason is kept apart.
  std::string message = status.message();
  if (!reason.empty() && message.rfind(reason + ": ", 0) == 0) message = message.substr(reason.size() + 2);
  return Error(static_cast<StatusCode>(status.code()), reason, message, delay,
               reason == "REQUEST_ID_EXISTS" ? existing : std::nullopt);
}

Error error_from_status(const grpc::Status& status) {
  google::rpc::Status details;
  if (!status.error_details().empty() && details.ParseFromString(status.error_details())) {
    details.set_code(static_cast<int>(status.error_code()));  // gRPC's code is the authority, as in the Python client
    return error_from_rpc_status(details);
  }
  return Error(static_cast<StatusCode>(status.error_code()), "", status.error_message());
}

}  // namespace ferrum

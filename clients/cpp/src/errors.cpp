// The error table on the client side: a failed status becomes ferrum::Error with the
// reason of its google.rpc.ErrorInfo (domain ferrum.executor.v1) and, where the server
// sent one, the delay of its google.rpc.RetryInfo and (REQUEST_ID_EXISTS) the live
// sequence's KvCacheHandle.
#include <set>

#include "ferrum/types.hpp"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace ferrum {

namespace {
const char kDomain[] = "ferrum.executor.v1";
const char kErrorInfo[] = "type.googleapis.com/google.rpc.ErrorInfo";
const char kRetryInfo[] = "type.googleapis.com/google.rpc.RetryInfo";
const char kHandle[] = "type.googleapis.com/ferrum.executor.v1.KvCacheHandle";

// The error table's reasons; an ErrorInfo naming anything else (the server names the
// code for statuses outside the table) gives an Error without a reason, as in Python.
const std::set<std::string> kReasons = {
    "CACHE_NOT_FOUND", "CACHE_EXPIRED", "STALE_HANDLE", "LENGTH_MISMATCH", "INVALID_INPUT", "SEQUENCE_TOO_LONG",
    "KV_CAPACITY_EXHAUSTED", "MODEL_NOT_FOUND", "MODEL_LOADING", "DRAINING", "UNAUTHENTICATED",
    "SEQUENCE_LIMIT_EXCEEDED", "TENANT_QUOTA_EXCEEDED", "SHARED_MEMORY_NOT_FOUND", "ADMIN_ONLY",
    "TENSOR_PARALLEL_RANK_LOST", "FINGERPRINT_MISMATCH", "TRANSFER_CORRUPTED", "TICKET_NOT_FOUND", "TICKET_EXPIRED",
    "TICKET_USED", "PUSH_TARGET_REFUSED", "NON_FINITE_LOGITS", "TRANSFER_BUDGET_EXHAUSTED", "TRANSFER_STALLED",
    "ADAPTER_NOT_FOUND", "ADAPTER_INVALID", "ADAPTER_IN_USE", "ADAPTER_LIMIT_EXCEEDED",
    "WEIGHTS_CHANGED", "REQUEST_ID_EXISTS", "REQUEST_ID_TAKEN"};

// Reasons whose call changed nothing and may succeed later or elsewhere.
const std::set<std::string> kRetryableReasons = {
    "DRAINING", "MODEL_LOADING", "KV_CAPACITY_EXHAUSTED", "SEQUENCE_LIMIT_EXCEEDED",
    "TENANT_QUOTA_EXCEEDED", "TRANSFER_BUDGET_EXHAUSTED", "TENSOR_PARALLEL_RANK_LOST"};
}  // namespace

Error::Error(grpc::StatusCode code, std::string reason, std::string message,
             std::optional<std::chrono::milliseconds> retry_delay, std::optional<Handle> existing)
    : std::runtime_error((reason.empty() ? std::string(code_name(code)) : reason) + ": " + message),
      code_(code), reason_(std::move(reason)), message_(std::move(message)), retry_delay_(retry_delay),
      existing_(std::move(existing)) {}

bool Error::retryable() const {
  if (!reason_.empty()) return kRetryableReasons.count(reason_) > 0;
  return code_ == grpc::StatusCode::UNAVAILABLE;  // no reason: the connection, not the server's table
}

bool Error::outcome_unknown() const {
  switch (code_) {
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
      return true;
    case grpc::StatusCode::UNAVAILABLE:
      return reason_.empty();  // DRAINING and MODEL_LOADING refuse before any work
    default:
      return false;
  }
}

const char* Error::code_name(grpc::StatusCode code) {
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
      if (info.ParseFromString(detail.value()) && info.domain() == kDomain && kReasons.count(info.reason()))
        reason = info.reason();
    } else if (detail.type_url() == kRetryInfo) {
      google::rpc::RetryInfo retry;
      if (retry.ParseFromString(detail.value()) && retry.has_retry_delay()) {
        const auto& d = retry.retry_delay();
        delay = std::chrono::milliseconds(d.seconds() * 1000 + d.nanos() / 1000000);
      }
    } else if (detail.type_url() == kHandle) {
      pb::KvCacheHandle handle;
      if (handle.ParseFromString(detail.value())) existing = Handle(std::move(handle));
    }
  }
  // The server's message starts with "REASON: "; the reason is kept apart.
  std::string message = status.message();
  if (!reason.empty() && message.rfind(reason + ": ", 0) == 0) message = message.substr(reason.size() + 2);
  return Error(static_cast<grpc::StatusCode>(status.code()), reason, message, delay,
               reason == "REQUEST_ID_EXISTS" ? existing : std::nullopt);
}

Error error_from_status(const grpc::Status& status) {
  google::rpc::Status details;
  if (!status.error_details().empty() && details.ParseFromString(status.error_details())) {
    details.set_code(status.error_code());  // gRPC's code is the authority, as in the Python client
    return error_from_rpc_status(details);
  }
  return Error(status.error_code(), "", status.error_message());
}

}  // namespace ferrum

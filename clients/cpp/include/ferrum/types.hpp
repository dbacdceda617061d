// Value types of the typed client: handles, logits policies and views, token choice,
// outputs, and the error every failed call throws.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "ferrum_rpc/v1/executor.pb.h"

namespace ferrum {

namespace pb = ::ferrum::executor::v1;

// The handle of a sequence the server holds. A value: copy it, keep it, pass it back.
// The server reads cache_id, server_instance_id and sequence_length; the rest is
// information for the caller.
class Handle {
 public:
  Handle() = default;
  explicit Handle(pb::KvCacheHandle proto) : proto_(std::move(proto)) {}
  const std::string& cache_id() const { return proto_.cache_id(); }
  uint32_t length() const { return proto_.sequence_length(); }
  const std::string& model() const { return proto_.model(); }
  const std::string& server_instance_id() const { return proto_.server_instance_id(); }
  const pb::KvCacheHandle& proto() const { return proto_; }
  pb::KvCacheHandle& proto() { return proto_; }  // to build a deliberately wrong one in tests

 private:
  pb::KvCacheHandle proto_;
};

enum class DType { Float32 = pb::DTYPE_FLOAT32, Float16 = pb::DTYPE_FLOAT16, BFloat16 = pb::DTYPE_BFLOAT16 };

// What logits a call returns: FULL rows in a dtype, TOP_K (scores + ids, sorted
// descending) or ARGMAX only; the last position or, for prefill and verify, all of them.
struct LogitsPolicy {
  pb::LogitsPolicy proto;
  static LogitsPolicy full(DType dtype = DType::Float32, bool all_positions = false);
  static LogitsPolicy top_k(uint32_t k, bool all_positions = false);
  static LogitsPolicy argmax(bool all_positions = false);
};

// A read-only view of contiguous elements owned by a reply (no copy).
template <typename T>
struct View {
  const T* data = nullptr;
  size_t size = 0;
  const T* begin() const { return data; }
  const T* end() const { return data + size; }
  const T& operator[](size_t i) const { return data[i]; }
};

// The logits of a reply, as views over the reply's own bytes. The reply stays alive
// as long as any Logits (or Output) that points into it.
class Logits {
 public:
  Logits() = default;
  Logits(std::shared_ptr<const void> owner, const pb::Logits* proto);
  bool present() const { return p_ != nullptr; }  // false: the call chose a token and asked for no logits
  pb::LogitsKind kind() const;
  uint32_t rows() const;        // positions
  uint32_t vocab_size() const;
  // FULL: the raw little-endian row-major bytes, (rows, vocab) of dtype().
  pb::DType dtype() const;
  std::string_view bytes() const;
  View<float> row(uint32_t r) const;            // FULL float32 only: row r, no copy
  std::vector<float> row_as_float(uint32_t r) const;  // FULL in any dtype, widened to float32
  // TOP_K: row r's k scores (descending) and token ids; ARGMAX: one id per row.
  View<float> scores(uint32_t r) const;
  View<uint32_t> token_ids(uint32_t r) const;
  uint32_t argmax(uint32_t r = 0) const;  // ARGMAX or TOP_K: the best id of row r
  const pb::Logits& proto() const { return *p_; }

 private:
  uint32_t per_row() const;
  std::shared_ptr<const void> owner_;
  const pb::Logits* p_ = nullptr;
  // FULL float32 rows copied to float-aligned memory, where the reply's bytes are not
  // aligned for float (null where they are, and are read in place).
  std::shared_ptr<const std::vector<float>> aligned_;
};

// The server choosing the next token (seeded sampling, penalties, bias, masks,
// logprobs). Unset fields take the contract's defaults; temperature 0 is greedy.
struct TokenChoice {
  std::optional<float> temperature;
  uint32_t top_k = 0;
  std::optional<float> top_p;
  float min_p = 0;
  std::optional<uint64_t> seed;
  std::optional<float> repetition_penalty;
  float presence_penalty = 0;
  float frequency_penalty = 0;
  std::map<uint32_t, float> logit_bias;
  std::string allowed_token_bitmask;  // ceil(vocab / 32) little-endian int32 words
  uint32_t top_logprobs = 0;
  pb::LogprobsMode logprobs_mode = pb::LOGPROBS_MODE_RAW;

  static TokenChoice greedy();
  static TokenChoice sampled(float temperature, uint64_t seed, uint32_t top_k = 0, float top_p = 1.0f);
  pb::TokenChoice to_proto() const;
};

struct Chosen {
  uint32_t token_id = 0;
  float logprob = 0;
  std::vector<std::pair<uint32_t, float>> top_logprobs;
  static Chosen from_proto(const pb::ChosenToken& c);
};

struct Timing {
  uint64_t queue_ns = 0, forward_ns = 0, total_ns = 0;
  uint32_t batch_size = 0;
};

// The result of prefill, decode, forward_verify and each batch item.
struct Output {
  Logits logits;
  Handle kv_cache;
  Timing timing;
  std::optional<Chosen> chosen;  // set when the call carried a token choice
  uint32_t cached_tokens = 0;    // prefill: prompt tokens served from the prefix cache
  // prefill with the caller's request_id: a retry answered with the live sequence that
  // name's first attempt made from this same prompt (REQUEST_ID_EXISTS): kv_cache is
  // its handle as it is now; no logits and no chosen token came back.
  bool existing = false;
};

// One sequence of a batch step: the token to append, the handle, and optionally the
// server's token choice for it.
struct DecodeInput {
  uint32_t token_id;
  Handle kv_cache;
  std::optional<TokenChoice> token_choice;
};

// A failed call: the gRPC code, the error table's reason (ErrorInfo, domain
// ferrum.executor.v1; empty for statuses outside the table such as UNIMPLEMENTED or a
// client-side DEADLINE_EXCEEDED) and the server's message. The table's errors change
// no state on the server.
class Error : public std::runtime_error {
 public:
  Error(grpc::StatusCode code, std::string reason, std::string message,
        std::optional<std::chrono::milliseconds> retry_delay = std::nullopt,
        std::optional<Handle> existing = std::nullopt);
  grpc::StatusCode code() const { return code_; }
  const std::string& reason() const { return reason_; }
  const std::string& message() const { return message_; }
  // The server's google.rpc.RetryInfo, when it sent one.
  std::optional<std::chrono::milliseconds> retry_delay() const { return retry_delay_; }
  // REQUEST_ID_EXISTS: the live sequence the request_id names (the status's KvCacheHandle detail).
  const std::optional<Handle>& existing() const { return existing_; }
  // The retry hint: the call changed nothing and the same call may succeed later or on
  // another server (a draining or loading server, a full pool, a cap or quota, a lost
  // connection). False for errors in the request itself (bad input, unknown or stale
  // handle), which fail the same way again.
  bool retryable() const;
  // The call may have run on the server (cancelled, timed out, connection lost): the
  // client released by request_id what it may have created under a name it generated
  // (a caller's own request_id it leaves to the caller: retry with it, or release it).
  bool outcome_unknown() const;
  static const char* code_name(grpc::StatusCode code);

 private:
  grpc::StatusCode code_;
  std::string reason_, message_;
  std::optional<std::chrono::milliseconds> retry_delay_;
  std::optional<Handle> existing_;
};

// The typed error of a failed status: the reason from the ErrorInfo of its details
// (serialized google.rpc.Status: the grpc-status-details-bin trailer, or a session
// step's in-band error).
Error error_from_status(const grpc::Status& status);
Error error_from_rpc_status(const ::google::rpc::Status& status);

}  // namespace ferrum

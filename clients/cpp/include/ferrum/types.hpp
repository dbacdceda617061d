// Value types of the typed client: handles, logits policies and views, token choice,
// outputs, and the error every failed call throws. Plain C++: this header (like
// client.hpp) includes neither gRPC nor protobuf, so a program built against the
// installed package needs only the standard library's headers and this folder.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferrum {

namespace detail {
struct Convert;  // the library's own bridge between these types and the wire messages
}

// The gRPC status codes (the same numbers as grpc::StatusCode).
enum class StatusCode : int {
  OK = 0, CANCELLED = 1, UNKNOWN = 2, INVALID_ARGUMENT = 3, DEADLINE_EXCEEDED = 4, NOT_FOUND = 5,
  ALREADY_EXISTS = 6, PERMISSION_DENIED = 7, RESOURCE_EXHAUSTED = 8, FAILED_PRECONDITION = 9, ABORTED = 10,
  OUT_OF_RANGE = 11, UNIMPLEMENTED = 12, INTERNAL = 13, UNAVAILABLE = 14, DATA_LOSS = 15, UNAUTHENTICATED = 16,
};

// The handle of a sequence the server holds. A value: copy it, keep it, pass it back.
// The server reads cache_id, server_instance_id and sequence_length; the rest is
// information for the caller. The setters exist to build a deliberately wrong one.
class Handle {
 public:
  const std::string& cache_id() const { return cache_id_; }
  uint32_t length() const { return length_; }
  const std::string& model() const { return model_; }
  const std::string& server_instance_id() const { return server_instance_id_; }
  const std::string& adapter() const { return adapter_; }  // the LoRA adapter it runs with ("": none)
  uint64_t weights_version() const { return weights_version_; }
  uint32_t num_layers() const { return num_layers_; }
  uint32_t num_kv_heads() const { return num_kv_heads_; }
  uint32_t head_dim() const { return head_dim_; }
  const std::string& device() const { return device_; }
  void set_cache_id(std::string v) { cache_id_ = std::move(v); }
  void set_length(uint32_t v) { length_ = v; }
  void set_server_instance_id(std::string v) { server_instance_id_ = std::move(v); }

 private:
  friend struct detail::Convert;
  std::string cache_id_, model_, server_instance_id_, adapter_, device_;
  uint32_t length_ = 0, num_layers_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  uint64_t weights_version_ = 0;
};

// The contract's enums, with the contract's numbers.
enum class DType { Unspecified = 0, Float32 = 1, Float16 = 2, BFloat16 = 3, Int32 = 4, Int64 = 5, UInt32 = 6 };
enum class LogitsKind { Unspecified = 0, Full = 1, TopK = 2, Argmax = 3 };
enum class LogprobsMode { Unspecified = 0, Raw = 1, Processed = 2 };

// What logits a call returns: FULL rows in a dtype, TOP_K (scores + ids, sorted
// descending) or ARGMAX only; the last position or, for prefill and verify, all of them.
// FULL rows may go to a registered shared-memory region instead of the reply.
struct LogitsPolicy {
  LogitsKind kind = LogitsKind::Full;
  DType dtype = DType::Float32;
  uint32_t k = 0;  // TOP_K: how many ids per row
  bool all_positions = false;
  struct SharedMemoryTarget {
    std::string region;
    uint64_t offset = 0;
  };
  std::optional<SharedMemoryTarget> shared_memory;

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
  bool present() const { return present_; }  // false: the call chose a token and asked for no logits
  LogitsKind kind() const { return kind_; }
  uint32_t rows() const;        // positions
  uint32_t vocab_size() const { return vocab_; }
  // FULL: the raw little-endian row-major bytes, (rows, vocab) of dtype().
  DType dtype() const { return dtype_; }
  std::string_view bytes() const { return bytes_; }
  View<float> row(uint32_t r) const;            // FULL float32 only: row r, no copy
  std::vector<float> row_as_float(uint32_t r) const;  // FULL in any dtype, widened to float32
  // TOP_K: row r's k scores (descending) and token ids; ARGMAX: one id per row.
  View<float> scores(uint32_t r) const;
  View<uint32_t> token_ids(uint32_t r) const;
  uint32_t argmax(uint32_t r = 0) const;  // ARGMAX or TOP_K: the best id of row r

 private:
  friend struct detail::Convert;
  uint32_t per_row() const;
  std::shared_ptr<const void> owner_;  // the reply the views below point into
  bool present_ = false;
  LogitsKind kind_ = LogitsKind::Unspecified;
  DType dtype_ = DType::Unspecified;
  uint32_t vocab_ = 0, positions_ = 0, shape_rows_ = 0;
  bool has_shape_ = false;
  std::string_view bytes_;
  View<float> scores_;
  View<uint32_t> ids_;
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
  LogprobsMode logprobs_mode = LogprobsMode::Raw;

  static TokenChoice greedy();
  static TokenChoice sampled(float temperature, uint64_t seed, uint32_t top_k = 0, float top_p = 1.0f);
};

struct Chosen {
  uint32_t token_id = 0;
  float logprob = 0;
  std::vector<std::pair<uint32_t, float>> top_logprobs;
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
  Error(StatusCode code, std::string reason, std::string message,
        std::optional<std::chrono::milliseconds> retry_delay = std::nullopt,
        std::optional<Handle> existing = std::nullopt);
  StatusCode code() const { return code_; }
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
  static const char* code_name(StatusCode code);

 private:
  StatusCode code_;
  std::string reason_, message_;
  std::optional<std::chrono::milliseconds> retry_delay_;
  std::optional<Handle> existing_;
};

}  // namespace ferrum

// The typed C++ client of a ferrum-rpc server (service ferrum.executor.v1.ModelExecutor).
//
//   ferrum::Client ex("127.0.0.1:50051");
//   auto out = ex.prefill({1, 2, 3}, ferrum::LogitsPolicy::argmax());
//   auto step = ex.decode(out.logits.argmax(), out.kv_cache);
//   ex.release_cache(step.kv_cache);
//
// Every call throws ferrum::Error on failure. Every call takes and returns this
// library's own types (types.hpp and below): the header includes neither gRPC nor
// protobuf, and the generated contract code stays inside the library.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferrum/types.hpp"

namespace ferrum {

// TLS for the channel (PEM file paths). ca empty: the system roots; cert + key: mTLS;
// server_name: the name to verify when the target address is not it.
struct Tls {
  std::string ca, cert, key, server_name;
};

// HTTP/2 keepalive pings, as the Python client sets them: a ping after time_ms, the
// connection closed (calls end UNAVAILABLE) when one is not answered in timeout_ms,
// idle connections pinged too. The server accepts a ping a second: keep time_ms >= 1000.
struct Keepalive {
  int time_ms = 2000;
  int timeout_ms = 2000;
  bool without_calls = true;
};

struct ClientOptions {
  std::string model;                                   // "" : the server's default model
  std::optional<std::chrono::milliseconds> timeout;    // per-call deadline; none: no deadline
  std::optional<Tls> tls;                              // none: plaintext
  std::string token;                                   // bearer token (TLS, or plaintext to loopback)
  std::optional<Keepalive> keepalive = Keepalive{};    // none: gRPC's defaults (no pings)
  int max_message_bytes = 512 << 20;                   // above the server's 256 MiB reply limit
};

// Why a decode-ahead item ended.
enum class FinishReason { Unknown, Length, StopToken, Stopped, MaxSequenceLength };
const char* finish_reason_name(FinishReason r);

// One item's end in a decode-ahead run: its handle (length = before + chosen.size():
// the token passed in is appended, the last chosen one is not yet), why, and every token chosen.
struct AheadResult {
  Handle kv_cache;
  FinishReason finish_reason = FinishReason::Unknown;
  std::vector<Chosen> chosen;
};

// GetModelInfo: the model's shape.
struct ModelInfo {
  std::string name, architecture, device;
  uint32_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_attention_heads = 0, num_kv_heads = 0,
           head_dim = 0, max_sequence_length = 0, bos_token_id = 0;
  DType dtype = DType::Unspecified, kv_dtype = DType::Unspecified;
  uint64_t parameter_count = 0;
  std::vector<uint32_t> eos_token_ids;
};

// GetCapabilities: what the server does for the model, and its limits.
struct Capabilities {
  std::string model, architecture, kernel_path, cpu_capability, quantization, kv_fingerprint;
  uint32_t max_batch_size = 0, max_sequence_length = 0, kv_block_size = 0, kv_num_blocks = 0,
           prefill_chunk_tokens = 0, optimal_batch_size = 0, max_decode_ahead = 0, tensor_parallel_degree = 0,
           max_adapters = 0, max_lora_rank = 0;
  uint64_t kv_capacity_tokens = 0, max_message_bytes = 0, kv_bytes = 0, weights_version = 0;
  double idle_timeout_s = 0;
  std::vector<LogitsKind> logits_kinds;
  std::vector<DType> logits_dtypes, supported_dtypes;
  std::vector<std::string> models, attention_mechanisms, supported_devices, tensor_parallel_fallbacks;
  bool chunked_prefill = false, forward_verify = false, truncate_kv = false, decode_session = false,
       prefix_cache = false, fork_cache = false, mixture_of_experts = false, shared_memory = false,
       speculative_decode = false, batch_prefill = false, tensor_parallel = false, pipeline_parallel = false,
       dynamic_batching = false, continuous_batching = false, token_choice = false, accepts_imports = false,
       kv_events = false, batch_invariant = false;
  struct Memory {
    uint64_t parameter_bytes = 0, kv_bytes_per_token_per_layer = 0, activation_bytes_per_token = 0,
             overhead_bytes = 0;
    uint32_t num_layers = 0;
  } memory;
};

// GetStatus: where the server is for the model, and its counters.
struct ServerStatus {
  enum class State { Unspecified = 0, Loading = 1, Serving = 2, Draining = 3 };
  State state = State::Unspecified;
  std::string server_instance_id, model;
  uint32_t kv_blocks_total = 0, kv_blocks_used = 0, kv_blocks_free = 0, active_sequences = 0, queue_depth = 0,
           kv_blocks_shared = 0, kv_blocks_cached = 0, tenant_max_sequences = 0, tenant_ahead_sequences = 0,
           ahead_sequences = 0, ahead_runs_paused = 0, imports_in_flight = 0, pushes_in_flight = 0,
           adapters_loaded = 0;
  uint64_t forwards = 0, tokens_processed = 0, prefix_cache_queried_tokens = 0, prefix_cache_hit_tokens = 0,
           sequences_expired = 0, prefill_operations = 0, decode_operations = 0, memory_allocated_bytes = 0,
           memory_used_bytes = 0, memory_peak_bytes = 0, tenant_kv_tokens = 0, session_bytes_unsent = 0,
           transfer_bytes_in_flight = 0, transfer_budget_bytes = 0, adapter_bytes = 0, weights_version = 0;
  double uptime_s = 0, prefix_cache_hit_rate = 0, avg_prefill_ms = 0, avg_decode_ms = 0, memory_utilization = 0;
};
const char* state_name(ServerStatus::State s);

// SpeculativeDecode: the drafts kept, the token after them (not yet in the KV: send it
// next), the logits after the kept drafts, and the sequence (1 + accepted longer).
struct SpeculativeResult {
  std::vector<uint32_t> accepted_token_ids;
  uint32_t next_token_id = 0;
  Logits logits;
  Handle kv_cache;
  Timing timing;
  std::vector<Chosen> chosen;  // with a token choice: each accepted draft, then next_token_id
};

// One message of an exported sequence (header, KV, or trailer), as the wire's bytes:
// carry the chunks as they are to import_sequence, here or in another process.
class SequenceChunk {
 public:
  SequenceChunk() = default;
  explicit SequenceChunk(std::string bytes) : bytes_(std::move(bytes)) {}
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

struct ImportTicket {
  std::string ticket, model;
  double ttl_s = 0;
};

struct PushResult {
  Handle kv_cache;  // the sequence on the target
  uint64_t bytes_sent = 0;
  bool released = false;  // a move: the source released its copy
};

// The registry's models, and a load's progress.
struct ModelEntry {
  std::string name, state, path;
  bool is_default = false;
};
struct LoadProgress {
  std::string stage;
  double elapsed_s = 0;
};

// A LoRA adapter the server holds.
struct AdapterEntry {
  std::string name, path, digest;
  uint32_t rank = 0, sequences = 0;
  double scaling = 0, load_s = 0;
  std::vector<std::string> target_modules;
  uint64_t bytes = 0;
};
struct AdapterList {
  std::vector<AdapterEntry> adapters;
  std::vector<std::string> evicted;
};

// An in-place weights update's reply.
struct WeightsUpdate {
  uint64_t weights_version = 0;
  uint32_t tensors = 0, sequences_invalidated = 0;
  double rebuild_s = 0, paused_s = 0;
};

// A registered shared-memory region, as the server names it.
struct SharedMemoryRegion {
  std::string name, key;
  uint64_t byte_size = 0;
};

// KV events: the prefix cache's blocks as they are stored and removed.
struct KvBlock {
  std::string block_hash, parent_hash;
  std::vector<uint32_t> token_ids;
};
struct KvEventsHello {
  std::string chain_root, model;
  uint32_t block_size = 0, queue_limit = 0;
  std::vector<KvBlock> cached;
  uint64_t next_sequence = 0;
  std::map<std::string, std::string> adapter_roots;
};
struct KvEvent {
  enum class Kind { Unspecified, Stored, Removed, AllCleared };
  uint64_t sequence = 0;
  Kind kind = Kind::Unspecified;
  KvBlock stored;       // Stored
  std::string removed;  // Removed: the block's hash
};
struct KvEventBatch {
  std::optional<KvEventsHello> hello;
  std::vector<KvEvent> events;
  bool resync = false;
};

class DecodeSession;

class Client {
 public:
  explicit Client(const std::string& target, ClientOptions options = {});
  // A client on the same channel with another per-call deadline (cheap: shares the channel).
  Client with_timeout(std::optional<std::chrono::milliseconds> timeout) const;
  // true once the server serves this client's model (GetStatus answers STATE_SERVING),
  // waiting out a server that is starting or loading it and a lost connection; false
  // when `timeout` passes first. Throws what waiting cannot change (MODEL_NOT_FOUND,
  // UNAUTHENTICATED, a draining server).
  bool wait_ready(std::chrono::milliseconds timeout);

  ModelInfo info() const;
  Capabilities capabilities() const;
  ServerStatus status() const;

  // A new sequence from tokens, or a continued one (chunked prefill) with continue_from.
  // A new one is named by request_id (at most 128 UTF-8 bytes) when given: the client
  // never releases that name, and a retry with it whose first attempt made the sequence
  // (its reply lost) returns that sequence (Output::existing, no logits). Without one,
  // the client names it and releases that name when the call's outcome is unknown.
  Output prefill(const std::vector<uint32_t>& tokens, std::optional<LogitsPolicy> logits = std::nullopt,
                 std::optional<TokenChoice> choice = std::nullopt, const Handle* continue_from = nullptr,
                 const std::string& request_id = "") const;
  Output decode(uint32_t token, const Handle& h, std::optional<LogitsPolicy> logits = std::nullopt,
                std::optional<TokenChoice> choice = std::nullopt) const;
  // One batched forward; results in input order (read to the end: all or nothing).
  std::vector<Output> batch_decode(const std::vector<DecodeInput>& items,
                                   std::optional<LogitsPolicy> logits = std::nullopt) const;
  Output forward_verify(const std::vector<uint32_t>& tokens, const Handle& h,
                        std::optional<LogitsPolicy> logits = std::nullopt) const;
  Handle truncate_kv(const Handle& h, uint32_t new_length) const;
  void release_cache(const Handle& h) const;
  void release_request(const std::string& request_id) const;  // by the caller's name
  std::vector<Handle> fork(const Handle& h, uint32_t num_children) const;
  SpeculativeResult speculative_decode(uint32_t token, const std::vector<uint32_t>& drafts, const Handle& h,
                                       std::optional<LogitsPolicy> logits = std::nullopt,
                                       std::optional<TokenChoice> choice = std::nullopt) const;
  // Several prompts (new: tokens only; continued: with a handle), shared forwards, in order.
  std::vector<Output> batch_prefill(const std::vector<std::pair<std::vector<uint32_t>, std::optional<Handle>>>& prompts,
                                    std::optional<LogitsPolicy> logits = std::nullopt) const;
  void forward() const;  // UNIMPLEMENTED, as the engine trait's default

  // Decode sessions: one bidirectional stream, step by step, or decoding ahead.
  std::shared_ptr<DecodeSession> decode_session() const;  // a run it starts holds it too
  // Appends token and lets the server choose up to max_new_tokens tokens (one session
  // step streaming each). on_token sees each token; returning true stops the run after
  // the server's current forward. If on_token throws, the session is cancelled (the
  // server undoes the run: the sequence is as it was) and the exception propagates.
  AheadResult decode_ahead(uint32_t token, const Handle& h, const TokenChoice& choice, uint32_t max_new_tokens,
                           const std::vector<uint32_t>& stop_token_ids = {},
                           const std::function<bool(const Chosen&)>& on_token = nullptr) const;

  // Sequences that move: the chunks of an export and an import of them; a ticket the
  // target issues, and a push of a sequence to that target (move: the source releases it).
  std::vector<SequenceChunk> export_sequence(const Handle& h, uint64_t chunk_bytes = 0) const;
  Handle import_sequence(const std::vector<SequenceChunk>& chunks) const;
  ImportTicket create_import_ticket(const std::string& fingerprint = "", double ttl_s = 0) const;
  PushResult push_sequence(const Handle& h, const std::string& target, const std::string& ticket,
                           bool move = false, uint64_t chunk_bytes = 0) const;

  // The registry: load reports each stage to progress and returns the last.
  std::vector<ModelEntry> list_models() const;
  LoadProgress load_model(const std::string& name, const std::string& path,
                          const std::function<void(const LoadProgress&)>& progress = nullptr) const;
  uint32_t unload_model(const std::string& name) const;  // the sequences dropped

  // Weights that change: LoRA adapters (a new sequence names one in its Prefill), and
  // an in-place update from one safetensors file's bytes, sent in chunks of chunk_bytes
  // with its BLAKE2b-256 checksum (32 raw bytes) as the trailer.
  AdapterEntry load_adapter(const std::string& name, const std::string& path, bool replace = false) const;
  void unload_adapter(const std::string& name) const;
  AdapterList list_adapters() const;
  WeightsUpdate update_weights(const std::string& safetensors, const std::string& checksum,
                               bool invalidate_sequences = false, size_t chunk_bytes = 1 << 20) const;

  // Shared memory: registers a region for the duration of the returned stream
  // (its first reply names the object); unregisters by name (the regions removed).
  class Registration;
  std::unique_ptr<Registration> register_shared_memory(const std::string& name, uint64_t byte_size,
                                                       const std::string& key = "", uint64_t offset = 0) const;
  uint32_t unregister_shared_memory(const std::string& name) const;

  // KV events: each batch to on_batch until it returns false (then the stream is cancelled).
  void watch_kv_events(bool snapshot, const std::function<bool(const KvEventBatch&)>& on_batch) const;

  const std::string& model() const;
  const ClientOptions& options() const;

  struct Impl;  // the channel, stub and options: the library's own

 private:
  friend class DecodeSession;
  explicit Client(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

class Client::Registration {
 public:
  struct Impl;
  explicit Registration(std::unique_ptr<Impl> impl);
  ~Registration();
  const SharedMemoryRegion& first() const;
  void close();  // ends the registration (the server unregisters the region)

 private:
  std::unique_ptr<Impl> impl_;
};

// A decode-ahead run on a session: next() yields (item index, chosen token) as they
// arrive; stop() asks the server to end it after its current forward; once every item
// has ended, results() holds each item's end. Read it to its end before the next step.
class AheadRun {
 public:
  AheadRun(std::shared_ptr<DecodeSession> session, uint64_t step_id, size_t items);
  bool next(uint32_t* index, Chosen* chosen);  // false once every item has ended
  void stop();
  bool finished() const { return left_ == 0; }
  const std::vector<AheadResult>& results() const { return results_; }

 private:
  std::shared_ptr<DecodeSession> session_;  // the run's stream stays open while the run is held
  uint64_t step_id_;
  std::vector<AheadResult> results_;
  size_t left_;
  std::vector<std::pair<uint32_t, Chosen>> pending_;
  bool stop_sent_ = false;
};

// A DecodeSession stream used from one thread. A failed step throws its Error and the
// session stays usable. close() ends it cleanly (confirming the last steps); cancel()
// ends it at once (the server undoes each sequence's unconfirmed step).
class DecodeSession : public std::enable_shared_from_this<DecodeSession> {
 public:
  explicit DecodeSession(const Client& client);
  ~DecodeSession();
  std::vector<Output> step(const std::vector<DecodeInput>& items, std::optional<LogitsPolicy> logits = std::nullopt,
                           std::optional<TokenChoice> choice = std::nullopt);
  AheadRun decode_ahead(const std::vector<DecodeInput>& items, uint32_t max_new_tokens,
                        std::optional<TokenChoice> choice = std::nullopt,
                        const std::vector<uint32_t>& stop_token_ids = {});
  void close();
  void cancel();

  struct Impl;  // the stream: the library's own

 private:
  friend class AheadRun;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferrum

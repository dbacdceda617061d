// The typed C++ client of a ferrum-rpc server (service ferrum.executor.v1.ModelExecutor).
//
//   ferrum::Client ex("127.0.0.1:50051");
//   auto out = ex.prefill({1, 2, 3}, ferrum::LogitsPolicy::argmax());
//   auto step = ex.decode(out.logits.argmax(), out.kv_cache);
//   ex.release_cache(step.kv_cache);
//
// Every call throws ferrum::Error on failure. The executor calls are typed; the
// registry, transfer and shared-memory calls take and return the contract's messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "ferrum/types.hpp"
#include "ferrum_rpc/v1/executor.grpc.pb.h"

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

  pb::ModelInfo info() const;
  pb::Capabilities capabilities() const;
  pb::Status status() const;

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
  pb::SpeculativeDecodeResponse speculative_decode(uint32_t token, const std::vector<uint32_t>& drafts,
                                                   const Handle& h, std::optional<LogitsPolicy> logits = std::nullopt,
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

  // Sequences that move: the chunks of an export, and an import of them.
  std::vector<pb::SequenceChunk> export_sequence(const Handle& h, uint64_t chunk_bytes = 0) const;
  Handle import_sequence(const std::vector<pb::SequenceChunk>& chunks) const;
  pb::ImportTicket create_import_ticket(const pb::CreateImportTicketRequest& request) const;
  pb::PushSequenceResponse push_sequence(const pb::PushSequenceRequest& request) const;

  // The registry.
  pb::ListModelsResponse list_models() const;
  pb::LoadModelResponse load_model(const pb::LoadModelRequest& request,
                                   const std::function<void(const pb::LoadModelResponse&)>& progress = nullptr) const;
  pb::UnloadModelResponse unload_model(const std::string& name) const;

  // Weights that change: LoRA adapters (a new sequence names one in its Prefill), and
  // an in-place update (the chunks of an UpdateWeights stream: header, data, trailer).
  pb::AdapterEntry load_adapter(const pb::LoadAdapterRequest& request) const;
  pb::UnloadAdapterResponse unload_adapter(const std::string& name) const;
  pb::ListAdaptersResponse list_adapters() const;
  pb::UpdateWeightsResponse update_weights(const std::vector<pb::WeightsChunk>& chunks) const;

  // Shared memory: registers a region for the duration of the returned stream
  // (its first reply names the object); unregisters by name.
  class Registration;
  std::unique_ptr<Registration> register_shared_memory(const pb::RegisterSharedMemoryRequest& request) const;
  void unregister_shared_memory(const pb::UnregisterSharedMemoryRequest& request) const;

  // KV events: each batch to on_batch until it returns false (then the stream is cancelled).
  void watch_kv_events(const pb::WatchKvEventsRequest& request,
                       const std::function<bool(const pb::KvEventBatch&)>& on_batch) const;

  const std::string& model() const { return options_.model; }
  const ClientOptions& options() const { return options_; }
  pb::ModelExecutor::Stub& stub() const { return *stub_; }
  // A context with this client's deadline, its ferrum-deadline-unix-ns header and the model.
  std::unique_ptr<grpc::ClientContext> context() const;

 private:
  Client(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<pb::ModelExecutor::Stub> stub, ClientOptions o);
  void release_names(const std::vector<std::string>& names) const;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<pb::ModelExecutor::Stub> stub_;
  ClientOptions options_;
};

class Client::Registration {
 public:
  Registration(std::unique_ptr<grpc::ClientContext> ctx,
               std::unique_ptr<grpc::ClientReader<pb::RegisterSharedMemoryResponse>> reader);
  ~Registration();
  const pb::RegisterSharedMemoryResponse& first() const { return first_; }
  void close();  // ends the registration (the server unregisters the region)

 private:
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReader<pb::RegisterSharedMemoryResponse>> reader_;
  pb::RegisterSharedMemoryResponse first_;
  bool closed_ = false;
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
  DecodeSession(const Client& client);
  ~DecodeSession();
  std::vector<Output> step(const std::vector<DecodeInput>& items, std::optional<LogitsPolicy> logits = std::nullopt,
                           std::optional<TokenChoice> choice = std::nullopt);
  AheadRun decode_ahead(const std::vector<DecodeInput>& items, uint32_t max_new_tokens,
                        std::optional<TokenChoice> choice = std::nullopt,
                        const std::vector<uint32_t>& stop_token_ids = {});
  void close();
  void cancel();

 private:
  friend class AheadRun;
  pb::DecodeSessionRequest request(const std::vector<DecodeInput>& items, std::optional<LogitsPolicy> logits,
                                   std::optional<TokenChoice> choice);
  void write(const pb::DecodeSessionRequest& request);
  std::shared_ptr<pb::DecodeSessionResponse> read();  // throws Error when the stream ends
  std::string model_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::DecodeSessionRequest, pb::DecodeSessionResponse>> stream_;
  uint64_t next_step_ = 0;
  bool done_ = false;
};

}  // namespace ferrum

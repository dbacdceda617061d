// The Client's unary and server-streaming calls: each builds its request, runs it with
// the client's deadline (and its ferrum-deadline-unix-ns header), and turns a failed
// status into ferrum::Error. Calls that create sequences name them (request_id) and
// release the names they generated when the outcome is unknown, so a lost reply leaves
// no orphan; a caller's own request_id is the caller's to retry with or release.
#include <algorithm>
#include <random>
#include <thread>

#include "channel.hpp"
#include "internal.hpp"

namespace ferrum {

namespace {
using Stub = pb::ModelExecutor::Stub;
constexpr auto kReleaseTimeout = std::chrono::seconds(5);

template <typename Req, typename Resp>
using Unary = grpc::Status (Stub::*)(grpc::ClientContext*, const Req&, Resp*);

template <typename Req, typename Resp>
std::shared_ptr<const Resp> call(const Client& c, Unary<Req, Resp> method, const Req& req) {
  auto ctx = c.context();
  auto resp = std::make_shared<Resp>();
  grpc::Status status = (c.stub().*method)(ctx.get(), req, resp.get());
  if (!status.ok()) throw error_from_status(status);
  return resp;
}

// Every message of a server stream, in order; the status at its end.
template <typename Req, typename Resp, typename Each>
void read_stream(const Client& c,
                 std::unique_ptr<grpc::ClientReader<Resp>> (Stub::*method)(grpc::ClientContext*, const Req&),
                 const Req& req, Each each) {
  auto ctx = c.context();
  auto reader = (c.stub().*method)(ctx.get(), req);
  bool stopped = false;
  while (!stopped) {
    auto msg = std::make_shared<Resp>();
    if (!reader->Read(msg.get())) break;
    if (!each(std::shared_ptr<const Resp>(msg))) {
      ctx->TryCancel();  // the caller has what it wanted
      stopped = true;
    }
  }
  grpc::Status status = reader->Finish();
  if (!status.ok() && !(stopped && status.error_code() == grpc::StatusCode::CANCELLED))
    throw error_from_status(status);
}

// A client stream: every message written, in order; the reply, or the status's error.
template <typename Req, typename Resp>
Resp write_stream(const Client& c,
                  std::unique_ptr<grpc::ClientWriter<Req>> (Stub::*method)(grpc::ClientContext*, Resp*),
                  const std::vector<Req>& messages) {
  auto ctx = c.context();
  Resp resp;
  auto writer = (c.stub().*method)(ctx.get(), &resp);
  for (const auto& m : messages)
    if (!writer->Write(m)) break;  // the server ended the call: its status says why
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) throw error_from_status(status);
  return resp;
}
}  // namespace

std::string new_request_id() {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32));
  char buf[33];
  snprintf(buf, sizeof buf, "%016llx%016llx", (unsigned long long)rng(), (unsigned long long)rng());
  return buf;
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Length: return "length";
    case FinishReason::StopToken: return "stop_token";
    case FinishReason::Stopped: return "stopped";
    case FinishReason::MaxSequenceLength: return "max_sequence_length";
    default: return "unknown";
  }
}

Client::Client(const std::string& target, ClientOptions options)
    : channel_(make_channel(target, options)),
      stub_(std::shared_ptr<Stub>(pb::ModelExecutor::NewStub(channel_))),
      options_(std::move(options)) {}

Client::Client(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<Stub> stub, ClientOptions o)
    : channel_(std::move(channel)), stub_(std::move(stub)), options_(std::move(o)) {}

Client Client::with_timeout(std::optional<std::chrono::milliseconds> timeout) const {
  ClientOptions o = options_;
  o.timeout = timeout;
  return Client(channel_, stub_, std::move(o));
}

// As the Python client's wait_ready (client/ready.py): GetStatus until the model serves;
// MODEL_LOADING, an unreachable server and a probe that ran out of time are asked again
// after a pause growing from 20 ms to 500 ms; any other error, and a draining server,
// are thrown at once (waiting cannot change them).
bool Client::wait_ready(std::chrono::milliseconds timeout) {
  using namespace std::chrono;
  const auto deadline = steady_clock::now() + timeout;
  milliseconds pause(20);
  for (;;) {
    const auto left = duration_cast<milliseconds>(deadline - steady_clock::now());
    if (left <= milliseconds(0)) return false;
    if (channel_->WaitForConnected(system_clock::now() + left)) {
      try {
        pb::Status status = with_timeout(std::max(left, milliseconds(1))).status();
        if (status.state() == pb::Status::STATE_SERVING) return true;
        if (status.state() == pb::Status::STATE_DRAINING)
          throw Error(grpc::StatusCode::UNAVAILABLE, "DRAINING", "the server is shutting down: it will not serve " +
                                                                     (model().empty() ? std::string("its models") : model()));
      } catch (const Error& e) {
        const bool again = e.reason() == "MODEL_LOADING" ||
                           (e.reason().empty() && (e.code() == grpc::StatusCode::UNAVAILABLE ||
                                                   e.code() == grpc::StatusCode::DEADLINE_EXCEEDED));
        if (!again) throw;
      }
    }
    const auto rest = duration_cast<milliseconds>(deadline - steady_clock::now());
    if (rest <= milliseconds(0)) return false;
    std::this_thread::sleep_for(std::min(pause, rest));
    pause = std::min(pause * 2, milliseconds(500));
  }
}

std::unique_ptr<grpc::ClientContext> Client::context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  set_deadline(ctx.get(), options_);
  return ctx;
}

pb::ModelInfo Client::info() const {
  pb::GetModelInfoRequest req;
  req.set_model(model());
  return *call(*this, &Stub::GetModelInfo, req);
}

pb::Capabilities Client::capabilities() const {
  pb::GetCapabilitiesRequest req;
  req.set_model(model());
  return *call(*this, &Stub::GetCapabilities, req);
}

pb::Status Client::status() const {
  pb::GetStatusRequest req;
  req.set_model(model());
  return *call(*this, &Stub::GetStatus, req);
}

void Client::release_names(const std::vector<std::string>& names) const {
  for (const auto& name : names) {
    pb::ReleaseCacheRequest req;
    req.set_request_id(name);
    req.set_model(model());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kReleaseTimeout);
    pb::ReleaseCacheResponse resp;
    stub_->ReleaseCache(&ctx, req, &resp);  // best effort: the name may never have reached the server
  }
}

Output Client::prefill(const std::vector<uint32_t>& tokens, std::optional<LogitsPolicy> logits,
                       std::optional<TokenChoice> choice, const Handle* continue_from,
                       const std::string& request_id) const {
  pb::PrefillRequest req;
  req.set_model(model());
  req.mutable_token_ids()->Add(tokens.begin(), tokens.end());
  if (continue_from) *req.mutable_kv_cache() = continue_from->proto();
  bool generated = !continue_from && request_id.empty();
  if (!request_id.empty()) req.set_request_id(request_id);
  else if (generated) req.set_request_id(new_request_id());
  if (logits) *req.mutable_logits() = logits->proto;
  if (choice) *req.mutable_token_choice() = choice->to_proto();
  try {
    auto r = call(*this, &Stub::Prefill, req);
    Output o = chosen_output_of(r);
    o.cached_tokens = r->cached_tokens();
    return o;
  } catch (const Error& e) {
    if (e.reason() == "REQUEST_ID_EXISTS" && e.existing()) {  // a retry whose first attempt made the sequence
      Output o;
      o.kv_cache = *e.existing();
      o.existing = true;
      return o;
    }
    if (e.outcome_unknown() && generated) release_names({req.request_id()});
    throw;
  }
}

Output Client::decode(uint32_t token, const Handle& h, std::optional<LogitsPolicy> logits,
                      std::optional<TokenChoice> choice) const {
  pb::DecodeRequest req;
  req.set_model(model());
  req.set_token_id(token);
  *req.mutable_kv_cache() = h.proto();
  if (logits) *req.mutable_logits() = logits->proto;
  if (choice) *req.mutable_token_choice() = choice->to_proto();
  return chosen_output_of(call(*this, &Stub::Decode, req));
}

std::vector<Output> Client::batch_decode(const std::vector<DecodeInput>& items,
                                         std::optional<LogitsPolicy> logits) const {
  pb::BatchDecodeRequest req;
  req.set_model(model());
  add_items(&req, items, std::nullopt);
  if (logits) *req.mutable_logits() = logits->proto;
  req.set_single_reply(wants_single_reply(logits, req));
  std::vector<Output> out(items.size());
  read_stream(*this, &Stub::BatchDecode, req, [&](std::shared_ptr<const pb::BatchDecodeResponse> msg) {
    auto take = [&](const pb::BatchDecodeResponse& r) {
      if (r.index() >= out.size()) throw Error(grpc::StatusCode::INTERNAL, "", "a reply for no item");
      out[r.index()] = chosen_output_of(std::shared_ptr<const pb::BatchDecodeResponse>(msg, &r));
    };
    if (msg->results_size() > 0) for (const auto& r : msg->results()) take(r);
    else take(*msg);
    return true;
  });
  return out;
}

Output Client::forward_verify(const std::vector<uint32_t>& tokens, const Handle& h,
                              std::optional<LogitsPolicy> logits) const {
  pb::ForwardVerifyRequest req;
  req.set_model(model());
  req.mutable_token_ids()->Add(tokens.begin(), tokens.end());
  *req.mutable_kv_cache() = h.proto();
  if (logits) *req.mutable_logits() = logits->proto;
  return output_of(call(*this, &Stub::ForwardVerify, req));
}

Handle Client::truncate_kv(const Handle& h, uint32_t new_length) const {
  pb::TruncateKvRequest req;
  *req.mutable_kv_cache() = h.proto();
  req.set_new_length(new_length);
  return Handle(call(*this, &Stub::TruncateKv, req)->kv_cache());
}

void Client::release_cache(const Handle& h) const {
  pb::ReleaseCacheRequest req;
  req.set_cache_id(h.cache_id());
  req.set_model(h.model().empty() ? model() : h.model());
  call(*this, &Stub::ReleaseCache, req);
}

void Client::release_request(const std::string& request_id) const {
  pb::ReleaseCacheRequest req;
  req.set_request_id(request_id);
  req.set_model(model());
  call(*this, &Stub::ReleaseCache, req);
}

std::vector<Handle> Client::fork(const Handle& h, uint32_t num_children) const {
  pb::ForkCacheRequest req;
  *req.mutable_kv_cache() = h.proto();
  req.set_num_children(num_children);
  auto r = call(*this, &Stub::ForkCache, req);
  return std::vector<Handle>(r->children().begin(), r->children().end());
}

pb::SpeculativeDecodeResponse Client::speculative_decode(uint32_t token, const std::vector<uint32_t>& drafts,
                                                         const Handle& h, std::optional<LogitsPolicy> logits,
                                                         std::optional<TokenChoice> choice) const {
  pb::SpeculativeDecodeRequest req;
  req.set_model(model());
  req.set_token_id(token);
  req.mutable_draft_token_ids()->Add(drafts.begin(), drafts.end());
  *req.mutable_kv_cache() = h.proto();
  if (logits) *req.mutable_logits() = logits->proto;
  if (choice) *req.mutable_token_choice() = choice->to_proto();
  return *call(*this, &Stub::SpeculativeDecode, req);
}

std::vector<Output> Client::batch_prefill(
    const std::vector<std::pair<std::vector<uint32_t>, std::optional<Handle>>>& prompts,
    std::optional<LogitsPolicy> logits) const {
  pb::BatchPrefillRequest req;
  req.set_model(model());
  std::vector<std::string> names;
  for (const auto& [tokens, handle] : prompts) {
    auto* item = req.add_items();
    item->mutable_token_ids()->Add(tokens.begin(), tokens.end());
    if (handle) *item->mutable_kv_cache() = handle->proto();
    else names.push_back(*item->mutable_request_id() = new_request_id());
  }
  if (logits) *req.mutable_logits() = logits->proto;
  std::vector<Output> out;
  try {
    read_stream(*this, &Stub::BatchPrefill, req, [&](std::shared_ptr<const pb::BatchPrefillResponse> msg) {
      out.push_back(output_of(msg));
      return true;
    });
  } catch (const Error& e) {
    if (e.outcome_unknown()) release_names(names);
    throw;
  }
  return out;
}

void Client::forward() const {
  pb::ForwardRequest req;
  call(*this, &Stub::Forward, req);
}

std::vector<pb::SequenceChunk> Client::export_sequence(const Handle& h, uint64_t chunk_bytes) const {
  pb::ExportSequenceRequest req;
  *req.mutable_kv_cache() = h.proto();
  req.set_model(h.model().empty() ? model() : h.model());
  req.set_chunk_bytes(chunk_bytes);
  std::vector<pb::SequenceChunk> chunks;
  read_stream(*this, &Stub::ExportSequence, req, [&](std::shared_ptr<const pb::SequenceChunk> c) {
    chunks.push_back(*c);
    return true;
  });
  return chunks;
}

Handle Client::import_sequence(const std::vector<pb::SequenceChunk>& chunks) const {
  return Handle(write_stream(*this, &Stub::ImportSequence, chunks).kv_cache());
}

pb::ImportTicket Client::create_import_ticket(const pb::CreateImportTicketRequest& request) const {
  return *call(*this, &Stub::CreateImportTicket, request);
}

pb::PushSequenceResponse Client::push_sequence(const pb::PushSequenceRequest& request) const {
  return *call(*this, &Stub::PushSequence, request);
}

pb::ListModelsResponse Client::list_models() const {
  return *call(*this, &Stub::ListModels, pb::ListModelsRequest());
}

pb::LoadModelResponse Client::load_model(const pb::LoadModelRequest& request,
                                         const std::function<void(const pb::LoadModelResponse&)>& progress) const {
  pb::LoadModelResponse last;
  read_stream(*this, &Stub::LoadModel, request, [&](std::shared_ptr<const pb::LoadModelResponse> r) {
    if (progress) progress(*r);
    last = *r;
    return true;
  });
  return last;
}

pb::UnloadModelResponse Client::unload_model(const std::string& name) const {
  pb::UnloadModelRequest req;
  req.set_name(name);
  return *call(*this, &Stub::UnloadModel, req);
}

pb::AdapterEntry Client::load_adapter(const pb::LoadAdapterRequest& request) const {
  pb::LoadAdapterRequest req = request;
  if (req.model().empty()) req.set_model(model());
  return *call(*this, &Stub::LoadAdapter, req);
}

pb::UnloadAdapterResponse Client::unload_adapter(const std::string& name) const {
  pb::UnloadAdapterRequest req;
  req.set_model(model());
  req.set_name(name);
  return *call(*this, &Stub::UnloadAdapter, req);
}

pb::ListAdaptersResponse Client::list_adapters() const {
  pb::ListAdaptersRequest req;
  req.set_model(model());
  return *call(*this, &Stub::ListAdapters, req);
}

pb::UpdateWeightsResponse Client::update_weights(const std::vector<pb::WeightsChunk>& chunks) const {
  return write_stream(*this, &Stub::UpdateWeights, chunks);
}

Client::Registration::Registration(std::unique_ptr<grpc::ClientContext> ctx,
                                   std::unique_ptr<grpc::ClientReader<pb::RegisterSharedMemoryResponse>> reader)
    : ctx_(std::move(ctx)), reader_(std::move(reader)) {
  if (!reader_->Read(&first_)) {
    grpc::Status status = reader_->Finish();
    closed_ = true;
    throw error_from_status(status.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "no registration") : status);
  }
}

Client::Registration::~Registration() { close(); }

void Client::Registration::close() {
  if (closed_) return;
  closed_ = true;
  ctx_->TryCancel();
  reader_->Finish();
}

std::unique_ptr<Client::Registration> Client::register_shared_memory(
    const pb::RegisterSharedMemoryRequest& request) const {
  auto ctx = std::make_unique<grpc::ClientContext>();  // held open: no deadline
  auto reader = stub_->RegisterSharedMemory(ctx.get(), request);
  return std::make_unique<Registration>(std::move(ctx), std::move(reader));
}

void Client::unregister_shared_memory(const pb::UnregisterSharedMemoryRequest& request) const {
  call(*this, &Stub::UnregisterSharedMemory, request);
}

void Client::watch_kv_events(const pb::WatchKvEventsRequest& request,
                             const std::function<bool(const pb::KvEventBatch&)>& on_batch) const {
  read_stream(*this, &Stub::WatchKvEvents, request,
              [&](std::shared_ptr<const pb::KvEventBatch> b) { return on_batch(*b); });
}

}  // namespace ferrum

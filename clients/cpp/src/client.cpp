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
std::shared_ptr<const Resp> call(const Client::Impl& c, Unary<Req, Resp> method, const Req& req) {
  auto ctx = c.context();
  auto resp = std::make_shared<Resp>();
  grpc::Status status = ((*c.stub).*method)(ctx.get(), req, resp.get());
  if (!status.ok()) throw error_from_status(status);
  return resp;
}

// Every message of a server stream, in order; the status at its end.
template <typename Req, typename Resp, typename Each>
void read_stream(const Client::Impl& c,
                 std::unique_ptr<grpc::ClientReader<Resp>> (Stub::*method)(grpc::ClientContext*, const Req&),
                 const Req& req, Each each) {
  auto ctx = c.context();
  auto reader = ((*c.stub).*method)(ctx.get(), req);
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
Resp write_stream(const Client::Impl& c,
                  std::unique_ptr<grpc::ClientWriter<Req>> (Stub::*method)(grpc::ClientContext*, Resp*),
                  const std::vector<Req>& messages) {
  auto ctx = c.context();
  Resp resp;
  auto writer = ((*c.stub).*method)(ctx.get(), &resp);
  for (const auto& m : messages)
    if (!writer->Write(m)) break;  // the server ended the call: its status says why
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) throw error_from_status(status);
  return resp;
}
// Best effort: releases by request_id the sequences a call may have made under names
// the client generated (the names may never have reached the server).
void release_names(const Client::Impl& c, const std::vector<std::string>& names) {
  for (const auto& name : names) {
    pb::ReleaseCacheRequest req;
    req.set_request_id(name);
    req.set_model(c.options.model);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kReleaseTimeout);
    pb::ReleaseCacheResponse resp;
    c.stub->ReleaseCache(&ctx, req, &resp);
  }
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

Client::Client(const std::string& target, ClientOptions options) {
  auto impl = std::make_shared<Impl>();
  impl->channel = make_channel(target, options);
  impl->stub = std::shared_ptr<Stub>(pb::ModelExecutor::NewStub(impl->channel));
  impl->options = std::move(options);
  impl_ = std::move(impl);
}

Client::Client(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Client Client::with_timeout(std::optional<std::chrono::milliseconds> timeout) const {
  auto impl = std::make_shared<Impl>(*impl_);
  impl->options.timeout = timeout;
  return Client(std::move(impl));
}

const std::string& Client::model() const { return impl_->options.model; }
const ClientOptions& Client::options() const { return impl_->options; }

const char* state_name(ServerStatus::State s) {
  switch (s) {
    case ServerStatus::State::Loading: return "loading";
    case ServerStatus::State::Serving: return "serving";
    case ServerStatus::State::Draining: return "draining";
    default: return "unspecified";
  }
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
    if (impl_->channel->WaitForConnected(system_clock::now() + left)) {
      try {
        ServerStatus status = with_timeout(std::max(left, milliseconds(1))).status();
        if (status.state == ServerStatus::State::Serving) return true;
        if (status.state == ServerStatus::State::Draining)
          throw Error(StatusCode::UNAVAILABLE, "DRAINING", "the server is shutting down: it will not serve " +
                                                               (model().empty() ? std::string("its models") : model()));
      } catch (const Error& e) {
        const bool again = e.reason() == "MODEL_LOADING" ||
                           (e.reason().empty() && (e.code() == StatusCode::UNAVAILABLE ||
                                                   e.code() == StatusCode::DEADLINE_EXCEEDED));
        if (!again) throw;
      }
    }
    const auto rest = duration_cast<milliseconds>(deadline - steady_clock::now());
    if (rest <= milliseconds(0)) return false;
    std::this_thread::sleep_for(std::min(pause, rest));
    pause = std::min(pause * 2, milliseconds(500));
  }
}

std::unique_ptr<grpc::ClientContext> Client::Impl::context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  set_deadline(ctx.get(), options);
  return ctx;
}

ModelInfo Client::info() const {
  pb::GetModelInfoRequest req;
  req.set_model(model());
  auto r = call(*impl_, &Stub::GetModelInfo, req);
  ModelInfo m;
  m.name = r->name();
  m.architecture = r->architecture();
  m.device = r->device();
  m.vocab_size = r->vocab_size();
  m.hidden_size = r->hidden_size();
  m.num_layers = r->num_layers();
  m.num_attention_heads = r->num_attention_heads();
  m.num_kv_heads = r->num_kv_heads();
  m.head_dim = r->head_dim();
  m.max_sequence_length = r->max_sequence_length();
  m.bos_token_id = r->bos_token_id();
  m.dtype = static_cast<DType>(r->dtype());
  m.kv_dtype = static_cast<DType>(r->kv_dtype());
  m.parameter_count = r->parameter_count();
  m.eos_token_ids.assign(r->eos_token_ids().begin(), r->eos_token_ids().end());
  return m;
}

Capabilities Client::capabilities() const {
  pb::GetCapabilitiesRequest req;
  req.set_model(model());
  auto r = call(*impl_, &Stub::GetCapabilities, req);
  Capabilities c;
  c.model = r->model();
  c.architecture = r->architecture();
  c.kernel_path = r->kernel_path();
  c.cpu_capability = r->cpu_capability();
  c.quantization = r->quantization();
  c.kv_fingerprint = r->kv_fingerprint();
  c.max_batch_size = r->max_batch_size();
  c.max_sequence_length = r->max_sequence_length();
  c.kv_block_size = r->kv_block_size();
  c.kv_num_blocks = r->kv_num_blocks();
  c.prefill_chunk_tokens = r->prefill_chunk_tokens();
  c.optimal_batch_size = r->optimal_batch_size();
  c.max_decode_ahead = r->max_decode_ahead();
  c.tensor_parallel_degree = r->tensor_parallel_degree();
  c.max_adapters = r->max_adapters();
  c.max_lora_rank = r->max_lora_rank();
  c.kv_capacity_tokens = r->kv_capacity_tokens();
  c.max_message_bytes = r->max_message_bytes();
  c.kv_bytes = r->kv_bytes();
  c.weights_version = r->weights_version();
  c.idle_timeout_s = r->idle_timeout_s();
  for (int k : r->logits_kinds()) c.logits_kinds.push_back(static_cast<LogitsKind>(k));
  for (int d : r->logits_dtypes()) c.logits_dtypes.push_back(static_cast<DType>(d));
  for (int d : r->supported_dtypes()) c.supported_dtypes.push_back(static_cast<DType>(d));
  c.models.assign(r->models().begin(), r->models().end());
  c.attention_mechanisms.assign(r->attention_mechanisms().begin(), r->attention_mechanisms().end());
  c.supported_devices.assign(r->supported_devices().begin(), r->supported_devices().end());
  c.tensor_parallel_fallbacks.assign(r->tensor_parallel_fallbacks().begin(), r->tensor_parallel_fallbacks().end());
  c.chunked_prefill = r->chunked_prefill();
  c.forward_verify = r->forward_verify();
  c.truncate_kv = r->truncate_kv();
  c.decode_session = r->decode_session();
  c.prefix_cache = r->prefix_cache();
  c.fork_cache = r->fork_cache();
  c.mixture_of_experts = r->mixture_of_experts();
  c.shared_memory = r->shared_memory();
  c.speculative_decode = r->speculative_decode();
  c.batch_prefill = r->batch_prefill();
  c.tensor_parallel = r->tensor_parallel();
  c.pipeline_parallel = r->pipeline_parallel();
  c.dynamic_batching = r->dynamic_batching();
  c.continuous_batching = r->continuous_batching();
  c.token_choice = r->token_choice();
  c.accepts_imports = r->accepts_imports();
  c.kv_events = r->kv_events();
  c.batch_invariant = r->batch_invariant();
  const auto& m = r->memory();
  c.memory = {m.parameter_bytes(), m.kv_bytes_per_token_per_layer(), m.activation_bytes_per_token(),
              m.overhead_bytes(), m.num_layers()};
  return c;
}

ServerStatus Client::status() const {
  pb::GetStatusRequest req;
  req.set_model(model());
  auto r = call(*impl_, &Stub::GetStatus, req);
  ServerStatus s;
  s.state = static_cast<ServerStatus::State>(r->state());
  s.server_instance_id = r->server_instance_id();
  s.model = r->model();
  s.kv_blocks_total = r->kv_blocks_total();
  s.kv_blocks_used = r->kv_blocks_used();
  s.kv_blocks_free = r->kv_blocks_free();
  s.active_sequences = r->active_sequences();
  s.queue_depth = r->queue_depth();
  s.kv_blocks_shared = r->kv_blocks_shared();
  s.kv_blocks_cached = r->kv_blocks_cached();
  s.tenant_max_sequences = r->tenant_max_sequences();
  s.tenant_ahead_sequences = r->tenant_ahead_sequences();
  s.ahead_sequences = r->ahead_sequences();
  s.ahead_runs_paused = r->ahead_runs_paused();
  s.imports_in_flight = r->imports_in_flight();
  s.pushes_in_flight = r->pushes_in_flight();
  s.adapters_loaded = r->adapters_loaded();
  s.forwards = r->forwards();
  s.tokens_processed = r->tokens_processed();
  s.prefix_cache_queried_tokens = r->prefix_cache_queried_tokens();
  s.prefix_cache_hit_tokens = r->prefix_cache_hit_tokens();
  s.sequences_expired = r->sequences_expired();
  s.prefill_operations = r->prefill_operations();
  s.decode_operations = r->decode_operations();
  s.memory_allocated_bytes = r->memory_allocated_bytes();
  s.memory_used_bytes = r->memory_used_bytes();
  s.memory_peak_bytes = r->memory_peak_bytes();
  s.tenant_kv_tokens = r->tenant_kv_tokens();
  s.session_bytes_unsent = r->session_bytes_unsent();
  s.transfer_bytes_in_flight = r->transfer_bytes_in_flight();
  s.transfer_budget_bytes = r->transfer_budget_bytes();
  s.adapter_bytes = r->adapter_bytes();
  s.weights_version = r->weights_version();
  s.uptime_s = r->uptime_s();
  s.prefix_cache_hit_rate = r->prefix_cache_hit_rate();
  s.avg_prefill_ms = r->avg_prefill_ms();
  s.avg_decode_ms = r->avg_decode_ms();
  s.memory_utilization = r->memory_utilization();
  return s;
}

Output Client::prefill(const std::vector<uint32_t>& tokens, std::optional<LogitsPolicy> logits,
                       std::optional<TokenChoice> choice, const Handle* continue_from,
                       const std::string& request_id) const {
  pb::PrefillRequest req;
  req.set_model(model());
  req.mutable_token_ids()->Add(tokens.begin(), tokens.end());
  if (continue_from) *req.mutable_kv_cache() = detail::Convert::proto(*continue_from);
  bool generated = !continue_from && request_id.empty();
  if (!request_id.empty()) req.set_request_id(request_id);
  else if (generated) req.set_request_id(new_request_id());
  if (logits) *req.mutable_logits() = detail::Convert::proto(*logits);
  if (choice) *req.mutable_token_choice() = detail::Convert::proto(*choice);
  try {
    auto r = call(*impl_, &Stub::Prefill, req);
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
    if (e.outcome_unknown() && generated) release_names(*impl_, {req.request_id()});
    throw;
  }
}

Output Client::decode(uint32_t token, const Handle& h, std::optional<LogitsPolicy> logits,
                      std::optional<TokenChoice> choice) const {
  pb::DecodeRequest req;
  req.set_model(model());
  req.set_token_id(token);
  *req.mutable_kv_cache() = detail::Convert::proto(h);
  if (logits) *req.mutable_logits() = detail::Convert::proto(*logits);
  if (choice) *req.mutable_token_choice() = detail::Convert::proto(*choice);
  return chosen_output_of(call(*impl_, &Stub::Decode, req));
}

std::vector<Output> Client::batch_decode(const std::vector<DecodeInput>& items,
                                         std::optional<LogitsPolicy> logits) const {
  pb::BatchDecodeRequest req;
  req.set_model(model());
  add_items(&req, items, std::nullopt);
  if (logits) *req.mutable_logits() = detail::Convert::proto(*logits);
  req.set_single_reply(wants_single_reply(logits, req));
  std::vector<Output> out(items.size());
  read_stream(*impl_, &Stub::BatchDecode, req, [&](std::shared_ptr<const pb::BatchDecodeResponse> msg) {
    auto take = [&](const pb::BatchDecodeResponse& r) {
      if (r.index() >= out.size()) throw Error(StatusCode::INTERNAL, "", "a reply for no item");
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
  *req.mutable_kv_cache() = detail::Convert::proto(h);
  if (logits) *req.mutable_logits() = detail::Convert::proto(*logits);
  return output_of(call(*impl_, &Stub::ForwardVerify, req));
}

Handle Client::truncate_kv(const Handle& h, uint32_t new_length) const {
  pb::TruncateKvRequest req;
  *req.mutable_kv_cache() = detail::Convert::proto(h);
  req.set_new_length(new_length);
  return detail::Convert::handle(call(*impl_, &Stub::TruncateKv, req)->kv_cache());
}

void Client::release_cache(const Handle& h) const {
  pb::ReleaseCacheRequest req;
  req.set_cache_id(h.cache_id());
  req.set_model(h.model().empty() ? model() : h.model());
  call(*impl_, &Stub::ReleaseCache, req);
}

void Client::release_request(const std::string& request_id) const {
  pb::ReleaseCacheRequest req;
  req.set_request_id(request_id);
  req.set_model(model());
  call(*impl_, &Stub::ReleaseCache, req);
}

std::vector<Handle> Client::fork(const Handle& h, uint32_t num_children) const {
  pb::ForkCacheRequest req;
  *req.mutable_kv_cache() = detail::Convert::proto(h);
  req.set_num_children(num_children);
  auto r = call(*impl_, &Stub::ForkCache, req);
  std::vector<Handle> out;
  for (const auto& c : r->children()) out.push_back(detail::Convert::handle(c));
  return out;
}

SpeculativeResult Client::speculative_decode(uint32_t token, const std::vector<uint32_t>& drafts, const Handle& h,
                                             std::optional<LogitsPolicy> logits,
                                             std::optional<TokenChoice> choice) const {
  pb::SpeculativeDecodeRequest req;
  req.set_model(model());
  req.set_token_id(token);
  req.mutable_draft_token_ids()->Add(drafts.begin(), drafts.end());
  *req.mutable_kv_cache() = detail::Convert::proto(h);
  if (logits) *req.mutable_logits() = detail::Convert::proto(*logits);
  if (choice) *req.mutable_token_choice() = detail::Convert::proto(*choice);
  auto r = call(*impl_, &Stub::SpeculativeDecode, req);
  SpeculativeResult out;
  out.accepted_token_ids.assign(r->accepted_token_ids().begin(), r->accepted_token_ids().end());
  out.next_token_id = r->next_token_id();
  if (r->has_logits()) out.logits = detail::Convert::logits(r, r->logits());
  out.kv_cache = detail::Convert::handle(r->kv_cache());
  out.timing = timing_from(r->timing());
  for (const auto& c : r->chosen()) out.chosen.push_back(detail::Convert::chosen(c));
  return out;
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
    if (handle) *item->mutable_kv_cache() = detail::Convert::proto(*handle);
    else names.push_back(*item->mutable_request_id() = new_request_id());
  }
  if (logits) *req.mutable_logits() = detail::Convert::proto(*logits);
  std::vector<Output> out;
  try {
    read_stream(*impl_, &Stub::BatchPrefill, req, [&](std::shared_ptr<const pb::BatchPrefillResponse> msg) {
      out.push_back(output_of(msg));
      return true;
    });
  } catch (const Error& e) {
    if (e.outcome_unknown()) release_names(*impl_, names);
    throw;
  }
  return out;
}

void Client::forward() const {
  pb::ForwardRequest req;
  call(*impl_, &Stub::Forward, req);
}

std::vector<SequenceChunk> Client::export_sequence(const Handle& h, uint64_t chunk_bytes) const {
  pb::ExportSequenceRequest req;
  *req.mutable_kv_cache() = detail::Convert::proto(h);
  req.set_model(h.model().empty() ? model() : h.model());
  req.set_chunk_bytes(chunk_bytes);
  std::vector<SequenceChunk> chunks;
  read_stream(*impl_, &Stub::ExportSequence, req, [&](std::shared_ptr<const pb::SequenceChunk> c) {
    chunks.emplace_back(c->SerializeAsString());
    return true;
  });
  return chunks;
}

Handle Client::import_sequence(const std::vector<SequenceChunk>& chunks) const {
  std::vector<pb::SequenceChunk> messages(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i)
    if (!messages[i].ParseFromString(chunks[i].bytes()))
      throw Error(StatusCode::INVALID_ARGUMENT, "", "chunk " + std::to_string(i) + " is not a SequenceChunk");
  return detail::Convert::handle(write_stream(*impl_, &Stub::ImportSequence, messages).kv_cache());
}

ImportTicket Client::create_import_ticket(const std::string& fingerprint, double ttl_s) const {
  pb::CreateImportTicketRequest req;
  req.set_model(model());
  req.set_fingerprint(fingerprint);
  req.set_ttl_s(ttl_s);
  auto r = call(*impl_, &Stub::CreateImportTicket, req);
  return {r->ticket(), r->model(), r->ttl_s()};
}

PushResult Client::push_sequence(const Handle& h, const std::string& target, const std::string& ticket, bool move,
                                 uint64_t chunk_bytes) const {
  pb::PushSequenceRequest req;
  *req.mutable_kv_cache() = detail::Convert::proto(h);
  req.set_model(h.model().empty() ? model() : h.model());
  req.set_target(target);
  req.set_ticket(ticket);
  req.set_move(move);
  req.set_chunk_bytes(chunk_bytes);
  auto r = call(*impl_, &Stub::PushSequence, req);
  return {detail::Convert::handle(r->kv_cache()), r->bytes_sent(), r->released()};
}

std::vector<ModelEntry> Client::list_models() const {
  auto r = call(*impl_, &Stub::ListModels, pb::ListModelsRequest());
  std::vector<ModelEntry> out;
  for (const auto& m : r->models()) out.push_back({m.name(), m.state(), m.path(), m.is_default()});
  return out;
}

LoadProgress Client::load_model(const std::string& name, const std::string& path,
                                const std::function<void(const LoadProgress&)>& progress) const {
  pb::LoadModelRequest req;
  req.set_name(name);
  req.set_path(path);
  LoadProgress last;
  read_stream(*impl_, &Stub::LoadModel, req, [&](std::shared_ptr<const pb::LoadModelResponse> r) {
    last = {r->stage(), r->elapsed_s()};
    if (progress) progress(last);
    return true;
  });
  return last;
}

uint32_t Client::unload_model(const std::string& name) const {
  pb::UnloadModelRequest req;
  req.set_name(name);
  return call(*impl_, &Stub::UnloadModel, req)->sequences_dropped();
}

namespace {
AdapterEntry adapter_from(const pb::AdapterEntry& a) {
  AdapterEntry e;
  e.name = a.name();
  e.path = a.path();
  e.digest = a.digest();
  e.rank = a.rank();
  e.sequences = a.sequences();
  e.scaling = a.scaling();
  e.load_s = a.load_s();
  e.target_modules.assign(a.target_modules().begin(), a.target_modules().end());
  e.bytes = a.bytes();
  return e;
}
}  // namespace

AdapterEntry Client::load_adapter(const std::string& name, const std::string& path, bool replace) const {
  pb::LoadAdapterRequest req;
  req.set_model(model());
  req.set_name(name);
  req.set_path(path);
  req.set_replace(replace);
  return adapter_from(*call(*impl_, &Stub::LoadAdapter, req));
}

void Client::unload_adapter(const std::string& name) const {
  pb::UnloadAdapterRequest req;
  req.set_model(model());
  req.set_name(name);
  call(*impl_, &Stub::UnloadAdapter, req);
}

AdapterList Client::list_adapters() const {
  pb::ListAdaptersRequest req;
  req.set_model(model());
  auto r = call(*impl_, &Stub::ListAdapters, req);
  AdapterList out;
  for (const auto& a : r->adapters()) out.adapters.push_back(adapter_from(a));
  out.evicted.assign(r->evicted().begin(), r->evicted().end());
  return out;
}

WeightsUpdate Client::update_weights(const std::string& safetensors, const std::string& checksum,
                                     bool invalidate_sequences, size_t chunk_bytes) const {
  if (chunk_bytes == 0) throw std::invalid_argument("update_weights: chunk_bytes must be positive");
  std::vector<pb::WeightsChunk> chunks(1);
  auto* header = chunks[0].mutable_header();
  header->set_model(model());
  header->set_total_bytes(safetensors.size());
  header->set_invalidate_sequences(invalidate_sequences);
  for (size_t at = 0; at < safetensors.size(); at += chunk_bytes)
    chunks.emplace_back().set_data(safetensors.substr(at, chunk_bytes));
  chunks.emplace_back().mutable_trailer()->set_checksum(checksum);
  auto r = write_stream(*impl_, &Stub::UpdateWeights, chunks);
  WeightsUpdate out;
  out.weights_version = r.weights_version();
  out.tensors = r.tensors();
  out.sequences_invalidated = r.sequences_invalidated();
  out.rebuild_s = r.rebuild_s();
  out.paused_s = r.paused_s();
  return out;
}

struct Client::Registration::Impl {
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReader<pb::RegisterSharedMemoryResponse>> reader;
  SharedMemoryRegion first;
  bool closed = false;
};

Client::Registration::Registration(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::Registration::~Registration() { close(); }

const SharedMemoryRegion& Client::Registration::first() const { return impl_->first; }

void Client::Registration::close() {
  if (impl_->closed) return;
  impl_->closed = true;
  impl_->ctx->TryCancel();
  impl_->reader->Finish();
}

std::unique_ptr<Client::Registration> Client::register_shared_memory(const std::string& name, uint64_t byte_size,
                                                                     const std::string& key, uint64_t offset) const {
  pb::RegisterSharedMemoryRequest req;
  req.set_name(name);
  req.set_byte_size(byte_size);
  req.set_key(key);
  req.set_offset(offset);
  auto impl = std::make_unique<Registration::Impl>();
  impl->ctx = std::make_unique<grpc::ClientContext>();  // held open: no deadline
  impl->reader = impl_->stub->RegisterSharedMemory(impl->ctx.get(), req);
  pb::RegisterSharedMemoryResponse first;
  if (!impl->reader->Read(&first)) {
    grpc::Status status = impl->reader->Finish();
    impl->closed = true;
    throw error_from_status(status.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "no registration") : status);
  }
  impl->first = {first.name(), first.key(), first.byte_size()};
  return std::make_unique<Registration>(std::move(impl));
}

uint32_t Client::unregister_shared_memory(const std::string& name) const {
  pb::UnregisterSharedMemoryRequest req;
  req.set_name(name);
  return call(*impl_, &Stub::UnregisterSharedMemory, req)->unregistered();
}

namespace {
KvBlock block_from(const pb::KvBlock& b) {
  return {b.block_hash(), b.parent_hash(), std::vector<uint32_t>(b.token_ids().begin(), b.token_ids().end())};
}

KvEventBatch batch_from(const pb::KvEventBatch& b) {
  KvEventBatch out;
  out.resync = b.resync();
  if (b.has_hello()) {
    const auto& h = b.hello();
    KvEventsHello hello;
    hello.chain_root = h.chain_root();
    hello.model = h.model();
    hello.block_size = h.block_size();
    hello.queue_limit = h.queue_limit();
    for (const auto& c : h.cached()) hello.cached.push_back(block_from(c));
    hello.next_sequence = h.next_sequence();
    for (const auto& [name, root] : h.adapter_roots()) hello.adapter_roots.emplace(name, root);
    out.hello = std::move(hello);
  }
  for (const auto& e : b.events()) {
    KvEvent ev;
    ev.sequence = e.sequence();
    switch (e.kind_case()) {
      case pb::KvEvent::kStored: ev.kind = KvEvent::Kind::Stored; ev.stored = block_from(e.stored()); break;
      case pb::KvEvent::kRemoved: ev.kind = KvEvent::Kind::Removed; ev.removed = e.removed(); break;
      case pb::KvEvent::kAllCleared: ev.kind = KvEvent::Kind::AllCleared; break;
      default: break;
    }
    out.events.push_back(std::move(ev));
  }
  return out;
}
}  // namespace

void Client::watch_kv_events(bool snapshot, const std::function<bool(const KvEventBatch&)>& on_batch) const {
  pb::WatchKvEventsRequest req;
  req.set_model(model());
  req.set_snapshot(snapshot);
  read_stream(*impl_, &Stub::WatchKvEvents, req,
              [&](std::shared_ptr<const pb::KvEventBatch> b) { return on_batch(batch_from(*b)); });
}

}  // namespace ferrum

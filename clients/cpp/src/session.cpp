// DecodeSession (one bidirectional stream, step by step), decode-ahead runs on it, and
// Client::decode_ahead (a whole run as one call).
#include <algorithm>

#include "internal.hpp"

namespace ferrum {

namespace {
FinishReason finish_from(pb::FinishReason r) {
  switch (r) {
    case pb::FINISH_REASON_LENGTH: return FinishReason::Length;
    case pb::FINISH_REASON_STOP_TOKEN: return FinishReason::StopToken;
    case pb::FINISH_REASON_STOPPED: return FinishReason::Stopped;
    case pb::FINISH_REASON_MAX_SEQUENCE_LENGTH: return FinishReason::MaxSequenceLength;
    default: return FinishReason::Unknown;
  }
}
}  // namespace

// The stream of a session and its step counter.
struct DecodeSession::Impl {
  std::string model;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<pb::DecodeSessionRequest, pb::DecodeSessionResponse>> stream;
  uint64_t next_step = 0;
  bool done = false;

  pb::DecodeSessionRequest request(const std::vector<DecodeInput>& items, std::optional<LogitsPolicy> logits,
                                   std::optional<TokenChoice> choice) {
    pb::DecodeSessionRequest req;
    req.set_step_id(++next_step);
    req.set_model(model);
    add_items(&req, items, choice);
    if (logits) *req.mutable_logits() = detail::Convert::proto(*logits);
    req.set_single_reply(wants_single_reply(logits, req));
    return req;
  }

  void write(const pb::DecodeSessionRequest& request) {
    if (done) throw Error(StatusCode::FAILED_PRECONDITION, "", "the session was closed");
    if (!stream->Write(request)) read();  // the stream ended: read() throws its status
  }

  std::shared_ptr<pb::DecodeSessionResponse> read() {  // throws Error when the stream ends
    auto reply = std::make_shared<pb::DecodeSessionResponse>();
    if (stream->Read(reply.get())) return reply;
    done = true;
    grpc::Status status = stream->Finish();
    if (!status.ok()) throw error_from_status(status);
    throw Error(StatusCode::UNAVAILABLE, "", "the session stream ended");
  }
};

std::shared_ptr<DecodeSession> Client::decode_session() const { return std::make_shared<DecodeSession>(*this); }

DecodeSession::DecodeSession(const Client& client) : impl_(std::make_unique<Impl>()) {
  impl_->model = client.model();
  impl_->ctx = client.impl_->context();
  impl_->stream = client.impl_->stub->DecodeSession(impl_->ctx.get());
}

DecodeSession::~DecodeSession() {
  if (!impl_->done) cancel();
}

std::vector<Output> DecodeSession::step(const std::vector<DecodeInput>& items, std::optional<LogitsPolicy> logits,
                                        std::optional<TokenChoice> choice) {
  pb::DecodeSessionRequest req = impl_->request(items, logits, choice);
  impl_->write(req);
  std::vector<std::pair<uint32_t, Output>> got;
  while (got.size() < static_cast<size_t>(req.items_size())) {
    std::shared_ptr<const pb::DecodeSessionResponse> reply = impl_->read();
    if (reply->has_error()) throw error_from_rpc_status(reply->error());  // the session goes on
    if (reply->results_size() > 0) {
      for (const auto& r : reply->results())
        got.emplace_back(r.index(), chosen_output_of(std::shared_ptr<const pb::DecodeSessionResponse>(reply, &r)));
    } else {
      got.emplace_back(reply->index(), chosen_output_of(reply));
    }
  }
  std::stable_sort(got.begin(), got.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Output> out;
  out.reserve(got.size());
  for (auto& g : got) out.push_back(std::move(g.second));
  return out;
}

AheadRun DecodeSession::decode_ahead(const std::vector<DecodeInput>& items, uint32_t max_new_tokens,
                                     std::optional<TokenChoice> choice, const std::vector<uint32_t>& stop_token_ids) {
  pb::DecodeSessionRequest req = impl_->request(items, std::nullopt, choice);
  req.set_single_reply(false);
  req.set_max_new_tokens(max_new_tokens);
  req.mutable_stop_token_ids()->Add(stop_token_ids.begin(), stop_token_ids.end());
  impl_->write(req);
  return AheadRun(shared_from_this(), req.step_id(), items.size());
}

void DecodeSession::close() {
  if (impl_->done) return;
  impl_->done = true;
  impl_->stream->WritesDone();
  pb::DecodeSessionResponse rest;
  while (impl_->stream->Read(&rest)) {
  }  // read to the end: a clean end confirms the last steps
  grpc::Status status = impl_->stream->Finish();
  if (!status.ok()) throw error_from_status(status);
}

void DecodeSession::cancel() {
  if (impl_->done) return;
  impl_->done = true;
  impl_->ctx->TryCancel();  // the server undoes each sequence's unconfirmed step
  impl_->stream->Finish();
}

AheadRun::AheadRun(std::shared_ptr<DecodeSession> session, uint64_t step_id, size_t items)
    : session_(std::move(session)), step_id_(step_id), results_(items), left_(items) {}

bool AheadRun::next(uint32_t* index, Chosen* chosen) {
  while (pending_.empty()) {
    if (left_ == 0) return false;
    std::shared_ptr<const pb::DecodeSessionResponse> reply = session_->impl_->read();
    if (reply->has_error()) {
      left_ = 0;
      throw error_from_rpc_status(reply->error());
    }
    if (reply->step_id() != step_id_)
      throw Error(StatusCode::INTERNAL, "",
                  "a reply of step " + std::to_string(reply->step_id()) + " during a decode-ahead step");
    auto take = [&](const pb::DecodeSessionResponse& r) {
      if (r.index() >= results_.size()) throw Error(StatusCode::INTERNAL, "", "a reply for no item");
      Chosen c = detail::Convert::chosen(r.chosen());
      AheadResult& res = results_[r.index()];
      res.chosen.push_back(c);
      if (r.has_kv_cache()) {  // the item's last message: its handle and why it ended
        res.kv_cache = detail::Convert::handle(r.kv_cache());
        res.finish_reason = finish_from(r.finish_reason());
        --left_;
      }
      pending_.emplace_back(r.index(), std::move(c));
    };
    if (reply->results_size() > 0) for (const auto& r : reply->results()) take(r);
    else take(*reply);
  }
  *index = pending_.front().first;
  *chosen = std::move(pending_.front().second);
  pending_.erase(pending_.begin());
  return true;
}

void AheadRun::stop() {
  if (finished() || stop_sent_) return;
  stop_sent_ = true;
  pb::DecodeSessionRequest req;
  req.set_step_id(step_id_);
  req.set_stop(true);
  session_->impl_->write(req);
}

AheadResult Client::decode_ahead(uint32_t token, const Handle& h, const TokenChoice& choice, uint32_t max_new_tokens,
                                 const std::vector<uint32_t>& stop_token_ids,
                                 const std::function<bool(const Chosen&)>& on_token) const {
  auto session = decode_session();
  AheadResult result;
  try {
    AheadRun run = session->decode_ahead({DecodeInput{token, h, choice}}, max_new_tokens, choice, stop_token_ids);
    uint32_t index;
    Chosen chosen;
    while (run.next(&index, &chosen))
      if (on_token && on_token(chosen)) run.stop();
    result = run.results()[0];
  } catch (...) {
    session->cancel();  // the server undoes the run: a failed call changes nothing
    throw;
  }
  session->close();
  return result;
}

}  // namespace ferrum

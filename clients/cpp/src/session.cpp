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

std::shared_ptr<DecodeSession> Client::decode_session() const { return std::make_shared<DecodeSession>(*this); }

DecodeSession::DecodeSession(const Client& client) : model_(client.model()), ctx_(client.context()) {
  stream_ = client.stub().DecodeSession(ctx_.get());
}

DecodeSession::~DecodeSession() {
  if (!done_) cancel();
}

pb::DecodeSessionRequest DecodeSession::request(const std::vector<DecodeInput>& items,
                                                std::optional<LogitsPolicy> logits,
                                                std::optional<TokenChoice> choice) {
  pb::DecodeSessionRequest req;
  req.set_step_id(++next_step_);
  req.set_model(model_);
  add_items(&req, items, choice);
  if (logits) *req.mutable_logits() = logits->proto;
  req.set_single_reply(wants_single_reply(logits, req));
  return req;
}

void DecodeSession::write(const pb::DecodeSessionRequest& request) {
  if (done_) throw Error(grpc::StatusCode::FAILED_PRECONDITION, "", "the session was closed");
  if (!stream_->Write(request)) read();  // the stream ended: read() throws its status
}

std::shared_ptr<pb::DecodeSessionResponse> DecodeSession::read() {
  auto reply = std::make_shared<pb::DecodeSessionResponse>();
  if (stream_->Read(reply.get())) return reply;
  done_ = true;
  grpc::Status status = stream_->Finish();
  if (!status.ok()) throw error_from_status(status);
  throw Error(grpc::StatusCode::UNAVAILABLE, "", "the session stream ended");
}

std::vector<Output> DecodeSession::step(const std::vector<DecodeInput>& items, std::optional<LogitsPolicy> logits,
                                        std::optional<TokenChoice> choice) {
  pb::DecodeSessionRequest req = request(items, logits, choice);
  write(req);
  std::vector<std::pair<uint32_t, Output>> got;
  while (got.size() < static_cast<size_t>(req.items_size())) {
    std::shared_ptr<const pb::DecodeSessionResponse> reply = read();
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
  pb::DecodeSessionRequest req = request(items, std::nullopt, choice);
  req.set_single_reply(false);
  req.set_max_new_tokens(max_new_tokens);
  req.mutable_stop_token_ids()->Add(stop_token_ids.begin(), stop_token_ids.end());
  write(req);
  return AheadRun(shared_from_this(), req.step_id(), items.size());
}

void DecodeSession::close() {
  if (done_) return;
  done_ = true;
  stream_->WritesDone();
  pb::DecodeSessionResponse rest;
  while (stream_->Read(&rest)) {
  }  // read to the end: a clean end confirms the last steps
  grpc::Status status = stream_->Finish();
  if (!status.ok()) throw error_from_status(status);
}

void DecodeSession::cancel() {
  if (done_) return;
  done_ = true;
  ctx_->TryCancel();  // the server undoes each sequence's unconfirmed step
  stream_->Finish();
}

AheadRun::AheadRun(std::shared_ptr<DecodeSession> session, uint64_t step_id, size_t items)
    : session_(std::move(session)), step_id_(step_id), results_(items), left_(items) {}

bool AheadRun::next(uint32_t* index, Chosen* chosen) {
  while (pending_.empty()) {
    if (left_ == 0) return false;
    std::shared_ptr<const pb::DecodeSessionResponse> reply = session_->read();
    if (reply->has_error()) {
      left_ = 0;
      throw error_from_rpc_status(reply->error());
    }
    if (reply->step_id() != step_id_)
      throw Error(grpc::StatusCode::INTERNAL, "",
                  "a reply of step " + std::to_string(reply->step_id()) + " during a decode-ahead step");
    auto take = [&](const pb::DecodeSessionResponse& r) {
      if (r.index() >= results_.size()) throw Error(grpc::StatusCode::INTERNAL, "", "a reply for no item");
      Chosen c = Chosen::from_proto(r.chosen());
      AheadResult& res = results_[r.index()];
      res.chosen.push_back(c);
      if (r.has_kv_cache()) {  // the item's last message: its handle and why it ended
        res.kv_cache = Handle(r.kv_cache());
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
  session_->write(req);
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

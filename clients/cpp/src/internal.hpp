// Internal helpers shared by the client's sources: replies to outputs, request ids.
#pragma once

#include <memory>
#include <string>

#include "ferrum/client.hpp"

namespace ferrum {

inline Timing timing_from(const pb::Timing& t) { return {t.queue_ns(), t.forward_ns(), t.total_ns(), t.batch_size()}; }

// An output whose logits view the reply r (kept alive by the output).
template <typename R>
Output output_of(const std::shared_ptr<const R>& r) {
  Output o;
  if (r->has_logits()) o.logits = Logits(r, &r->logits());
  o.kv_cache = Handle(r->kv_cache());
  o.timing = timing_from(r->timing());
  return o;
}

template <typename R>
Output chosen_output_of(const std::shared_ptr<const R>& r) {
  Output o = output_of(r);
  if (r->has_chosen()) o.chosen = Chosen::from_proto(r->chosen());
  return o;
}

// A fresh caller-chosen name for a new sequence (128 random bits, hex).
std::string new_request_id();

// The items of a batch or session step, as the contract's DecodeItem messages; an item
// without its own token choice takes the step's.
template <typename Req>
void add_items(Req* req, const std::vector<DecodeInput>& items, const std::optional<TokenChoice>& step_choice) {
  for (const auto& it : items) {
    auto* item = req->add_items();
    item->set_token_id(it.token_id);
    *item->mutable_kv_cache() = it.kv_cache.proto();
    if (it.token_choice) *item->mutable_token_choice() = it.token_choice->to_proto();
    else if (step_choice) *item->mutable_token_choice() = step_choice->to_proto();
  }
}

// single_reply unless the rows are full logits (then one message per sequence keeps
// each under the message limit), as the Python client asks.
template <typename Req>
bool wants_single_reply(const std::optional<LogitsPolicy>& logits, const Req& req) {
  if (logits) return logits->proto.kind() != pb::LOGITS_KIND_FULL || logits->proto.has_shared_memory();
  for (const auto& item : req.items())
    if (!item.has_token_choice()) return false;  // no policy and no choice: full float32 rows
  return req.items_size() > 0;
}

}  // namespace ferrum

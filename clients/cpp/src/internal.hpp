// Internal to the library: the generated contract code, and the bridge between it and
// the public types (detail::Convert), the Client's channel and stub (Client::Impl), and
// helpers shared by the client's sources. Nothing here is installed.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "ferrum/client.hpp"
#include "ferrum_rpc/v1/executor.grpc.pb.h"
#include "google/rpc/status.pb.h"

namespace ferrum {

namespace pb = ::ferrum::executor::v1;

struct Client::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::shared_ptr<pb::ModelExecutor::Stub> stub;
  ClientOptions options;
  // A context with this client's deadline, its ferrum-deadline-unix-ns header.
  std::unique_ptr<grpc::ClientContext> context() const;
};

namespace detail {
// Public types to and from the contract's messages (a friend of Handle and Logits).
struct Convert {
  static Handle handle(const pb::KvCacheHandle& p);
  static pb::KvCacheHandle proto(const Handle& h);
  static pb::LogitsPolicy proto(const LogitsPolicy& p);
  static pb::TokenChoice proto(const TokenChoice& c);
  static Chosen chosen(const pb::ChosenToken& c);
  // Views of `p`, which `owner` keeps alive.
  static Logits logits(std::shared_ptr<const void> owner, const pb::Logits& p);
};
}  // namespace detail

inline Timing timing_from(const pb::Timing& t) { return {t.queue_ns(), t.forward_ns(), t.total_ns(), t.batch_size()}; }

// An output whose logits view the reply r (kept alive by the output).
template <typename R>
Output output_of(const std::shared_ptr<const R>& r) {
  Output o;
  if (r->has_logits()) o.logits = detail::Convert::logits(r, r->logits());
  o.kv_cache = detail::Convert::handle(r->kv_cache());
  o.timing = timing_from(r->timing());
  return o;
}

template <typename R>
Output chosen_output_of(const std::shared_ptr<const R>& r) {
  Output o = output_of(r);
  if (r->has_chosen()) o.chosen = detail::Convert::chosen(r->chosen());
  return o;
}

// A fresh caller-chosen name for a new sequence (128 random bits, hex).
std::string new_request_id();

// The typed error of a failed status: the reason from the ErrorInfo of its details
// (serialized google.rpc.Status: the grpc-status-details-bin trailer, or a session
// step's in-band error).
Error error_from_status(const grpc::Status& status);
Error error_from_rpc_status(const ::google::rpc::Status& status);

// The items of a batch or session step, as the contract's DecodeItem messages; an item
// without its own token choice takes the step's.
template <typename Req>
void add_items(Req* req, const std::vector<DecodeInput>& items, const std::optional<TokenChoice>& step_choice) {
  for (const auto& it : items) {
    auto* item = req->add_items();
    item->set_token_id(it.token_id);
    *item->mutable_kv_cache() = detail::Convert::proto(it.kv_cache);
    if (it.token_choice) *item->mutable_token_choice() = detail::Convert::proto(*it.token_choice);
    else if (step_choice) *item->mutable_token_choice() = detail::Convert::proto(*step_choice);
  }
}

// single_reply unless the rows are full logits (then one message per sequence keeps
// each under the message limit), as the Python client asks.
template <typename Req>
bool wants_single_reply(const std::optional<LogitsPolicy>& logits, const Req& req) {
  if (logits) return logits->kind != LogitsKind::Full || logits->shared_memory.has_value();
  for (const auto& item : req.items())
    if (!item.has_token_choice()) return false;  // no policy and no choice: full float32 rows
  return req.items_size() > 0;
}

}  // namespace ferrum

// "rpcs": every RPC of the contract through the typed C++ API, one line each:
// "<RPC> OK <summary>" or "<RPC> <CODE> <REASON>" (the test knows which answer each
// RPC must give on its server: Forward is UNIMPLEMENTED, a push to a target outside
// --push-allow is PUSH_TARGET_REFUSED).
#include "check.hpp"

#include <fstream>
#include <iterator>

namespace check {

using ferrum::LogitsPolicy;

int run_rpcs(const ferrum_args::Args& args) {
  auto ex = client_from(args);
  uint32_t vocab = ex.info().vocab_size();
  auto n = [](auto v) { return std::to_string(v); };
  ferrum::Handle h;

  outcome("GetModelInfo", [&] { return ex.info().architecture() + ":" + n(ex.info().vocab_size()); });
  outcome("GetCapabilities", [&] { return n(ex.capabilities().max_decode_ahead()); });
  outcome("GetStatus", [&] { return n(ex.status().state()); });
  outcome("Prefill", [&] {
    auto out = ex.prefill(prompt(6, vocab), LogitsPolicy::argmax());
    h = out.kv_cache;
    return n(h.length()) + ":" + n(out.logits.argmax());
  });
  outcome("Decode", [&] {
    auto out = ex.decode(5, h, LogitsPolicy::top_k(3));
    h = out.kv_cache;
    return n(h.length()) + ":" + n(out.logits.token_ids(0).size);
  });
  outcome("BatchDecode", [&] {
    auto kids = ex.fork(h, 2);
    auto outs = ex.batch_decode({{5, kids[0], std::nullopt}, {6, kids[1], ferrum::TokenChoice::greedy()}},
                                LogitsPolicy::argmax());
    for (auto& o : outs) ex.release_cache(o.kv_cache);
    return n(outs.size()) + ":" + n(outs[1].chosen.has_value());
  });
  outcome("ForwardVerify", [&] {
    auto out = ex.forward_verify({5, 6, 7}, h, LogitsPolicy::argmax(true));
    h = out.kv_cache;
    return n(h.length()) + ":" + n(out.logits.rows());
  });
  outcome("TruncateKv", [&] {
    h = ex.truncate_kv(h, h.length() - 2);
    return n(h.length());
  });
  outcome("ForkCache", [&] {
    auto kids = ex.fork(h, 3);
    for (auto& k : kids) ex.release_cache(k);
    return n(kids.size());
  });
  outcome("DecodeSession", [&] {
    auto session = ex.decode_session();
    auto outs = session->step({{5, h, std::nullopt}}, LogitsPolicy::argmax());
    h = outs[0].kv_cache;
    auto run = session->decode_ahead({{outs[0].logits.argmax(), h, std::nullopt}}, 4, ferrum::TokenChoice::greedy());
    uint32_t index;
    ferrum::Chosen c;
    size_t got = 0;
    while (run.next(&index, &c)) ++got;
    h = run.results()[0].kv_cache;
    session->close();
    return n(got) + ":" + ferrum::finish_reason_name(run.results()[0].finish_reason);
  });
  outcome("SpeculativeDecode", [&] {
    auto r = ex.speculative_decode(5, {6, 7}, h, LogitsPolicy::argmax());
    h = ferrum::Handle(r.kv_cache());
    return n(h.length());
  });
  outcome("BatchPrefill", [&] {
    auto outs = ex.batch_prefill({{prompt(4, vocab, 2), std::nullopt}, {{5, 6}, h}}, LogitsPolicy::argmax());
    ex.release_cache(outs[0].kv_cache);
    h = outs[1].kv_cache;
    return n(outs.size()) + ":" + n(h.length());
  });
  std::vector<ferrum::pb::SequenceChunk> chunks;
  outcome("ExportSequence", [&] {
    chunks = ex.export_sequence(h);
    return n(chunks.size());
  });
  outcome("ImportSequence", [&] {
    auto copy = ex.import_sequence(chunks);
    ex.release_cache(copy);
    return n(copy.length() == h.length());
  });
  std::string ticket;
  outcome("CreateImportTicket", [&] {
    ferrum::pb::CreateImportTicketRequest req;
    req.set_model(ex.model());
    ticket = ex.create_import_ticket(req).ticket();
    return n(ticket.size());
  });
  outcome("PushSequence", [&] {  // to this same server, with the ticket it issued
    ferrum::pb::PushSequenceRequest req;
    *req.mutable_kv_cache() = h.proto();
    req.set_target(args.str("target"));
    req.set_ticket(ticket);
    auto r = ex.push_sequence(req);
    ex.release_cache(ferrum::Handle(r.kv_cache()));
    return n(r.kv_cache().sequence_length() == h.length());
  });
  outcome("WatchKvEvents", [&] {
    ferrum::pb::WatchKvEventsRequest req;
    req.set_snapshot(true);
    int batches = 0;
    ex.watch_kv_events(req, [&](const ferrum::pb::KvEventBatch&) { return ++batches < 1; });
    return n(batches);
  });
  outcome("RegisterSharedMemory", [&] {
    ferrum::pb::RegisterSharedMemoryRequest req;
    req.set_name("cpp-region");
    req.set_byte_size(4096);
    auto reg = ex.register_shared_memory(req);
    std::string key = reg->first().key();
    outcome("UnregisterSharedMemory", [&] {
      ferrum::pb::UnregisterSharedMemoryRequest un;
      un.set_name("cpp-region");
      ex.unregister_shared_memory(un);
      return "";
    });
    reg->close();
    return n(!key.empty());
  });
  outcome("ListModels", [&] { return n(ex.list_models().models_size()); });
  if (args.has("load-dir")) {
    outcome("LoadModel", [&] {
      ferrum::pb::LoadModelRequest req;
      req.set_name("cpp-loaded");
      req.set_path(args.str("load-dir"));
      int stages = 0;
      auto last = ex.load_model(req, [&](const ferrum::pb::LoadModelResponse&) { ++stages; });
      return last.stage();
    });
    outcome("UnloadModel", [&] { return n(ex.unload_model("cpp-loaded").sequences_dropped()); });
  }
  if (args.has("adapter-dir")) {  // a PEFT adapter folder for this model
    outcome("LoadAdapter", [&] {
      ferrum::pb::LoadAdapterRequest req;
      req.set_name("cpp-adapter");
      req.set_path(args.str("adapter-dir"));
      return n(ex.load_adapter(req).rank());
    });
    outcome("ListAdapters", [&] { return n(ex.list_adapters().adapters_size()); });
    outcome("UnloadAdapter", [&] {
      ex.unload_adapter("cpp-adapter");
      return "";
    });
  }
  if (args.has("update-file")) {  // a safetensors file of this model's tensors, and its BLAKE2b-256 (hex)
    outcome("UpdateWeights", [&] {
      std::ifstream in(args.str("update-file"), std::ios::binary);
      std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::vector<ferrum::pb::WeightsChunk> chunks(1);
      chunks[0].mutable_header()->set_model(ex.model());
      chunks[0].mutable_header()->set_total_bytes(data.size());
      for (size_t at = 0; at < data.size(); at += 1 << 20) chunks.emplace_back().set_data(data.substr(at, 1 << 20));
      std::string hex = args.str("update-checksum"), checksum;
      for (size_t i = 0; i + 1 < hex.size(); i += 2) checksum.push_back(char(std::stoi(hex.substr(i, 2), nullptr, 16)));
      chunks.emplace_back().mutable_trailer()->set_checksum(checksum);
      return n(ex.update_weights(chunks).weights_version());
    });
  }
  outcome("ReleaseCache", [&] {
    ex.release_cache(h);
    return "";
  });
  outcome("Forward", [&] {
    ex.forward();
    return "";
  });
  return 0;
}

}  // namespace check

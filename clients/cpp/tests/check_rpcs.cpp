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
  uint32_t vocab = ex.info().vocab_size;
  auto n = [](auto v) { return std::to_string(v); };
  ferrum::Handle h;

  outcome("GetModelInfo", [&] { return ex.info().architecture + ":" + n(ex.info().vocab_size); });
  outcome("GetCapabilities", [&] { return n(ex.capabilities().max_decode_ahead); });
  outcome("GetStatus", [&] { return std::string(ferrum::state_name(ex.status().state)); });
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
    h = r.kv_cache;
    return n(h.length()) + ":" + n(r.accepted_token_ids.size() + 1 == r.chosen.size() || r.chosen.empty());
  });
  outcome("BatchPrefill", [&] {
    auto outs = ex.batch_prefill({{prompt(4, vocab, 2), std::nullopt}, {{5, 6}, h}}, LogitsPolicy::argmax());
    ex.release_cache(outs[0].kv_cache);
    h = outs[1].kv_cache;
    return n(outs.size()) + ":" + n(h.length());
  });
  std::vector<ferrum::SequenceChunk> chunks;
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
    ticket = ex.create_import_ticket().ticket;
    return n(ticket.size());
  });
  outcome("PushSequence", [&] {  // to this same server, with the ticket it issued
    auto r = ex.push_sequence(h, args.str("target"), ticket);
    ex.release_cache(r.kv_cache);
    return n(r.kv_cache.length() == h.length());
  });
  outcome("WatchKvEvents", [&] {
    int batches = 0;
    bool hello = false;
    ex.watch_kv_events(true, [&](const ferrum::KvEventBatch& b) {
      hello = b.hello.has_value() && b.hello->block_size > 0;
      return ++batches < 1;
    });
    return n(batches) + ":" + n(hello);
  });
  outcome("RegisterSharedMemory", [&] {
    auto reg = ex.register_shared_memory("cpp-region", 4096);
    std::string key = reg->first().key;
    outcome("UnregisterSharedMemory", [&] { return n(ex.unregister_shared_memory("cpp-region")); });
    reg->close();
    return n(!key.empty());
  });
  outcome("ListModels", [&] { return n(ex.list_models().size()); });
  if (args.has("load-dir")) {
    outcome("LoadModel", [&] {
      int stages = 0;
      auto last = ex.load_model("cpp-loaded", args.str("load-dir"), [&](const ferrum::LoadProgress&) { ++stages; });
      return last.stage;
    });
    outcome("UnloadModel", [&] { return n(ex.unload_model("cpp-loaded")); });
  }
  if (args.has("adapter-dir")) {  // a PEFT adapter folder for this model
    outcome("LoadAdapter", [&] {
      return n(ex.load_adapter("cpp-adapter", args.str("adapter-dir")).rank);
    });
    outcome("ListAdapters", [&] { return n(ex.list_adapters().adapters.size()); });
    outcome("UnloadAdapter", [&] {
      ex.unload_adapter("cpp-adapter");
      return "";
    });
  }
  if (args.has("update-file")) {  // a safetensors file of this model's tensors, and its BLAKE2b-256 (hex)
    outcome("UpdateWeights", [&] {
      std::ifstream in(args.str("update-file"), std::ios::binary);
      std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::string hex = args.str("update-checksum"), checksum;
      for (size_t i = 0; i + 1 < hex.size(); i += 2) checksum.push_back(char(std::stoi(hex.substr(i, 2), nullptr, 16)));
      return n(ex.update_weights(data, checksum).weights_version);
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

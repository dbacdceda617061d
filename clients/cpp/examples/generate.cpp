// ferrum-generate: token ids in, token ids out. Runs a seeded decode-ahead generation
// on a ferrum-rpc server: Prefill with the token choice (the server chooses the first
// token), then one DecodeSession step that decodes ahead for the rest, stopping at a
// stop token or max tokens. Tokenization stays the caller's.
//
//   ferrum-generate --target 127.0.0.1:50051 --tokens 1,2,3 --max-tokens 32 \
//       --temperature 0.8 --top-k 40 --top-p 0.9 --seed 7 --stop 2 [--info]
//       [--ca ca.pem --server-name localhost] [--token T] [--timeout-ms 30000] [--repeat N]
//
// Prints the generated ids on one line (stdout); --info first prints GetCapabilities and
// GetStatus (stderr); timing goes to stderr as one JSON line.
#include <algorithm>
#include <chrono>
#include <iostream>

#include "args.hpp"
#include "ferrum/client.hpp"

int main(int argc, char** argv) try {
  ferrum_args::Args args(argc, argv);
  ferrum::ClientOptions options;
  options.model = args.str("model");
  options.token = args.str("token");
  if (args.has("timeout-ms")) options.timeout = std::chrono::milliseconds(long(args.num("timeout-ms", 0)));
  if (args.has("ca")) options.tls = ferrum::Tls{args.str("ca"), args.str("cert"), args.str("key"), args.str("server-name")};
  ferrum::Client ex(args.str("target", "127.0.0.1:50051"), options);

  if (args.has("info")) {
    const ferrum::Capabilities caps = ex.capabilities();
    std::cerr << "GetCapabilities:\n  model: " << caps.model << "\n  architecture: " << caps.architecture
              << "\n  max_batch_size: " << caps.max_batch_size << "\n  max_sequence_length: "
              << caps.max_sequence_length << "\n  kv_capacity_tokens: " << caps.kv_capacity_tokens
              << "\n  max_decode_ahead: " << caps.max_decode_ahead << "\n  cpu_capability: " << caps.cpu_capability
              << "\n";
    const ferrum::ServerStatus status = ex.status();
    std::cerr << "GetStatus:\n  state: " << ferrum::state_name(status.state)
              << "\n  active_sequences: " << status.active_sequences << "\n  kv_blocks_free: " << status.kv_blocks_free
              << "/" << status.kv_blocks_total << "\n  uptime_s: " << status.uptime_s << "\n";
  }
  std::vector<uint32_t> prompt = args.ids("tokens");
  if (prompt.empty()) {
    if (args.has("info")) return 0;
    throw std::invalid_argument("--tokens: the prompt's token ids (1,2,3)");
  }
  std::vector<uint32_t> stops = args.ids("stop");
  auto max_tokens = uint32_t(args.num("max-tokens", 32));
  ferrum::TokenChoice choice = args.has("greedy") ? ferrum::TokenChoice::greedy()
      : ferrum::TokenChoice::sampled(float(args.num("temperature", 1.0)), uint64_t(args.num("seed", 0)),
                                     uint32_t(args.num("top-k", 0)), float(args.num("top-p", 1.0)));
  int repeat = int(args.num("repeat", 1));

  std::vector<uint32_t> out;
  double ahead_s = 0;
  size_t ahead_tokens = 0;
  for (int r = 0; r < repeat; ++r) {
    out.clear();
    ferrum::Output first = ex.prefill(prompt, std::nullopt, choice);
    uint32_t token = first.chosen->token_id;
    out.push_back(token);
    ferrum::Handle handle = first.kv_cache;
    bool stopped = std::find(stops.begin(), stops.end(), token) != stops.end();
    if (!stopped && max_tokens > 1) {
      auto t0 = std::chrono::steady_clock::now();
      ferrum::AheadResult run = ex.decode_ahead(token, handle, choice, max_tokens - 1, stops);
      ahead_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ahead_tokens += run.chosen.size();
      for (const auto& c : run.chosen) out.push_back(c.token_id);
      handle = run.kv_cache;
    }
    ex.release_cache(handle);
  }
  for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? " " : "") << out[i];
  std::cout << "\n";
  std::cerr << "{\"ahead_tokens\": " << ahead_tokens << ", \"ahead_s\": " << ahead_s << ", \"tokens_per_s\": "
            << (ahead_s > 0 ? ahead_tokens / ahead_s : 0) << "}\n";
  return 0;
} catch (const ferrum::Error& e) {
  std::cerr << "ferrum-generate: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "ferrum-generate: " << e.what() << "\n";
  return 1;
}

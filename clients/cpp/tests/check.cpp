// ferrum-cpp-check: the C++ side of tests/contract/test_cpp_client.py. Each command
// runs the C++ client against a server and prints what the Python side compares:
//   greedy  --tokens 1,2,3 --n 8          argmax ids of a prefill + decode loop
//   logits  --tokens ... --out DIR        FULL float32 rows (raw bytes) and TOP_K rows
//   errors  --rows a,b,c                  "<row> <CODE> <REASON>" per error-table row
//   cancel  --tokens ... --after 3        a decode-ahead run cancelled mid-way, then the sequence
//   stop    --tokens ... --after 3        a decode-ahead run stopped mid-way
//   rpcs                                   "<RPC> OK <summary>" for every RPC of the contract
//   names   --tokens ... --name R         a prefill named R that timed out, retried, retried again
// Common: --target HOST:PORT [--model M] [--token T] [--ca PEM --server-name N] [--timeout-ms MS]
#include <cmath>
#include <fstream>
#include <iomanip>
#include <limits>

#include "check.hpp"

namespace check {

ferrum::Client client_from(const ferrum_args::Args& args) {
  ferrum::ClientOptions o;
  o.model = args.str("model");
  o.token = args.str("token");
  o.timeout = std::chrono::milliseconds(long(args.num("timeout-ms", 30000)));
  if (args.has("ca")) o.tls = ferrum::Tls{args.str("ca"), "", "", args.str("server-name")};
  return ferrum::Client(args.str("target"), o);
}

void outcome(const std::string& name, const std::function<std::string()>& fn) {
  try {
    std::string what = fn();
    std::cout << name << " OK " << (what.empty() ? "-" : what) << "\n";
  } catch (const ferrum::Error& e) {
    std::cout << name << " " << ferrum::Error::code_name(e.code()) << " " << (e.reason().empty() ? "-" : e.reason())
              << (e.retryable() ? " retryable" : "") << "\n";
  }
  std::cout.flush();
}

std::vector<uint32_t> prompt(uint32_t n, uint32_t vocab, uint32_t seed) {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < n; ++i) out.push_back((37 * i + 11 + 101 * seed) % vocab);
  return out;
}

}  // namespace check

namespace {

using ferrum::LogitsPolicy;

void print_ids(const std::string& tag, const std::vector<uint32_t>& ids) {
  std::cout << tag;
  for (auto id : ids) std::cout << " " << id;
  std::cout << "\n";
}

int greedy(const ferrum_args::Args& args) {
  auto ex = check::client_from(args);
  auto out = ex.prefill(args.ids("tokens"), LogitsPolicy::argmax());
  std::vector<uint32_t> ids{out.logits.argmax()};
  ferrum::Handle h = out.kv_cache;
  for (int i = 1; i < int(args.num("n", 8)); ++i) {
    auto step = ex.decode(ids.back(), h, LogitsPolicy::argmax());
    ids.push_back(step.logits.argmax());
    h = step.kv_cache;
  }
  ex.release_cache(h);
  print_ids("greedy", ids);
  return 0;
}

void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

int logits(const ferrum_args::Args& args) {
  auto ex = check::client_from(args);
  std::string dir = args.str("out");
  auto pre = ex.prefill(args.ids("tokens"), LogitsPolicy::full(ferrum::DType::Float32, true));
  // The views are the reply's own bytes: write them as they are.
  ferrum::View<float> last = pre.logits.row(pre.logits.rows() - 1);
  write_bytes(dir + "/prefill.f32", pre.logits.bytes());
  std::cout << "prefill_shape " << pre.logits.rows() << " " << pre.logits.vocab_size() << "\n";
  std::cout << "view_in_place " << (reinterpret_cast<const char*>(last.data) >= pre.logits.bytes().data()) << "\n";
  uint32_t next = pre.logits.argmax(pre.logits.rows() - 1);
  auto dec = ex.decode(next, pre.kv_cache, LogitsPolicy::full());
  write_bytes(dir + "/decode.f32", dec.logits.bytes());
  auto top = ex.forward_verify({next, 7}, dec.kv_cache, LogitsPolicy::top_k(5, true));
  std::cout << std::setprecision(9);  // scores print exactly (float32 round-trips in 9 digits)
  std::cout << "topk_shape " << top.logits.rows() << " " << top.logits.token_ids(0).size << "\n";
  for (uint32_t r = 0; r < top.logits.rows(); ++r) {
    std::cout << "topk_row";
    for (size_t i = 0; i < top.logits.token_ids(r).size; ++i)
      std::cout << " " << top.logits.token_ids(r)[i] << ":" << top.logits.scores(r)[i];
    std::cout << "\n";
  }
  auto bf = ex.forward_verify({next}, top.kv_cache, LogitsPolicy::full(ferrum::DType::BFloat16));
  write_bytes(dir + "/verify.bf16", bf.logits.bytes());
  std::vector<float> wide = bf.logits.row_as_float(0);
  write_bytes(dir + "/verify_widened.f32", std::string_view(reinterpret_cast<const char*>(wide.data()), wide.size() * 4));
  ex.release_cache(bf.kv_cache);
  return 0;
}

int errors(const ferrum_args::Args& args) {
  auto ex = check::client_from(args);
  uint32_t vocab = ex.info().vocab_size;
  auto subject = ex.prefill(check::prompt(6, vocab), LogitsPolicy::argmax()).kv_cache;
  auto with = [&](auto change) {
    ferrum::Handle h = subject;
    change(h);
    return h;
  };
  ferrum::TokenChoice nan_temperature;
  nan_temperature.temperature = std::numeric_limits<float>::quiet_NaN();
  std::map<std::string, std::function<std::string()>> rows = {
      {"cache_not_found", [&] { ex.decode(5, with([](auto& p) { p.set_cache_id("no-such-sequence"); })); return ""; }},
      {"stale_handle", [&] { ex.decode(5, with([](auto& p) { p.set_server_instance_id("another-server"); })); return ""; }},
      {"length_mismatch", [&] { ex.decode(5, with([](auto& p) { p.set_length(p.length() + 1); })); return ""; }},
      {"empty_prefill", [&] { ex.prefill({}); return ""; }},
      {"empty_verify", [&] { ex.forward_verify({}, subject); return ""; }},
      {"token_outside_vocab", [&] { ex.decode(vocab, subject); return ""; }},
      {"bad_top_k", [&] { ex.decode(5, subject, LogitsPolicy::top_k(0)); return ""; }},
      {"bad_temperature", [&] { ex.decode(5, subject, std::nullopt, nan_temperature); return ""; }},
      {"truncate_past_end", [&] { ex.truncate_kv(subject, subject.length() + 1); return ""; }},
      {"release_unknown", [&] { ex.release_cache(with([](auto& p) { p.set_cache_id("no-such-sequence"); })); return ""; }},
      {"fork_unknown", [&] { ex.fork(with([](auto& p) { p.set_cache_id("no-such-sequence"); }), 2); return ""; }},
      {"unknown_model", [&] {
         ferrum::ClientOptions o = ex.options();
         o.model = "no-such-model";
         ferrum::Client(args.str("target"), o).info();
         return "";
       }},
      {"forward_unimplemented", [&] { ex.forward(); return ""; }},
      {"ahead_too_many", [&] { ex.decode_ahead(5, subject, ferrum::TokenChoice::greedy(), 5000); return ""; }},
      {"ahead_bad_stop", [&] { ex.decode_ahead(5, subject, ferrum::TokenChoice::greedy(), 4, {vocab}); return ""; }},
      {"deadline", [&] { ex.with_timeout(std::chrono::milliseconds(0)).prefill({1, 2, 3}); return ""; }},
      {"too_long", [&] { ex.prefill(check::prompt(ex.info().max_sequence_length + 1, vocab)); return ""; }},
      {"kv_exhausted", [&] {  // two sequences of 28 tokens hold 14 of 16 blocks; 12 more need 3
         std::vector<ferrum::Handle> fillers;
         for (uint32_t seed : {1u, 2u}) fillers.push_back(ex.prefill(check::prompt(28, vocab, seed), LogitsPolicy::argmax()).kv_cache);
         try {
           ex.prefill(check::prompt(12, vocab));
         } catch (...) {
           for (auto& f : fillers) ex.release_cache(f);
           throw;
         }
         for (auto& f : fillers) ex.release_cache(f);
         return "";
       }},
      {"prefill", [&] { ex.release_cache(ex.prefill({1, 2, 3}).kv_cache); return ""; }},
  };
  std::string list = args.str("rows");
  for (char& c : list)
    if (c == ',') c = ' ';
  std::istringstream names(list);
  for (std::string name; names >> name;) {
    auto it = rows.find(name);
    if (it == rows.end()) throw std::invalid_argument("no row " + name);
    check::outcome(name, it->second);
  }
  // The subject must be as it was: its length decodes (a failed call changes nothing).
  check::outcome("subject_after", [&] {
    auto step = ex.decode(5, subject, LogitsPolicy::argmax());
    ex.release_cache(step.kv_cache);
    return std::to_string(step.kv_cache.length()) + ":" + std::to_string(step.logits.argmax());
  });
  return 0;
}

// A decode-ahead run that the caller abandons (cancel) or stops after `after` tokens;
// prints the tokens seen, then what the sequence is afterwards.
int ahead_interrupted(const ferrum_args::Args& args, bool cancel) {
  auto ex = check::client_from(args);
  auto pre = ex.prefill(args.ids("tokens"), LogitsPolicy::argmax());
  auto choice = ferrum::TokenChoice::sampled(0.8f, 7, 40, 0.9f);
  size_t after = size_t(args.num("after", 3)), seen = 0;
  std::vector<uint32_t> ids;
  struct Abandon {};
  ferrum::Handle h = pre.kv_cache;
  try {
    auto run = ex.decode_ahead(pre.logits.argmax(), pre.kv_cache, choice, 200, {}, [&](const ferrum::Chosen& c) {
      ids.push_back(c.token_id);
      if (++seen < after) return false;
      if (cancel) throw Abandon{};
      return true;  // stop
    });
    h = run.kv_cache;
    std::cout << "finish " << ferrum::finish_reason_name(run.finish_reason) << " " << run.chosen.size() << "\n";
  } catch (const Abandon&) {
    std::cout << "cancelled " << ids.size() << "\n";
  }
  std::cout << "length " << h.length() << "\n";
  // The sequence as the server has it now: the handle decodes, and its next argmax.
  auto step = ex.decode(5, h, LogitsPolicy::argmax());
  std::cout << "after " << step.kv_cache.length() << " " << step.logits.argmax() << "\n";
  ex.release_cache(step.kv_cache);
  return 0;
}

// A prefill the caller named, whose call timed out before it was sent: the client leaves
// the caller's name alone, so the retry makes the sequence; a second retry gets that
// sequence back (existing, no logits); another prompt under the name is refused.
int names(const ferrum_args::Args& args) {
  auto ex = check::client_from(args);
  std::string name = args.str("name");
  auto tokens = args.ids("tokens");
  auto named = [&](const ferrum::Client& c, const std::vector<uint32_t>& t) {
    return c.prefill(t, LogitsPolicy::argmax(), std::nullopt, nullptr, name);
  };
  check::outcome("timed_out", [&] {
    named(ex.with_timeout(std::chrono::milliseconds(0)), tokens);
    return "";
  });
  std::string first;
  check::outcome("retry", [&] {
    auto out = named(ex, tokens);
    first = out.kv_cache.cache_id();
    return std::to_string(out.existing) + ":" + std::to_string(out.kv_cache.length());
  });
  check::outcome("again", [&] {
    auto out = named(ex, tokens);
    return std::to_string(out.existing) + ":" + std::to_string(out.kv_cache.cache_id() == first) + ":" +
           std::to_string(out.kv_cache.length()) + ":" + std::to_string(out.logits.present());
  });
  auto other = tokens;
  other.push_back(5);
  check::outcome("other_prompt", [&] {
    named(ex, other);
    return "";
  });
  check::outcome("release", [&] {
    ex.release_request(name);
    return "";
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) throw std::invalid_argument("usage: ferrum-cpp-check COMMAND --target HOST:PORT ...");
  std::string cmd = argv[1];
  ferrum_args::Args args(argc, argv, 2);
  if (cmd == "greedy") return greedy(args);
  if (cmd == "logits") return logits(args);
  if (cmd == "errors") return errors(args);
  if (cmd == "cancel") return ahead_interrupted(args, true);
  if (cmd == "stop") return ahead_interrupted(args, false);
  if (cmd == "rpcs") return check::run_rpcs(args);
  if (cmd == "names") return names(args);
  throw std::invalid_argument("unknown command " + cmd);
} catch (const ferrum::Error& e) {
  std::cerr << "ferrum-cpp-check: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "ferrum-cpp-check: " << e.what() << "\n";
  return 1;
}

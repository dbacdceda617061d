// ferrum-cpp-vectors: the C++ client's runner of the shared test vectors
// (tests/vectors/cases.json):
//
//   ferrum-cpp-vectors --addr HOST:PORT [--cases FILE]
//
// Runs every case's steps through ferrum::Client and prints one JSON line per case,
// {"case": NAME, "steps": [RESULT, ...]}, in the format every client's runner prints
// (tests/vectors/README.md); tests/contract/test_vectors.py compares them with the
// cases' `expect`. A call this runner does not know ends it with an error (exit 1).
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>

#include "args.hpp"
#include "ferrum/client.hpp"
#include "json.hpp"

namespace {

using ferrum::LogitsPolicy;
using json::Value;

std::optional<LogitsPolicy> policy(const Value& step) {
  if (step.has("choice")) return std::nullopt;
  const std::string& name = step["logits"].str();
  if (name == "argmax") return LogitsPolicy::argmax();
  if (name == "argmax_all") return LogitsPolicy::argmax(true);
  if (name == "full") return LogitsPolicy::full();
  if (name == "full_all") return LogitsPolicy::full(ferrum::DType::Float32, true);
  throw std::invalid_argument("unknown logits policy " + name);
}

std::optional<ferrum::TokenChoice> choice(const Value& step) {
  if (!step.has("choice")) return std::nullopt;
  const Value& c = step["choice"];
  ferrum::TokenChoice out;
  if (c.has("temperature")) out.temperature = float(c["temperature"].number);
  if (c.has("top_k")) out.top_k = c["top_k"].u32();
  if (c.has("top_p")) out.top_p = float(c["top_p"].number);
  if (c.has("seed")) out.seed = c["seed"].u64();
  return out;
}

std::string hex(std::string_view bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += digits[b >> 4], out += digits[b & 15];
  return out;
}

// One case's state: per handle name its handle and its next token (the argmax of the
// last row or the chosen token of the last call on it).
struct Case {
  const ferrum::Client& client;
  std::string addr;
  std::map<std::string, ferrum::Handle> handles;
  std::map<std::string, uint32_t> next;
  std::map<std::string, std::vector<ferrum::SequenceChunk>> exports;  // relayed to import_sequence untouched
  std::map<std::string, std::string> tickets;                          // an import ticket's secret by name

  uint32_t token(const std::string& name, const Value& token) {
    return token.type == Value::Type::String ? next.at(name) : token.u32();
  }

  // Stores the output's handle under name; the result of an output-producing call.
  Value kept(const std::string& name, const ferrum::Output& out, const Value& step) {
    handles[name] = out.kv_cache;
    Value result = json::object();
    result.object["length"] = json::number(out.kv_cache.length());
    std::vector<uint32_t> ids;
    if (out.chosen) {
      ids.push_back(out.chosen->token_id);
    } else if (step["logits"].str().rfind("full", 0) == 0) {
      Value logits = json::object();
      logits.object["shape"] = json::numbers(std::vector<uint32_t>{out.logits.rows(), out.logits.vocab_size()});
      logits.object["f32_hex"] = json::string(hex(out.logits.bytes()));
      result.object["logits"] = logits;
      return result;
    } else {
      for (uint32_t r = 0; r < out.logits.rows(); ++r) ids.push_back(out.logits.argmax(r));
    }
    if (!ids.empty()) next[name] = ids.back();
    result.object["ids"] = json::numbers(ids);
    return result;
  }

  // Stores a SpeculativeDecode round's handle under name with its next_token_id as the
  // next token; the result: length, the drafts kept, the next token and the argmax of
  // the logits row after them.
  Value speculated(const std::string& name, const ferrum::SpeculativeResult& out) {
    handles[name] = out.kv_cache;
    next[name] = out.next_token_id;
    std::vector<uint32_t> ids;
    for (uint32_t r = 0; r < out.logits.rows(); ++r) ids.push_back(out.logits.argmax(r));
    Value result = json::object();
    result.object["length"] = json::number(out.kv_cache.length());
    result.object["accepted"] = json::numbers(out.accepted_token_ids);
    result.object["next"] = json::number(out.next_token_id);
    result.object["ids"] = json::numbers(ids);
    return result;
  }

  Value kept_all(const Value& names, const std::vector<ferrum::Output>& outs, const Value& step) {
    Value items = json::array();
    for (size_t i = 0; i < outs.size(); ++i) items.array.push_back(kept(names[i].str(), outs[i], step));
    Value result = json::object();
    result.object["items"] = items;
    return result;
  }

  std::vector<ferrum::DecodeInput> items(const Value& step) {
    std::vector<ferrum::DecodeInput> out;
    for (size_t i = 0; i < step["handles"].size(); ++i) {
      const std::string& name = step["handles"][i].str();
      out.push_back(ferrum::DecodeInput{token(name, step["tokens"][i]), handles.at(name), std::nullopt});
    }
    return out;
  }
};

// The results of a step run `repeat` times as one: ids (or each item's) concatenated,
// the last length.
Value repeated(const Value& step, const std::function<Value()>& once) {
  std::vector<Value> results;
  size_t times = step.has("repeat") ? step["repeat"].u32() : 1;
  for (size_t i = 0; i < times; ++i) results.push_back(once());
  Value last = results.back();
  if (last.has("ids")) {
    Value all = json::array();
    for (const auto& r : results)
      for (const auto& id : r["ids"].array) all.array.push_back(id);
    last.object["ids"] = all;
  }
  if (last.has("items")) {
    for (size_t k = 0; k < last["items"].size(); ++k) {
      Value all = json::array();
      for (const auto& r : results)
        for (const auto& id : r["items"][k]["ids"].array) all.array.push_back(id);
      last.object["items"].array[k].object["ids"] = all;
    }
  }
  return last;
}

Value run_step(Case& c, const Value& step) {
  const ferrum::Client& ex = c.client;
  const std::string& call = step["call"].str();
  Value result = json::object();
  if (call == "info") {
    auto info = ex.info();
    result.object["vocab_size"] = json::number(info.vocab_size);
    result.object["num_layers"] = json::number(info.num_layers);
    result.object["max_sequence_length"] = json::number(info.max_sequence_length);
  } else if (call == "status") {
    result.object["active_sequences"] = json::number(ex.status().active_sequences);
  } else if (call == "prefill") {
    if (step.has("model")) {
      ferrum::ClientOptions o = ex.options();
      o.model = step["model"].str();
      return c.kept(step["as"].str(), ferrum::Client(c.addr, o).prefill(step["tokens"].ids(), policy(step), choice(step)), step);
    }
    return c.kept(step["as"].str(), ex.prefill(step["tokens"].ids(), policy(step), choice(step)), step);
  } else if (call == "batch_prefill") {
    if (step.has("choice")) throw std::invalid_argument("batch_prefill with a token choice");
    std::vector<std::pair<std::vector<uint32_t>, std::optional<ferrum::Handle>>> prompts;
    for (const auto& p : step["prompts"].array) prompts.emplace_back(p.ids(), std::nullopt);
    return c.kept_all(step["as"], ex.batch_prefill(prompts, policy(step)), step);
  } else if (call == "decode") {
    const std::string& name = step["handle"].str();
    std::string keep = step.has("as") ? step["as"].str() : name;
    return repeated(step, [&] {
      return c.kept(keep, ex.decode(c.token(name, step["token"]), c.handles.at(name), policy(step), choice(step)), step);
    });
  } else if (call == "batch_decode") {
    return repeated(step, [&] { return c.kept_all(step["handles"], ex.batch_decode(c.items(step), policy(step)), step); });
  } else if (call == "session") {
    auto session = ex.decode_session();
    Value out = repeated(step, [&] { return c.kept_all(step["handles"], session->step(c.items(step), policy(step)), step); });
    session->close();
    return out;
  } else if (call == "verify") {
    const std::string& name = step["handle"].str();
    return c.kept(name, ex.forward_verify(step["tokens"].ids(), c.handles.at(name), policy(step)), step);
  } else if (call == "truncate") {
    const std::string& name = step["handle"].str();
    c.handles[name] = ex.truncate_kv(c.handles.at(name), step["length"].u32());
    result.object["length"] = json::number(c.handles[name].length());
  } else if (call == "release") {
    ex.release_cache(c.handles.at(step["handle"].str()));
  } else if (call == "fork") {
    const std::string& parent = step["handle"].str();
    auto children = ex.fork(c.handles.at(parent), uint32_t(step["as"].size()));
    std::vector<uint32_t> lengths;
    for (size_t i = 0; i < children.size(); ++i) {
      const std::string& name = step["as"][i].str();
      c.handles[name] = children[i];
      if (c.next.count(parent)) c.next[name] = c.next[parent];
      lengths.push_back(children[i].length());
    }
    result.object["lengths"] = json::numbers(lengths);
  } else if (call == "speculative") {
    const std::string& name = step["handle"].str();
    return c.speculated(name, ex.speculative_decode(c.token(name, step["token"]), step["draft"].ids(),
                                                    c.handles.at(name), policy(step)));
  } else if (call == "export") {
    const std::string& name = step["handle"].str();
    c.exports[step["as"].str()] = ex.export_sequence(c.handles.at(name));
    if (c.next.count(name)) c.next[step["as"].str()] = c.next[name];
  } else if (call == "import") {
    const std::string& from = step["from"].str();
    const std::string& name = step["as"].str();
    c.handles[name] = ex.import_sequence(c.exports.at(from));
    if (c.next.count(from)) c.next[name] = c.next[from];
    result.object["length"] = json::number(c.handles[name].length());
  } else if (call == "ticket") {
    // What is the same on every run: the secret's length (it is random), the model and
    // the seconds it stays valid rounded up (they run down).
    auto t = ex.create_import_ticket(step.has("fingerprint") ? step["fingerprint"].str() : "",
                                     step.has("ttl_s") ? step["ttl_s"].number : 0);
    if (step.has("as")) c.tickets[step["as"].str()] = t.ticket;
    result.object["ticket_chars"] = json::number(double(t.ticket.size()));
    result.object["model"] = json::string(t.model);
    result.object["ttl_s"] = json::number(std::ceil(t.ttl_s));
  } else if (call == "push") {  // into the server the runner talks to, named by the runner's own address
    const std::string& name = step["handle"].str();
    const std::string& keep = step["as"].str();
    auto pushed = ex.push_sequence(c.handles.at(name), c.addr, c.tickets.at(step["ticket"].str()),
                                   step["move"].type == Value::Type::Bool && step["move"].boolean);
    c.handles[keep] = pushed.kv_cache;
    if (c.next.count(name)) c.next[keep] = c.next[name];
    result.object["length"] = json::number(pushed.kv_cache.length());
    result.object["released"] = json::boolean(pushed.released);
  } else if (call == "forward") {
    ex.forward();
  } else {
    throw std::invalid_argument("unknown call " + call);
  }
  return result;
}

Value run_case(const ferrum::Client& client, const std::string& addr, const Value& kase) {
  Case c{client, addr, {}, {}, {}, {}};
  Value steps = json::array();
  for (const auto& step : kase["steps"].array) {
    try {
      steps.array.push_back(run_step(c, step));
    } catch (const ferrum::Error& e) {
      Value error = json::object();
      error.object["code"] = json::string(ferrum::Error::code_name(e.code()));
      error.object["reason"] = e.reason().empty() ? Value{} : json::string(e.reason());
      Value failed = json::object();
      failed.object["error"] = error;
      steps.array.push_back(failed);
    }
  }
  Value out = json::object();
  out.object["case"] = kase["name"];
  out.object["steps"] = steps;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    ferrum_args::Args args(argc, argv);
    if (!args.has("addr")) throw std::invalid_argument("usage: ferrum-cpp-vectors --addr HOST:PORT [--cases FILE]");
    std::ifstream in(args.str("cases", FERRUM_VECTORS_CASES));
    if (!in) throw std::runtime_error("cannot read the cases file");
    std::stringstream text;
    text << in.rdbuf();
    Value doc = json::parse(text.str());
    ferrum::ClientOptions o;
    o.timeout = std::chrono::milliseconds(30000);
    ferrum::Client client(args.str("addr"), o);
    for (const auto& kase : doc["cases"].array) std::cout << json::dump(run_case(client, args.str("addr"), kase)) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ferrum-cpp-vectors: " << e.what() << "\n";
    return 1;
  }
}

// A small JSON reader and writer for ferrum-cpp-vectors (tests/vectors/cases.json): the
// client depends on no JSON library, and the vectors need only objects, arrays, strings
// without unicode escapes beyond \uXXXX of ASCII, numbers, booleans and null.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace json {

struct Value {
  enum class Type { Null, Bool, Number, String, Array, Object } type = Type::Null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  bool has(const std::string& key) const { return type == Type::Object && object.count(key) > 0; }
  const Value& operator[](const std::string& key) const {
    auto it = object.find(key);
    if (it == object.end()) throw std::runtime_error("JSON: no key " + key);
    return it->second;
  }
  const Value& operator[](size_t i) const { return array.at(i); }
  size_t size() const { return array.size(); }
  const std::string& str() const { return string; }
  uint32_t u32() const { return static_cast<uint32_t>(number); }
  uint64_t u64() const { return static_cast<uint64_t>(number); }
  std::vector<uint32_t> ids() const {
    std::vector<uint32_t> out;
    for (const auto& v : array) out.push_back(v.u32());
    return out;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}
  Value parse() {
    Value v = value();
    space();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  bool take(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(const char* w) {
    std::string t(w);
    if (s_.compare(i_, t.size(), t) != 0) return false;
    i_ += t.size();
    return true;
  }
  std::string text() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          unsigned long code = std::stoul(s_.substr(i_, 4), nullptr, 16);
          if (code > 0x7f) fail("non-ASCII \\u escape");
          out += static_cast<char>(code);
          i_ += 4;
          break;
        }
        default: out += e;  // \" \\ \/
      }
    }
    expect('"');
    return out;
  }
  Value value() {
    space();
    if (i_ >= s_.size()) fail("unexpected end");
    Value v;
    char c = s_[i_];
    if (c == '{') {
      v.type = Value::Type::Object;
      ++i_;
      if (take('}')) return v;
      do {
        space();
        std::string key = text();
        expect(':');
        v.object[key] = value();
      } while (take(','));
      expect('}');
    } else if (c == '[') {
      v.type = Value::Type::Array;
      ++i_;
      if (take(']')) return v;
      do v.array.push_back(value());
      while (take(','));
      expect(']');
    } else if (c == '"') {
      v.type = Value::Type::String;
      v.string = text();
    } else if (word("true")) {
      v.type = Value::Type::Bool;
      v.boolean = true;
    } else if (word("false")) {
      v.type = Value::Type::Bool;
    } else if (word("null")) {
    } else {
      size_t used = 0;
      v.type = Value::Type::Number;
      v.number = std::stod(s_.substr(i_, 32), &used);
      if (used == 0) fail("not a value");
      i_ += used;
    }
    return v;
  }
  const std::string& s_;
  size_t i_ = 0;
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

// A JSON string literal of s (the vectors' names and reasons are ASCII).
inline std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// Builders for results.
inline Value number(double n) {
  Value v;
  v.type = Value::Type::Number;
  v.number = n;
  return v;
}
inline Value boolean(bool b) {
  Value v;
  v.type = Value::Type::Bool;
  v.boolean = b;
  return v;
}
inline Value string(const std::string& s) {
  Value v;
  v.type = Value::Type::String;
  v.string = s;
  return v;
}
inline Value array(std::vector<Value> items = {}) {
  Value v;
  v.type = Value::Type::Array;
  v.array = std::move(items);
  return v;
}
inline Value object() {
  Value v;
  v.type = Value::Type::Object;
  return v;
}
template <typename T>
Value numbers(const std::vector<T>& values) {
  Value v = array();
  for (const auto& x : values) v.array.push_back(number(double(x)));
  return v;
}

// One line of JSON (integral numbers without a fraction; keys in sorted order).
inline std::string dump(const Value& v) {
  std::ostringstream out;
  switch (v.type) {
    case Value::Type::Null: return "null";
    case Value::Type::Bool: return v.boolean ? "true" : "false";
    case Value::Type::Number:
      if (v.number == double(int64_t(v.number))) out << int64_t(v.number);
      else out.precision(17), out << v.number;
      return out.str();
    case Value::Type::String: return quote(v.string);
    case Value::Type::Array:
      out << "[";
      for (size_t i = 0; i < v.array.size(); ++i) out << (i ? ", " : "") << dump(v.array[i]);
      out << "]";
      return out.str();
    case Value::Type::Object: {
      out << "{";
      bool first = true;
      for (const auto& [k, x] : v.object) out << (first ? "" : ", ") << quote(k) << ": " << dump(x), first = false;
      out << "}";
      return out.str();
    }
  }
  return "null";
}

}  // namespace json

// Logits policies, logits views over reply bytes, token choice and chosen tokens, and
// handles: the public types and the contract's messages they stand for.
#include <cstdint>
#include <cstring>

#include "internal.hpp"

namespace ferrum {

static_assert(sizeof(float) == 4, "float32 logits are viewed as float");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "logits bytes are little-endian and are viewed in place; this host is not"
#endif

LogitsPolicy LogitsPolicy::full(DType dtype, bool all_positions) {
  LogitsPolicy p;
  p.kind = LogitsKind::Full;
  p.dtype = dtype;
  p.all_positions = all_positions;
  return p;
}

LogitsPolicy LogitsPolicy::top_k(uint32_t k, bool all_positions) {
  LogitsPolicy p;
  p.kind = LogitsKind::TopK;
  p.k = k;
  p.all_positions = all_positions;
  return p;
}

LogitsPolicy LogitsPolicy::argmax(bool all_positions) {
  LogitsPolicy p;
  p.kind = LogitsKind::Argmax;
  p.all_positions = all_positions;
  return p;
}

namespace detail {

Handle Convert::handle(const pb::KvCacheHandle& p) {
  Handle h;
  h.cache_id_ = p.cache_id();
  h.length_ = p.sequence_length();
  h.num_layers_ = p.num_layers();
  h.num_kv_heads_ = p.num_kv_heads();
  h.head_dim_ = p.head_dim();
  h.device_ = p.device();
  h.model_ = p.model();
  h.server_instance_id_ = p.server_instance_id();
  h.adapter_ = p.adapter();
  h.weights_version_ = p.weights_version();
  return h;
}

pb::KvCacheHandle Convert::proto(const Handle& h) {
  pb::KvCacheHandle p;
  p.set_cache_id(h.cache_id_);
  p.set_sequence_length(h.length_);
  p.set_num_layers(h.num_layers_);
  p.set_num_kv_heads(h.num_kv_heads_);
  p.set_head_dim(h.head_dim_);
  p.set_device(h.device_);
  p.set_model(h.model_);
  p.set_server_instance_id(h.server_instance_id_);
  p.set_adapter(h.adapter_);
  p.set_weights_version(h.weights_version_);
  return p;
}

pb::LogitsPolicy Convert::proto(const LogitsPolicy& l) {
  pb::LogitsPolicy p;
  p.set_kind(static_cast<pb::LogitsKind>(l.kind));
  if (l.kind == LogitsKind::Full) p.set_dtype(static_cast<pb::DType>(l.dtype));
  p.set_top_k(l.k);
  p.set_all_positions(l.all_positions);
  if (l.shared_memory) {
    p.mutable_shared_memory()->set_region(l.shared_memory->region);
    p.mutable_shared_memory()->set_offset(l.shared_memory->offset);
  }
  return p;
}

pb::TokenChoice Convert::proto(const TokenChoice& c) {
  pb::TokenChoice p;
  if (c.temperature) p.set_temperature(*c.temperature);
  p.set_top_k(c.top_k);
  if (c.top_p) p.set_top_p(*c.top_p);
  p.set_min_p(c.min_p);
  if (c.seed) p.set_seed(*c.seed);
  if (c.repetition_penalty) p.set_repetition_penalty(*c.repetition_penalty);
  p.set_presence_penalty(c.presence_penalty);
  p.set_frequency_penalty(c.frequency_penalty);
  for (const auto& [id, bias] : c.logit_bias) (*p.mutable_logit_bias())[id] = bias;
  p.set_allowed_token_bitmask(c.allowed_token_bitmask);
  p.set_top_logprobs(c.top_logprobs);
  p.set_logprobs_mode(static_cast<pb::LogprobsMode>(c.logprobs_mode));
  return p;
}

Chosen Convert::chosen(const pb::ChosenToken& c) {
  Chosen out;
  out.token_id = c.token_id();
  out.logprob = c.logprob();
  for (const auto& t : c.top_logprobs()) out.top_logprobs.emplace_back(t.token_id(), t.logprob());
  return out;
}

Logits Convert::logits(std::shared_ptr<const void> owner, const pb::Logits& p) {
  Logits l;
  l.owner_ = std::move(owner);
  l.present_ = true;
  l.kind_ = static_cast<LogitsKind>(p.kind());
  l.vocab_ = p.vocab_size();
  l.positions_ = p.positions();
  l.dtype_ = static_cast<DType>(p.values().dtype());
  l.has_shape_ = p.values().shape_size() > 0;
  l.shape_rows_ = l.has_shape_ ? static_cast<uint32_t>(p.values().shape(0)) : 0;
  const std::string& data = p.values().data();
  l.bytes_ = std::string_view(data.data(), data.size());
  l.scores_ = {p.scores().data(), static_cast<size_t>(p.scores_size())};
  l.ids_ = {p.token_ids().data(), static_cast<size_t>(p.token_ids_size())};
  if (l.kind_ != LogitsKind::Full || l.dtype_ != DType::Float32) return l;
  // protobuf promises nothing about a bytes field's alignment: floats are read in place
  // only where the buffer is aligned for them, and copied once otherwise.
  if (reinterpret_cast<std::uintptr_t>(data.data()) % alignof(float) == 0) return l;
  auto copy = std::make_shared<std::vector<float>>(data.size() / sizeof(float));
  std::memcpy(copy->data(), data.data(), copy->size() * sizeof(float));
  l.aligned_ = std::move(copy);
  return l;
}

}  // namespace detail

uint32_t Logits::rows() const {
  if (!present_) return 0;
  if (kind_ == LogitsKind::Full && has_shape_) return shape_rows_;
  // TOP_K and ARGMAX: `positions` rows (a reply that leaves it 0 carries one row).
  return positions_ ? positions_ : (ids_.size ? 1 : 0);
}

View<float> Logits::row(uint32_t r) const {
  if (kind() != LogitsKind::Full || dtype() != DType::Float32)
    throw std::logic_error("Logits::row: FULL float32 logits only (row_as_float widens other dtypes)");
  if (r >= rows()) throw std::out_of_range("Logits::row: no such row");
  const uint32_t v = vocab_size();
  if (bytes_.size() < size_t(rows()) * v * 4)
    throw std::logic_error("Logits::row: the reply's bytes are fewer than its shape (shared memory?)");
  // The bytes are little-endian IEEE floats laid out row-major: read in place where
  // aligned for float, else from the aligned copy the constructor made.
  const float* base = aligned_ ? aligned_->data() : reinterpret_cast<const float*>(bytes_.data());
  return {base + size_t(r) * v, v};
}

static float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::vector<float> Logits::row_as_float(uint32_t r) const {
  if (kind() != LogitsKind::Full) throw std::logic_error("Logits::row_as_float: FULL logits only");
  if (dtype() == DType::Float32) {
    View<float> v = row(r);
    return std::vector<float>(v.begin(), v.end());
  }
  if (r >= rows()) throw std::out_of_range("Logits::row_as_float: no such row");
  const uint32_t v = vocab_size();
  const auto* src = reinterpret_cast<const uint8_t*>(bytes_.data()) + size_t(r) * v * 2;
  std::vector<float> out(v);
  for (uint32_t i = 0; i < v; ++i) {
    uint16_t x = uint16_t(src[2 * i]) | uint16_t(src[2 * i + 1]) << 8;
    if (dtype() == DType::BFloat16) {
      uint32_t bits = uint32_t(x) << 16;
      std::memcpy(&out[i], &bits, 4);
    } else {
      out[i] = half_to_float(x);
    }
  }
  return out;
}

uint32_t Logits::per_row() const {
  uint32_t n = rows();
  return n ? static_cast<uint32_t>(ids_.size / n) : 0;
}

View<float> Logits::scores(uint32_t r) const {
  if (kind() != LogitsKind::TopK && kind() != LogitsKind::Argmax)
    throw std::logic_error("Logits::scores: TOP_K or ARGMAX logits only");
  if (r >= rows()) throw std::out_of_range("Logits::scores: no such row");
  uint32_t k = per_row();
  return {scores_.data + size_t(r) * k, k};
}

View<uint32_t> Logits::token_ids(uint32_t r) const {
  if (kind() != LogitsKind::TopK && kind() != LogitsKind::Argmax)
    throw std::logic_error("Logits::token_ids: TOP_K or ARGMAX logits only");
  if (r >= rows()) throw std::out_of_range("Logits::token_ids: no such row");
  uint32_t k = per_row();
  return {ids_.data + size_t(r) * k, k};
}

uint32_t Logits::argmax(uint32_t r) const {
  if (kind() == LogitsKind::Full) {
    std::vector<float> row = row_as_float(r);
    uint32_t best = 0;
    for (uint32_t i = 1; i < row.size(); ++i)
      if (row[i] > row[best]) best = i;
    return best;
  }
  View<uint32_t> ids = token_ids(r);
  if (ids.size == 0) throw std::logic_error("Logits::argmax: an empty row");
  return ids[0];
}

TokenChoice TokenChoice::greedy() {
  TokenChoice c;
  c.temperature = 0.0f;
  return c;
}

TokenChoice TokenChoice::sampled(float temperature, uint64_t seed, uint32_t top_k, float top_p) {
  TokenChoice c;
  c.temperature = temperature;
  c.seed = seed;
  c.top_k = top_k;
  c.top_p = top_p;
  return c;
}

}  // namespace ferrum

// Logits policies, logits views over reply bytes, token choice and chosen tokens.
#include <cstdint>
#include <cstring>

#include "ferrum/types.hpp"

namespace ferrum {

static_assert(sizeof(float) == 4, "float32 logits are viewed as float");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "logits bytes are little-endian and are viewed in place; this host is not"
#endif

LogitsPolicy LogitsPolicy::full(DType dtype, bool all_positions) {
  LogitsPolicy p;
  p.proto.set_kind(pb::LOGITS_KIND_FULL);
  p.proto.set_dtype(static_cast<pb::DType>(dtype));
  p.proto.set_all_positions(all_positions);
  return p;
}

LogitsPolicy LogitsPolicy::top_k(uint32_t k, bool all_positions) {
  LogitsPolicy p;
  p.proto.set_kind(pb::LOGITS_KIND_TOP_K);
  p.proto.set_top_k(k);
  p.proto.set_all_positions(all_positions);
  return p;
}

LogitsPolicy LogitsPolicy::argmax(bool all_positions) {
  LogitsPolicy p;
  p.proto.set_kind(pb::LOGITS_KIND_ARGMAX);
  p.proto.set_all_positions(all_positions);
  return p;
}

Logits::Logits(std::shared_ptr<const void> owner, const pb::Logits* proto) : owner_(std::move(owner)), p_(proto) {
  if (!p_ || p_->kind() != pb::LOGITS_KIND_FULL || p_->values().dtype() != pb::DTYPE_FLOAT32) return;
  const std::string& data = p_->values().data();
  // protobuf promises nothing about a bytes field's alignment: floats are read in place
  // only where the buffer is aligned for them, and copied once otherwise.
  if (reinterpret_cast<std::uintptr_t>(data.data()) % alignof(float) == 0) return;
  auto copy = std::make_shared<std::vector<float>>(data.size() / sizeof(float));
  std::memcpy(copy->data(), data.data(), copy->size() * sizeof(float));
  aligned_ = std::move(copy);
}

pb::LogitsKind Logits::kind() const { return p_ ? p_->kind() : pb::LOGITS_KIND_UNSPECIFIED; }

uint32_t Logits::rows() const {
  if (!p_) return 0;
  if (p_->kind() == pb::LOGITS_KIND_FULL && p_->values().shape_size() > 0)
    return static_cast<uint32_t>(p_->values().shape(0));
  // TOP_K and ARGMAX: `positions` rows (a reply that leaves it 0 carries one row).
  return p_->positions() ? p_->positions() : (p_->token_ids_size() ? 1 : 0);
}

uint32_t Logits::vocab_size() const { return p_ ? p_->vocab_size() : 0; }

pb::DType Logits::dtype() const { return p_ ? p_->values().dtype() : pb::DTYPE_UNSPECIFIED; }

std::string_view Logits::bytes() const {
  if (!p_) return {};
  const std::string& data = p_->values().data();
  return std::string_view(data.data(), data.size());
}

View<float> Logits::row(uint32_t r) const {
  if (kind() != pb::LOGITS_KIND_FULL || dtype() != pb::DTYPE_FLOAT32)
    throw std::logic_error("Logits::row: FULL float32 logits only (row_as_float widens other dtypes)");
  if (r >= rows()) throw std::out_of_range("Logits::row: no such row");
  const uint32_t v = vocab_size();
  if (p_->values().data().size() < size_t(rows()) * v * 4)
    throw std::logic_error("Logits::row: the reply's bytes are fewer than its shape (shared memory?)");
  // The bytes are little-endian IEEE floats laid out row-major: read in place where
  // aligned for float, else from the aligned copy the constructor made.
  const float* base = aligned_ ? aligned_->data() : reinterpret_cast<const float*>(p_->values().data().data());
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
  if (kind() != pb::LOGITS_KIND_FULL) throw std::logic_error("Logits::row_as_float: FULL logits only");
  if (dtype() == pb::DTYPE_FLOAT32) {
    View<float> v = row(r);
    return std::vector<float>(v.begin(), v.end());
  }
  if (r >= rows()) throw std::out_of_range("Logits::row_as_float: no such row");
  const uint32_t v = vocab_size();
  const auto* src = reinterpret_cast<const uint8_t*>(p_->values().data().data()) + size_t(r) * v * 2;
  std::vector<float> out(v);
  for (uint32_t i = 0; i < v; ++i) {
    uint16_t x = uint16_t(src[2 * i]) | uint16_t(src[2 * i + 1]) << 8;
    if (dtype() == pb::DTYPE_BFLOAT16) {
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
  return n ? static_cast<uint32_t>(p_->token_ids_size() / n) : 0;
}

View<float> Logits::scores(uint32_t r) const {
  if (kind() != pb::LOGITS_KIND_TOP_K && kind() != pb::LOGITS_KIND_ARGMAX)
    throw std::logic_error("Logits::scores: TOP_K or ARGMAX logits only");
  if (r >= rows()) throw std::out_of_range("Logits::scores: no such row");
  uint32_t k = per_row();
  return {p_->scores().data() + size_t(r) * k, k};
}

View<uint32_t> Logits::token_ids(uint32_t r) const {
  if (kind() != pb::LOGITS_KIND_TOP_K && kind() != pb::LOGITS_KIND_ARGMAX)
    throw std::logic_error("Logits::token_ids: TOP_K or ARGMAX logits only");
  if (r >= rows()) throw std::out_of_range("Logits::token_ids: no such row");
  uint32_t k = per_row();
  return {p_->token_ids().data() + size_t(r) * k, k};
}

uint32_t Logits::argmax(uint32_t r) const {
  if (kind() == pb::LOGITS_KIND_FULL) {
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

pb::TokenChoice TokenChoice::to_proto() const {
  pb::TokenChoice p;
  if (temperature) p.set_temperature(*temperature);
  p.set_top_k(top_k);
  if (top_p) p.set_top_p(*top_p);
  p.set_min_p(min_p);
  if (seed) p.set_seed(*seed);
  if (repetition_penalty) p.set_repetition_penalty(*repetition_penalty);
  p.set_presence_penalty(presence_penalty);
  p.set_frequency_penalty(frequency_penalty);
  for (const auto& [id, bias] : logit_bias) (*p.mutable_logit_bias())[id] = bias;
  p.set_allowed_token_bitmask(allowed_token_bitmask);
  p.set_top_logprobs(top_logprobs);
  p.set_logprobs_mode(logprobs_mode);
  return p;
}

Chosen Chosen::from_proto(const pb::ChosenToken& c) {
  Chosen out;
  out.token_id = c.token_id();
  out.logprob = c.logprob();
  for (const auto& t : c.top_logprobs()) out.top_logprobs.emplace_back(t.token_id(), t.logprob());
  return out;
}

}  // namespace ferrum

// pickle_value.cpp: the Value model of pickle.h (construction, typed access, equality,
// rendering for messages).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>

#include "cachealloc/trace/pickle.h"
#include "pickle_internal.h"

namespace cachealloc::trace {

using detail::escape_text;
using detail::ValueAccess;

Value::Value(std::string text) : kind_(Kind::str) {
  auto* node = new detail::StrNode;
  node->text = std::move(text);
  payload_.node = node;
}
Value::Value(std::string_view text) : Value(std::string(text)) {}
Value::Value(const char* text) : Value(text == nullptr ? Value() : Value(std::string(text))) {}

Value Value::bytes(Bytes data) {
  auto* node = new detail::BytesNode;
  node->data = std::move(data);
  return Value(Kind::bytes, node);
}

namespace {
std::uint32_t deepest(const std::vector<Value>& items) noexcept {
  std::uint32_t d = 0;
  for (const Value& v : items) d = std::max(d, v.depth());
  return d;
}

[[noreturn]] void throw_too_deep(std::uint32_t depth) {
  throw TraceError("pickle value: nesting depth " + std::to_string(depth) +
                   " exceeds the limit of " + std::to_string(kMaxNestingDepth) +
                   " levels; flatten the data");
}

Value make_sequence(Value::Kind kind, std::vector<Value> items) {
  const std::uint32_t depth = deepest(items) + 1;
  if (depth > kMaxNestingDepth) throw_too_deep(depth);
  auto* node = new detail::SeqNode;
  node->items = std::move(items);
  node->depth = depth;
  return ValueAccess::make(kind, node);
}
}  // namespace

Value Value::list(std::vector<Value> items) { return make_sequence(Kind::list, std::move(items)); }
Value Value::tuple(std::vector<Value> items) {
  return make_sequence(Kind::tuple, std::move(items));
}
Value Value::set(std::vector<Value> items) { return make_sequence(Kind::set, std::move(items)); }

Value Value::dict(Dict items) {
  std::uint32_t depth = 1;
  for (const auto& [k, v] : items.items) depth = std::max({depth, k.depth() + 1, v.depth() + 1});
  if (depth > kMaxNestingDepth) throw_too_deep(depth);
  auto* node = new detail::DictNode;
  node->dict = std::move(items);
  node->depth = depth;
  return Value(Kind::dict, node);
}

void Value::destroy_node() noexcept {
  switch (kind_) {
    case Kind::str:
      delete static_cast<detail::StrNode*>(payload_.node);
      break;
    case Kind::bytes:
      delete static_cast<detail::BytesNode*>(payload_.node);
      break;
    case Kind::list:
    case Kind::tuple:
    case Kind::set:
      delete static_cast<detail::SeqNode*>(payload_.node);
      break;
    case Kind::dict:
      delete static_cast<detail::DictNode*>(payload_.node);
      break;
    default:
      break;
  }
}

std::string_view Value::type_name() const noexcept {
  switch (kind_) {
    case Kind::none:
      return "NoneType";
    case Kind::boolean:
      return "bool";
    case Kind::integer:
    case Kind::unsigned_integer:
      return "int";
    case Kind::real:
      return "float";
    case Kind::str:
      return "str";
    case Kind::bytes:
      return "bytes";
    case Kind::list:
      return "list";
    case Kind::tuple:
      return "tuple";
    case Kind::set:
      return "set";
    case Kind::dict:
      return "dict";
  }
  return "?";
}

std::string detail::escape_text(std::string_view raw, std::size_t max_chars) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  const std::size_t n = std::min(raw.size(), max_chars);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(raw[i]);
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (raw.size() > n) out += "...";
  return out;
}

namespace {
std::string format_double(double d) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d);
  return std::string(buf, r.ptr);
}
}  // namespace

std::string Value::repr(std::size_t max_chars) const {
  switch (kind_) {
    case Kind::none:
      return "None";
    case Kind::boolean:
      return payload_.boolean ? "True" : "False";
    case Kind::integer:
      return std::to_string(payload_.integer);
    case Kind::unsigned_integer:
      return std::to_string(payload_.unsigned_integer);
    case Kind::real:
      return format_double(payload_.real);
    case Kind::str:
      return "'" + escape_text(as_str(), max_chars) + "'";
    case Kind::bytes: {
      const Bytes& b = as_bytes();
      return "b'" +
             escape_text(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()),
                         max_chars) +
             "'";
    }
    case Kind::list:
    case Kind::tuple:
    case Kind::set:
      return std::string(type_name()) + " of " + std::to_string(as_sequence().size()) + " items";
    case Kind::dict:
      return "dict of " + std::to_string(as_dict().size()) + " items";
  }
  return "?";
}

void Value::throw_type_error(std::string_view expected, std::string_view context) const {
  std::string msg(context.empty() ? std::string_view("pickle value") : context);
  if (expected == "int" && kind_ == Kind::unsigned_integer) {
    msg += ": expected an int in the int64 range, got " + repr();
  } else if (expected == "non-negative int" && kind_ == Kind::integer) {
    msg += ": expected a non-negative int, got " + repr();
  } else {
    msg += ": expected ";
    msg += expected;
    msg += ", got ";
    msg += type_name();
    if (!is_none()) msg += " " + repr();
  }
  throw TraceError(msg);
}

bool Value::as_bool(std::string_view context) const {
  if (kind_ != Kind::boolean) throw_type_error("bool", context);
  return payload_.boolean;
}

std::uint64_t Value::as_uint(std::string_view context) const {
  if (kind_ == Kind::unsigned_integer) return payload_.unsigned_integer;
  if (kind_ != Kind::integer || payload_.integer < 0) throw_type_error("non-negative int", context);
  return static_cast<std::uint64_t>(payload_.integer);
}

double Value::as_float(std::string_view context) const {
  switch (kind_) {
    case Kind::real:
      return payload_.real;
    case Kind::integer:
      return static_cast<double>(payload_.integer);
    case Kind::unsigned_integer:
      return static_cast<double>(payload_.unsigned_integer);
    default:
      throw_type_error("float", context);
  }
}

const Bytes& Value::as_bytes(std::string_view context) const {
  if (kind_ != Kind::bytes) throw_type_error("bytes", context);
  return static_cast<const detail::BytesNode*>(payload_.node)->data;
}

const std::vector<Value>& Value::as_tuple(std::string_view context) const {
  if (kind_ != Kind::tuple) throw_type_error("tuple", context);
  return static_cast<const detail::SeqNode*>(payload_.node)->items;
}

bool operator==(const Value& a, const Value& b) noexcept {
  using Kind = Value::Kind;
  if (a.kind_ != b.kind_) return false;
  const auto& pa = a.payload_;
  const auto& pb = b.payload_;
  switch (a.kind_) {
    case Kind::none:
      return true;
    case Kind::boolean:
      return pa.boolean == pb.boolean;
    case Kind::integer:
      return pa.integer == pb.integer;
    case Kind::unsigned_integer:
      return pa.unsigned_integer == pb.unsigned_integer;
    case Kind::real:
      return pa.real == pb.real || (std::isnan(pa.real) && std::isnan(pb.real));
    default:
      break;
  }
  if (pa.node == pb.node) return true;
  switch (a.kind_) {
    case Kind::str:
      return static_cast<const detail::StrNode*>(pa.node)->text ==
             static_cast<const detail::StrNode*>(pb.node)->text;
    case Kind::bytes:
      return static_cast<const detail::BytesNode*>(pa.node)->data ==
             static_cast<const detail::BytesNode*>(pb.node)->data;
    case Kind::dict:
      return static_cast<const detail::DictNode*>(pa.node)->dict.items ==
             static_cast<const detail::DictNode*>(pb.node)->dict.items;
    default:
      return static_cast<const detail::SeqNode*>(pa.node)->items ==
             static_cast<const detail::SeqNode*>(pb.node)->items;
  }
}

const Value* Dict::find(std::string_view key) const noexcept {
  for (auto it = items.rbegin(); it != items.rend(); ++it) {
    if (it->first.is_str() && it->first.as_str() == key) return &it->second;
  }
  return nullptr;
}

const Value& Dict::at(std::string_view key, std::string_view context) const {
  if (const Value* v = find(key)) return *v;
  std::string msg(context.empty() ? std::string_view("pickle dict") : context);
  msg += ": missing key '" + escape_text(key, 80) + "'";
  throw TraceError(msg);
}

}  // namespace cachealloc::trace

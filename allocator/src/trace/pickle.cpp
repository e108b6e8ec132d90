// pickle.cpp: the safe pickle decoder (decode_pickle). See pickle.h, Note [Why this pickle
// reader is safe] and Note [Resource bounds].
#include "cachealloc/trace/pickle.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <unordered_map>

#include "pickle_internal.h"

namespace cachealloc::trace {

using detail::escape_text;
using detail::ValueAccess;
using namespace detail;  // the opcodes

namespace {

const char* opcode_name(unsigned char op) noexcept {
  switch (op) {
    // clang-format off
#define CACHEALLOC_OPCODE_NAME(x) case x: return #x;
    CACHEALLOC_OPCODE_NAME(MARK) CACHEALLOC_OPCODE_NAME(STOP) CACHEALLOC_OPCODE_NAME(POP)
    CACHEALLOC_OPCODE_NAME(POP_MARK) CACHEALLOC_OPCODE_NAME(DUP) CACHEALLOC_OPCODE_NAME(FLOAT)
    CACHEALLOC_OPCODE_NAME(INT) CACHEALLOC_OPCODE_NAME(BININT) CACHEALLOC_OPCODE_NAME(BININT1)
    CACHEALLOC_OPCODE_NAME(LONG) CACHEALLOC_OPCODE_NAME(BININT2) CACHEALLOC_OPCODE_NAME(NONE)
    CACHEALLOC_OPCODE_NAME(PERSID) CACHEALLOC_OPCODE_NAME(BINPERSID) CACHEALLOC_OPCODE_NAME(REDUCE)
    CACHEALLOC_OPCODE_NAME(STRING) CACHEALLOC_OPCODE_NAME(BINSTRING)
    CACHEALLOC_OPCODE_NAME(SHORT_BINSTRING) CACHEALLOC_OPCODE_NAME(UNICODE)
    CACHEALLOC_OPCODE_NAME(BINUNICODE) CACHEALLOC_OPCODE_NAME(APPEND) CACHEALLOC_OPCODE_NAME(BUILD)
    CACHEALLOC_OPCODE_NAME(GLOBAL) CACHEALLOC_OPCODE_NAME(DICT) CACHEALLOC_OPCODE_NAME(EMPTY_DICT)
    CACHEALLOC_OPCODE_NAME(APPENDS) CACHEALLOC_OPCODE_NAME(GET) CACHEALLOC_OPCODE_NAME(BINGET)
    CACHEALLOC_OPCODE_NAME(INST) CACHEALLOC_OPCODE_NAME(LONG_BINGET) CACHEALLOC_OPCODE_NAME(LIST)
    CACHEALLOC_OPCODE_NAME(EMPTY_LIST) CACHEALLOC_OPCODE_NAME(OBJ) CACHEALLOC_OPCODE_NAME(PUT)
    CACHEALLOC_OPCODE_NAME(BINPUT) CACHEALLOC_OPCODE_NAME(LONG_BINPUT)
    CACHEALLOC_OPCODE_NAME(SETITEM) CACHEALLOC_OPCODE_NAME(TUPLE)
    CACHEALLOC_OPCODE_NAME(EMPTY_TUPLE)
    CACHEALLOC_OPCODE_NAME(SETITEMS) CACHEALLOC_OPCODE_NAME(BINFLOAT) CACHEALLOC_OPCODE_NAME(PROTO)
    CACHEALLOC_OPCODE_NAME(NEWOBJ) CACHEALLOC_OPCODE_NAME(EXT1) CACHEALLOC_OPCODE_NAME(EXT2)
    CACHEALLOC_OPCODE_NAME(EXT4) CACHEALLOC_OPCODE_NAME(TUPLE1) CACHEALLOC_OPCODE_NAME(TUPLE2)
    CACHEALLOC_OPCODE_NAME(TUPLE3) CACHEALLOC_OPCODE_NAME(NEWTRUE) CACHEALLOC_OPCODE_NAME(NEWFALSE)
    CACHEALLOC_OPCODE_NAME(LONG1) CACHEALLOC_OPCODE_NAME(LONG4) CACHEALLOC_OPCODE_NAME(BINBYTES)
    CACHEALLOC_OPCODE_NAME(SHORT_BINBYTES) CACHEALLOC_OPCODE_NAME(SHORT_BINUNICODE)
    CACHEALLOC_OPCODE_NAME(BINUNICODE8) CACHEALLOC_OPCODE_NAME(BINBYTES8)
    CACHEALLOC_OPCODE_NAME(EMPTY_SET) CACHEALLOC_OPCODE_NAME(ADDITEMS)
    CACHEALLOC_OPCODE_NAME(FROZENSET) CACHEALLOC_OPCODE_NAME(NEWOBJ_EX)
    CACHEALLOC_OPCODE_NAME(STACK_GLOBAL) CACHEALLOC_OPCODE_NAME(MEMOIZE)
    CACHEALLOC_OPCODE_NAME(FRAME) CACHEALLOC_OPCODE_NAME(BYTEARRAY8)
    CACHEALLOC_OPCODE_NAME(NEXT_BUFFER) CACHEALLOC_OPCODE_NAME(READONLY_BUFFER)
#undef CACHEALLOC_OPCODE_NAME
        // clang-format on
        default : return nullptr;
  }
}

/// "pickle opcode GLOBAL (0x63, 'c')", "pickle opcode PROTO (0x80)", "unknown pickle opcode
/// (0xff)".
std::string describe_opcode(unsigned char op) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex = "0x";
  hex += kHex[op >> 4];
  hex += kHex[op & 15];
  const char* name = opcode_name(op);
  if (name == nullptr) return "unknown pickle opcode (" + hex + ")";
  std::string out = std::string("pickle opcode ") + name + " (" + hex;
  if (op >= 0x20 && op < 0x7f) {
    out += ", '";
    out += static_cast<char>(op);
    out += "'";
  }
  return out + ")";
}

constexpr std::string_view kPlainDataHint =
    "cachealloc reads only plain data (dicts, lists, tuples, strings, bytes, numbers, bools, "
    "None); re-save the snapshot with torch.cuda.memory._dump_snapshot()";
constexpr std::string_view kCorruptHint =
    "the file is truncated or corrupt: copy it again, or record it again with "
    "torch.cuda.memory._dump_snapshot()";
constexpr std::string_view kLimitHint =
    "a real snapshot stays far below this limit, so the file is probably corrupt or hostile; "
    "if it is genuine, raise the limit in DecodeOptions";

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

int hex_digit(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class Decoder {
 public:
  Decoder(std::span<const std::byte> data, const DecodeOptions& options)
      : begin_(reinterpret_cast<const unsigned char*>(data.data())),
        pos_(begin_),
        end_(begin_ + data.size()),
        opt_(options) {}
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;
  ~Decoder() {
    if (!clean_) unlink_all();
  }

  Value run() {
    try {
      return loop();
    } catch (const std::bad_alloc&) {
      fail("ran out of memory while decoding", kLimitHint);
    }
  }

 private:
  using Kind = Value::Kind;

  // -- errors ---------------------------------------------------------------------------------
  [[noreturn]] void fail(std::string_view what, std::string_view hint = kCorruptHint) const {
    std::string msg(opt_.source_name);
    msg += ": byte " + std::to_string(op_offset_) + ": " + describe_opcode(op_) + ": ";
    msg += what;
    msg += ". ";
    msg += hint;
    throw TraceError(msg, op_offset_);
  }
  [[noreturn]] void refuse(std::string_view why) const {
    std::string msg(opt_.source_name);
    msg += ": byte " + std::to_string(op_offset_) + ": " + describe_opcode(op_) + " is refused: ";
    msg += why;
    msg += ". ";
    msg += kPlainDataHint;
    throw TraceError(msg, op_offset_);
  }

  // -- input ----------------------------------------------------------------------------------
  [[nodiscard]] std::uint64_t remaining() const noexcept {
    return static_cast<std::uint64_t>(end_ - pos_);
  }
  const unsigned char* take(std::uint64_t n, std::string_view what) {
    if (n > remaining()) {
      fail("needs " + std::to_string(n) + " bytes of " + std::string(what) + " but only " +
           std::to_string(remaining()) + " remain");
    }
    const unsigned char* p = pos_;
    pos_ += n;
    return p;
  }
  std::uint8_t u8() { return *take(1, "argument"); }
  std::uint64_t le(unsigned n) {
    const unsigned char* p = take(n, "argument");
    std::uint64_t v = 0;
    for (unsigned i = n; i-- > 0;) v = (v << 8) | p[i];
    return v;
  }
  std::int32_t le_i32() { return static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4))); }
  /// The text up to the next newline (which is consumed), for the protocol-0 text opcodes.
  std::string_view line() {
    const void* nl = std::memchr(pos_, '\n', remaining());
    if (nl == nullptr) fail("its text argument has no terminating newline");
    const auto* p = pos_;
    pos_ = static_cast<const unsigned char*>(nl) + 1;
    return {reinterpret_cast<const char*>(p), static_cast<std::size_t>(pos_ - 1 - p)};
  }
  /// A line for a refusal message only: never fails, bounded length.
  std::string_view peek_line(std::size_t max) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(remaining(), max));
    const auto* p = reinterpret_cast<const char*>(pos_);
    const void* nl = std::memchr(p, '\n', n);
    const std::size_t len = nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - p) : n;
    pos_ += nl ? len + 1 : len;
    return {p, len};
  }

  // -- stack and memo -------------------------------------------------------------------------
  [[nodiscard]] std::size_t fence() const noexcept { return marks_.empty() ? 0 : marks_.back(); }
  void need_stack(std::size_t n) const {
    const std::size_t have = stack_.size() - fence();
    if (have < n) {
      fail("needs " + std::to_string(n) + " value(s) on the stack but " + std::to_string(have) +
           (marks_.empty() ? " are there" : " are above the last MARK"));
    }
  }
  void push(Value v) {
    if (stack_.size() >= opt_.max_stack_entries) {
      fail("the value stack would exceed " + std::to_string(opt_.max_stack_entries) + " entries",
           kLimitHint);
    }
    stack_.push_back(std::move(v));
  }
  Value pop() {
    Value v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  std::size_t pop_mark() {
    if (marks_.empty()) fail("there is no MARK to close");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  /// The container just below a closed MARK: must be above the enclosing MARK and of `kind`.
  Value& mark_target(std::size_t mark, Kind kind) {
    if (mark <= fence()) fail("there is no container below the MARK to add the items to");
    Value& target = stack_[mark - 1];
    if (target.kind() != kind) {
      const std::string_view expected = kind == Kind::dict  ? "dict"
                                        : kind == Kind::set ? "set"
                                                            : "list";
      fail("expects a " + std::string(expected) + " to add the items to, found " +
           std::string(target.type_name()));
    }
    return target;
  }

  [[nodiscard]] std::uint64_t memo_count() const noexcept {
    return memo_.size() + sparse_memo_.size();
  }
  void memo_put(std::uint64_t index) {
    need_stack(1);
    const Value& v = stack_.back();
    if (index < memo_.size()) {
      memo_[index] = v;
      return;
    }
    if (memo_count() >= opt_.max_memo_entries && !sparse_memo_.contains(index)) {
      fail("the memo would exceed " + std::to_string(opt_.max_memo_entries) + " entries",
           kLimitHint);
    }
    if (index != memo_.size()) {
      sparse_memo_[index] = v;
      return;
    }
    memo_.push_back(v);
    while (!sparse_memo_.empty()) {  // keep the dense part dense
      const auto it = sparse_memo_.find(memo_.size());
      if (it == sparse_memo_.end()) break;
      memo_.push_back(std::move(it->second));
      sparse_memo_.erase(it);
    }
  }
  void memo_get(std::uint64_t index) {
    const Value* v = nullptr;
    if (index < memo_.size()) {
      v = &memo_[index];
    } else if (const auto it = sparse_memo_.find(index); it != sparse_memo_.end()) {
      v = &it->second;
    } else {
      fail("memo entry " + std::to_string(index) + " was never stored");
    }
    note_shared(*v);
    push(*v);
  }
  /// A mutable container reachable twice may later be mutated into a cycle or a deep chain:
  /// remember to check the whole graph at STOP (Note [Resource bounds]).
  void note_shared(const Value& v) noexcept {
    if (v.kind() == Kind::list || v.kind() == Kind::dict || v.kind() == Kind::set) {
      shared_mutable_ = true;
    }
  }

  // -- building values ------------------------------------------------------------------------
  void charge(std::uint64_t bytes) {
    value_bytes_ += bytes;
    if (value_bytes_ > opt_.max_value_bytes) {
      fail("the decoded values would take more than " + std::to_string(opt_.max_value_bytes) +
               " bytes of memory",
           kLimitHint);
    }
  }
  Value new_str(std::string text) {
    charge(sizeof(detail::StrNode) + text.size());
    return Value(std::move(text));
  }
  /// A str of input bytes. Short ones are interned: PyTorch writes compile_context 'N/A' as a
  /// new, unmemoized string for every trace entry (102,633 times in gpt2), and sharing one
  /// immutable node per distinct text saves an allocation for each.
  Value new_str(const unsigned char* p, std::uint64_t n) {
    const std::string_view text(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n));
    if (n > kInternMaxLength) return new_str(std::string(text));
    if (const auto it = interned_.find(text); it != interned_.end()) return it->second;
    Value v = new_str(std::string(text));
    if (interned_.size() < kInternMaxEntries) interned_.emplace(text, v);
    return v;
  }
  Value new_bytes(const unsigned char* p, std::uint64_t n) {
    charge(sizeof(detail::BytesNode) + n);
    const auto* b = reinterpret_cast<const std::byte*>(p);
    return Value::bytes(Bytes(b, b + n));
  }
  /// A new, empty container, registered so that unlink_all() can take it apart.
  Value new_container(Kind kind) {
    detail::Node* node = nullptr;
    if (kind == Kind::dict) {
      charge(sizeof(detail::DictNode));
      node = new detail::DictNode;
    } else {
      charge(sizeof(detail::SeqNode));
      node = new detail::SeqNode;
    }
    Value v = ValueAccess::make(kind, node);
    containers_.push_back(v);
    return v;
  }
  void check_depth(std::uint32_t depth) const {
    if (depth > opt_.max_depth) {
      fail("the data nests deeper than " + std::to_string(opt_.max_depth) + " levels", kLimitHint);
    }
  }
  /// Moves stack_[from..] into a container's item array (sequence) and updates its depth.
  void move_items(detail::SeqNode* node, std::size_t from) {
    auto& items = node->items;
    const std::size_t n = stack_.size() - from;
    if (items.capacity() < items.size() + n)
      items.reserve(std::max(items.size() + n, 2 * items.capacity()));
    charge(n * sizeof(Value));
    std::uint32_t depth = node->depth;
    for (std::size_t i = from; i < stack_.size(); ++i) {
      depth = std::max(depth, stack_[i].depth() + 1);
      items.push_back(std::move(stack_[i]));
    }
    stack_.resize(from);
    check_depth(depth);
    node->depth = depth;
  }
  void move_pairs(detail::DictNode* node, std::size_t from) {
    auto& items = node->dict.items;
    const std::size_t n = stack_.size() - from;
    if (n % 2 != 0)
      fail("has an odd number of items (" + std::to_string(n) + ") for key/value pairs");
    if (items.capacity() < items.size() + n / 2) {
      items.reserve(std::max(items.size() + n / 2, 2 * items.capacity()));
    }
    charge(n / 2 * sizeof(Dict::Item));
    std::uint32_t depth = node->depth;
    for (std::size_t i = from; i < stack_.size(); i += 2) {
      depth = std::max({depth, stack_[i].depth() + 1, stack_[i + 1].depth() + 1});
      items.emplace_back(std::move(stack_[i]), std::move(stack_[i + 1]));
    }
    stack_.resize(from);
    check_depth(depth);
    node->depth = depth;
  }
  /// A new sequence of `kind` holding stack_[from..].
  void build_sequence(Kind kind, std::size_t from) {
    Value v = new_container(kind);
    move_items(ValueAccess::seq(v), from);
    push(std::move(v));
  }

  // -- numbers --------------------------------------------------------------------------------
  /// A little-endian two's-complement integer of n bytes (LONG1, LONG4).
  Value int_from_le(const unsigned char* p, std::uint64_t n) const {
    if (n == 0) return Value(0);
    const bool negative = (p[n - 1] & 0x80) != 0;
    const unsigned char sign_byte = negative ? 0xFF : 0x00;
    std::uint64_t low = 0;
    for (std::uint64_t i = std::min<std::uint64_t>(n, 8); i-- > 0;) low = (low << 8) | p[i];
    if (n < 8) {
      if (negative) low |= ~std::uint64_t{0} << (8 * n);
      return Value(static_cast<std::int64_t>(low));
    }
    bool fits = true;
    for (std::uint64_t i = 8; i < n && fits; ++i) fits = p[i] == sign_byte;
    if (fits) {
      if (!negative) return Value(low);  // n >= 9 with a zero top byte may exceed int64
      if ((low >> 63) != 0 || n == 8) return Value(static_cast<std::int64_t>(low));
    }
    double magnitude = 0;  // beyond 64 bits: the nearest double (Note [Integers])
    for (std::uint64_t i = n; i-- > 0;) {
      magnitude = magnitude * 256 + static_cast<unsigned char>(negative ? ~p[i] : p[i]);
    }
    if (negative) magnitude += 1;
    if (!std::isfinite(magnitude)) {
      fail("an integer of " + std::to_string(n) + " bytes is too large even for a float");
    }
    return Value(negative ? -magnitude : magnitude);
  }
  /// Decimal integer text (INT, LONG): exact in [-2^63, 2^64), else the nearest double.
  Value int_from_text(std::string_view text) const {
    std::string_view t = text;
    while (!t.empty() && (t.front() == ' ' || t.front() == '\t')) t.remove_prefix(1);
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t' || t.back() == '\r'))
      t.remove_suffix(1);
    bool negative = false;
    if (!t.empty() && (t.front() == '-' || t.front() == '+')) {
      negative = t.front() == '-';
      t.remove_prefix(1);
    }
    const bool digits =
        !t.empty() && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits) fail("'" + escape_text(text, 60) + "' is not a decimal integer");
    std::uint64_t magnitude = 0;
    const auto r = std::from_chars(t.data(), t.data() + t.size(), magnitude);
    if (r.ec == std::errc{}) {
      if (!negative) return Value(magnitude);
      if (magnitude <= (std::uint64_t{1} << 63)) {
        return Value(static_cast<std::int64_t>(0 - magnitude));  // two's complement wraps exactly
      }
    }
    double d = 0;
    std::from_chars(t.data(), t.data() + t.size(), d);
    if (!std::isfinite(d))
      fail("the integer '" + escape_text(text, 60) + "' is too large even for a float");
    return Value(negative ? -d : d);
  }
  Value float_from_text(std::string_view text) const {
    std::string_view t = text;
    while (!t.empty() && (t.front() == ' ' || t.front() == '\t')) t.remove_prefix(1);
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t' || t.back() == '\r'))
      t.remove_suffix(1);
    if (!t.empty() && t.front() == '+') t.remove_prefix(1);
    double d = 0;
    const auto r = std::from_chars(t.data(), t.data() + t.size(), d);
    if (t.empty() || r.ec != std::errc{} || r.ptr != t.data() + t.size()) {
      fail("'" + escape_text(text, 60) + "' is not a float");
    }
    return Value(d);
  }
  std::uint64_t index_from_text(std::string_view text) const {
    std::uint64_t index = 0;
    const auto r = std::from_chars(text.data(), text.data() + text.size(), index);
    if (text.empty() || r.ec != std::errc{} || r.ptr != text.data() + text.size()) {
      fail("'" + escape_text(text, 60) + "' is not a memo index");
    }
    return index;
  }

  // -- protocol-0 strings ---------------------------------------------------------------------
  /// STRING: a quoted Python 2 str literal with backslash escapes (codecs.escape_decode).
  std::string decode_string_literal(std::string_view text) const {
    if (text.size() < 2 || text.front() != text.back() ||
        (text.front() != '\'' && text.front() != '"')) {
      fail("its argument must be a quoted string");
    }
    const std::string_view s = text.substr(1, text.size() - 2);
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '\\' || i + 1 == s.size()) {
        if (s[i] == '\\') fail("its string ends with a lone backslash");
        out += s[i];
        continue;
      }
      const char c = s[++i];
      switch (c) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x': {
          const int hi = i + 1 < s.size() ? hex_digit(s[i + 1]) : -1;
          const int lo = i + 2 < s.size() ? hex_digit(s[i + 2]) : -1;
          if (hi < 0 || lo < 0) fail("its string has an invalid \\x escape");
          out += static_cast<char>(hi * 16 + lo);
          i += 2;
          break;
        }
        default:
          if (c >= '0' && c <= '7') {
            int v = c - '0';
            for (int k = 0; k < 2 && i + 1 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7'; ++k) {
              v = v * 8 + (s[++i] - '0');
            }
            out += static_cast<char>(v & 0xFF);
          } else {
            out += '\\';
            out += c;
          }
      }
    }
    return out;
  }
  /// UNICODE: raw-unicode-escape text (Latin-1 bytes, \uXXXX and \UXXXXXXXX escapes) to UTF-8.
  std::string decode_raw_unicode_escape(std::string_view s) const {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size();) {
      if (s[i] != '\\') {
        append_utf8(out, static_cast<unsigned char>(s[i++]));
        continue;
      }
      std::size_t run = 0;  // \u is an escape only after an odd number of backslashes
      while (i + run < s.size() && s[i + run] == '\\') ++run;
      out.append(run - 1, '\\');
      i += run - 1;
      const char kind = i + 1 < s.size() ? s[i + 1] : '\0';
      if (run % 2 == 0 || (kind != 'u' && kind != 'U')) {
        out += '\\';
        ++i;
        continue;
      }
      const std::size_t digits = kind == 'u' ? 4 : 8;
      if (i + 2 + digits > s.size()) fail("its text has a truncated \\u escape");
      std::uint32_t cp = 0;
      for (std::size_t k = 0; k < digits; ++k) {
        const int h = hex_digit(s[i + 2 + k]);
        if (h < 0) fail("its text has an invalid \\u escape");
        cp = cp * 16 + static_cast<std::uint32_t>(h);
      }
      if (cp > 0x10FFFF) fail("its text has a \\U escape beyond U+10FFFF");
      append_utf8(out, cp);
      i += 2 + digits;
    }
    return out;
  }

  // -- refused opcodes ------------------------------------------------------------------------
  [[noreturn]] void refuse_opcode() {
    switch (op_) {
      case GLOBAL: {
        const std::string module = escape_text(peek_line(256), 80);
        const std::string name = escape_text(peek_line(256), 80);
        refuse("it would import '" + module + " " + name + "'");
      }
      case INST: {
        const std::string module = escape_text(peek_line(256), 80);
        const std::string name = escape_text(peek_line(256), 80);
        refuse("it would import '" + module + " " + name + "' and create an instance of it");
      }
      case STACK_GLOBAL:
        if (stack_.size() - fence() >= 2 && stack_[stack_.size() - 2].is_str() &&
            stack_.back().is_str()) {
          refuse("it would import '" + escape_text(stack_[stack_.size() - 2].as_str(), 80) + " " +
                 escape_text(stack_.back().as_str(), 80) + "'");
        }
        refuse("it would import a Python object");
      case REDUCE:
        refuse("it would call a Python object");
      case BUILD:
        refuse("it would set the state of a Python object (__setstate__)");
      case OBJ:
      case NEWOBJ:
      case NEWOBJ_EX:
        refuse("it would create an instance of a Python class");
      case PERSID:
        refuse("it would look up the persistent object '" + escape_text(peek_line(256), 80) + "'");
      case BINPERSID:
        refuse("it would look up a persistent object");
      case EXT1:
      case EXT2:
      case EXT4:
        refuse("it would import an object from the copyreg extension registry");
      case NEXT_BUFFER:
      case READONLY_BUFFER:
        refuse("out-of-band buffers (pickle protocol 5) are not supported");
      default:
        break;
    }
    std::string msg(opt_.source_name);
    msg += ": byte " + std::to_string(op_offset_) + ": " + describe_opcode(op_) +
           ": not an opcode of pickle protocols 0-5, so this is not a pickle or it is corrupt. ";
    msg += kCorruptHint;
    throw TraceError(msg, op_offset_);
  }

  // -- the machine ----------------------------------------------------------------------------
  void report_progress() {
    const auto done = static_cast<std::uint64_t>(pos_ - begin_);
    const auto total = static_cast<std::uint64_t>(end_ - begin_);
    opt_.progress(static_cast<double>(done) /
                  static_cast<double>(std::max<std::uint64_t>(total, 1)));
    next_progress_ = done + kProgressStep;
  }

  Value loop();
  Value stop();
  void check_graph();
  void unlink_all() noexcept;

  static constexpr std::uint64_t kProgressStep = std::uint64_t{1} << 20;
  static constexpr std::uint64_t kInternMaxLength = 24;
  static constexpr std::size_t kInternMaxEntries = std::size_t{1} << 16;

  const unsigned char* const begin_;
  const unsigned char* pos_;
  const unsigned char* const end_;
  std::uint64_t next_progress_ = 0;  // input offset of the next progress report
  const DecodeOptions& opt_;
  std::uint64_t op_offset_ = 0;
  unsigned char op_ = 0;
  std::vector<Value> stack_;
  std::vector<std::size_t> marks_;
  std::vector<Value> memo_;
  std::unordered_map<std::uint64_t, Value> sparse_memo_;
  std::vector<Value> containers_;  // every container built, for check_graph() and unlink_all()
  std::unordered_map<std::string_view, Value> interned_;  // short strs, keyed by input bytes
  std::uint64_t value_bytes_ = 0;
  bool shared_mutable_ = false;
  bool clean_ = false;
};

Value Decoder::loop() {
  next_progress_ = opt_.progress ? 0 : std::numeric_limits<std::uint64_t>::max();
  stack_.reserve(256);
  for (;;) {
    if (static_cast<std::uint64_t>(pos_ - begin_) >= next_progress_) report_progress();
    if (pos_ >= end_) {
      op_offset_ = static_cast<std::uint64_t>(end_ - begin_);
      std::string msg(opt_.source_name);
      msg += ": byte " + std::to_string(op_offset_) + ": the pickle ends before its STOP opcode. " +
             std::string(kCorruptHint);
      throw TraceError(msg, op_offset_);
    }
    op_offset_ = static_cast<std::uint64_t>(pos_ - begin_);
    op_ = *pos_++;
    switch (op_) {
      case PROTO: {
        const std::uint8_t proto = u8();
        if (proto > 5) {
          fail("pickle protocol " + std::to_string(proto) + " is newer than the supported 0-5",
               "re-save the snapshot with pickle protocol 5 or lower");
        }
        break;
      }
      case FRAME: {
        const std::uint64_t size = le(8);
        if (size > remaining()) {
          fail("announces a frame of " + std::to_string(size) + " bytes but only " +
               std::to_string(remaining()) + " remain");
        }
        break;
      }
      case STOP:
        return stop();
      case MARK:
        if (marks_.size() >= opt_.max_stack_entries) {
          fail("too many open MARKs", kLimitHint);
        }
        marks_.push_back(stack_.size());
        break;
      case POP:
        if (stack_.size() > fence()) {
          stack_.pop_back();
        } else if (!marks_.empty()) {
          marks_.pop_back();  // as Python does: POP on an empty frame discards the MARK
        } else {
          need_stack(1);
        }
        break;
      case POP_MARK:
        stack_.resize(pop_mark());
        break;
      case DUP:
        need_stack(1);
        note_shared(stack_.back());
        push(Value(stack_.back()));
        break;

      case NONE:
        push(Value());
        break;
      case NEWTRUE:
        push(Value(true));
        break;
      case NEWFALSE:
        push(Value(false));
        break;
      case BININT:
        push(Value(le_i32()));
        break;
      case BININT1:
        push(Value(u8()));
        break;
      case BININT2:
        push(Value(static_cast<std::uint16_t>(le(2))));
        break;
      case INT: {
        const std::string_view text = line();
        if (text == "01") {
          push(Value(true));
        } else if (text == "00") {
          push(Value(false));
        } else {
          push(int_from_text(text));
        }
        break;
      }
      case LONG: {
        std::string_view text = line();
        if (!text.empty() && text.back() == 'L') text.remove_suffix(1);
        push(int_from_text(text));
        break;
      }
      case LONG1: {
        const std::uint8_t n = u8();
        push(int_from_le(take(n, "integer data"), n));
        break;
      }
      case LONG4: {
        const std::int32_t n = le_i32();
        if (n < 0) fail("has a negative length " + std::to_string(n));
        push(int_from_le(take(static_cast<std::uint64_t>(n), "integer data"),
                         static_cast<std::uint64_t>(n)));
        break;
      }
      case FLOAT:
        push(float_from_text(line()));
        break;
      case BINFLOAT: {
        const unsigned char* p = take(8, "float data");
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];  // big-endian
        double d = 0;
        std::memcpy(&d, &bits, sizeof d);
        push(Value(d));
        break;
      }

      case SHORT_BINUNICODE: {
        const std::uint8_t n = u8();
        push(new_str(take(n, "string data"), n));
        break;
      }
      case BINUNICODE: {
        const std::uint64_t n = le(4);
        push(new_str(take(n, "string data"), n));
        break;
      }
      case BINUNICODE8: {
        const std::uint64_t n = le(8);
        push(new_str(take(n, "string data"), n));
        break;
      }
      case UNICODE:
        push(new_str(decode_raw_unicode_escape(line())));
        break;
      case STRING:
        push(new_str(decode_string_literal(line())));
        break;
      case SHORT_BINSTRING: {
        const std::uint8_t n = u8();
        push(new_str(take(n, "string data"), n));
        break;
      }
      case BINSTRING: {
        const std::int32_t n = le_i32();
        if (n < 0) fail("has a negative length " + std::to_string(n));
        push(new_str(take(static_cast<std::uint64_t>(n), "string data"),
                     static_cast<std::uint64_t>(n)));
        break;
      }
      case SHORT_BINBYTES: {
        const std::uint8_t n = u8();
        push(new_bytes(take(n, "bytes data"), n));
        break;
      }
      case BINBYTES: {
        const std::uint64_t n = le(4);
        push(new_bytes(take(n, "bytes data"), n));
        break;
      }
      case BINBYTES8:
      case BYTEARRAY8: {
        const std::uint64_t n = le(8);
        push(new_bytes(take(n, "bytes data"), n));
        break;
      }

      case EMPTY_DICT:
        push(new_container(Kind::dict));
        break;
      case EMPTY_LIST:
        push(new_container(Kind::list));
        break;
      case EMPTY_SET:
        push(new_container(Kind::set));
        break;
      case EMPTY_TUPLE:
        push(new_container(Kind::tuple));
        break;
      case TUPLE1:
      case TUPLE2:
      case TUPLE3: {
        const std::size_t n = op_ - TUPLE1 + 1;
        need_stack(n);
        build_sequence(Kind::tuple, stack_.size() - n);
        break;
      }
      case TUPLE:
        build_sequence(Kind::tuple, pop_mark());
        break;
      case LIST:
        build_sequence(Kind::list, pop_mark());
        break;
      case FROZENSET:
        build_sequence(Kind::set, pop_mark());
        break;
      case DICT: {
        const std::size_t m = pop_mark();
        Value v = new_container(Kind::dict);
        move_pairs(ValueAccess::dict(v), m);
        push(std::move(v));
        break;
      }
      case APPEND: {
        need_stack(2);
        if (!stack_[stack_.size() - 2].is_list()) {
          fail("expects a list to append to, found " +
               std::string(stack_[stack_.size() - 2].type_name()));
        }
        move_items(ValueAccess::seq(stack_[stack_.size() - 2]), stack_.size() - 1);
        break;
      }
      case APPENDS: {
        const std::size_t m = pop_mark();
        move_items(ValueAccess::seq(mark_target(m, Kind::list)), m);
        break;
      }
      case ADDITEMS: {
        const std::size_t m = pop_mark();
        move_items(ValueAccess::seq(mark_target(m, Kind::set)), m);
        break;
      }
      case SETITEM: {
        need_stack(3);
        if (!stack_[stack_.size() - 3].is_dict()) {
          fail("expects a dict to set an item in, found " +
               std::string(stack_[stack_.size() - 3].type_name()));
        }
        move_pairs(ValueAccess::dict(stack_[stack_.size() - 3]), stack_.size() - 2);
        break;
      }
      case SETITEMS: {
        const std::size_t m = pop_mark();
        move_pairs(ValueAccess::dict(mark_target(m, Kind::dict)), m);
        break;
      }

      case PUT:
        memo_put(index_from_text(line()));
        break;
      case BINPUT:
        memo_put(u8());
        break;
      case LONG_BINPUT:
        memo_put(le(4));
        break;
      case MEMOIZE:
        memo_put(memo_count());
        break;
      case GET:
        memo_get(index_from_text(line()));
        break;
      case BINGET:
        memo_get(u8());
        break;
      case LONG_BINGET:
        memo_get(le(4));
        break;

      default:
        refuse_opcode();
    }
  }
}

Value Decoder::stop() {
  need_stack(1);
  Value result = pop();
  if (shared_mutable_) check_graph();
  clean_ = true;
  if (opt_.progress) opt_.progress(1.0);
  return result;
}

/// Finds cycles and the true nesting depth of every container built (iterative DFS; each node
/// is visited once). Runs only when a mutable container was shared via GET or DUP.
void Decoder::check_graph() {
  struct Frame {
    detail::ContainerNode* node;
    Kind kind;
    std::size_t next;
    std::uint32_t depth;
  };
  std::vector<Frame> path;
  for (const Value& root : containers_) {
    if (ValueAccess::container(root)->visit == 2) continue;
    ValueAccess::container(root)->visit = 1;
    path.push_back({ValueAccess::container(root), root.kind(), 0, 1});
    while (!path.empty()) {
      Frame& f = path.back();
      const Value* child = nullptr;
      if (f.kind == Kind::dict) {
        const auto& items = static_cast<detail::DictNode*>(f.node)->dict.items;
        while (child == nullptr && f.next < 2 * items.size()) {
          const Value& c = f.next % 2 == 0 ? items[f.next / 2].first : items[f.next / 2].second;
          ++f.next;
          if (c.is_container()) child = &c;
        }
      } else {
        const auto& items = static_cast<detail::SeqNode*>(f.node)->items;
        while (child == nullptr && f.next < items.size()) {
          const Value& c = items[f.next++];
          if (c.is_container()) child = &c;
        }
      }
      if (child == nullptr) {  // all items seen
        const Frame done = f;
        path.pop_back();
        done.node->depth = done.depth;
        done.node->visit = 2;
        if (!path.empty()) path.back().depth = std::max(path.back().depth, done.depth + 1);
        continue;
      }
      detail::ContainerNode* c = ValueAccess::container(*child);
      if (c->visit == 1) {
        fail(
            "the data contains itself (a reference cycle built through the memo); snapshots "
            "never do");
      }
      if (c->visit == 2) {
        f.depth = std::max(f.depth, c->depth + 1);
        check_depth(f.depth);
        continue;
      }
      check_depth(static_cast<std::uint32_t>(path.size()) + 1);
      c->visit = 1;
      path.push_back({c, child->kind(), 0, 1});
    }
  }
}

/// On failure the partial graph may hold cycles or deep chains: empty every container first
/// (each is still held by containers_, so nothing is destroyed recursively), then drop them.
void Decoder::unlink_all() noexcept {
  for (const Value& v : containers_) {
    if (v.kind() == Kind::dict) {
      std::vector<Dict::Item> doomed;
      doomed.swap(ValueAccess::dict(v)->dict.items);
    } else {
      std::vector<Value> doomed;
      doomed.swap(ValueAccess::seq(v)->items);
    }
  }
  stack_.clear();
  memo_.clear();
  sparse_memo_.clear();
  interned_.clear();
  containers_.clear();
}

}  // namespace

Value decode_pickle(std::span<const std::byte> data, const DecodeOptions& options) {
  Decoder decoder(data, options);
  return decoder.run();
}

}  // namespace cachealloc::trace

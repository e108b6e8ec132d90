// pickle.cpp: the Value model, the safe pickle decoder and the pickle encoder.
// See pickle.h, Note [Why this pickle reader is safe] and Note [Resource bounds].
#include "cachealloc/trace/pickle.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <new>
#include <string>
#include <unordered_map>

namespace cachealloc::trace {

namespace detail {
/// The decoder's and encoder's access to Value internals.
struct ValueAccess {
  static Node* node(const Value& v) noexcept { return v.payload_.node; }
  static Value make(Value::Kind kind, Node* node) noexcept { return Value(kind, node); }
  static ContainerNode* container(const Value& v) noexcept {
    return static_cast<ContainerNode*>(v.payload_.node);
  }
  static SeqNode* seq(const Value& v) noexcept { return static_cast<SeqNode*>(v.payload_.node); }
  static DictNode* dict(const Value& v) noexcept {
    return static_cast<DictNode*>(v.payload_.node);
  }
  static const Value::Payload& payload(const Value& v) noexcept { return v.payload_; }
};
}  // namespace detail

using detail::ValueAccess;

// ---------------------------------------------------------------------------------------------
// Value

Value::Value(std::string text) : kind_(Kind::str) {
  auto* node = new detail::StrNode;
  node->text = std::move(text);
  payload_.node = node;
}
Value::Value(std::string_view text) : Value(std::string(text)) {}
Value::Value(const char* text) : Value(std::string(text)) {}

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
  throw TraceError("pickle value: nesting depth " + std::to_string(depth) + " exceeds the limit of " +
                   std::to_string(kMaxNestingDepth) + " levels; flatten the data");
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
Value Value::tuple(std::vector<Value> items) { return make_sequence(Kind::tuple, std::move(items)); }
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
    case Kind::none: return "NoneType";
    case Kind::boolean: return "bool";
    case Kind::integer:
    case Kind::unsigned_integer: return "int";
    case Kind::real: return "float";
    case Kind::str: return "str";
    case Kind::bytes: return "bytes";
    case Kind::list: return "list";
    case Kind::tuple: return "tuple";
    case Kind::set: return "set";
    case Kind::dict: return "dict";
  }
  return "?";
}

namespace {
/// Printable ASCII as is, everything else as \xNN; at most max_chars source bytes.
std::string escape_text(std::string_view raw, std::size_t max_chars) {
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

std::string format_double(double d) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d);
  return std::string(buf, r.ptr);
}
}  // namespace

std::string Value::repr(std::size_t max_chars) const {
  switch (kind_) {
    case Kind::none: return "None";
    case Kind::boolean: return payload_.boolean ? "True" : "False";
    case Kind::integer: return std::to_string(payload_.integer);
    case Kind::unsigned_integer: return std::to_string(payload_.unsigned_integer);
    case Kind::real: return format_double(payload_.real);
    case Kind::str: return "'" + escape_text(as_str(), max_chars) + "'";
    case Kind::bytes: {
      const Bytes& b = as_bytes();
      return "b'" +
             escape_text(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()), max_chars) +
             "'";
    }
    case Kind::list:
    case Kind::tuple:
    case Kind::set:
      return std::string(type_name()) + " of " + std::to_string(as_sequence().size()) + " items";
    case Kind::dict: return "dict of " + std::to_string(as_dict().size()) + " items";
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
    case Kind::real: return payload_.real;
    case Kind::integer: return static_cast<double>(payload_.integer);
    case Kind::unsigned_integer: return static_cast<double>(payload_.unsigned_integer);
    default: throw_type_error("float", context);
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
    case Kind::none: return true;
    case Kind::boolean: return pa.boolean == pb.boolean;
    case Kind::integer: return pa.integer == pb.integer;
    case Kind::unsigned_integer: return pa.unsigned_integer == pb.unsigned_integer;
    case Kind::real: return pa.real == pb.real || (std::isnan(pa.real) && std::isnan(pb.real));
    default: break;
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

// ---------------------------------------------------------------------------------------------
// Decoder

namespace {

// The opcodes of pickle protocols 0-5 (CPython Lib/pickle.py).
enum Op : unsigned char {
  MARK = '(', STOP = '.', POP = '0', POP_MARK = '1', DUP = '2', FLOAT = 'F', INT = 'I',
  BININT = 'J', BININT1 = 'K', LONG = 'L', BININT2 = 'M', NONE = 'N', PERSID = 'P',
  BINPERSID = 'Q', REDUCE = 'R', STRING = 'S', BINSTRING = 'T', SHORT_BINSTRING = 'U',
  UNICODE = 'V', BINUNICODE = 'X', APPEND = 'a', BUILD = 'b', GLOBAL = 'c', DICT = 'd',
  EMPTY_DICT = '}', APPENDS = 'e', GET = 'g', BINGET = 'h', INST = 'i', LONG_BINGET = 'j',
  LIST = 'l', EMPTY_LIST = ']', OBJ = 'o', PUT = 'p', BINPUT = 'q', LONG_BINPUT = 'r',
  SETITEM = 's', TUPLE = 't', EMPTY_TUPLE = ')', SETITEMS = 'u', BINFLOAT = 'G',
  PROTO = 0x80, NEWOBJ = 0x81, EXT1 = 0x82, EXT2 = 0x83, EXT4 = 0x84, TUPLE1 = 0x85,
  TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88, NEWFALSE = 0x89, LONG1 = 0x8a, LONG4 = 0x8b,
  BINBYTES = 'B', SHORT_BINBYTES = 'C', SHORT_BINUNICODE = 0x8c, BINUNICODE8 = 0x8d,
  BINBYTES8 = 0x8e, EMPTY_SET = 0x8f, ADDITEMS = 0x90, FROZENSET = 0x91, NEWOBJ_EX = 0x92,
  STACK_GLOBAL = 0x93, MEMOIZE = 0x94, FRAME = 0x95, BYTEARRAY8 = 0x96, NEXT_BUFFER = 0x97,
  READONLY_BUFFER = 0x98,
};

const char* opcode_name(unsigned char op) noexcept {
  switch (op) {
#define CACHEALLOC_OPCODE_NAME(x) \
  case x: return #x;
    CACHEALLOC_OPCODE_NAME(MARK) CACHEALLOC_OPCODE_NAME(STOP) CACHEALLOC_OPCODE_NAME(POP)
    CACHEALLOC_OPCODE_NAME(POP_MARK) CACHEALLOC_OPCODE_NAME(DUP) CACHEALLOC_OPCODE_NAME(FLOAT)
    CACHEALLOC_OPCODE_NAME(INT) CACHEALLOC_OPCODE_NAME(BININT) CACHEALLOC_OPCODE_NAME(BININT1)
    CACHEALLOC_OPCODE_NAME(LONG) CACHEALLOC_OPCODE_NAME(BININT2) CACHEALLOC_OPCODE_NAME(NONE)
    CACHEALLOC_OPCODE_NAME(PERSID) CACHEALLOC_OPCODE_NAME(BINPERSID)
    CACHEALLOC_OPCODE_NAME(REDUCE) CACHEALLOC_OPCODE_NAME(STRING)
    CACHEALLOC_OPCODE_NAME(BINSTRING) CACHEALLOC_OPCODE_NAME(SHORT_BINSTRING)
    CACHEALLOC_OPCODE_NAME(UNICODE) CACHEALLOC_OPCODE_NAME(BINUNICODE)
    CACHEALLOC_OPCODE_NAME(APPEND) CACHEALLOC_OPCODE_NAME(BUILD) CACHEALLOC_OPCODE_NAME(GLOBAL)
    CACHEALLOC_OPCODE_NAME(DICT) CACHEALLOC_OPCODE_NAME(EMPTY_DICT)
    CACHEALLOC_OPCODE_NAME(APPENDS) CACHEALLOC_OPCODE_NAME(GET) CACHEALLOC_OPCODE_NAME(BINGET)
    CACHEALLOC_OPCODE_NAME(INST) CACHEALLOC_OPCODE_NAME(LONG_BINGET) CACHEALLOC_OPCODE_NAME(LIST)
    CACHEALLOC_OPCODE_NAME(EMPTY_LIST) CACHEALLOC_OPCODE_NAME(OBJ) CACHEALLOC_OPCODE_NAME(PUT)
    CACHEALLOC_OPCODE_NAME(BINPUT) CACHEALLOC_OPCODE_NAME(LONG_BINPUT)
    CACHEALLOC_OPCODE_NAME(SETITEM) CACHEALLOC_OPCODE_NAME(TUPLE)
    CACHEALLOC_OPCODE_NAME(EMPTY_TUPLE) CACHEALLOC_OPCODE_NAME(SETITEMS)
    CACHEALLOC_OPCODE_NAME(BINFLOAT) CACHEALLOC_OPCODE_NAME(PROTO) CACHEALLOC_OPCODE_NAME(NEWOBJ)
    CACHEALLOC_OPCODE_NAME(EXT1) CACHEALLOC_OPCODE_NAME(EXT2) CACHEALLOC_OPCODE_NAME(EXT4)
    CACHEALLOC_OPCODE_NAME(TUPLE1) CACHEALLOC_OPCODE_NAME(TUPLE2) CACHEALLOC_OPCODE_NAME(TUPLE3)
    CACHEALLOC_OPCODE_NAME(NEWTRUE) CACHEALLOC_OPCODE_NAME(NEWFALSE)
    CACHEALLOC_OPCODE_NAME(LONG1) CACHEALLOC_OPCODE_NAME(LONG4) CACHEALLOC_OPCODE_NAME(BINBYTES)
    CACHEALLOC_OPCODE_NAME(SHORT_BINBYTES) CACHEALLOC_OPCODE_NAME(SHORT_BINUNICODE)
    CACHEALLOC_OPCODE_NAME(BINUNICODE8) CACHEALLOC_OPCODE_NAME(BINBYTES8)
    CACHEALLOC_OPCODE_NAME(EMPTY_SET) CACHEALLOC_OPCODE_NAME(ADDITEMS)
    CACHEALLOC_OPCODE_NAME(FROZENSET) CACHEALLOC_OPCODE_NAME(NEWOBJ_EX)
    CACHEALLOC_OPCODE_NAME(STACK_GLOBAL) CACHEALLOC_OPCODE_NAME(MEMOIZE)
    CACHEALLOC_OPCODE_NAME(FRAME) CACHEALLOC_OPCODE_NAME(BYTEARRAY8)
    CACHEALLOC_OPCODE_NAME(NEXT_BUFFER) CACHEALLOC_OPCODE_NAME(READONLY_BUFFER)
#undef CACHEALLOC_OPCODE_NAME
    default: return nullptr;
  }
}

/// "pickle opcode GLOBAL (0x63, 'c')", "pickle opcode PROTO (0x80)", "unknown pickle opcode (0xff)".
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
      const std::string_view expected = kind == Kind::dict ? "dict" : kind == Kind::set ? "set" : "list";
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
  /// A str of input bytes. Short ones are interned: snapshots repeat the same few action names
  /// as distinct (so unmemoized) objects 100k times, and sharing one immutable node per
  /// distinct text saves an allocation for each.
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
    if (items.capacity() < items.size() + n) items.reserve(std::max(items.size() + n, 2 * items.capacity()));
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
    if (n % 2 != 0) fail("has an odd number of items (" + std::to_string(n) + ") for key/value pairs");
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
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t' || t.back() == '\r')) t.remove_suffix(1);
    bool negative = false;
    if (!t.empty() && (t.front() == '-' || t.front() == '+')) {
      negative = t.front() == '-';
      t.remove_prefix(1);
    }
    const bool digits = !t.empty() && std::all_of(t.begin(), t.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
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
    if (!std::isfinite(d)) fail("the integer '" + escape_text(text, 60) + "' is too large even for a float");
    return Value(negative ? -d : d);
  }
  Value float_from_text(std::string_view text) const {
    std::string_view t = text;
    while (!t.empty() && (t.front() == ' ' || t.front() == '\t')) t.remove_prefix(1);
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t' || t.back() == '\r')) t.remove_suffix(1);
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
    if (text.size() < 2 || text.front() != text.back() || (text.front() != '\'' && text.front() != '"')) {
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
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
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
        if (stack_.size() - fence() >= 2 && stack_[stack_.size() - 2].is_str() && stack_.back().is_str()) {
          refuse("it would import '" + escape_text(stack_[stack_.size() - 2].as_str(), 80) + " " +
                 escape_text(stack_.back().as_str(), 80) + "'");
        }
        refuse("it would import a Python object");
      case REDUCE: refuse("it would call a Python object");
      case BUILD: refuse("it would set the state of a Python object (__setstate__)");
      case OBJ:
      case NEWOBJ:
      case NEWOBJ_EX: refuse("it would create an instance of a Python class");
      case PERSID: refuse("it would look up the persistent object '" + escape_text(peek_line(256), 80) + "'");
      case BINPERSID: refuse("it would look up a persistent object");
      case EXT1:
      case EXT2:
      case EXT4: refuse("it would import an object from the copyreg extension registry");
      case NEXT_BUFFER:
      case READONLY_BUFFER: refuse("out-of-band buffers (pickle protocol 5) are not supported");
      default: break;
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
    opt_.progress(static_cast<double>(done) / static_cast<double>(std::max<std::uint64_t>(total, 1)));
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
      msg += ": byte " + std::to_string(op_offset_) +
             ": the pickle ends before its STOP opcode. " + std::string(kCorruptHint);
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
      case STOP: return stop();
      case MARK:
        if (marks_.size() >= opt_.max_stack_entries) {
          fail("too many open MARKs", kLimitHint);
        }
        marks_.push_back(stack_.size());
        break;
      case POP:
        if (stack_.size() > fence()) {
          stack_.pop_back();
        } else {
          pop_mark();  // as Python does: POP on an empty frame discards the MARK
        }
        break;
      case POP_MARK: stack_.resize(pop_mark()); break;
      case DUP:
        need_stack(1);
        note_shared(stack_.back());
        push(Value(stack_.back()));
        break;

      case NONE: push(Value()); break;
      case NEWTRUE: push(Value(true)); break;
      case NEWFALSE: push(Value(false)); break;
      case BININT: push(Value(le_i32())); break;
      case BININT1: push(Value(u8())); break;
      case BININT2: push(Value(static_cast<std::uint16_t>(le(2)))); break;
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
        push(int_from_le(take(static_cast<std::uint64_t>(n), "integer data"), static_cast<std::uint64_t>(n)));
        break;
      }
      case FLOAT: push(float_from_text(line())); break;
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
      case UNICODE: push(new_str(decode_raw_unicode_escape(line()))); break;
      case STRING: push(new_str(decode_string_literal(line()))); break;
      case SHORT_BINSTRING: {
        const std::uint8_t n = u8();
        push(new_str(take(n, "string data"), n));
        break;
      }
      case BINSTRING: {
        const std::int32_t n = le_i32();
        if (n < 0) fail("has a negative length " + std::to_string(n));
        push(new_str(take(static_cast<std::uint64_t>(n), "string data"), static_cast<std::uint64_t>(n)));
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

      case EMPTY_DICT: push(new_container(Kind::dict)); break;
      case EMPTY_LIST: push(new_container(Kind::list)); break;
      case EMPTY_SET: push(new_container(Kind::set)); break;
      case EMPTY_TUPLE: push(new_container(Kind::tuple)); break;
      case TUPLE1:
      case TUPLE2:
      case TUPLE3: {
        const std::size_t n = op_ - TUPLE1 + 1;
        need_stack(n);
        build_sequence(Kind::tuple, stack_.size() - n);
        break;
      }
      case TUPLE: build_sequence(Kind::tuple, pop_mark()); break;
      case LIST: build_sequence(Kind::list, pop_mark()); break;
      case FROZENSET: build_sequence(Kind::set, pop_mark()); break;
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
          fail("expects a list to append to, found " + std::string(stack_[stack_.size() - 2].type_name()));
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

      case PUT: memo_put(index_from_text(line())); break;
      case BINPUT: memo_put(u8()); break;
      case LONG_BINPUT: memo_put(le(4)); break;
      case MEMOIZE: memo_put(memo_count()); break;
      case GET: memo_get(index_from_text(line())); break;
      case BINGET: memo_get(u8()); break;
      case LONG_BINGET: memo_get(le(4)); break;

      default: refuse_opcode();
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
        fail("the data contains itself (a reference cycle built through the memo); snapshots "
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

// ---------------------------------------------------------------------------------------------
// Encoder

namespace {

class Encoder {
 public:
  std::string finish(const Value& root) {
    out_ += static_cast<char>(PROTO);
    out_ += static_cast<char>(4);
    write(root);
    out_ += static_cast<char>(STOP);
    return std::move(out_);
  }

 private:
  static constexpr std::size_t kBatch = 1000;           // items per APPENDS/SETITEMS, as Python
  static constexpr std::size_t kMemoMaxLength = 64;     // memoize str values up to this length

  void op(unsigned char code) { out_ += static_cast<char>(code); }
  void le(std::uint64_t v, unsigned n) {
    for (unsigned i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }
  void raw(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }

  void write_long1(std::uint64_t bits, bool is_unsigned) {
    unsigned char b[9];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(bits >> (8 * i));
    std::size_t n = 8;
    if (is_unsigned) {
      b[8] = 0;  // >= 2^63: a ninth, zero, sign byte
      n = 9;
    } else {
      while (n > 1 && ((b[n - 1] == 0x00 && (b[n - 2] & 0x80) == 0) ||
                       (b[n - 1] == 0xFF && (b[n - 2] & 0x80) != 0))) {
        --n;
      }
    }
    op(LONG1);
    out_ += static_cast<char>(n);
    raw(b, n);
  }
  void write_int(std::int64_t v) {
    if (v >= 0 && v < 256) {
      op(BININT1);
      le(static_cast<std::uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      op(BININT2);
      le(static_cast<std::uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      op(BININT);
      le(static_cast<std::uint64_t>(v), 4);
    } else {
      write_long1(static_cast<std::uint64_t>(v), false);
    }
  }
  void write_str(const std::string& s) {
    const bool memoizable = s.size() <= kMemoMaxLength;
    if (memoizable) {
      if (const auto it = memo_.find(s); it != memo_.end()) {
        if (it->second < 256) {
          op(BINGET);
          le(it->second, 1);
        } else {
          op(LONG_BINGET);
          le(it->second, 4);
        }
        return;
      }
    }
    if (s.size() < 256) {
      op(SHORT_BINUNICODE);
      le(s.size(), 1);
    } else if (s.size() <= UINT32_MAX) {
      op(BINUNICODE);
      le(s.size(), 4);
    } else {
      op(BINUNICODE8);
      le(s.size(), 8);
    }
    raw(s.data(), s.size());
    if (memoizable && memo_.size() < UINT32_MAX) {
      op(MEMOIZE);
      memo_.emplace(s, static_cast<std::uint32_t>(memo_.size()));
    }
  }
  void write_bytes(const Bytes& b) {
    if (b.size() < 256) {
      op(SHORT_BINBYTES);
      le(b.size(), 1);
    } else if (b.size() <= UINT32_MAX) {
      op(BINBYTES);
      le(b.size(), 4);
    } else {
      op(BINBYTES8);
      le(b.size(), 8);
    }
    raw(b.data(), b.size());
  }
  /// Items in batches: one item with `single`, more between MARK and `many`.
  void write_batches(const std::vector<Value>& items, unsigned char single, unsigned char many) {
    for (std::size_t i = 0; i < items.size(); i += kBatch) {
      const std::size_t n = std::min(kBatch, items.size() - i);
      if (n == 1 && single != 0) {
        write(items[i]);
        op(single);
        continue;
      }
      op(MARK);
      for (std::size_t k = 0; k < n; ++k) write(items[i + k]);
      op(many);
    }
  }

  void write(const Value& v) {
    using Kind = Value::Kind;
    switch (v.kind()) {
      case Kind::none: op(NONE); return;
      case Kind::boolean: op(v.as_bool() ? NEWTRUE : NEWFALSE); return;
      case Kind::integer: write_int(v.as_int()); return;
      case Kind::unsigned_integer: write_long1(v.as_uint(), true); return;
      case Kind::real: {
        const double d = v.as_float();
        std::uint64_t bits = 0;
        std::memcpy(&bits, &d, sizeof d);
        op(BINFLOAT);
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xFF);
        return;
      }
      case Kind::str: write_str(v.as_str()); return;
      case Kind::bytes: write_bytes(v.as_bytes()); return;
      case Kind::list:
        op(EMPTY_LIST);
        write_batches(v.as_list(), APPEND, APPENDS);
        return;
      case Kind::set:
        op(EMPTY_SET);
        write_batches(v.as_sequence(), 0, ADDITEMS);
        return;
      case Kind::tuple: {
        const auto& items = v.as_tuple();
        if (items.empty()) {
          op(EMPTY_TUPLE);
          return;
        }
        if (items.size() > 3) op(MARK);
        for (const Value& item : items) write(item);
        op(items.size() > 3 ? static_cast<unsigned char>(TUPLE)
                            : static_cast<unsigned char>(TUPLE1 + items.size() - 1));
        return;
      }
      case Kind::dict: {
        const auto& items = v.as_dict().items;
        op(EMPTY_DICT);
        for (std::size_t i = 0; i < items.size(); i += kBatch) {
          const std::size_t n = std::min(kBatch, items.size() - i);
          if (n > 1) op(MARK);
          for (std::size_t k = 0; k < n; ++k) {
            write(items[i + k].first);
            write(items[i + k].second);
          }
          op(n > 1 ? SETITEMS : SETITEM);
        }
        return;
      }
    }
  }

  std::string out_;
  std::unordered_map<std::string_view, std::uint32_t> memo_;  // views into the encoded Value
};

}  // namespace

std::string encode_pickle(const Value& value) { return Encoder().finish(value); }

}  // namespace cachealloc::trace

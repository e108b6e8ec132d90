// pickle.h: a safe, data-only reader and a writer for Python pickles (protocols 0-5), the
// container format of PyTorch memory snapshots (torch.cuda.memory._dump_snapshot()).
//
// Note [Why this pickle reader is safe]
// Pickle is a small stack machine. Most opcodes only build data (numbers, strings, bytes,
// lists, tuples, dicts, sets). A handful import or call Python objects (GLOBAL, STACK_GLOBAL,
// REDUCE, BUILD, INST, OBJ, NEWOBJ, NEWOBJ_EX, PERSID, BINPERSID, EXT1/2/4) or refer to
// out-of-band buffers (NEXT_BUFFER, READONLY_BUFFER). decode_pickle() implements the first group
// and refuses everything else with a TraceError naming the opcode and its byte offset: nothing
// is ever imported, called or executed, whatever the file says.
//
// Note [Resource bounds]
// Every length field is checked against the bytes that remain before anything is allocated;
// nesting depth (default 1000), memo entries, the value stack and the approximate memory the
// decoded values take are bounded (DecodeOptions), so a hostile or corrupt file produces a
// TraceError, never a crash, an abort, an out-of-bounds read or an unbounded allocation.
// Containers shared through the memo (GET, DUP) may be mutated afterwards, which can build
// cycles or chains deeper than the incremental depth check sees; the decoder then re-checks
// the whole object graph at STOP, and on any failure it unlinks every container it built so
// that tearing the partial graph down never recurses deeply and never leaks.
//
// Note [Integers]
// Integers in [-2^63, 2^64) are exact (kind integer for the int64 range, unsigned_integer for
// 2^63..2^64-1). Larger magnitudes (never seen in snapshots) are stored as the nearest double
// (kind real), so as_int()/as_uint() on them fail with a clear "expected int, got float" error
// instead of silently truncating. Python bools are their own kind (not integers).
//
// Note [Strings]
// str values hold the bytes found in the file (UTF-8 for the binary opcodes; protocol-0 UNICODE
// escapes are decoded to UTF-8). STRING/BINSTRING/SHORT_BINSTRING (Python 2 str) also become
// str, byte for byte. UTF-8 validity is not checked.
#pragma once

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cachealloc/errors.h"

namespace cachealloc::trace {

/// A trace or snapshot file could not be read. what() says what went wrong, where (the file and
/// the byte offset in the decompressed stream, or the key path of a bad field) and what to do.
class TraceError : public Error {
 public:
  static constexpr std::uint64_t kNoOffset = std::numeric_limits<std::uint64_t>::max();

  explicit TraceError(const std::string& what, std::uint64_t offset = kNoOffset)
      : Error(what), offset_(offset) {}

  /// The byte offset (in the decompressed pickle stream) where decoding failed, or kNoOffset.
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] bool has_offset() const noexcept { return offset_ != kNoOffset; }

 private:
  std::uint64_t offset_;
};

class Value;
class Dict;
using Bytes = std::vector<std::byte>;

/// Values nested deeper than this are refused by the decoder and by the Value factories.
inline constexpr std::uint32_t kMaxNestingDepth = 1000;

namespace detail {
/// Heap part of a str, bytes or container Value, shared by reference count (like Python).
struct Node {
  std::atomic<std::uint64_t> refs{1};
};
struct ValueAccess;
}  // namespace detail

/// One Python value: None, bool, int, float, str, bytes, list, tuple, set or dict.
///
/// 16 bytes. Scalars are stored inline; str, bytes and containers live in a reference-counted
/// node, so copying a Value is O(1) and copies share their contents (as Python references do).
/// Values are immutable once built; construct containers with the static factories.
/// Copying and destroying Values from several threads is safe (atomic reference counts).
class Value {
 public:
  enum class Kind : std::uint8_t {
    none,
    boolean,
    integer,           ///< fits in int64
    unsigned_integer,  ///< 2^63 .. 2^64-1 (only such values; smaller ones are `integer`)
    real,
    str,  // kinds from here on live on the heap
    bytes,
    list,  // containers from here on
    tuple,
    set,
    dict,
  };

  Value() noexcept : kind_(Kind::none) { payload_.integer = 0; }
  Value(std::nullptr_t) noexcept : Value() {}  // NOLINT(google-explicit-constructor)
  template <typename T>
  requires std::same_as<T, bool> Value(T b)
  noexcept : kind_(Kind::boolean) {  // NOLINT(google-explicit-constructor)
    payload_.integer = 0;
    payload_.boolean = b;
  }
  template <std::signed_integral T>
  requires(!std::same_as<T, bool>) Value(T v)
  noexcept : kind_(Kind::integer) {  // NOLINT(google-explicit-constructor)
    payload_.integer = static_cast<std::int64_t>(v);
  }
  template <std::unsigned_integral T>
  requires(!std::same_as<T, bool>) Value(T v)
  noexcept {  // NOLINT(google-explicit-constructor)
    const auto u = static_cast<std::uint64_t>(v);
    if (u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      kind_ = Kind::integer;
      payload_.integer = static_cast<std::int64_t>(u);
    } else {
      kind_ = Kind::unsigned_integer;
      payload_.unsigned_integer = u;
    }
  }
  template <std::floating_point T>
  Value(T v) noexcept : kind_(Kind::real) {  // NOLINT(google-explicit-constructor)
    payload_.real = static_cast<double>(v);
  }
  Value(std::string text);       // NOLINT(google-explicit-constructor) a str
  Value(std::string_view text);  // NOLINT(google-explicit-constructor) a str
  Value(const char* text);       // NOLINT(google-explicit-constructor) a str

  /// Factories for the kinds that have no natural C++ literal. Each throws TraceError when the
  /// result would nest deeper than kMaxNestingDepth.
  static Value bytes(Bytes data);
  static Value list(std::vector<Value> items);
  static Value tuple(std::vector<Value> items);
  static Value set(std::vector<Value> items);  ///< kept in the given order, not de-duplicated
  static Value dict(Dict items);

  Value(const Value& other) noexcept : kind_(other.kind_), payload_(other.payload_) {
    if (on_heap()) payload_.node->refs.fetch_add(1, std::memory_order_relaxed);
  }
  Value(Value&& other) noexcept : kind_(other.kind_), payload_(other.payload_) {
    other.kind_ = Kind::none;
  }
  Value& operator=(const Value& other) noexcept {
    Value copy(other);
    swap(copy);
    return *this;
  }
  Value& operator=(Value&& other) noexcept {
    Value moved(std::move(other));
    swap(moved);
    return *this;
  }
  ~Value() {
    if (on_heap() && payload_.node->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      destroy_node();
    }
  }
  void swap(Value& other) noexcept {
    std::swap(kind_, other.kind_);
    std::swap(payload_, other.payload_);
  }

  [[nodiscard]] Kind kind() const noexcept { return kind_; }
  [[nodiscard]] bool is_none() const noexcept { return kind_ == Kind::none; }
  [[nodiscard]] bool is_bool() const noexcept { return kind_ == Kind::boolean; }
  /// An int of either integer kind (bools are not ints here).
  [[nodiscard]] bool is_int() const noexcept {
    return kind_ == Kind::integer || kind_ == Kind::unsigned_integer;
  }
  [[nodiscard]] bool is_float() const noexcept { return kind_ == Kind::real; }
  [[nodiscard]] bool is_str() const noexcept { return kind_ == Kind::str; }
  [[nodiscard]] bool is_bytes() const noexcept { return kind_ == Kind::bytes; }
  [[nodiscard]] bool is_list() const noexcept { return kind_ == Kind::list; }
  [[nodiscard]] bool is_tuple() const noexcept { return kind_ == Kind::tuple; }
  [[nodiscard]] bool is_set() const noexcept { return kind_ == Kind::set; }
  [[nodiscard]] bool is_dict() const noexcept { return kind_ == Kind::dict; }
  /// list, tuple or set: the kinds as_sequence() accepts.
  [[nodiscard]] bool is_sequence() const noexcept {
    return kind_ == Kind::list || kind_ == Kind::tuple || kind_ == Kind::set;
  }
  [[nodiscard]] bool is_container() const noexcept { return kind_ >= Kind::list; }

  /// Typed accessors. On a kind mismatch (or an int out of range) they throw TraceError:
  /// "<context>: expected int, got str 'alloc'". `context` names the value for the message,
  /// e.g. "device_traces[0][12]['size']".
  [[nodiscard]] bool as_bool(std::string_view context = {}) const;
  [[nodiscard]] std::int64_t as_int(std::string_view context = {}) const;
  /// A non-negative int.
  [[nodiscard]] std::uint64_t as_uint(std::string_view context = {}) const;
  /// A float, or an int converted to double.
  [[nodiscard]] double as_float(std::string_view context = {}) const;
  [[nodiscard]] const std::string& as_str(std::string_view context = {}) const;
  [[nodiscard]] const Bytes& as_bytes(std::string_view context = {}) const;
  [[nodiscard]] const std::vector<Value>& as_list(std::string_view context = {}) const;
  [[nodiscard]] const std::vector<Value>& as_tuple(std::string_view context = {}) const;
  /// The items of a list, tuple or set.
  [[nodiscard]] const std::vector<Value>& as_sequence(std::string_view context = {}) const;
  [[nodiscard]] const Dict& as_dict(std::string_view context = {}) const;

  /// Python's type name: NoneType, bool, int, float, str, bytes, list, tuple, set, dict.
  [[nodiscard]] std::string_view type_name() const noexcept;
  /// A short, bounded, Python-like rendering for messages: 42, 'alloc', list of 3 items.
  [[nodiscard]] std::string repr(std::size_t max_chars = 60) const;
  /// 0 for scalars, strings and bytes; 1 + the deepest item for containers.
  [[nodiscard]] std::uint32_t depth() const noexcept;

  /// Structural equality (same kind and contents; NaN equals NaN so round trips compare equal).
  friend bool operator==(const Value& a, const Value& b) noexcept;

 private:
  friend struct detail::ValueAccess;
  union Payload {
    bool boolean;
    std::int64_t integer;
    std::uint64_t unsigned_integer;
    double real;
    detail::Node* node;
  };

  Value(Kind kind, detail::Node* node) noexcept : kind_(kind) { payload_.node = node; }
  [[nodiscard]] bool on_heap() const noexcept { return kind_ >= Kind::str; }
  void destroy_node() noexcept;
  [[noreturn]] void throw_type_error(std::string_view expected, std::string_view context) const;

  Kind kind_;
  Payload payload_;
};

/// A Python dict: key/value pairs in insertion (file) order.
///
/// Keys are not de-duplicated when a pickle sets one twice; find() returns the last one, which
/// is the value Python would keep.
class Dict {
 public:
  using Item = std::pair<Value, Value>;

  Dict() = default;
  Dict(std::initializer_list<Item> init) : items(init) {}
  explicit Dict(std::vector<Item> init) noexcept : items(std::move(init)) {}

  /// The value of the last item whose key is the str `key`, or nullptr.
  [[nodiscard]] const Value* find(std::string_view key) const noexcept;
  /// Like find(), but throws TraceError "<context>: missing key 'key'" when absent.
  [[nodiscard]] const Value& at(std::string_view key, std::string_view context = {}) const;

  [[nodiscard]] std::size_t size() const noexcept { return items.size(); }
  [[nodiscard]] bool empty() const noexcept { return items.empty(); }
  [[nodiscard]] auto begin() const noexcept { return items.begin(); }
  [[nodiscard]] auto end() const noexcept { return items.end(); }

  friend bool operator==(const Dict& a, const Dict& b) noexcept { return a.items == b.items; }

  std::vector<Item> items;
};

namespace detail {
struct StrNode : Node {
  std::string text;
};
struct BytesNode : Node {
  Bytes data;
};
/// Shared head of the container nodes: `depth` is 1 + the deepest item; `visit` is scratch
/// state for the decoder's graph check.
struct ContainerNode : Node {
  std::uint32_t depth = 1;
  std::uint8_t visit = 0;
};
struct SeqNode : ContainerNode {
  std::vector<Value> items;
};
struct DictNode : ContainerNode {
  Dict dict;
};
}  // namespace detail

inline std::uint32_t Value::depth() const noexcept {
  return is_container() ? static_cast<const detail::ContainerNode*>(payload_.node)->depth : 0;
}

inline const std::string& Value::as_str(std::string_view context) const {
  if (kind_ != Kind::str) throw_type_error("str", context);
  return static_cast<const detail::StrNode*>(payload_.node)->text;
}

inline const std::vector<Value>& Value::as_list(std::string_view context) const {
  if (kind_ != Kind::list) throw_type_error("list", context);
  return static_cast<const detail::SeqNode*>(payload_.node)->items;
}

inline const std::vector<Value>& Value::as_sequence(std::string_view context) const {
  if (!is_sequence()) throw_type_error("list", context);
  return static_cast<const detail::SeqNode*>(payload_.node)->items;
}

inline const Dict& Value::as_dict(std::string_view context) const {
  if (kind_ != Kind::dict) throw_type_error("dict", context);
  return static_cast<const detail::DictNode*>(payload_.node)->dict;
}

inline std::int64_t Value::as_int(std::string_view context) const {
  if (kind_ != Kind::integer) throw_type_error("int", context);
  return payload_.integer;
}

/// Limits and reporting for decode_pickle(). The defaults suit real snapshots (gpt2 training:
/// 7 MB, 206k memo entries, depth 5) with orders of magnitude to spare.
struct DecodeOptions {
  /// Prefix of every error message: the file name, or "<memory>".
  std::string_view source_name = "<memory>";
  std::uint32_t max_depth = kMaxNestingDepth;
  std::uint64_t max_memo_entries = std::uint64_t{1} << 26;
  std::uint64_t max_stack_entries = std::uint64_t{1} << 25;
  /// Approximate bytes the decoded values may take in memory (nodes, strings, item arrays).
  std::uint64_t max_value_bytes = std::uint64_t{8} << 30;
  /// Called with the fraction of the input decoded so far (0..1), about every MiB, and with 1
  /// at the end. Optional.
  std::function<void(double fraction)> progress;
};

/// Decodes one pickle (protocols 0-5) into a Value. Trailing bytes after STOP are ignored, as
/// Python does. Throws TraceError on any refused opcode, malformed or truncated input, or
/// exceeded bound; the message names the source, the byte offset and the opcode.
[[nodiscard]] Value decode_pickle(std::span<const std::byte> data,
                                  const DecodeOptions& options = {});

/// Encodes a Value as a protocol-4 pickle that Python's pickle.load reads back equal. Uses only
/// data opcodes; repeated short strings are memoized (MEMOIZE/BINGET) to keep files small.
[[nodiscard]] std::string encode_pickle(const Value& value);

}  // namespace cachealloc::trace

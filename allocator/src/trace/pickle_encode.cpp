// pickle_encode.cpp: encode_pickle(), a Value as a protocol-4 pickle that Python reads.
#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>

#include "cachealloc/trace/pickle.h"
#include "pickle_internal.h"

namespace cachealloc::trace {

using namespace detail;  // the opcodes

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
  static constexpr std::size_t kBatch = 1000;        // items per APPENDS/SETITEMS, as Python
  static constexpr std::size_t kMemoMaxLength = 64;  // memoize str values up to this length

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
      case Kind::none:
        op(NONE);
        return;
      case Kind::boolean:
        op(v.as_bool() ? NEWTRUE : NEWFALSE);
        return;
      case Kind::integer:
        write_int(v.as_int());
        return;
      case Kind::unsigned_integer:
        write_long1(v.as_uint(), true);
        return;
      case Kind::real: {
        const double d = v.as_float();
        std::uint64_t bits = 0;
        std::memcpy(&bits, &d, sizeof d);
        op(BINFLOAT);
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xFF);
        return;
      }
      case Kind::str:
        write_str(v.as_str());
        return;
      case Kind::bytes:
        write_bytes(v.as_bytes());
        return;
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

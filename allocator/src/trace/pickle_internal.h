// pickle_internal.h (private): what the Value model, the decoder and the encoder share: access to
// Value internals, the pickle opcodes, and message formatting.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "cachealloc/trace/pickle.h"

namespace cachealloc::trace::detail {

/// The decoder's and encoder's access to Value internals.
struct ValueAccess {
  static Value make(Value::Kind kind, Node* node) noexcept { return Value(kind, node); }
  static ContainerNode* container(const Value& v) noexcept {
    return static_cast<ContainerNode*>(v.payload_.node);
  }
  static SeqNode* seq(const Value& v) noexcept { return static_cast<SeqNode*>(v.payload_.node); }
  static DictNode* dict(const Value& v) noexcept { return static_cast<DictNode*>(v.payload_.node); }
};

/// The opcodes of pickle protocols 0-5 (CPython Lib/pickle.py).
enum Op : unsigned char {
  MARK = '(',
  STOP = '.',
  POP = '0',
  POP_MARK = '1',
  DUP = '2',
  FLOAT = 'F',
  INT = 'I',
  BININT = 'J',
  BININT1 = 'K',
  LONG = 'L',
  BININT2 = 'M',
  NONE = 'N',
  PERSID = 'P',
  BINPERSID = 'Q',
  REDUCE = 'R',
  STRING = 'S',
  BINSTRING = 'T',
  SHORT_BINSTRING = 'U',
  UNICODE = 'V',
  BINUNICODE = 'X',
  APPEND = 'a',
  BUILD = 'b',
  GLOBAL = 'c',
  DICT = 'd',
  EMPTY_DICT = '}',
  APPENDS = 'e',
  GET = 'g',
  BINGET = 'h',
  INST = 'i',
  LONG_BINGET = 'j',
  LIST = 'l',
  EMPTY_LIST = ']',
  OBJ = 'o',
  PUT = 'p',
  BINPUT = 'q',
  LONG_BINPUT = 'r',
  SETITEM = 's',
  TUPLE = 't',
  EMPTY_TUPLE = ')',
  SETITEMS = 'u',
  BINFLOAT = 'G',
  PROTO = 0x80,
  NEWOBJ = 0x81,
  EXT1 = 0x82,
  EXT2 = 0x83,
  EXT4 = 0x84,
  TUPLE1 = 0x85,
  TUPLE2 = 0x86,
  TUPLE3 = 0x87,
  NEWTRUE = 0x88,
  NEWFALSE = 0x89,
  LONG1 = 0x8a,
  LONG4 = 0x8b,
  BINBYTES = 'B',
  SHORT_BINBYTES = 'C',
  SHORT_BINUNICODE = 0x8c,
  BINUNICODE8 = 0x8d,
  BINBYTES8 = 0x8e,
  EMPTY_SET = 0x8f,
  ADDITEMS = 0x90,
  FROZENSET = 0x91,
  NEWOBJ_EX = 0x92,
  STACK_GLOBAL = 0x93,
  MEMOIZE = 0x94,
  FRAME = 0x95,
  BYTEARRAY8 = 0x96,
  NEXT_BUFFER = 0x97,
  READONLY_BUFFER = 0x98,
};

/// Printable ASCII as is (quote and backslash escaped), everything else as \xNN; at most
/// `max_chars` bytes of `raw`, then "...". For error messages.
[[nodiscard]] std::string escape_text(std::string_view raw, std::size_t max_chars);

}  // namespace cachealloc::trace::detail

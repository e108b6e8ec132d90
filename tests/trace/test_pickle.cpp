// test_pickle.cpp: the safe pickle decoder and the encoder: every data opcode of protocols 0-5,
// refusal of every code-running opcode, hostile lengths and structures, truncation and fuzzing.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachealloc/trace/pickle.h"

#ifndef CACHEALLOC_TRACE_DIR
#error "CACHEALLOC_TRACE_DIR must name tests/data/traces (set by CMake)"
#endif

using cachealloc::trace::Bytes;
using cachealloc::trace::decode_pickle;
using cachealloc::trace::DecodeOptions;
using cachealloc::trace::Dict;
using cachealloc::trace::encode_pickle;
using cachealloc::trace::TraceError;
using cachealloc::trace::Value;
using Catch::Matchers::Contains;

namespace {

#ifdef CACHEALLOC_TEST_DATA_DIR
const std::filesystem::path kDataDir(CACHEALLOC_TEST_DATA_DIR);
#else
const std::filesystem::path kDataDir = std::filesystem::path(CACHEALLOC_TRACE_DIR).parent_path();
#endif

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::span<const std::byte> span_of(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

Value decode(std::string_view s, const DecodeOptions& options = {}) {
  return decode_pickle(span_of(s), options);
}

/// Decodes and returns the TraceError's message (fails the test when nothing is thrown).
std::string decode_error(std::string_view s, const DecodeOptions& options = {}) {
  try {
    (void)decode(s, options);
  } catch (const TraceError& e) {
    return e.what();
  }
  FAIL("decode_pickle accepted the input");
  return {};
}

Bytes bytes_of(std::string_view s) {
  const auto sp = span_of(s);
  return {sp.begin(), sp.end()};
}

/// The value every tests/data/pickles/protocolN.pickle holds (see make_fixtures.py).
Value expected_fixture(int protocol) {
  const Value shared = Value::list({1});
  Dict d{
      {"none", Value()},
      {"t", true},
      {"f", false},
      {"small", 5},
      {"neg", -7},
      {"big", std::int64_t{1} << 40},
      {"i64min", std::numeric_limits<std::int64_t>::min()},
      {"u64max", std::numeric_limits<std::uint64_t>::max()},
      {"huge", std::ldexp(1.0, 70)},
      {"pi", 3.25},
      {"inf", std::numeric_limits<double>::infinity()},
      {"s", "h\xc3\xa9llo\n\\u \xe2\x82\xac\xf0\x9f\x98\x80"},
      {"empty", ""},
      {"list", Value::list({1, Value::list({2, Value::list({})})})},
      {"tuple", Value::tuple({1, 2, 3, 4})},
      {"t1", Value::tuple({"x"})},
      {"empty_t", Value::tuple({})},
      {"nested", Value::dict({{"a", Value::dict({{"b", "c"}})}})},
      {"shared", Value::list({shared, shared})},
  };
  if (protocol >= 3)
    d.items.emplace_back("bytes", Value::bytes(bytes_of(std::string_view("\x00\xff"
                                                                         "ab",
                                                                         4))));
  if (protocol >= 4) {
    d.items.emplace_back("set", Value::set({7}));
    d.items.emplace_back("frozen", Value::set({8}));
  }
  if (protocol >= 5) d.items.emplace_back("bytearray", Value::bytes(bytes_of("xyz")));
  return Value::dict(std::move(d));
}

std::string marker_path() { return "/tmp/cachealloc_pwned_" + std::to_string(::getpid()); }

}  // namespace

TEST_CASE("pickle: Python's pickles of every protocol decode to the expected values",
          "[trace][pickle]") {
  for (int protocol = 0; protocol <= 5; ++protocol) {
    INFO("protocol " << protocol);
    const std::string data =
        read_file(kDataDir / "pickles" / ("protocol" + std::to_string(protocol) + ".pickle"));
    const Value v = decode(data);
    CHECK(v == expected_fixture(protocol));
    const Dict& d = v.as_dict();
    CHECK(d.at("u64max").as_uint() == std::numeric_limits<std::uint64_t>::max());
    CHECK(d.at("i64min").as_int() == std::numeric_limits<std::int64_t>::min());
    CHECK(d.at("huge").is_float());
    CHECK(d.at("t").as_bool());
    CHECK(d.at("s").as_str() == "h\xc3\xa9llo\n\\u \xe2\x82\xac\xf0\x9f\x98\x80");
    CHECK(d.at("nested").depth() == 2);
    CHECK(v.depth() == 4);  // list -> list -> list
  }
}

TEST_CASE("pickle: protocol-0 and Python 2 text opcodes", "[trace][pickle]") {
  CHECK(decode("I01\n.") == Value(true));
  CHECK(decode("I00\n.") == Value(false));
  CHECK(decode("I-42\n.") == Value(-42));
  CHECK(decode("L123L\n.") == Value(123));
  CHECK(decode("L-9223372036854775809L\n.").is_float());
  CHECK(decode("F-1.5e3\n.") == Value(-1500.0));
  CHECK(std::isnan(decode("Fnan\n.").as_float()));
  CHECK(decode("S'a\\nb\\x41\\101\\'q'\n.") == Value("a\nbAA'q"));
  CHECK(decode("S\"dq\"\n.") == Value("dq"));
  CHECK(decode(std::string_view("T\x03\x00\x00\x00xyz.", 9)) == Value("xyz"));
  CHECK(decode("U\x02hi.") == Value("hi"));
  CHECK(decode("V\\u20ac\\\\u0041\n.") == Value("\xe2\x82\xac\\\\u0041"));
  CHECK(decode("(I1\nI2\nl.") == Value::list({1, 2}));
  CHECK(decode("(I1\nI2\nt.") == Value::tuple({1, 2}));
  CHECK(decode("(VK\nI2\nd.") == Value::dict({{"K", 2}}));
  CHECK(decode("I7\np5\n0g5\n.") == Value(7));                          // PUT, POP, GET
  CHECK(decode("I1\n(I2\nI3\n1.") == Value(1));                         // POP_MARK
  CHECK(decode("]2I1\na0.") == Value::list({1}));                       // DUP shares the list
  CHECK(decode(std::string_view("\x80\x02\x8a\x00.", 5)) == Value(0));  // LONG1 of zero bytes
  CHECK(decode(std::string_view("\x80\x02\x8b\x02\x00\x00\x00\xff\x7f.", 10)) ==
        Value(32767));  // LONG4
  CHECK(decode(std::string_view(
            "\x80\x02\x8a\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff.",
            21)) == Value(-1));  // redundant sign bytes
}

TEST_CASE("pickle: a sparse memo index stores nothing huge", "[trace][pickle]") {
  // LONG_BINPUT 0xFFFFFFFF must not size a vector to 4 billion entries.
  CHECK(decode(std::string_view("\x80\x02K\x09r\xff\xff\xff\xff"
                                "0j\xff\xff\xff\xff.",
                                16)) == Value(9));
  CHECK_THAT(decode_error(std::string_view("\x80\x02K\x09r\xff\xff\xff\xff"
                                           "0j\x01\x00\x00\x00.",
                                           16)),
             Contains("memo entry 1 was never stored"));
}

TEST_CASE("pickle: encode_pickle round-trips every kind and boundary", "[trace][pickle]") {
  for (int protocol = 0; protocol <= 5; ++protocol) {
    const Value v = expected_fixture(protocol);
    CHECK(decode(encode_pickle(v)) == v);
  }
  const std::vector<Value> numbers = {0,
                                      255,
                                      256,
                                      65535,
                                      65536,
                                      -1,
                                      -256,
                                      std::numeric_limits<std::int32_t>::min(),
                                      std::numeric_limits<std::int32_t>::max(),
                                      std::int64_t{std::numeric_limits<std::int32_t>::max()} + 1,
                                      std::numeric_limits<std::int64_t>::min(),
                                      std::numeric_limits<std::int64_t>::max(),
                                      std::uint64_t{1} << 63,
                                      std::numeric_limits<std::uint64_t>::max(),
                                      0.1,
                                      -0.0,
                                      1e300};
  for (const Value& n : numbers) {
    INFO(n.repr());
    CHECK(decode(encode_pickle(n)) == n);
  }
  std::vector<Value> many;
  Dict big;
  for (int i = 0; i < 2500; ++i) {
    many.emplace_back(i % 7 == 0 ? Value("k" + std::to_string(i % 300)) : Value(i));
    big.items.emplace_back("key" + std::to_string(i), Value::tuple({i, "v"}));
  }
  const Value lists =
      Value::list({Value::list(many), Value::set(many), Value::tuple(many), Value::dict(big),
                   Value::list({Value::list({})}), std::string(70000, 'x'),
                   Value::bytes(Bytes(300, std::byte{7}))});
  CHECK(decode(encode_pickle(lists)) == lists);
}

TEST_CASE("pickle: Value accessors report type mismatches clearly", "[trace][pickle]") {
  const Value s("alloc");
  try {
    (void)s.as_int("device_traces[0][3]['size']");
    FAIL("no throw");
  } catch (const TraceError& e) {
    CHECK(std::string(e.what()) == "device_traces[0][3]['size']: expected int, got str 'alloc'");
    CHECK_FALSE(e.has_offset());
  }
  CHECK_THROWS_WITH(Value(-3).as_uint("x"), "x: expected a non-negative int, got -3");
  CHECK_THROWS_WITH(Value(std::numeric_limits<std::uint64_t>::max()).as_int("x"),
                    "x: expected an int in the int64 range, got 18446744073709551615");
  CHECK_THROWS_WITH(Value().as_dict(), "pickle value: expected dict, got NoneType");
  const Dict d{{"a", 1}, {2, "not a str key"}, {"a", 3}};
  REQUIRE(d.find("a") != nullptr);
  CHECK(*d.find("a") == Value(3));  // the last one wins, as in Python
  CHECK(d.find("b") == nullptr);
  CHECK_THROWS_WITH(d.at("b", "snapshot"), "snapshot: missing key 'b'");
  CHECK(Value(1.5).as_float() == 1.5);
  CHECK(Value(2).as_float() == 2.0);
  CHECK_FALSE(Value(true).is_int());
}

TEST_CASE("pickle: Value factories refuse nesting deeper than the limit", "[trace][pickle]") {
  Value v = Value::list({});
  for (std::uint32_t i = 1; i < cachealloc::trace::kMaxNestingDepth; ++i) v = Value::list({v});
  CHECK(v.depth() == cachealloc::trace::kMaxNestingDepth);
  CHECK_THROWS_AS(Value::list({v}), TraceError);
  CHECK(decode(encode_pickle(v)) == v);
}

namespace {
struct Refusal {
  const char* file;
  const char* opcode;  // as the message names it
  std::uint64_t offset;
  const char* detail;  // more text the message must hold
};
}  // namespace

TEST_CASE("pickle: every opcode that could run code is refused, naming it and its offset",
          "[trace][pickle][hostile]") {
  const Refusal refusals[] = {
      {"os_system.pickle", "pickle opcode GLOBAL (0x63, 'c')", 2, "it would import 'posix system'"},
      {"os_system_proto0.pickle", "pickle opcode GLOBAL (0x63, 'c')", 0, "'posix system'"},
      {"global_os_system.pickle", "pickle opcode GLOBAL (0x63, 'c')", 0,
       "it would import 'os system'"},
      {"stack_global.pickle", "pickle opcode STACK_GLOBAL (0x93)", 28,
       "it would import 'posix system'"},
      {"inst.pickle", "pickle opcode INST (0x69, 'i')", 38, "'os system'"},
      {"obj.pickle", "pickle opcode OBJ (0x6f, 'o')", 7, "create an instance"},
      {"newobj.pickle", "pickle opcode NEWOBJ (0x81)", 4, "create an instance"},
      {"newobj_ex.pickle", "pickle opcode NEWOBJ_EX (0x92)", 5, "create an instance"},
      {"build.pickle", "pickle opcode BUILD (0x62, 'b')", 4, "set the state"},
      {"reduce.pickle", "pickle opcode REDUCE (0x52, 'R')", 4, "call a Python object"},
      {"persid.pickle", "pickle opcode PERSID (0x50, 'P')", 0, "persistent object 'foo'"},
      {"binpersid.pickle", "pickle opcode BINPERSID (0x51, 'Q')", 3, "persistent object"},
      {"ext1.pickle", "pickle opcode EXT1 (0x82)", 2, "extension registry"},
      {"next_buffer.pickle", "pickle opcode NEXT_BUFFER (0x97)", 2, "out-of-band buffers"},
  };
  for (const Refusal& r : refusals) {
    INFO(r.file);
    const std::string data = read_file(kDataDir / "hostile" / r.file);
    DecodeOptions options;
    options.source_name = r.file;
    try {
      (void)decode(data, options);
      FAIL("accepted");
    } catch (const TraceError& e) {
      const std::string msg = e.what();
      CHECK_THAT(msg, Contains(std::string(r.file) + ": byte " + std::to_string(r.offset) + ": "));
      CHECK_THAT(msg, Contains(std::string(r.opcode) + " is refused: "));
      CHECK_THAT(msg, Contains(r.detail));
      CHECK_THAT(msg, Contains("re-save the snapshot with torch.cuda.memory._dump_snapshot()"));
      CHECK(e.offset() == r.offset);
    }
  }
  // Had any payload run, `touch /tmp/cachealloc_pwned_$PPID` would have created this file.
  CHECK_FALSE(std::filesystem::exists(marker_path()));
}

TEST_CASE("pickle: the GLOBAL message matches the documented form", "[trace][pickle][hostile]") {
  DecodeOptions options;
  options.source_name = "snapshot.pickle";
  const std::string msg = decode_error(std::string(1234, '(') + "cos\nsystem\n.", options);
  CHECK(msg ==
        "snapshot.pickle: byte 1234: pickle opcode GLOBAL (0x63, 'c') is refused: it would import "
        "'os "
        "system'. cachealloc reads only plain data (dicts, lists, tuples, strings, bytes, numbers, "
        "bools, "
        "None); re-save the snapshot with torch.cuda.memory._dump_snapshot()");
  // Module and name are shown escaped and bounded, even when hostile.
  const std::string wild = decode_error("c" + std::string(5000, 'A') + "\x01\n" + "n\xff\n.");
  CHECK(wild.size() < 600);
  CHECK_THAT(wild, Contains("it would import 'AAAA") && Contains("AAA... AAA"));
  CHECK_FALSE(std::filesystem::exists(marker_path()));
}

TEST_CASE("pickle: unknown opcodes, bad lengths and bad structure are clear errors",
          "[trace][pickle][hostile]") {
  struct Case {
    const char* file;
    const char* text;
  };
  const Case cases[] = {
      {"unknown_opcode.pickle",
       "byte 2: unknown pickle opcode (0xff): not an opcode of pickle protocols 0-5"},
      {"binunicode_huge_length.pickle",
       "byte 2: pickle opcode BINUNICODE (0x58, 'X'): needs 4294967295 bytes of string data but "
       "only 4 remain"},
      {"binbytes8_huge_length.pickle",
       "byte 2: pickle opcode BINBYTES8 (0x8e): needs 9223372036854775808 bytes of bytes data but "
       "only 4 remain"},
      {"long4_huge_length.pickle",
       "byte 2: pickle opcode LONG4 (0x8b): needs 2147483647 bytes of integer data"},
      {"binstring_negative_length.pickle",
       "byte 0: pickle opcode BINSTRING (0x54, 'T'): has a negative length -1"},
      {"frame_huge_length.pickle",
       "byte 2: pickle opcode FRAME (0x95): announces a frame of 1099511627776 bytes"},
      {"deep_tuple.pickle", "pickle opcode TUPLE1 (0x85): the data nests deeper than 1000 levels"},
      {"deep_list.pickle",
       "pickle opcode APPEND (0x61, 'a'): the data nests deeper than 1000 levels"},
      {"cycle.pickle", "byte 8: pickle opcode STOP (0x2e, '.'): the data contains itself"},
      {"shared_chain.pickle",
       "pickle opcode STOP (0x2e, '.'): the data nests deeper than 1000 levels"},
      {"memo_missing.pickle",
       "byte 2: pickle opcode BINGET (0x68, 'h'): memo entry 5 was never stored"},
  };
  for (const Case& c : cases) {
    INFO(c.file);
    CHECK_THAT(decode_error(read_file(kDataDir / "hostile" / c.file)), Contains(c.text));
  }
  CHECK_THAT(decode_error(""),
             Contains("<memory>: byte 0: the pickle ends before its STOP opcode"));
  CHECK_THAT(
      decode_error("."),
      Contains(
          "byte 0: pickle opcode STOP (0x2e, '.'): needs 1 value(s) on the stack but 0 are there"));
  CHECK(decode("(N.") == Value());  // as Python: STOP takes the top value even under a MARK
  CHECK_THAT(decode_error("N(."), Contains("are above the last MARK"));
  CHECK_THAT(decode_error("Na."), Contains("needs 2 value(s)"));
  CHECK_THAT(decode_error("NNa."), Contains("expects a list to append to, found NoneType"));
  CHECK_THAT(decode_error("N(Ne."), Contains("expects a list to add the items to, found NoneType"));
  CHECK_THAT(decode_error("}(Nu."), Contains("odd number of items (1)"));
  CHECK_THAT(decode_error("e."), Contains("there is no MARK to close"));
  CHECK_THAT(decode_error("Iabc\n."), Contains("'abc' is not a decimal integer"));
  CHECK_THAT(decode_error("F1.5x\n."), Contains("'1.5x' is not a float"));
  CHECK_THAT(decode_error("S'abc\n."), Contains("must be a quoted string"));
  CHECK_THAT(decode_error("Vabc"), Contains("no terminating newline"));
  CHECK_THAT(decode_error("V\\u12\n."), Contains("truncated \\u escape"));
  CHECK_THAT(decode_error("\x80\x06N."),
             Contains("pickle protocol 6 is newer than the supported 0-5"));
}

TEST_CASE("pickle: resource limits are enforced with clear errors", "[trace][pickle][hostile]") {
  const std::string data = read_file(kDataDir / "pickles" / "protocol4.pickle");
  DecodeOptions few_memo;
  few_memo.max_memo_entries = 3;
  CHECK_THAT(decode_error(data, few_memo), Contains("the memo would exceed 3 entries"));
  DecodeOptions small_stack;
  small_stack.max_stack_entries = 4;
  CHECK_THAT(decode_error("(NNNNN.", small_stack),
             Contains("the value stack would exceed 4 entries"));
  DecodeOptions small_memory;
  small_memory.max_value_bytes = 100;
  CHECK_THAT(decode_error(data, small_memory),
             Contains("would take more than 100 bytes of memory"));
  DecodeOptions shallow;
  shallow.max_depth = 2;
  CHECK_THAT(decode_error(data, shallow), Contains("deeper than 2 levels"));
}

TEST_CASE("pickle: every truncation of a valid pickle is a TraceError",
          "[trace][pickle][hostile]") {
  for (int protocol = 0; protocol <= 5; ++protocol) {
    const std::string data =
        read_file(kDataDir / "pickles" / ("protocol" + std::to_string(protocol) + ".pickle"));
    for (std::size_t cut = 0; cut < data.size(); ++cut) {
      INFO("protocol " << protocol << " cut at " << cut);
      CHECK_THROWS_AS(decode(std::string_view(data).substr(0, cut)), TraceError);
    }
  }
}

TEST_CASE("pickle: random byte flips either parse or raise TraceError",
          "[trace][pickle][hostile]") {
  std::mt19937 rng(20240601);
  int parsed = 0;
  int rejected = 0;
  for (int protocol : {0, 2, 4, 5}) {
    const std::string original =
        read_file(kDataDir / "pickles" / ("protocol" + std::to_string(protocol) + ".pickle"));
    for (int i = 0; i < 500; ++i) {
      std::string data = original;
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < flips; ++k) {
        data[rng() % data.size()] = static_cast<char>(rng() & 0xFF);
      }
      INFO("protocol " << protocol << " mutation " << i);
      try {
        const Value v = decode(data);
        (void)encode_pickle(v);  // whatever parsed is a well-formed Value
        ++parsed;
      } catch (const TraceError& e) {
        CHECK(e.has_offset());
        CHECK(e.offset() <= data.size());
        ++rejected;
      }
    }
  }
  CHECK(parsed + rejected == 2000);
  CHECK(rejected > 0);
  CHECK(parsed > 0);
  CHECK_FALSE(std::filesystem::exists(marker_path()));
}

TEST_CASE("pickle: progress is reported up to 1", "[trace][pickle]") {
  std::vector<double> seen;
  DecodeOptions options;
  options.progress = [&](double f) { seen.push_back(f); };
  (void)decode(read_file(kDataDir / "pickles" / "protocol2.pickle"), options);
  REQUIRE_FALSE(seen.empty());
  CHECK(seen.back() == 1.0);
  CHECK(std::is_sorted(seen.begin(), seen.end()));
}

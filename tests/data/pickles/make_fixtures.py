#!/usr/bin/env python3
"""Regenerates protocol0.pickle ... protocol5.pickle: one dict covering every data opcode that
Python's pickler emits for protocols 0-5 (the expected value is built in tests/trace/test_pickle.cpp).
Bytes need protocol 3+ and sets 4+ (older protocols write them with GLOBAL + REDUCE, which
cachealloc refuses)."""
import pathlib
import pickle

HERE = pathlib.Path(__file__).resolve().parent


def fixture(protocol):
    obj = {
        "none": None, "t": True, "f": False, "small": 5, "neg": -7, "big": 2**40,
        "i64min": -2**63, "u64max": 2**64 - 1, "huge": 2**70, "pi": 3.25, "inf": float("inf"),
        "s": "h\u00e9llo\n\\u \u20ac\U0001F600", "empty": "", "list": [1, [2, []]],
        "tuple": (1, 2, 3, 4), "t1": ("x",), "empty_t": (), "nested": {"a": {"b": "c"}},
    }
    shared = [1]
    obj["shared"] = [shared, shared]  # one list referenced twice: GET of a list
    if protocol >= 3:
        obj["bytes"] = b"\x00\xffab"
    if protocol >= 4:
        obj["set"] = {7}
        obj["frozen"] = frozenset([8])
    if protocol >= 5:
        obj["bytearray"] = bytearray(b"xyz")
    return pickle.dumps(obj, protocol=protocol)


if __name__ == "__main__":
    for p in range(6):
        (HERE / f"protocol{p}.pickle").write_bytes(fixture(p))
    print("wrote protocol0..5.pickle to", HERE)

#!/usr/bin/env python3
"""Regenerates the hostile and malformed pickles in this folder (run from anywhere).

Every file here must make cachealloc::trace::decode_pickle / read_snapshot throw TraceError
without executing anything. Files that would run a command in Python run
`touch /tmp/cachealloc_pwned_$PPID`: $PPID is the process that called system(), so the test
checks that /tmp/cachealloc_pwned_<its own pid> does not exist. NEVER unpickle these files with
Python's pickle module.
"""
import lzma
import os
import pathlib
import pickle
import struct

HERE = pathlib.Path(__file__).resolve().parent
TRACES = HERE.parent / "traces"
PAYLOAD = "touch /tmp/cachealloc_pwned_$PPID"


class Evil:
    """pickle.dumps() of this writes a GLOBAL/STACK_GLOBAL of os.system and a REDUCE."""

    def __reduce__(self):
        return (os.system, (PAYLOAD,))


def u32(n):
    return struct.pack("<I", n)


def u64(n):
    return struct.pack("<Q", n)


def shared_chain(n):
    """n empty lists in the memo, then linked list[i].append(list[i+1]): a chain n deep that the
    incremental depth check cannot see (the lists are shared through the memo)."""
    out = bytearray(b"\x80\x02")
    for i in range(n):
        out += b"]r" + u32(i) + b"0"  # EMPTY_LIST LONG_BINPUT i POP
    for i in range(n - 1):
        out += b"j" + u32(i) + b"j" + u32(i + 1) + b"a0"  # GET i, GET i+1, APPEND, POP
    out += b"j" + u32(0) + b"."
    return bytes(out)


def shared_device_traces():
    """A snapshot whose device_traces repeats one list 20,000 times through the memo: 20 million
    entries from a pickle of a few tens of kB."""
    entry = {"action": "alloc", "addr": 0, "size": 1, "stream": 0, "time_us": 0}
    events = [entry] * 1000
    return pickle.dumps({"device_traces": [events] * 20000}, protocol=4)


FILES = {
    # Code execution attempts, as Python's pickler writes them.
    "os_system.pickle": pickle.dumps(Evil(), protocol=2),  # GLOBAL 'posix system' + REDUCE
    "os_system_proto0.pickle": pickle.dumps(Evil(), protocol=0),
    "stack_global.pickle": pickle.dumps(Evil(), protocol=4),  # STACK_GLOBAL
    "global_os_system.pickle": b"cos\nsystem\n(S'" + PAYLOAD.encode() + b"'\ntR.",
    "inst.pickle": b"(S'" + PAYLOAD.encode() + b"'\nios\nsystem\n.",
    # The other object-building opcodes, reached without any GLOBAL.
    "obj.pickle": b"(NS'x'\no.",
    "newobj.pickle": b"\x80\x02N)\x81.",
    "newobj_ex.pickle": b"\x80\x04N)}\x92.",
    "build.pickle": b"\x80\x02}}b.",
    "reduce.pickle": b"\x80\x02N)R.",
    "persid.pickle": b"Pfoo\n.",
    "binpersid.pickle": b"\x80\x02NQ.",
    "ext1.pickle": b"\x80\x02\x82\x01.",
    "next_buffer.pickle": b"\x80\x05\x97.",
    "unknown_opcode.pickle": b"\x80\x02\xff.",
    # Lengths that point far beyond the end of the data.
    "binunicode_huge_length.pickle": b"\x80\x02X\xff\xff\xff\xffabc.",
    "binbytes8_huge_length.pickle": b"\x80\x04\x8e" + u64(2**63) + b"abc.",
    "long4_huge_length.pickle": b"\x80\x02\x8b\xff\xff\xff\x7fabc.",
    "binstring_negative_length.pickle": b"T\xff\xff\xff\xffabc.",
    "frame_huge_length.pickle": b"\x80\x04\x95" + u64(2**40) + b"N.",
    # Structure bombs.
    "deep_tuple.pickle": b"\x80\x02)" + b"\x85" * 100000 + b".",
    "deep_list.pickle": b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b".",
    "cycle.pickle": b"\x80\x02]q\x00h\x00a.",
    "shared_chain.pickle": shared_chain(3000),
    "memo_missing.pickle": b"\x80\x02h\x05.",
    "shared_device_traces.pickle": shared_device_traces(),
}


def main():
    for name, data in FILES.items():
        (HERE / name).write_bytes(data)
    # xz: a real trace cut in half, and a bomb (a valid pickle of 64 MiB of zero bytes).
    real = (TRACES / "mlp_two_streams.pickle.xz").read_bytes()
    (HERE / "truncated.pickle.xz").write_bytes(real[: len(real) // 2])
    bomb = b"\x80\x04\x8e" + u64(64 << 20) + bytes(64 << 20) + b"."
    (HERE / "bomb_64mib.pickle.xz").write_bytes(lzma.compress(bomb, preset=9))
    print("wrote", len(FILES) + 2, "files to", HERE)


if __name__ == "__main__":
    main()

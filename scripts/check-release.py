#!/usr/bin/env python3
"""Proves that the product binaries carry no test knobs or test objects,
whatever else was built beside them, and that the tests' hooked builds do (so
the check can see them).

  check-release.py --release BIN... --test BIN...

For each binary: the BPF objects embedded in it (ELF headers with e_machine
EM_BPF) and the test knobs' names (XDPCNI_TEST_STOP_AT, XDPCNI_TEST_FAIL_AFTER,
the benchmark's program). A release binary must hold at most two BPF objects
(the datapath, which the agent loads and the plugin only opens the pins of,
and the Service programs the agent attaches) and no knob; a test binary must hold at least one knob, or the check proves nothing. Prints one line per binary and exits 1 on a failure.
"""
import argparse
import struct
import sys

EM_BPF = 247
KNOBS = [b"XDPCNI_TEST_STOP_AT", b"XDPCNI_TEST_FAIL_AFTER", b"xdp_drop_count"]


def bpf_objects(data: bytes) -> int:
    n, at = 0, data.find(b"\x7fELF")
    while at >= 0:
        # e_ident[4] = 2 (64-bit), e_ident[5] = 1 (little endian); e_machine at 18.
        if at + 20 <= len(data) and data[at + 4] == 2 and data[at + 5] == 1:
            (machine,) = struct.unpack_from("<H", data, at + 18)
            if machine == EM_BPF:
                n += 1
        at = data.find(b"\x7fELF", at + 1)
    return n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--release", nargs="+", required=True)
    p.add_argument("--test", nargs="+", required=True)
    a = p.parse_args()
    bad = 0
    for kind, paths in (("release", a.release), ("test", a.test)):
        for path in paths:
            data = open(path, "rb").read()
            objs = bpf_objects(data)
            knobs = [k.decode() for k in KNOBS if k in data]
            ok = (objs <= 2 and not knobs) if kind == "release" else bool(knobs)
            print(f"{'ok' if ok else 'FAIL'} {kind} {path}: {objs} BPF object(s), test knobs {knobs or 'none'}")
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

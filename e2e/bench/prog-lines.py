#!/usr/bin/env python3
"""Where a BPF program's own samples fall, by source line, without libbfd
(Debian's perf and bpftool have none, so neither annotates a BPF program).

  prog-lines.py snapshot NAME DIR    while the programs are loaded: for each
                                     program called NAME, its JIT address and
                                     the kernel's line info (JIT offset ->
                                     file:line and the source text, from the
                                     program's BTF) into DIR/NAME.<id>.json
  prog-lines.py report PERF_DATA DIR NAME [TOP]
                                     the samples `perf record` took in those
                                     programs, per source line and per
                                     function-sized region of the source

Used by e2e/bench/profile.sh when XDPCNI_PROFILE_PROG names a program.
Root (the bpf syscall's BPF_PROG_GET_FD_BY_ID).
"""
import bisect
import collections
import ctypes
import glob
import json
import os
import struct
import subprocess
import sys

SYS_BPF = 321  # x86_64
PROG_GET_NEXT_ID, PROG_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, BTF_GET_FD_BY_ID = 11, 13, 15, 19

libc = ctypes.CDLL(None, use_errno=True)
u32, u64 = ctypes.c_uint32, ctypes.c_uint64


class ProgInfo(ctypes.Structure):
    # struct bpf_prog_info (linux/bpf.h), up to the fields read here.
    _fields_ = [("type", u32), ("id", u32), ("tag", ctypes.c_uint8 * 8),
                ("jited_prog_len", u32), ("xlated_prog_len", u32),
                ("jited_prog_insns", u64), ("xlated_prog_insns", u64),
                ("load_time", u64), ("created_by_uid", u32), ("nr_map_ids", u32),
                ("map_ids", u64), ("name", ctypes.c_char * 16), ("ifindex", u32),
                ("gpl", u32), ("netns_dev", u64), ("netns_ino", u64),
                ("nr_jited_ksyms", u32), ("nr_jited_func_lens", u32),
                ("jited_ksyms", u64), ("jited_func_lens", u64), ("btf_id", u32),
                ("func_info_rec_size", u32), ("func_info", u64), ("nr_func_info", u32),
                ("nr_line_info", u32), ("line_info", u64), ("jited_line_info", u64),
                ("nr_jited_line_info", u32), ("line_info_rec_size", u32),
                ("jited_line_info_rec_size", u32), ("nr_prog_tags", u32),
                ("prog_tags", u64), ("run_time_ns", u64), ("run_cnt", u64),
                ("recursion_misses", u64), ("verified_insns", u32),
                ("attach_btf_obj_id", u32), ("attach_btf_id", u32), ("pad", u32)]


class BtfInfo(ctypes.Structure):
    _fields_ = [("btf", u64), ("btf_size", u32), ("id", u32), ("name", u64),
                ("name_len", u32), ("kernel_btf", u32)]


class IdAttr(ctypes.Structure):
    _fields_ = [("id", u32), ("next_id", u32), ("open_flags", u32)]


class InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", u32), ("info_len", u32), ("info", u64)]


def bpf(cmd, attr):
    r = libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return r


def info_of(fd, info):
    bpf(OBJ_GET_INFO_BY_FD, InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info)))


def prog_ids():
    attr, ids = IdAttr(0, 0, 0), []
    while True:
        try:
            bpf(PROG_GET_NEXT_ID, attr)
        except OSError:
            return ids
        ids.append(attr.next_id)
        attr.id = attr.next_id


def btf_strings(btf_id):
    fd = bpf(BTF_GET_FD_BY_ID, IdAttr(btf_id, 0, 0))
    try:
        i = BtfInfo()
        info_of(fd, i)
        raw = (ctypes.c_uint8 * i.btf_size)()
        j = BtfInfo(btf=ctypes.addressof(raw), btf_size=i.btf_size)
        info_of(fd, j)
    finally:
        os.close(fd)
    data = bytes(raw)
    hdr_len, = struct.unpack_from("<I", data, 4)
    str_off, str_len = struct.unpack_from("<II", data, 16)
    return data[hdr_len + str_off:hdr_len + str_off + str_len]


def cstr(strings, off):
    return strings[off:strings.index(b"\0", off)].decode(errors="replace")


def snapshot_one(pid):
    fd = bpf(PROG_GET_FD_BY_ID, IdAttr(pid, 0, 0))
    try:
        i = ProgInfo()
        info_of(fd, i)
        n, rec = i.nr_line_info, i.line_info_rec_size
        lines = (ctypes.c_uint8 * (n * rec))()
        jited = (u64 * i.nr_jited_line_info)()
        ksym = (u64 * 1)()
        j = ProgInfo(nr_line_info=n, line_info_rec_size=rec, line_info=ctypes.addressof(lines),
                     nr_jited_line_info=i.nr_jited_line_info, jited_line_info_rec_size=8,
                     jited_line_info=ctypes.addressof(jited), nr_jited_ksyms=1,
                     jited_ksyms=ctypes.addressof(ksym))
        info_of(fd, j)
    finally:
        os.close(fd)
    strings = btf_strings(i.btf_id)
    rows = []
    for k in range(n):
        _insn, file_off, line_off, line_col = struct.unpack_from("<IIII", bytes(lines), k * rec)
        rows.append({"jit": jited[k] - ksym[0], "file": os.path.basename(cstr(strings, file_off)),
                     "line": line_col >> 10, "text": cstr(strings, line_off).strip()})
    return {"id": pid, "name": i.name.decode(), "start": ksym[0], "len": i.jited_prog_len,
            "lines": sorted(rows, key=lambda r: r["jit"])}


def snapshot(name, out):
    os.makedirs(out, exist_ok=True)
    found = 0
    for pid in prog_ids():
        try:
            p = snapshot_one(pid)
        except OSError:
            continue  # unloaded meanwhile
        if p["name"] == name[:15]:
            with open(os.path.join(out, f"{name}.{pid}.json"), "w") as f:
                json.dump(p, f)
            found += 1
    if not found:
        sys.exit(f"prog-lines.py: no loaded program called {name}")


def report(perf_data, snap, name, top):
    progs = [json.load(open(f)) for f in glob.glob(os.path.join(snap, f"{name}.*.json"))]
    if not progs:
        sys.exit(f"prog-lines.py: no snapshot of {name} in {snap}")
    starts = sorted(p["start"] for p in progs)
    by_start = {p["start"]: p for p in progs}
    script = subprocess.run(["perf", "script", "-i", perf_data, "-F", "ip"],
                            capture_output=True, text=True, check=True).stdout
    per_line, per_prog, total = collections.Counter(), collections.Counter(), 0
    for word in script.split():
        ip = int(word, 16)
        k = bisect.bisect_right(starts, ip) - 1
        if k < 0 or ip >= starts[k] + by_start[starts[k]]["len"]:
            continue
        p = by_start[starts[k]]
        offs = [r["jit"] for r in p["lines"]]
        at = bisect.bisect_right(offs, ip - p["start"]) - 1
        r = p["lines"][at] if at >= 0 else {"file": "?", "line": 0, "text": "(prologue)"}
        per_line[(r["file"], r["line"], r["text"])] += 1
        per_prog[p["id"]] += 1
        total += 1
    if not total:
        sys.exit(f"prog-lines.py: no samples in {name}")
    print(f"== {name}: {total} samples ({', '.join(f'id {i}: {n}' for i, n in per_prog.items())})")
    print("== by source line, share of the program's samples")
    for (f, line, text), n in per_line.most_common(top):
        print(f"{100 * n / total:5.1f}%  {f}:{line}  {text[:80]}")


def main():
    a = sys.argv[1:]
    if len(a) == 3 and a[0] == "snapshot":
        snapshot(a[1], a[2])
    elif len(a) in (4, 5) and a[0] == "report":
        report(a[1], a[2], a[3], int(a[4]) if len(a) == 5 else 30)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()

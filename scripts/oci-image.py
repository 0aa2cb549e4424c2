#!/usr/bin/env python3
"""Writes a one-layer OCI image archive from a directory, with no registry.

    oci-image.py ROOTFS NAME:TAG OUT.tar [--entrypoint /path] [--env K=V]...

The archive holds `oci-layout`, `index.json` (annotated with the image name
that `ctr images import` tags it with), one config blob and one gzip layer
blob. Files are owned by root, mtimes are zeroed, so the same ROOTFS gives the
same image digest.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile


def layer_tar(rootfs: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                arc = os.path.relpath(full, rootfs)
                info = tar.gettarinfo(full, arcname=arc)
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mtime = 0
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def blob(out: tarfile.TarFile, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))
    return {"digest": f"sha256:{digest}", "size": len(data)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rootfs")
    ap.add_argument("name")
    ap.add_argument("out")
    ap.add_argument("--entrypoint", default=None)
    ap.add_argument("--env", action="append", default=[])
    a = ap.parse_args()
    if not os.path.isdir(a.rootfs):
        print(f"oci-image.py: {a.rootfs} is not a directory", file=sys.stderr)
        return 1
    raw = layer_tar(a.rootfs)
    gz = gzip.compress(raw, mtime=0)
    env = ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"] + a.env
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env, "Entrypoint": [a.entrypoint] if a.entrypoint else None},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(raw).hexdigest()]},
    }
    with tarfile.open(a.out, "w") as out:
        layout = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
        info = tarfile.TarInfo("oci-layout")
        info.size = len(layout)
        out.addfile(info, io.BytesIO(layout))
        cfg = blob(out, json.dumps(config).encode())
        lay = blob(out, gz)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **lay}],
        }
        man = blob(out, json.dumps(manifest).encode())
        index = {
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json", **man,
                "annotations": {
                    "io.containerd.image.name": a.name,
                    "org.opencontainers.image.ref.name": a.name.rsplit(":", 1)[-1],
                },
            }],
        }
        data = json.dumps(index).encode()
        info = tarfile.TarInfo("index.json")
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))
    print(man["digest"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

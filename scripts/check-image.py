#!/usr/bin/env python3
"""Checks that an image archive (from scripts/image.sh) holds what the chart
runs, and that Containerfile lays out the same files.

    check-image.py IMAGE.tar RENDERED-CHART.yaml Containerfile

- the image's entrypoint is the agent;
- every command the rendered chart's containers run exists in the image,
  as an executable regular file;
- the CNI plugin and the reference plugins install-cni copies (host-local,
  portmap, loopback) sit next to the agent, where install-cni looks;
- /var/run leads to /run (pod netns paths the runtime records under
  /var/run/netns resolve to the chart's /run/netns mount);
- iptables-save and ip6tables-save (the agent's FORWARD rule check) with the
  xtables extensions, and Containerfile installs iptables;
- nft with its libraries and /etc/protocols (the agent's NetworkPolicy
  rules), and Containerfile installs nftables and netbase;
- Containerfile puts the same files in the same directory.
Prints what it checked; exits 1 naming the first difference.
"""

import io
import json
import re
import sys
import tarfile

PLUGINS = ["xdpcni", "host-local", "portmap", "loopback"]
BIN = "usr/local/bin"


def fail(msg: str) -> None:
    print(f"check-image.py: {msg}", file=sys.stderr)
    sys.exit(1)


def image(path: str):
    outer = tarfile.open(path)
    blob = lambda d: outer.extractfile("blobs/sha256/" + d.split(":", 1)[1]).read()
    index = json.load(outer.extractfile("index.json"))
    manifest = json.loads(blob(index["manifests"][0]["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    files = {}
    for layer in manifest["layers"]:
        with tarfile.open(fileobj=io.BytesIO(blob(layer["digest"]))) as t:
            for m in t.getmembers():
                files[m.name.lstrip("./")] = m
    return config, files


def main() -> None:
    if len(sys.argv) != 4:
        fail(__doc__.strip().splitlines()[3].strip())
    config, files = image(sys.argv[1])
    entry = (config.get("config") or {}).get("Entrypoint") or []
    if entry != ["/usr/local/bin/xdpcni-agent"]:
        fail(f"entrypoint is {entry}, not the agent")
    chart = open(sys.argv[2]).read()
    commands = set(re.findall(r'command: \["(/[^"]+)"', chart))
    if not commands:
        fail("the rendered chart runs no command")
    for path in sorted(commands | {f"/{BIN}/{p}" for p in PLUGINS}):
        m = files.get(path.lstrip("/"))
        if m is None or not m.isreg() or not m.mode & 0o111:
            fail(f"{path} is not an executable file in the image")
    # The agent's FORWARD rule check runs iptables-save and ip6tables-save.
    for tool in ["iptables-save", "ip6tables-save"]:
        m = files.get(f"usr/sbin/{tool}")
        if m is None or not m.issym():
            fail(f"/usr/sbin/{tool} is not in the image")
        target = files.get("usr/sbin/" + m.linkname)
        if target is None or not target.isreg() or not target.mode & 0o111:
            fail(f"/usr/sbin/{tool} -> {m.linkname} is not an executable file")
    if not any(n.endswith("xtables/libxt_comment.so") for n in files):
        fail("the xtables extensions are not in the image")
    if not re.search(r"apt-get install[^\n]*\biptables\b", containerfile := open(sys.argv[3]).read()):
        fail("Containerfile does not install iptables")
    # The agent's NetworkPolicy rules: nft, its libraries, protocol names.
    m = files.get("usr/sbin/nft")
    if m is None or not m.isreg() or not m.mode & 0o111:
        fail("/usr/sbin/nft is not an executable file in the image")
    for lib in ["libnftables.so.1", "libjansson.so.4", "libnftnl.so.11", "libmnl.so.0"]:
        if not any(n.endswith("/" + lib) for n in files):
            fail(f"nft's {lib} is not in the image")
    if "etc/protocols" not in files:
        fail("/etc/protocols (nft's protocol names) is not in the image")
    if not re.search(r"apt-get install[^\n]*\bnftables\b[^\n]*\bnetbase\b", containerfile):
        fail("Containerfile does not install nftables and netbase")
    run = files.get("var/run")
    if run is None or not run.issym() or run.linkname.rstrip("/") not in ("../run", "/run"):
        fail("/var/run is not a link to /run")
    containerfile = open(sys.argv[3]).read()
    for p in ["xdpcni-agent"] + PLUGINS:
        if not re.search(rf"\b{re.escape(p)}\b[^\n]*/{BIN}/?", containerfile):
            fail(f"Containerfile does not put {p} in /{BIN}")
    if 'ENTRYPOINT ["/usr/local/bin/xdpcni-agent"]' not in containerfile:
        fail("Containerfile's entrypoint is not the agent")
    print(f"image: entrypoint the agent; {len(commands)} chart command(s) "
          f"{sorted(commands)} and {', '.join(PLUGINS)} executable in /{BIN}; Containerfile alike")


if __name__ == "__main__":
    main()

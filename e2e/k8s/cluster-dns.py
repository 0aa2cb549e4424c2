#!/usr/bin/env python3
"""The local node's cluster DNS feed: the Kubernetes DNS specification's
A/AAAA records (and their PTRs) for every Service, kept in a hosts file that
dnsmasq serves (up.sh starts both in the node's namespace).

  <service>.<namespace>.svc.<domain>            each cluster IP of the Service;
                                                a headless Service: each ready
                                                endpoint address
  <hostname>.<service>.<namespace>.svc.<domain>  a headless Service's endpoint
                                                with a hostname

Polls the API server every second (kubectl) and, when the records change,
rewrites the file and has dnsmasq re-read it (SIGHUP). Not served: SRV
records, ExternalName CNAMEs, pod records.

usage: cluster-dns.py KUBECTL KUBECONFIG HOSTS_FILE DNSMASQ_PIDFILE DOMAIN
"""
import json
import os
import signal
import subprocess
import sys
import time


def records(objs, domain):
    eps = {}
    for o in objs:
        if o["kind"] == "Endpoints":
            m = o["metadata"]
            eps[(m["namespace"], m["name"])] = o.get("subsets") or []
    out = set()
    for o in objs:
        if o["kind"] != "Service":
            continue
        m, spec = o["metadata"], o.get("spec", {})
        if spec.get("type") == "ExternalName":
            continue
        fqdn = f'{m["name"]}.{m["namespace"]}.svc.{domain}'
        ips = [ip for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")]) if ip and ip != "None"]
        if ips:
            out.update((ip, fqdn) for ip in ips)
            continue
        for subset in eps.get((m["namespace"], m["name"]), []):
            for a in subset.get("addresses") or []:
                out.add((a["ip"], fqdn))
                if a.get("hostname"):
                    out.add((a["ip"], f'{a["hostname"]}.{fqdn}'))
    return sorted(out)


def main():
    kubectl, kubeconfig, hosts, pidfile, domain = sys.argv[1:6]
    last = None
    while True:
        try:
            got = subprocess.run(
                [kubectl, "--kubeconfig", kubeconfig, "get", "services,endpoints",
                 "--all-namespaces", "-o", "json"],
                check=True, capture_output=True, text=True, timeout=10)
            now = records(json.loads(got.stdout)["items"], domain)
        except (subprocess.SubprocessError, ValueError, KeyError) as e:
            print(f"cluster-dns: reading the API: {e}", file=sys.stderr, flush=True)
            time.sleep(1)
            continue
        if now != last:
            tmp = hosts + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(f"{ip} {name}\n" for ip, name in now)
            os.replace(tmp, hosts)
            try:
                with open(pidfile) as f:
                    os.kill(int(f.read().strip()), signal.SIGHUP)
            except (OSError, ValueError) as e:
                print(f"cluster-dns: telling dnsmasq: {e}", file=sys.stderr, flush=True)
                time.sleep(1)
                continue
            print(f"cluster-dns: {len(now)} records", file=sys.stderr, flush=True)
            last = now
        time.sleep(1)


if __name__ == "__main__":
    main()

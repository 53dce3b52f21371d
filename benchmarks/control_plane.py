"""The figures behind the control plane's shape (issue 42): etcd's costs on this machine.

A 3-member etcd cluster on loopback (Debian's etcd-server 3.4, data on tmpfs,
50 ms heartbeats), reached through its v3 JSON gateway by
:class:`jaxckpt.ft._etcd.Etcd`. Measured, medians of ``--repeats``:

* ``put_ms`` and ``txn_ms``: one client's put, and a compare-and-put
  transaction (what the leader's fence of each quorum costs);
* ``etcd_quorum_ms[G]``: a lower bound of a quorum kept *in* etcd with no
  lighthouse (the other shape the issue allows): G groups put their requests
  (8 client connections at once), one range reads them, one transaction writes
  the quorum; the G watch deliveries that would tell the members are not
  counted;
* ``failover_s``: from a leading replica's death (its lease left to expire) to
  a follower leading (:class:`jaxckpt.ft._replicas.Candidacy`, 1 s leases), and
  ``handover_s``: the same when the leader exits cleanly (revokes its lease).

Prints one JSON object.

    python benchmarks/control_plane.py [--groups 128,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # Uninstalled repo.

from jaxckpt.ft import _etcd, _replicas  # noqa: E402  pylint: disable=wrong-import-position
import _repo  # noqa: F401  (the repository root on the path: tests.support)
from tests.support.etcd import EtcdCluster  # noqa: E402  pylint: disable=wrong-import-position


def _ms(secs: list[float]) -> float:
  return round(1e3 * statistics.median(secs), 3)


def latencies(client: _etcd.Etcd, n: int) -> dict[str, float]:
  puts, txns = [], []
  for i in range(n):
    t0 = time.perf_counter()
    client.put("/bench/k", str(i))
    puts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    client.txn([_etcd.compare("/bench/k", "VALUE", str(i))], [_etcd.put_op("/bench/q", str(i))])
    txns.append(time.perf_counter() - t0)
  return {"put_ms": _ms(puts), "txn_ms": _ms(txns), "put_p99_ms": round(1e3 * sorted(puts)[int(0.99 * n)], 3)}


def etcd_quorum_secs(endpoints: list[str], groups: int, round_: int) -> float:
  """G requests put, read back with one range, one transaction writing the quorum."""
  clients = [_etcd.Etcd(endpoints) for _ in range(8)]
  prefix = f"/bench/r{round_}/"
  try:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
      list(pool.map(lambda k: [clients[k].put(f"{prefix}g{i:05d}", "member")
                               for i in range(k, groups, len(clients))], range(len(clients))))
    got = clients[0].call("/v3/kv/range", {"key": _etcd._b64(prefix), "range_end": _etcd._b64(prefix[:-1] + "0")})  # pylint: disable=protected-access
    assert int(got.get("count", 0)) == groups, got.get("count")
    clients[0].txn([_etcd.compare("/bench/quorum", "VERSION", 0, "GREATER")] if round_ else [],
                   [_etcd.put_op("/bench/quorum", f"q{round_}")])
    return time.perf_counter() - t0
  finally:
    for c in clients:
      c.close()


def failover_secs(endpoints: list[str], job: str, clean: bool) -> float:
  """From the leader's death (or clean exit) to a follower leading."""
  led = {name: threading.Event() for name in ("a", "b")}
  cands = {name: _replicas.Candidacy(endpoints, job, name, lease_ttl_secs=1, on_elected=led[name].set,
                                     on_deposed=lambda: None) for name in ("a", "b")}
  cands["a"].start()
  assert led["a"].wait(10)
  cands["b"].start()
  time.sleep(0.3)
  t0 = time.perf_counter()
  if clean:
    cands["a"].stop()
  else:                                   # dead: it neither renews nor revokes its lease
    cands["a"]._stop.set()  # pylint: disable=protected-access
  assert led["b"].wait(10)
  secs = time.perf_counter() - t0
  cands["b"].stop()
  return secs


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--groups", default="128,1024")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()
  out: dict = {"benchmark": "control_plane", "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
               "repeats": args.repeats}
  with EtcdCluster(3) as cluster:
    client = _etcd.Etcd(cluster.endpoints)
    out.update(latencies(client, 200))
    out["etcd_quorum_ms"] = {}
    for g in (int(x) for x in args.groups.split(",")):
      out["etcd_quorum_ms"][g] = _ms([etcd_quorum_secs(cluster.endpoints, g, r) for r in range(args.repeats)])
    out["failover_s"] = round(statistics.median(
        failover_secs(cluster.endpoints, f"f{r}", clean=False) for r in range(args.repeats)), 3)
    out["handover_s"] = round(statistics.median(
        failover_secs(cluster.endpoints, f"h{r}", clean=True) for r in range(args.repeats)), 3)
    client.close()
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()

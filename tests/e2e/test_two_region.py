"""Two regions on one machine. Region a: the Redis primary, the dataflow and the trainer. Region b: a real
Redis replica (`redis-server --replicaof`, replicating over the long link) and two RaaS processes whose
`redis.url` reaches the primary and whose weight pulls reach the trainer only through `LinkProxy`s
standing for the long link (50 ms, a bandwidth cap). The run trains, its ledger balances, region b's RaaS
read notices and manifests off the replica (their `raas_stopped` counts), and per version one delta or
one full buffer crosses into region b, not one per RaaS (the weight link's byte count against the
manifests' payload sizes)."""

import os
import signal
import subprocess

import pytest
import redis

from astraflow.messages import WeightManifest, decode
from astraflow.streams import Keys
from tests.e2e.deploy_helpers import ASTRAFLOW, ROOT, events, free_port, redis_up, wait_for
from tests.e2e.test_deploy import QUICK, prebuild_tiny_model
from tests.integration.replicas import system_redis
from tests.link_proxy import LinkProxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = "recipes/addition-tiny.yaml"
MODEL = "policy"
LONG_LINK = {"latency_s": 0.05, "bps": 4 << 20}  # 50 ms each way, 4 MiB/s
HANDSHAKES = 4096
"""Bytes of handshakes and request frames one crossing adds to its payload (generous)."""
VERSIONS = 6
# The deploy test's small model and batches, with a short supervised warm start: some answers are right
# from the start, so rewards vary within groups and every version changes the weights (a real delta).
TINY = {**QUICK, "ASTRAFLOW_RUN__TINY__WARM_START_STEPS": "200"}


def crossings(primary: redis.Redis, keys: Keys) -> dict[tuple[int, str], int]:
    """(version, full|delta) of each relay seat region b took -> the payload bytes of that crossing."""
    out = {}
    for key in primary.scan_iter(keys.weight_relay(MODEL, "*", "*", "b", "*")):  # type: ignore[arg-type]
        parts = key.decode().split(":")
        version, what = int(parts[parts.index("relay") - 1]), parts[-1]
        manifest = decode(primary.hgetall(keys.weights(MODEL, version)), WeightManifest)
        out[(version, what)] = manifest.nbytes if what == "full" else manifest.delta_nbytes
    return out


@pytest.mark.timeout(240)
def test_region_b_reads_off_its_replica_and_one_copy_of_each_version_crosses_the_long_link(tmp_path):
    run = f"two-region-{os.getpid()}"
    keys = Keys(run)
    prebuild_tiny_model(RECIPE, TINY)
    procs: dict[str, subprocess.Popen] = {}
    links: list[LinkProxy] = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        out = open(logs / f"{name}.log", "w")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def tail(name: str) -> str:
        return (logs / f"{name}.log").read_text()[-3000:]

    def redis_server(name: str, port: str, *extra: str) -> None:
        (tmp_path / name).mkdir()
        args = ["--port", port, "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path / name)]
        start(name, [system_redis(), *args, *extra])
        wait_for(lambda: redis_up(port), 30, f"{name} up")

    def link(port: int | str | None = None) -> LinkProxy:
        links.append(LinkProxy(None if port is None else ("127.0.0.1", int(port)), **LONG_LINK))
        return links[-1]

    try:
        primary_port = free_port()
        redis_server("redis-a", primary_port, "--repl-diskless-sync-delay", "0")
        primary = redis.Redis(port=int(primary_port))
        replication, redis_link, weight_link = link(primary_port), link(primary_port), link()
        # Ports picked while the links hold theirs: a link bound after a pick could take the picked port
        # (the replica's "port" then answered as the primary, through the link).
        replica_port, weights_port = free_port(), free_port()
        weight_link.target = ("127.0.0.1", int(weights_port))
        redis_server("redis-b", replica_port, "--replicaof", "127.0.0.1", str(replication.port))
        replica = redis.Redis(port=int(replica_port))
        wait_for(lambda: replica.info("replication").get("master_link_status") == "up", 30, "replica in sync")

        # Lockstep (sync): every version is pulled by region b before it generates with it, so each
        # version's crossing can be checked. (Async, this trainer outruns the long link: region b skips
        # versions and a pull started late is refused, "not served here", once the trainer moved on.)
        base = {
            **os.environ,
            **TINY,
            "ASTRAFLOW_RUN__NAME": run,
            "ASTRAFLOW_TRAINER__MODE": "sync",
            "ASTRAFLOW_WEIGHTS__FULL_EVERY": "3",
            # Small steps change few bf16 weights, so versions between full ones cross as deltas.
            "ASTRAFLOW_TRAINER__LR": "1e-5",
        }
        region_a = {**base, "ASTRAFLOW_REDIS__URL": f"redis://127.0.0.1:{primary_port}/0"}
        trainer = {
            **region_a,
            "ASTRAFLOW_RUN__DIR": str(tmp_path / "trainer"),
            "ASTRAFLOW_WEIGHTS__PORT": weights_port,
            "ASTRAFLOW_WEIGHTS__ADVERTISE": f"127.0.0.1:{weight_link.port}",  # what region b pulls from
        }
        start("trainer", [*ASTRAFLOW, "trainer", RECIPE], trainer)
        start("dataflow", [*ASTRAFLOW, "dataflow", RECIPE], region_a)
        for i in (1, 2):
            region_b = {
                **base,
                "ASTRAFLOW_REDIS__URL": f"redis://127.0.0.1:{redis_link.port}/0",
                "ASTRAFLOW_REDIS__REPLICA_URL": f"redis://127.0.0.1:{replica_port}/0",
                "ASTRAFLOW_RAAS__REGION": "b",
                "ASTRAFLOW_RAAS__ID": f"raas-b{i}",
                "ASTRAFLOW_WEIGHTS__SAME_HOST": "false",  # region b stands for other hosts: no file copies
            }
            start(f"raas-b{i}", [*ASTRAFLOW, "raas", RECIPE], region_b)

        def loaded() -> list[int]:
            return [len(events(logs / f"raas-b{i}.log", "weights_loaded")) for i in (1, 2)]

        wait_for(
            lambda: min(loaded()) >= VERSIONS, 180, f"{VERSIONS} versions in region b:\n{tail('trainer')}"
        )

        # The trainer first (no version crosses after it), then the seats and bytes region b took, then
        # region b: a stopping RaaS resigns its relay seats (no one is sent to a stopped relay).
        for name in ("trainer", "dataflow"):
            procs[name].send_signal(signal.SIGTERM)
            procs[name].wait(timeout=90)
        versions = {e["version"] for i in (1, 2) for e in events(logs / f"raas-b{i}.log", "weights_loaded")}
        seats, crossed = crossings(primary, keys), weight_link.down
        for name in ("raas-b1", "raas-b2"):
            procs[name].send_signal(signal.SIGTERM)
        for name in ("raas-b1", "raas-b2"):
            procs[name].wait(timeout=90)

        # The run trained and its ledger balances.
        trained = events(logs / "trainer.log", "trained")
        rewards = [t["reward"] for t in trained]
        print(f"\ntrained {len(trained)} versions; mean reward per step {rewards}")
        assert len(trained) >= VERSIONS
        url = f"redis://127.0.0.1:{primary_port}/0"
        ledger = subprocess.run(
            [*ASTRAFLOW, "ledger", "--run", run, "--redis", url], cwd=ROOT, capture_output=True, text=True
        )
        assert ledger.returncode == 0 and "balanced" in ledger.stdout, ledger.stdout + ledger.stderr

        # Region b read notices and manifests off its replica.
        stopped = [events(logs / f"raas-b{i}.log", "raas_stopped")[-1] for i in (1, 2)]
        reads = [s["replica_reads"] for s in stopped]
        print(f"region b replica reads {reads}")
        for r in reads:
            assert r.get("replica", 0) >= 2 * VERSIONS and not r.get("fallback"), reads  # notice + manifest

        # Per version, one copy (delta or full) crossed into region b, whatever the number of RaaS there.
        pulls = [s["weights"][MODEL] for s in stopped]
        payload = sum(size for (v, _), size in seats.items() if v in versions)
        print(f"weight link into region b, per version: {sorted(seats.items())} (version, kind): payload")
        print(
            f"  {crossed} bytes crossed for {len(versions)} versions loaded by 2 RaaS "
            f"({crossed // len(versions)} per version; payload {payload}); "
            f"redis link {redis_link.down} down / {redis_link.up} up; pulls per RaaS {pulls}"
        )
        assert len({v for v, _ in seats}) == len(seats)  # one crossing per version: a delta or a full
        assert versions <= {v for v, _ in seats}
        assert len(versions) <= sum(p.get("relay_pulls", 0) for p in pulls) <= len(seats)
        assert sum(p.get("relayed_pulls", 0) for p in pulls) >= len(versions) - 1  # the other one, in-region
        assert payload <= crossed <= sum(seats.values()) + HANDSHAKES * len(seats)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proxy in links:
            proxy.close()

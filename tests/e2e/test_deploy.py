"""deploy/: every compose service run as a local process (hostnames mapped to 127.0.0.1, ports to free
ones, volumes to temp dirs) trains and balances its ledger, and `astraflow health` tells a live worker from
a killed one; the Kubernetes manifests validate against the Kubernetes schemas, name what the code names,
and their commands run; the sbatch script parses and its commands pass `astraflow config`.

No Docker daemon or cluster exists on these machines: a container is emulated by its command, its
environment and its hostname (a replica's own hostname shows as its own consumer id)."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from astraflow.cli import _parser
from astraflow.health import ROLES
from astraflow.streams import Keys, acl
from astraflow.streams.settings import RedisSettings

pytestmark = [pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ASTRAFLOW = [sys.executable, "-m", "astraflow.cli"]
REDIS_PORT = "6379"
# On top of each service's compose environment: a smaller model than the recipe's (no warm start) and
# smaller batches, so a short run fits a loaded 2-core box; groups without reward variance are trained
# too (an untrained model rarely solves one), so versions follow.
QUICK = {
    "ASTRAFLOW_RUN__TINY__HIDDEN": "64",
    "ASTRAFLOW_RUN__TINY__LAYERS": "2",
    "ASTRAFLOW_RUN__TINY__INTERMEDIATE": "128",
    "ASTRAFLOW_RUN__TINY__WARM_START_STEPS": "0",
    "ASTRAFLOW_DATAFLOW__BATCH__SIZE": "32",
    "ASTRAFLOW_DATAFLOW__COLLECTOR__DYNAMIC_SAMPLING": "false",
}


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.5)
    raise TimeoutError(what)


def astraflow_args(command: list[str]) -> list[str]:
    """A container's `astraflow ...` command as this machine runs it."""
    assert command[0] == "astraflow", command
    return [*ASTRAFLOW, *command[1:]]


def effective_settings(recipe: str, env: dict[str, str]) -> dict:
    """What `astraflow config` prints for `recipe` under `env` (it exits 0: the settings are valid)."""
    cmd = [*ASTRAFLOW, "config", recipe]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


# --- compose ---------------------------------------------------------------------------------------------


def compose_services(*names: str) -> dict[str, dict]:
    """The services of `docker compose -f A -f B`: later files add services or override their keys."""
    merged: dict[str, dict] = {}
    for name in names:
        for svc, spec in yaml.safe_load((DEPLOY / "compose" / name).read_text())["services"].items():
            merged[svc] = {**merged.get(svc, {}), **spec}
    return merged


class Host:
    """This machine standing in for the compose network: service names resolve to 127.0.0.1, each Redis
    service's port is a free local one, and each container's volumes are directories of `tmp`."""

    def __init__(self, services: dict[str, dict], tmp: Path) -> None:
        self.services, self.tmp = services, tmp
        self.ports = {s: free_port() for s, spec in services.items() if spec["image"].startswith("redis")}

    def text(self, value: str, container: str) -> str:
        for svc, port in self.ports.items():
            value = value.replace(f"{svc}:{REDIS_PORT}", f"127.0.0.1:{port}")
        for volume in self.services[container.rsplit("#", 1)[0]].get("volumes", []):
            target = volume.split(":", 1)[1]
            if value == target or value.startswith(target + "/"):
                return str(self.tmp / container / value.lstrip("/"))
        return value

    def redis_command(self, svc: str) -> list[str]:
        out, args = [], self.services[svc]["command"][1:]
        for i, arg in enumerate(args):
            before = args[i - 1] if i else ""
            if before == "--port":
                arg = self.ports[svc]
            elif before == "--replicaof":
                arg = "127.0.0.1"
            elif args[i - 2 : i][:1] == ["--replicaof"]:
                arg = self.ports[args[i - 1]]
            elif before == "--dir":
                arg = self.text(arg, svc)
                Path(arg).mkdir(parents=True)
            out.append(arg)
        return ["redis-server", *out, "--bind", "127.0.0.1"]

    def env(self, svc: str, replica: int | str) -> dict[str, str]:
        name = f"{svc}#{replica}"
        env = {k: self.text(str(v), name) for k, v in self.services[svc].get("environment", {}).items()}
        env.update({k: "127.0.0.1" for k, v in env.items() if k.endswith("__HOST") and v in self.services})
        if "replica_url" not in RedisSettings.model_fields:  # redis.replica_url: region b reads the primary
            env.pop("ASTRAFLOW_REDIS__REPLICA_URL", None)
        if self.services[svc].get("deploy", {}).get("replicas", 1) > 1:  # each container's own hostname
            env[f"ASTRAFLOW_{svc.upper()}__ID"] = f"{svc}-{replica}"
        return {**os.environ, **QUICK, **env}


def redis_up(port: str) -> bool:
    try:
        return redis.Redis(port=int(port)).ping()
    except redis.ConnectionError:
        return False


def prebuild_tiny_model(recipe: str) -> None:
    """Each container builds the recipe's tiny model in its own directory; processes sharing this
    checkout would build it in one directory at once, so it is built once first."""
    code = (
        "from astraflow.config import load_settings as load\n"
        f"from astraflow.launch.tiny import build_tiny\nbuild_tiny(load({recipe!r}))"
    )
    cmd, env = [sys.executable, "-c", code], {**os.environ, **QUICK}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)


def healthchecks(checks: list[tuple[dict, dict]], *extra: str) -> list[tuple[int, str]]:
    """(exit status, output) of the healthcheck of each (service, environment), run at once."""
    procs = []
    for spec, env in checks:
        test = spec["healthcheck"]["test"]
        assert test[0] == "CMD", test
        cmd = astraflow_args(test[1:]) + list(extra)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    return [(p.wait(timeout=60), p.stdout.read()) for p in procs]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_two_region_compose_services_as_local_processes_train_and_report_health(tmp_path):
    services = compose_services("compose.yaml", "compose.two-region.yaml")
    host = Host(services, tmp_path)
    workers = {s: spec for s, spec in services.items() if s not in host.ports}
    run = next(iter(workers.values()))["environment"]["ASTRAFLOW_RUN__NAME"]
    keys = Keys(run)
    prebuild_tiny_model(workers["trainer"]["command"][2])
    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, cmd: list[str], env=None) -> None:
        out = open(logs / f"{name}.log", "w")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def tail(name: str) -> str:
        return (logs / f"{name}.log").read_text()[-3000:]

    try:
        for svc in sorted(host.ports, key=lambda s: "--replicaof" in services[s]["command"]):
            start(svc, host.redis_command(svc))
            wait_for(lambda s=svc: redis_up(host.ports[s]), 30, f"{svc} up")
        primary = redis.Redis(port=int(host.ports["redis"]))
        for svc, spec in workers.items():
            for i in range(1, spec.get("deploy", {}).get("replicas", 1) + 1):
                start(f"{svc}#{i}", astraflow_args(spec["command"]), host.env(svc, i))

        def versions() -> int:
            found = [k.decode().rsplit(":", 1)[1] for k in primary.scan_iter(keys.weights("policy", "*"))]
            return max([int(v) for v in found if v.isdigit()], default=0)

        def probe(*names: str, extra=()) -> list[tuple[int, str]]:
            return healthchecks([(workers[n.split("#")[0]], host.env(*n.split("#"))) for n in names], *extra)

        def all_ready(names: list[str]) -> list[tuple[int, str]] | None:
            results = probe(*names)
            return results if all(rc == 0 for rc, _ in results) else None

        def dead(name: str, extra: tuple[str, ...]) -> tuple[int, str] | None:
            (result,) = probe(name, extra=extra)
            return result if result[0] else None

        wait_for(lambda: versions() >= 2, 240, f"2 versions; trainer log:\n{tail('trainer#1')}")
        running = [name for name in procs if name.split("#")[0] in workers]
        ready = wait_for(lambda: all_ready(running), 60, "every worker ready")
        assert all(out.startswith("ready:") for _, out in ready), ready

        # A dataflow replica killed: its probe says so, and the run goes on with the other one.
        os.kill(procs["dataflow#2"].pid, signal.SIGKILL)
        procs["dataflow#2"].wait()
        live = ("--live", "--max-idle-s", "3")
        _, out = wait_for(lambda: dead("dataflow#2", live), 30, "dataflow-2 unhealthy")
        assert "dataflow-2 last read rollouts" in out, out
        assert probe("dataflow#1", extra=live)[0][0] == 0
        seen = versions()
        wait_for(lambda: versions() > seen, 120, f"training goes on; trainer log:\n{tail('trainer#1')}")

        # Region b's workers took part, beside region b's Redis, a replica of the primary with the run.
        consumers = {c["name"].decode() for c in primary.xinfo_consumers(keys.prompts, "raas")}
        assert {"raas-a1", "raas-a2", "raas-b1", "raas-b2"} <= consumers, consumers
        replica = redis.Redis(port=int(host.ports["redis-replica-b"]))
        assert replica.info("replication")["role"] == "slave" and replica.exists(keys.identity)

        for name, proc in procs.items():
            if name.split("#")[0] in workers and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            if name.split("#")[0] in workers:
                proc.wait(timeout=90)
        url = f"redis://127.0.0.1:{host.ports['redis']}/0"
        ledger = subprocess.run(
            [*ASTRAFLOW, "ledger", "--run", run, "--redis", url], cwd=ROOT, capture_output=True, text=True
        )
        assert ledger.returncode == 0 and "balanced" in ledger.stdout, ledger.stdout + ledger.stderr
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --- Kubernetes --------------------------------------------------------------------------------------------

K8S_VERSION = "1.30"


def k8s_docs() -> list[dict]:
    """Every resource the kustomization lists; it lists every manifest of the folder."""
    folder = DEPLOY / "k8s"
    listed = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")
    return [d for name in listed for d in yaml.safe_load_all((folder / name).read_text())]


def containers(docs: list[dict]):
    """(resource, container) of every pod template."""
    for d in docs:
        spec = d.get("spec", {})
        pod = spec.get("jobTemplate", {}).get("spec", spec).get("template", {}).get("spec")
        for c in (pod or {}).get("containers", []):
            yield d, c


def container_env(docs: list[dict], c: dict) -> tuple[dict[str, str], dict[str, str]]:
    """The container's environment (secrets as `<secret>/<key>`, the pod's IP as 10.0.0.7, `$(VAR)`
    expanded as Kubernetes does), and the Secret key each variable comes from."""
    config = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = {k: v for ref in c.get("envFrom", []) for k, v in config[ref["configMapRef"]["name"]].items()}
    from_secret = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            from_secret[e["name"]] = ref["secretKeyRef"]["key"]
            env[e["name"]] = f"{ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']}"
        elif "fieldRef" in ref:
            env[e["name"]] = "10.0.0.7"
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env, from_secret


def test_the_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = k8s_docs()
    for d in docs:
        if d["apiVersion"] != "keda.sh/v1alpha1":  # a CRD: checked against what it targets below
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    raas = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "raas")
    wrong = yaml.safe_load(yaml.safe_dump(raas))
    wrong["spec"]["template"]["spec"]["containers"][0]["comand"] = ["astraflow", "raas"]
    with pytest.raises(kubernetes_validate.ValidationError):  # a misspelt field does not pass
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)


def test_keda_scales_the_raas_deployment_on_the_runs_needed_workers_gauge():
    docs = k8s_docs()
    run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    target = scaled["spec"]["scaleTargetRef"]["name"]
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == target)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["command"][1] == "raas"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    metric = re.search(r"(\w+)\{run=\"([^\"]+)\"\}", trigger["metadata"]["query"])
    assert metric.group(2) == run and float(trigger["metadata"]["threshold"]) == 1.0
    try:  # the exporter (`astraflow scale --serve`) lands with issue 13's item 5
        from astraflow.launch.scaling import GAUGES
    except ImportError:
        GAUGES = {"astraflow_raas_needed": ""}
    assert metric.group(1) in GAUGES
    exporter = next(c for _, c in containers(docs) if c["command"][1:2] == ["scale"])
    assert exporter["command"][exporter["command"].index("--serve") + 1] == str(
        exporter["ports"][0]["containerPort"]
    )


@pytest.mark.slow
def test_every_container_command_and_probe_is_one_astraflow_runs_under_its_roles_user():
    docs = k8s_docs()
    run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
    known = set(_parser()._subparsers._group_actions[0].choices)  # the CLI's commands
    checked = []
    for d, c in containers(docs):
        cmd = c.get("command", [])
        if cmd[:1] != ["astraflow"]:
            continue
        env, from_secret = container_env(docs, c)
        if cmd[1] in ROLES:  # a worker: its role's user and password, probes of its own role
            assert env["ASTRAFLOW_REDIS__USERNAME"] == acl.user_name(run, cmd[1])
            assert from_secret["ASTRAFLOW_REDIS__PASSWORD"] == cmd[1]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c:
                    probe = c[kind]["exec"]["command"]
                    assert probe[:2] == ["astraflow", "health"] and probe[probe.index("--role") + 1] == cmd[1]
                    _parser().parse_args(probe[1:])
        elif "ASTRAFLOW_REDIS__USERNAME" in env:
            role = from_secret["ASTRAFLOW_REDIS__PASSWORD"]
            assert env["ASTRAFLOW_REDIS__USERNAME"] == acl.user_name(run, role) and role in acl.ROLES
        if cmd[1] not in known:
            assert cmd[1] == "scale", cmd  # `astraflow scale` lands with issue 13's item 5
            continue
        _parser().parse_args(cmd[1:])
        recipe = next(a for a in cmd[2:] if a.endswith(".yaml"))
        out = subprocess.run(
            [*ASTRAFLOW, "config", recipe],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        assert yaml.safe_load(out.stdout)["run"]["name"] == run
        checked.append(d["metadata"]["name"])
    assert {"dataflow", "trainer", "raas"} <= set(checked)


# --- Slurm -------------------------------------------------------------------------------------------------

SBATCH = DEPLOY / "slurm" / "astraflow.sbatch"
# What the script's variables hold on a cluster, for `astraflow config`.
SBATCH_ENV = {
    "ASTRAFLOW_RUN__NAME": "addition",
    "ASTRAFLOW_RUN__DIR": "/shared/runs/slurm-addition/run",
    "ASTRAFLOW_REDIS__URL": "redis://node001:6379/0",
    "ASTRAFLOW_REDIS__PASSWORD": "from-the-password-file",
    "ASTRAFLOW_WEIGHTS__HOST": "node002",
    "ASTRAFLOW_RAAS__ID": "raas-0",
}


def test_the_sbatch_script_parses_and_its_commands_pass_astraflow_config():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    script = SBATCH.read_text()
    recipe = re.search(r"RECIPE=\$\{1:-([^}]+)\}", script).group(1)
    assert set(re.findall(r"\b(ASTRAFLOW_\w+)=", script)) <= set(SBATCH_ENV)
    assert "af:{$ASTRAFLOW_RUN__NAME}:run" in script and Keys("x").identity == "af:{x}:run"
    found = re.findall(r'astraflow (\w+) "\$(?:RECIPE|0)"([^>\n\']*)', script)
    assert {sub for sub, _ in found} == {"trainer", "dataflow", "raas", "health"}, found
    for sub, rest in found:
        rest = rest.replace('"${RESUME[@]}"', "--resume").replace('"$@"', "--resume").split()
        _parser().parse_args([sub, recipe, *rest])
    out = subprocess.run(
        [*ASTRAFLOW, "config", recipe],
        cwd=ROOT,
        env={**os.environ, **SBATCH_ENV},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    settings = yaml.safe_load(out.stdout)
    assert settings["run"]["dir"] == SBATCH_ENV["ASTRAFLOW_RUN__DIR"]  # checkpoints on shared storage


def start_redis(tmp: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    tmp.mkdir()
    cmd = ["redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    wait_for(lambda: redis_up_as(port, "default", args[args.index("--requirepass") + 1]), 30, "redis up")
    return proc, port


def redis_up_as(port: str, user: str, password: str) -> bool:
    try:
        return redis.Redis(port=int(port), username=user, password=password).ping()
    except redis.ConnectionError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_acl_job_installs_users_under_which_every_workers_probe_runs(tmp_path):
    """The `redis-acl` Job's command, run as a local process against a primary and a replica with the
    manifests' admin password: each role's user exists on both, and each worker's readiness probe,
    run under that user, gets as far as the worker itself (no NOPERM)."""
    if not shutil.which("redis-server"):
        (pytest.fail if os.environ.get("CI") else pytest.skip)("no redis-server (7.x) on PATH")
    docs = k8s_docs()
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    admin = secrets["astraflow-redis-admin"]["password"]
    auth = ("--requirepass", admin, "--masterauth", admin)
    procs = []
    try:
        primary, port = start_redis(tmp_path / "primary", *auth)
        procs.append(primary)
        replica, replica_port = start_redis(tmp_path / "replica", *auth, "--replicaof", "127.0.0.1", port)
        procs.append(replica)

        def local(value: str) -> str:
            value = value.replace("redis-replica:6379", f"127.0.0.1:{replica_port}")
            return value.replace("redis:6379", f"127.0.0.1:{port}")

        def run_env(c: dict) -> dict[str, str]:
            env, _ = container_env(docs, c)
            for k, v in env.items():  # the Secrets' values, as Kubernetes mounts them
                name, _, key = v.partition("/")
                env[k] = secrets[name][key] if name in secrets else local(v)
            path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `astraflow` on PATH
            return {**os.environ, **env, "PATH": path}

        (job,) = [c for d, c in containers(docs) if d["kind"] == "Job"]
        cmd = [*job["command"], *[local(a) for a in job["args"]]]
        out = subprocess.run(cmd, cwd=ROOT, env=run_env(job), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
        users = secrets["astraflow-redis-users"]
        for role in acl.ROLES:
            for p in (port, replica_port):  # ACL users are not replicated: the Job installs them on both
                client = redis.Redis(port=int(p), protocol=2)  # AUTH on a fresh connection
                assert client.execute_command("AUTH", acl.user_name(run, role), users[role])

        # The run exists (its identity and groups), no worker yet: each probe says which one it misses.
        root = redis.Redis(port=int(port), password=admin)
        keys = Keys(run)
        root.hset(keys.identity, mapping={"nonce": "n", "created": "1"})
        for stream, group in keys.grouped_streams(["policy"]).items():
            root.xgroup_create(stream, group, id="0", mkstream=True)
        for _, c in containers(docs):
            if c["command"][1:2] and c["command"][1] in ROLES:
                probe = astraflow_args(c["readinessProbe"]["exec"]["command"])
                out = subprocess.run(probe, cwd=ROOT, env=run_env(c), capture_output=True, text=True)
                assert out.returncode == 1, out.stdout + out.stderr
                assert out.stdout.startswith(f"unhealthy: no consumer {c['command'][1]}-"), out.stdout
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

"""deploy/ without Docker or Slurm: every compose service run as a local process (hostnames mapped to
127.0.0.1, ports to free ones, volumes and secrets to temp dirs) trains, each worker under its own Redis
user that the one-shot `redis-acl` installed, and balances its ledger, and `astraflow health` tells a live
worker from a killed one; the sbatch script parses and its commands pass `astraflow config`.

No Docker daemon exists on these machines: a container is emulated by its command, its environment and
its hostname (a replica's own hostname shows as its own consumer id)."""

import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from astraflow.cli import _parser
from astraflow.streams import Keys, acl_users
from astraflow.streams.connection import credentials
from astraflow.streams.settings import RedisSettings
from tests.e2e.deploy_helpers import (
    DEPLOY,
    ROOT,
    astraflow_args,
    effective_settings,
    free_port,
    redis_up,
    wait_for,
)
from tests.redis7 import system_redis

pytestmark = [pytest.mark.e2e]

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
    "ASTRAFLOW_EVAL__EVERY": "0",  # deployment mechanics here; evaluation has its own tests
}


# --- compose ---------------------------------------------------------------------------------------------


SECRETS = "/run/secrets/"  # where a container finds the compose secrets it lists


def interpolated(node):
    """`node` as compose reads it: `$$` is a `$`; the shipped files use no host variable (`$VAR`)."""
    if isinstance(node, str):
        parts = node.split("$$")
        assert not any("$" in part for part in parts), node
        return "$".join(parts)
    if isinstance(node, dict):
        return {k: interpolated(v) for k, v in node.items()}
    return [interpolated(v) for v in node] if isinstance(node, list) else node


def compose_section(section: str, *names: str) -> dict[str, dict]:
    """A top-level section (`services`, `secrets`) of `docker compose -f A -f B`: later files add entries
    or override their keys."""
    merged: dict[str, dict] = {}
    for name in names:
        doc = interpolated(yaml.safe_load((DEPLOY / "compose" / name).read_text()))
        for key, spec in (doc.get(section) or {}).items():
            merged[key] = {**merged.get(key, {}), **spec}
    return merged


def compose_services(*names: str) -> dict[str, dict]:
    return compose_section("services", *names)


def mounted(spec: dict) -> dict[str, str]:
    """The secrets a service lists: the name it finds each under in /run/secrets -> the secret."""
    found = {}
    for s in spec.get("secrets", []):
        source, target = (s, s) if isinstance(s, str) else (s["source"], s.get("target", s["source"]))
        found[target] = source
    return found


class Host:
    """This machine standing in for the compose network: service names resolve to 127.0.0.1, each Redis
    service's port is a free local one, each container's volumes are directories of `tmp` and its
    /run/secrets holds the secrets it lists, each file made once with a password of its own (as
    deploy/README.md has them made). On PATH: the images' `astraflow`, `redis-server` and `redis-cli`, and
    the Redis image's entrypoint (which only drops to the user `redis` before it runs its arguments)."""

    def __init__(self, services: dict[str, dict], secret_files: dict[str, dict], tmp: Path) -> None:
        self.services, self.tmp = services, tmp
        self.ports = {s: free_port() for s, spec in services.items() if spec["image"].startswith("redis")}
        self.passwords = {name: secrets.token_hex(24) for name in secret_files}
        self.bin = tmp / "bin"
        self.bin.mkdir()
        server = Path(system_redis())
        for tool in ("redis-server", "redis-cli"):
            (self.bin / tool).symlink_to(server.with_name(tool))
        shims = {
            "docker-entrypoint.sh": 'exec "$@"',
            "astraflow": f'exec {shlex.quote(sys.executable)} -m astraflow.cli "$@"',
        }
        for name, line in shims.items():
            (self.bin / name).write_text(f"#!/bin/sh\n{line}\n")
            (self.bin / name).chmod(0o755)

    def secrets_dir(self, container: str) -> Path:
        """The container's /run/secrets: one file per secret its service lists, under its target name."""
        folder = self.tmp / container / SECRETS.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        for target, source in mounted(self.services[container.split("#")[0]]).items():
            if not (folder / target).exists():  # (made once: a process may be reading it)
                (folder / target).write_text(self.passwords[source] + "\n")
        return folder

    def shell(self, script: str, container: str) -> str:
        """A shell script of the container (an entrypoint, a command, a healthcheck) as run here."""
        script = script.replace(SECRETS, f"{self.secrets_dir(container)}/")
        port = self.ports.get(container.split("#")[0])
        return script.replace(f"-p {REDIS_PORT}", f"-p {port}") if port else script

    def text(self, value: str, container: str) -> str:
        for svc, port in self.ports.items():
            value = value.replace(f"{svc}:{REDIS_PORT}", f"127.0.0.1:{port}")
        if value.startswith(SECRETS):
            return str(self.secrets_dir(container) / value.removeprefix(SECRETS))
        for volume in self.services[container.rsplit("#", 1)[0]].get("volumes", []):
            target = volume.split(":", 1)[1]
            if value == target or value.startswith(target + "/"):
                return str(self.tmp / container / value.lstrip("/"))
        return value

    def redis_command(self, svc: str) -> list[str]:
        out, args = self.services[svc]["command"][:1], self.services[svc]["command"][1:]
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
        entrypoint = [self.shell(a, svc) for a in self.services[svc].get("entrypoint", [])]
        return [*entrypoint, *out, "--bind", "127.0.0.1"]

    def redis_healthy(self, svc: str) -> bool:
        """The Redis service's own healthcheck passes."""
        kind, script = self.services[svc]["healthcheck"]["test"]
        assert kind == "CMD-SHELL", kind
        cmd = ["sh", "-c", self.shell(script, svc)]
        return subprocess.run(cmd, env=self.env_path(os.environ), capture_output=True).returncode == 0

    def env_path(self, env) -> dict[str, str]:
        return {**env, "PATH": f"{self.bin}:{os.environ['PATH']}"}

    def env(self, svc: str, replica: int | str) -> dict[str, str]:
        name = f"{svc}#{replica}"
        env = {k: self.text(str(v), name) for k, v in self.services[svc].get("environment", {}).items()}
        env.update({k: "127.0.0.1" for k, v in env.items() if k.endswith("__HOST") and v in self.services})
        if self.services[svc].get("deploy", {}).get("replicas", 1) > 1:  # each container's own hostname
            env[f"ASTRAFLOW_{svc.upper()}__ID"] = f"{svc}-{replica}"
        return self.env_path({**os.environ, **QUICK, **env})


def prebuild_tiny_model(recipe: str, quick: dict[str, str] = QUICK) -> None:
    """Each container builds the recipe's tiny model in its own directory; processes sharing this
    checkout would build it in one directory at once, so it is built once first."""
    code = (
        "from astraflow.settings_load import load_settings as load\n"
        f"from astraflow.launch.tiny_cache import build_tiny\nbuild_tiny(load({recipe!r}))"
    )
    cmd, env = [sys.executable, "-c", code], {**os.environ, **quick}
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
    """Every worker runs as its own Redis user, which the one-shot `redis-acl` installed on the primary and
    the replica first, with its own password file and never the admin's; a RaaS's user is refused another
    RaaS's name and the dead letters."""
    system_redis()  # the compose file's Redis services, run as local processes
    files = ("compose.yaml", "compose.two-region.yaml")
    services = compose_services(*files)
    host = Host(services, compose_section("secrets", *files), tmp_path)
    one_shot = [s for s, spec in services.items() if spec.get("restart") == "on-failure"]
    on_demand = [s for s, spec in services.items() if "profiles" in spec]  # the operator's tools
    workers = {s: spec for s, spec in services.items() if s not in {*host.ports, *one_shot, *on_demand}}
    run = next(iter(workers.values()))["environment"]["ASTRAFLOW_RUN__NAME"]
    keys = Keys(run)
    for svc in [*workers, *on_demand]:  # its role's user, a RaaS its own: the one password file it mounts
        spec, env = services[svc], services[svc]["environment"]
        role = spec["command"][1] if svc in workers else "observer"
        label = f"raas/{env['ASTRAFLOW_RAAS__ID']}" if role == "raas" else role
        assert env["ASTRAFLOW_REDIS__USERNAME"] == acl_users.user_name(run, label), svc
        assert env["ASTRAFLOW_REDIS__PASSWORD_FILE"] == f"{SECRETS}redis-password", svc
        assert mounted(spec) == {"redis-password": f"redis-{label.rpartition('/')[2]}"}, svc
        assert spec["depends_on"]["redis-acl"] == {"condition": "service_completed_successfully"}, svc
    prebuild_tiny_model(workers["trainer"]["command"][2])
    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, cmd: list[str], env=None) -> None:
        out = open(logs / f"{name}.log", "w")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def tail(name: str) -> str:
        return (logs / f"{name}.log").read_text()[-3000:]

    def as_worker(name: str) -> redis.Redis:
        """A client of the primary as the worker logs in: its user and its password file."""
        env = host.env(*name.split("#"))
        user, file = env.get("ASTRAFLOW_REDIS__USERNAME"), env.get("ASTRAFLOW_REDIS__PASSWORD_FILE")
        settings = RedisSettings(username=user, password_file=file)
        return redis.Redis(port=int(host.ports["redis"]), protocol=2, **credentials(settings))

    try:
        for svc in sorted(host.ports, key=lambda s: "--replicaof" in services[s]["command"]):
            start(svc, host.redis_command(svc), host.env_path(os.environ))
            wait_for(lambda s=svc: host.redis_healthy(s), 30, f"{svc} healthy")
        admin = host.passwords["redis-admin"]
        primary = redis.Redis(port=int(host.ports["redis"]), password=admin)
        assert not redis_up(host.ports["redis"])  # (no password: refused)
        for svc in one_shot:  # before any worker, as `service_completed_successfully` orders it
            cmd = [host.shell(arg, f"{svc}#1") for arg in services[svc]["command"]]
            out = subprocess.run(cmd, cwd=ROOT, env=host.env(svc, 1), capture_output=True, text=True)
            assert out.returncode == 0, out.stdout + out.stderr
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
        assert probe("dataflow#1", extra=("--live",))[0][0] == 0  # within its own bound (a loaded machine)
        seen = versions()
        wait_for(lambda: versions() > seen, 120, f"training goes on; trainer log:\n{tail('trainer#1')}")

        # Region b's workers took part, beside region b's Redis, a replica of the primary with the run.
        consumers = {c["name"].decode() for c in primary.xinfo_consumers(keys.prompts, "raas")}
        assert {"raas-a1", "raas-a2", "raas-b1", "raas-b2"} <= consumers, consumers
        replica = redis.Redis(port=int(host.ports["redis-replica-b"]), password=admin)
        assert replica.info("replication")["role"] == "slave" and replica.exists(keys.identity)

        # No worker holds the admin password; a RaaS's user may not take another's name nor forge a dead
        # letter (the role's functions write those).
        for name, proc in procs.items():
            if name.split("#")[0] in workers and proc.poll() is None:
                assert admin.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes(), name
        thief = as_worker("raas-a1#1")
        assert thief.set(keys.consumer_name("raas:raas-a1"), "raas-a1", px=60_000, nx=True) is None  # its own
        for attack in (
            lambda: thief.set(keys.consumer_name("raas:raas-a2"), "me", px=5000),
            lambda: thief.xadd(keys.dead, {"uid": "forged"}),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attack()

        for name, proc in procs.items():
            if name.split("#")[0] in workers and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            if name.split("#")[0] in workers:
                proc.wait(timeout=90)
        (observer,) = on_demand
        cmd = astraflow_args(services[observer]["command"])  # `astraflow ledger`, as the read-only user
        ledger = subprocess.run(cmd, cwd=ROOT, env=host.env(observer, 1), capture_output=True, text=True)
        assert ledger.returncode == 0 and "balanced" in ledger.stdout, ledger.stdout + ledger.stderr
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


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
    "ASTRAFLOW_TRAINER__DEVICE": "cuda",
    "ASTRAFLOW_ENGINE__VLLM__TENSOR_PARALLEL_SIZE": "1",
}


def test_the_sbatch_script_parses_and_its_commands_pass_astraflow_config():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    script = SBATCH.read_text()
    recipe = re.search(r"RECIPE=\$\{1:-([^}]+)\}", script).group(1)
    assert set(re.findall(r"\b(ASTRAFLOW_\w+)=", script)) <= set(SBATCH_ENV)
    assert "af:{$ASTRAFLOW_RUN__NAME}:run" in script and Keys("x").identity == "af:{x}:run"
    found = re.findall(r'astraflow(?:\.cli)? (\w+) "\$(?:RECIPE|0)"([^>\n\'\\]*)', script)
    assert {sub for sub, _ in found} == {"trainer", "dataflow", "raas", "health"}, found
    for sub, rest in found:
        rest = rest.replace('"${RESUME[@]}"', "--resume").replace('"$@"', "--resume").split()
        _parser().parse_args([sub, recipe, *rest])
    settings = effective_settings(recipe, SBATCH_ENV)
    assert settings["run"]["dir"] == SBATCH_ENV["ASTRAFLOW_RUN__DIR"]  # checkpoints on shared storage
    # GPU nodes: the job asks for GPUs; the trainer runs under torchrun, a rank per GPU of its step's
    # gres; each RaaS task gets its engine's GPUs.
    assert re.search(r"^#SBATCH --gres=gpu:(\d+)$", script, re.M)
    trainer = next(line for line in script.split("srun ")[1:] if " trainer " in line)
    assert '--gres=gpu:"$TRAINER_GPUS"' in trainer
    assert 'torchrun --standalone --nproc_per_node "$TRAINER_GPUS" -m astraflow.cli trainer' in trainer
    raas = next(line for line in script.split("srun ")[1:] if " raas " in line)
    assert '--gpus-per-task="$ENGINE_GPUS"' in raas

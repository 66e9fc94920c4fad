"""deploy/k8s without a cluster: the manifests validate against the Kubernetes schemas, name what the
code names (users, roles, the KEDA gauge), give each RaaS pod a user and a password of its own, their
commands pass `astraflow config`, and the ACL Job, run as a local process, installs users under which every
worker's probe runs, and under which no RaaS can take another's name."""

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import yaml

from astraflow.cli import _parser
from astraflow.ops.health import ROLES
from astraflow.ops.scale import GAUGES
from astraflow.streams import Keys, acl, acl_users
from astraflow.streams.connection import credentials
from astraflow.streams.keys import GROUP_RAAS
from astraflow.streams.settings import RedisSettings
from tests.e2e import deploy_helpers as deploy
from tests.redis7 import system_redis

pytestmark = [pytest.mark.e2e]


K8S_VERSION = "1.30"


def k8s_docs() -> list[dict]:
    """Every resource the kustomization lists; it lists every manifest of the folder."""
    folder = deploy.DEPLOY / "k8s"
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


def expand(value: str, env: dict[str, str]) -> str:
    """`$(VAR)` in `value` replaced from `env`, as Kubernetes expands env values and `subPathExpr`."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def container_env(docs: list[dict], c: dict, pod: str = "pod-0") -> tuple[dict[str, str], dict[str, str]]:
    """The container's environment in pod `pod` (secrets as `<secret>/<key>`, the pod's name as `pod`, its
    IP as 10.0.0.7, `$(VAR)` expanded as Kubernetes does), and the Secret key each variable comes from."""
    config = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = {k: v for ref in c.get("envFrom", []) for k, v in config[ref["configMapRef"]["name"]].items()}
    from_secret = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            from_secret[e["name"]] = ref["secretKeyRef"]["key"]
            env[e["name"]] = f"{ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']}"
        elif "fieldRef" in ref:
            env[e["name"]] = pod if ref["fieldRef"]["fieldPath"] == "metadata.name" else "10.0.0.7"
        else:
            env[e["name"]] = expand(e["value"], env)
    return env, from_secret


def secret_mounts(d: dict, c: dict, env: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    """The container's Secret volumes: mount path -> (Secret, the key a `subPath`/`subPathExpr` picks, or
    None where the whole Secret is mounted)."""
    volumes = {v["name"]: v for v in d["spec"]["template"]["spec"].get("volumes", [])}
    found = {}
    for m in c.get("volumeMounts", []):
        if "secret" in volumes.get(m["name"], {}):  # (not a volumeClaimTemplate's)
            key = m.get("subPath") or expand(m.get("subPathExpr", ""), env) or None
            found[m["mountPath"]] = (volumes[m["name"]]["secret"]["secretName"], key)
    return found


def mount_secrets(docs: list[dict], d: dict, c: dict, env: dict[str, str], root: Path) -> dict[str, str]:
    """The container's Secret volumes as the kubelet mounts them, under `root`: a whole Secret as a folder
    of one file per key, one key (`subPathExpr`) as that file alone. Returns mount path -> local path."""
    secrets = {s["metadata"]["name"]: s["stringData"] for s in docs if s["kind"] == "Secret"}
    local = {}
    for path, (secret, key) in secret_mounts(d, c, env).items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if key is not None:
            target.write_text(secrets[secret][key])
        else:
            target.mkdir()
            for name, value in secrets[secret].items():
                (target / name).write_text(value)
        local[path] = str(target)
    return local


def pod_name(d: dict, ordinal: int = 0) -> str:
    """The name of a pod of `d`: a StatefulSet's pod `ordinal`, else a made-up one."""
    return (
        f"{d['metadata']['name']}-{ordinal}" if d["kind"] == "StatefulSet" else f"{d['metadata']['name']}-x1"
    )


def password_source(d: dict, c: dict, env: dict[str, str]) -> tuple[str, str]:
    """(Secret, key) the container's Redis password comes from: an env var, or a file it mounts."""
    ref = next((e["valueFrom"] for e in c.get("env", []) if e["name"] == "ASTRAFLOW_REDIS__PASSWORD"), None)
    if ref is not None:
        return ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
    secret, key = secret_mounts(d, c, env)[env["ASTRAFLOW_REDIS__PASSWORD_FILE"]]
    assert key is not None, "a worker mounts one key of a Secret, never all"
    return secret, key


def test_the_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = k8s_docs()
    for d in docs:
        if d["apiVersion"] != "keda.sh/v1alpha1":  # a CRD: checked against what it targets below
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    raas = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "raas")
    wrong = yaml.safe_load(yaml.safe_dump(raas))
    wrong["spec"]["template"]["spec"]["containers"][0]["comand"] = ["astraflow", "raas"]
    with pytest.raises(kubernetes_validate.ValidationError):  # a misspelt field does not pass
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)


def scaled_raas(docs: list[dict]) -> tuple[dict, dict]:
    """KEDA's ScaledObject and the resource it scales."""
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    ref = scaled["spec"]["scaleTargetRef"]
    (target,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (ref.get("kind"), ref["name"])]
    return scaled, target


def test_keda_scales_the_raas_statefulset_on_the_runs_needed_workers_gauge():
    docs = k8s_docs()
    run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
    scaled, target = scaled_raas(docs)
    assert target["spec"]["template"]["spec"]["containers"][0]["command"][1] == "raas"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    metric = re.search(r"(\w+)\{run=\"([^\"]+)\"\}", trigger["metadata"]["query"])
    assert metric.group(2) == run and float(trigger["metadata"]["threshold"]) == 1.0
    assert metric.group(1) in GAUGES
    exporter = next(c for _, c in containers(docs) if c["command"][1:2] == ["scale"])
    assert exporter["command"][exporter["command"].index("--serve") + 1] == str(
        exporter["ports"][0]["containerPort"]
    )


def test_every_raas_pod_up_to_kedas_maximum_has_a_user_and_a_password_of_its_own():
    """KEDA scales the StatefulSet `raas` (stable pod names raas-0, raas-1, ...) up to maxReplicaCount.
    The ACL Job installs one user per name up to it, from a Secret with one key per name; pod raas-N is
    RaaS `raas-N` under user af-RUN-raas-raas-N, and mounts its own key alone (the Job alone mounts them
    all, no worker has any other Secret in its environment)."""
    docs = k8s_docs()
    run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    scaled, sts = scaled_raas(docs)
    assert sts["kind"] == "StatefulSet" and sts["spec"]["podManagementPolicy"] == "Parallel"
    (service,) = [
        d for d in docs if (d["kind"], d["metadata"]["name"]) == ("Service", sts["spec"]["serviceName"])
    ]
    assert service["spec"]["clusterIP"] == "None"
    ids = [pod_name(sts, i) for i in range(scaled["spec"]["maxReplicaCount"])]
    (job,) = [c for d, c in containers(docs) if d["kind"] == "Job"]
    assert container_env(docs, job)[0]["RAAS_IDS"].split(",") == ids
    ((raas_d, raas),) = [(d, c) for d, c in containers(docs) if c.get("command", [])[1:2] == ["raas"]]
    assert raas_d is sts
    for ordinal in (0, 1, len(ids) - 1):
        pod = pod_name(sts, ordinal)
        env, from_secret = container_env(docs, raas, pod)
        assert env["ASTRAFLOW_RAAS__ID"] == pod == ids[ordinal] and not from_secret
        assert env["ASTRAFLOW_REDIS__USERNAME"] == acl_users.user_name(run, f"raas/{pod}")
        secret, key = password_source(sts, raas, env)
        assert key == pod and sorted(secrets[secret]) == sorted(ids)
        assert secret_mounts(sts, raas, env) == {env["ASTRAFLOW_REDIS__PASSWORD_FILE"]: (secret, pod)}
    for d, c in containers(docs):
        mounts = secret_mounts(d, c, container_env(docs, c, pod_name(d))[0])
        if c is job:
            assert list(mounts.values()) == [(secret, None)]
        elif c is not raas:
            assert secret not in {s for s, _ in mounts.values()}, d["metadata"]


@pytest.mark.slow
def test_every_container_command_and_probe_is_one_astraflow_runs_under_its_roles_user(tmp_path):
    docs = k8s_docs()
    run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
    known = set(_parser()._subparsers._group_actions[0].choices)  # the CLI's commands
    checked = []
    for d, c in containers(docs):
        cmd = c.get("command", [])
        if cmd[:1] != ["astraflow"]:
            continue
        pod = pod_name(d)
        env, from_secret = container_env(docs, c, pod)
        if cmd[1] in ROLES:  # a worker: its role's (a RaaS: its own) user and password, probes of its role
            label = f"raas/{pod}" if cmd[1] == "raas" else cmd[1]
            assert env["ASTRAFLOW_REDIS__USERNAME"] == acl_users.user_name(run, label)
            assert password_source(d, c, env)[1] == label.rpartition("/")[2]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c:
                    probe = c[kind]["exec"]["command"]
                    assert probe[:2] == ["astraflow", "health"] and probe[probe.index("--role") + 1] == cmd[1]
                    _parser().parse_args(probe[1:])
        elif "ASTRAFLOW_REDIS__USERNAME" in env:
            role = from_secret["ASTRAFLOW_REDIS__PASSWORD"]
            assert env["ASTRAFLOW_REDIS__USERNAME"] == acl_users.user_name(run, role) and role in acl.ROLES
        assert cmd[1] in known, cmd
        _parser().parse_args(cmd[1:])
        recipe = next(a for a in cmd[2:] if a.endswith(".yaml"))
        files = mount_secrets(docs, d, c, env, tmp_path / pod)
        effective = deploy.effective_settings(recipe, {k: files.get(v, v) for k, v in env.items()})
        assert effective["run"]["name"] == run
        if cmd[1] == "raas":
            assert effective["raas"]["id"] == pod and effective["redis"]["password_file"]
        checked.append(d["metadata"]["name"])
    assert {"dataflow", "trainer", "raas"} <= set(checked)


def start_redis(tmp: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = deploy.free_port()
    tmp.mkdir()
    cmd = [system_redis(), "--port", port, "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    deploy.wait_for(lambda: deploy.redis_up(port, args[args.index("--requirepass") + 1]), 30, "redis up")
    return proc, port


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_acl_job_installs_users_under_which_every_workers_probe_runs(tmp_path):
    """The `redis-acl` Job's command, run as a local process against a primary and a replica with the
    manifests' admin password and Secrets mounted as the pods mount them: each role's user, and one user
    per RaaS pod, exists on both (the shared RaaS user on neither), and each worker's readiness probe, run
    under its user - RaaS pods 0 and 1 each under its own, with its own password file - gets as far as the
    worker itself (no NOPERM). RaaS 1's user may hold its own name, and Redis refuses it RaaS 0's."""
    system_redis()
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

        def run_env(d: dict, c: dict, pod: str) -> tuple[dict[str, str], Callable[[str], str]]:
            """The container's environment in `pod` as this machine runs it (Secrets mounted under a
            folder of the pod's), and what maps one of its paths and hosts here."""
            env, _ = container_env(docs, c, pod)
            files = mount_secrets(docs, d, c, env, tmp_path / pod)
            (tmp_path / pod).mkdir(exist_ok=True)
            files["/tmp/passwords"] = str(tmp_path / pod / "passwords")

            def local(value: str) -> str:
                for path, here in files.items():
                    value = value.replace(path, here)
                value = value.replace("redis-replica:6379", f"127.0.0.1:{replica_port}")
                return value.replace("redis:6379", f"127.0.0.1:{port}")

            for k, v in env.items():  # the Secrets' values, as Kubernetes sets them
                name, _, key = v.partition("/")
                env[k] = secrets[name][key] if name in secrets else local(v)
            path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `astraflow` on PATH
            return {**os.environ, **env, "PATH": path}, local

        ((job_d, job),) = [(d, c) for d, c in containers(docs) if d["kind"] == "Job"]
        env, local = run_env(job_d, job, "redis-acl-x1")
        cmd = [*job["command"], *[local(a) for a in job["args"]]]
        out = subprocess.run(cmd, cwd=deploy.ROOT, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
        users, raas_users = secrets["astraflow-redis-users"], secrets["astraflow-redis-raas"]
        labels = acl_users.accounts(tuple(env["RAAS_IDS"].split(",")))
        assert len(labels) == len(raas_users) + len(acl.ROLES) - 1
        for p in (port, replica_port):  # ACL users are not replicated: the Job installs them on both
            assert (
                acl_users.user_name(run, "raas").encode()
                not in redis.Redis(port=int(p), password=admin).acl_users()
            )
            for label in labels:
                role, _, pod = label.partition("/")
                client = redis.Redis(port=int(p), protocol=2)  # AUTH on a fresh connection
                password = raas_users[pod] if pod else users[role]
                assert client.execute_command("AUTH", acl_users.user_name(run, label), password)

        # The run exists (its identity and groups), no worker yet: each probe says which one it misses.
        root = redis.Redis(port=int(port), password=admin)
        keys = Keys(run)
        root.hset(keys.identity, mapping={"nonce": "n", "created": "1"})
        for stream, group in keys.grouped_streams(["policy"]).items():
            root.xgroup_create(stream, group, id="0", mkstream=True)
        pods = {}
        for d, c in containers(docs):
            role = c["command"][1] if c["command"][1:2] else None
            if role in ROLES:
                for pod in (pod_name(d, 0), pod_name(d, 1)) if role == "raas" else (pod_name(d),):
                    pods[pod] = (role, c, run_env(d, c, pod)[0])
        assert {"raas-0", "raas-1"} <= set(pods)

        def as_pod(pod: str) -> redis.Redis:
            """A client of `pod`'s user, authenticated with the password its env and mount give it."""
            env = pods[pod][2]
            settings = RedisSettings(
                username=env["ASTRAFLOW_REDIS__USERNAME"], password_file=env["ASTRAFLOW_REDIS__PASSWORD_FILE"]
            )
            return redis.Redis(port=int(port), protocol=2, **credentials(settings))

        # RaaS 1, under its own user, joins its group: its probe finds it by its id, RaaS 0's does not
        root.xadd(
            keys.prompts, {"probe": "1"}
        )  # (a read that returns nothing makes no consumer on Redis 7.0)
        assert as_pod("raas-1").xreadgroup(GROUP_RAAS, "raas-1", {keys.prompts: ">"}, count=1)
        expected = {"raas-0": "no consumer raas-0 in group", "raas-1": "no heartbeat raas:raas-1"}
        for pod, (role, c, env) in pods.items():
            probe = deploy.astraflow_args(c["readinessProbe"]["exec"]["command"])
            out = subprocess.run(probe, cwd=deploy.ROOT, env=env, capture_output=True, text=True)
            assert out.returncode == 1, out.stdout + out.stderr
            assert out.stdout.startswith(f"unhealthy: {expected.get(pod, f'no consumer {role}-')}"), (
                out.stdout
            )

        thief = as_pod("raas-1")
        assert thief.set(keys.consumer_name("raas:raas-1"), "me", px=5000)  # its own name: allowed
        for attack in (
            lambda: thief.set(keys.consumer_name("raas:raas-0"), "me", px=5000),
            lambda: thief.hset(keys.raas("raas-0"), "slots", 1024),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attack()
        assert root.exists(keys.consumer_name("raas:raas-0"), keys.raas("raas-0")) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def served_gib(shape: str) -> float:
    """`S` of deploy/README.md: a shape's parameters, tied embeddings once, in bf16."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from astraflow.tiny import SHAPES

    d = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return sum(p.numel() for p in model.parameters()) * 2 / 2**30


def test_every_process_that_holds_weights_gets_dev_shm_sized_for_a_half_billion_model():
    """Weight buffers live in /dev/shm (`weights.dir`), and a container gets 64 MiB of it unless told
    otherwise. The shipped files size it by deploy/README.md's rule for Qwen2.5-0.5B's served bytes `S`:
    a RaaS 2.5 x S, a trainer 3.2 x S (they held 2 GiB, short of a 0.5B trainer's halves and eval copy)."""
    from tests.e2e.test_deploy import compose_services

    s = served_gib("qwen2.5-0.5b")
    assert 0.9 < s < 0.95
    need = {"raas": 2.5 * s, "trainer": 3.2 * s}
    docs = k8s_docs()
    for d, c in containers(docs):
        role = c.get("command", [])[1:2]
        if role in (["raas"], ["trainer"]):
            pod = d["spec"]["template"]["spec"]
            (mount,) = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert volume["emptyDir"]["medium"] == "Memory"
            assert float(volume["emptyDir"]["sizeLimit"].removesuffix("Gi")) >= need[role[0]], d["metadata"]
    services = compose_services("compose.yaml", "compose.two-region.yaml")
    holders = {
        s: spec["command"][1]
        for s, spec in services.items()
        if spec.get("command", [])[1:2] in (["raas"], ["trainer"])
    }
    assert len(holders) == 5
    for name, role in holders.items():
        assert float(services[name]["shm_size"].removesuffix("gb")) * 1e9 / 2**30 >= need[role], name


def test_every_raas_may_make_the_user_namespaces_its_tool_sandbox_needs():
    """The images run the RaaS as a non-root user: its tools are sandboxed in user namespaces
    (`isolation.mode`), which the runtime's default seccomp profile (unshare without CAP_SYS_ADMIN) and
    default AppArmor profile (mount) refuse. Every RaaS gets profiles that allow them, and keeps no
    capability and no privilege escalation of its own."""
    from tests.e2e.test_deploy import compose_services

    docs = k8s_docs()
    raas = [(d, c) for d, c in containers(docs) if c.get("command", [])[1:2] == ["raas"]]
    assert raas
    for d, c in raas:
        pod, own = d["spec"]["template"]["spec"], c["securityContext"]
        assert pod["securityContext"]["seccompProfile"]["type"] in ("Unconfined", "Localhost")
        assert own["appArmorProfile"]["type"] in ("Unconfined", "Localhost")
        assert own["capabilities"]["drop"] == ["ALL"] and own["allowPrivilegeEscalation"] is False
    services = compose_services("compose.yaml", "compose.two-region.yaml")
    workers = [spec for spec in services.values() if spec.get("command", [])[1:2] == ["raas"]]
    assert len(workers) == 4
    for spec in workers:
        assert {"seccomp=unconfined", "apparmor=unconfined"} <= set(spec["security_opt"])
        assert spec["cap_drop"] == ["ALL"]


def gpu_overlay() -> list[dict]:
    """The resources `kubectl apply -k deploy/k8s/gpu` makes: the base with the overlay's JSON 6902
    patches applied as kustomize applies them (`add` and `replace` of a path)."""
    import copy

    overlay = yaml.safe_load((deploy.DEPLOY / "k8s" / "gpu" / "kustomization.yaml").read_text())
    assert overlay["resources"] == [".."] and overlay["images"][0]["newTag"] == "gpu"
    docs = copy.deepcopy(k8s_docs())
    for patch in overlay["patches"]:
        target = patch["target"]
        (doc,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (target["kind"], target["name"])]
        for op in yaml.safe_load(patch["patch"]):
            *parents, last = [int(p) if p.isdigit() else p for p in op["path"].strip("/").split("/")]
            node = doc
            for p in parents:
                node = node[p]
            assert op["op"] in ("add", "replace") and (op["op"] == "add" or last in node), op
            node[last] = op["value"]
    return docs


def gib(quantity: str) -> float:
    return float(quantity.removesuffix("Gi"))


def test_the_gpu_overlay_requests_gpus_and_sizes_dev_shm_by_the_served_bytes():
    """On GPU nodes every RaaS and the trainer get a GPU (`nvidia.com/gpu`), and /dev/shm as deploy/README.md
    sizes it for the overlay's model, Qwen2.5-1.5B (RaaS 2.5 x S, trainer 3.2 x S), inside the pod's
    memory request (a memory emptyDir counts against it); the result still validates."""
    import kubernetes_validate

    s = served_gib("qwen2.5-1.5b")
    assert 2.8 < s < 2.95
    need = {"raas": 2.5 * s, "trainer": 3.2 * s}
    docs = gpu_overlay()
    holders = 0
    for d, c in containers(docs):
        role = c.get("command", [])[1:2]
        if role not in (["raas"], ["trainer"]):
            assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}), d["metadata"]
            continue
        holders += 1
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1, d["metadata"]
        pod = d["spec"]["template"]["spec"]
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        shm = gib(volume["emptyDir"]["sizeLimit"])
        assert need[role[0]] <= shm < gib(c["resources"]["requests"]["memory"]), d["metadata"]
    assert holders == 2

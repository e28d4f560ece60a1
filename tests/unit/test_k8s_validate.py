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
        # Broken image references (docker/distribution's grammar; sha256 digests only).
        (["k8s.image=convoy@sha256:abc"], "k8s.image", "an image reference"),
        (["k8s.image=IMG:1.0"], "k8s.image", "an image reference"),
        (["k8s.image=img:1.0:2"], "k8s.image", "an image reference"),
        (["k8s.image=img@md5:" + "a" * 32], "k8s.image", "a digest is sha256:"),
        (["k8s.image=img@sha256:" + "A" * 64], "k8s.image", "a digest is sha256:"),
        # What lands in labels, node selectors and resource limits.
        (
            ["scaling.use_gpu=true", "k8s.gpu_type=NVIDIA H100 80GB"],
            "k8s.gpu_type",
            "a label value",
        ),
        (["k8s.node_selector={pool: gpu nodes}"], "k8s.node_selector.pool", "a label value"),
        (["k8s.node_selector={'bad key!': x}"], "k8s.node_selector", "a label key"),
        (["k8s.labels={'bad key!': x}"], "k8s.labels", "a label key"),
        (["k8s.gpu_node_label=a b"], "k8s.gpu_node_label", "a label key"),
        (["k8s.gpu_resource=gpu"], "k8s.gpu_resource", "an extended resource name"),
        (["k8s.gpu_resource=kubernetes.io/gpu"], "k8s.gpu_resource", "extended resource"),
        (["k8s.extra_resources={efa: '4'}"], "k8s.extra_resources", "extended resource"),
        (["k8s.extra_resources={cpu: '4'}"], "k8s.extra_resources", "k8s.worker_cpu"),
        (["k8s.name=My_Run"], "k8s.name", "e.g. 'my-run'); set k8s.name to such a name"),
        # Storage that leaves the PVC, and a PVC over a system directory.
        (["run.storage_dir=../../etc"], "run.storage_dir", "no '..' out of it"),
        (["run.storage_dir=/mnt/shared/../etc"], "run.storage_dir", "no '..' out of it"),
        *[
            ([f"k8s.pvc_mount_path={p}"], "k8s.pvc_mount_path", "a system directory")
            for p in ["/", "/dev", "/etc", "/proc", "/sys", "/usr", "/bin", "/lib", "/usr/local"]
        ],
        (
            ["k8s.active_deadline_s=600", "k8s.pre_running_deadline_s=1200"],
            "k8s.active_deadline_s",
            "below k8s.pre_running_deadline_s 1200",
        ),
        (["k8s.tmp_size=big"], "k8s.tmp_size", "a Kubernetes quantity"),
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
    if kind == "raycluster" and "k8s.recipe_in=inline" in overrides:
        overrides = [o for o in overrides if o != "k8s.recipe_in=inline"]
    check_manifests(rendered(*overrides, kind=kind))


def test_a_raycluster_refuses_an_inline_recipe():
    with pytest.raises(ConfigError, match="a RayCluster has neither") as caught:
        rendered("k8s.recipe_in=inline", kind="raycluster")
    assert caught.value.field == "k8s.recipe_in"


@pytest.mark.parametrize(
    "image",
    [
        "localhost:5000/convoy:1.0",
        "registry.example.com:443/team/convoy:0.1.0-cuda",
        "convoy@sha256:" + "0" * 64,
        "registry.example.com/convoy:0.1.0@sha256:" + "a" * 64,
    ],
)
def test_valid_image_references_pass(image):
    rendered(f"k8s.image={image}")


def test_numbers_and_bools_in_string_maps_become_strings():
    job = load_job(
        REPO / "recipes" / "default.yaml",
        [
            *BASE,
            "k8s.env={OMP_NUM_THREADS: 4, DEBUG: true}",
            "k8s.extra_resources={vpc.amazonaws.com/efa: 4}",
            "k8s.node_selector={example.com/generation: 5}",
        ],
    )
    assert job.k8s.env == {"OMP_NUM_THREADS": "4", "DEBUG": "true"}
    assert job.k8s.extra_resources == {"vpc.amazonaws.com/efa": "4"}
    assert job.k8s.node_selector == {"example.com/generation": "5"}
    check_manifests(render(job))


def test_storage_dir_is_normalised_onto_the_pvc():
    manifests = rendered("run.storage_dir=runs/../team/./runs")
    recipe = manifests[0]["data"]["recipe.yaml"]
    assert "storage_dir: /mnt/shared/team/runs" in recipe


def test_tmp_has_a_size_limit():
    pod = rendered("k8s.tmp_size=10Gi")[1]["spec"]["rayClusterSpec"]["headGroupSpec"]
    volumes = {v["name"]: v for v in pod["template"]["spec"]["volumes"]}
    assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "10Gi"}


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


def test_a_toleration_typo_is_reported_once_for_every_pod():
    with pytest.raises(K8sError) as caught:
        check_manifests(rendered("k8s.tolerations=[{key: a, operatr: Exists}]"))
    lines = str(caught.value).splitlines()[1:]
    assert len(lines) == 1
    assert "operatr: unknown field (did you mean 'operator'?)" in lines[0]
    assert "the same in" in lines[0]


def test_the_recipe_in_the_configmap_is_checked():
    manifests = rendered()
    manifests[0]["data"]["recipe.yaml"] += "optim:\n  lr_typo: 1\n"
    problems = manifest_problems(manifests[0])
    assert len(problems) == 1
    assert problems[0].startswith("ConfigMap/digits-vit-recipe data.recipe.yaml: optim")
    manifests[0]["data"]["recipe.yaml"] = "model: [unclosed"
    assert "not valid YAML" in manifest_problems(manifests[0])[0]


def test_the_workload_must_mount_the_configmap_of_the_file():
    manifests = rendered()
    manifests[0]["metadata"]["name"] = "other-recipe"
    with pytest.raises(K8sError, match=r"ConfigMap .digits-vit-recipe. .* is not in this file"):
        check_manifests(manifests)


def test_the_entrypoint_must_read_a_key_the_configmap_has():
    manifests = rendered()
    manifests[0]["data"] = {"job.yaml": manifests[0]["data"]["recipe.yaml"]}
    with pytest.raises(K8sError, match=r"reads /etc/convoy/recipe\.yaml, but ConfigMap"):
        check_manifests(manifests)
    manifests = rendered(kind="pytorchjob")
    manifests[0]["data"] = {"job.yaml": manifests[0]["data"]["recipe.yaml"]}
    with pytest.raises(K8sError, match=r"Worker.template.spec.containers\[0\].command: reads"):
        check_manifests(manifests)


def test_worker_pods_must_hold_the_recipes_workers():
    manifests = rendered()  # default.yaml: 2 workers, 1 per pod
    group = manifests[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group.update(replicas=1, minReplicas=1, maxReplicas=1)
    with pytest.raises(K8sError, match=r"at most 1 worker pod.*needs 2, so training would wait"):
        check_manifests(manifests)
    manifests = rendered(kind="pytorchjob")
    manifests[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
    manifests[1]["spec"]["elasticPolicy"].update(minReplicas=1, maxReplicas=1)
    with pytest.raises(K8sError) as caught:
        check_manifests(manifests)
    assert "Worker.replicas: got 1; the recipe's scaling.num_workers 2" in str(caught.value)
    assert "elasticPolicy.maxReplicas: got 1" in str(caught.value)


def test_an_elastic_rayjob_without_autoscaling_has_max_replicas():
    manifests = rendered("scaling.num_workers=[2, 4]", "data.batch_size=48")
    group = manifests[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 4


def test_a_bad_quantity_reads_as_a_quantity():
    rayjob = _rayjob()
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    head["containers"][0]["resources"]["limits"]["memory"] = "4 GB"
    problems = manifest_problems(rayjob)
    assert any("got '4 GB'; expected an integer or a quantity" in p for p in problems), problems
    assert not any("^(" in p for p in problems), problems


def test_no_manifests_and_a_recipe_are_refused():
    with pytest.raises(K8sError, match="no manifests"):
        check_manifests([])
    problems = manifest_problems({"model": {"name": "mlp"}, "data": {}})
    assert problems == [
        "kind: missing; this looks like a recipe, not a manifest; use convoy k8s render RECIPE "
        "(or convoy k8s submit RECIPE)"
    ]


def test_a_pytorchjob_is_checked_field_by_field():
    pytorchjob = rendered(kind="pytorchjob")[1]
    assert manifest_problems(pytorchjob) == []
    pytorchjob["spec"]["elasticPolicy"]["maxRestart"] = 1
    pytorchjob["spec"]["runPolicy"]["backoffLimit"] = "3"
    pod = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["nodeSelectr"] = {}
    pod["containers"][0]["resources"]["limits"]["cpu"] = "two"
    problems = manifest_problems(pytorchjob)
    assert (
        "spec.elasticPolicy.maxRestart: unknown field (did you mean 'maxRestarts'?)"
        in (problems[0])
    )
    assert "spec.runPolicy.backoffLimit: got '3'; expected an integer" in problems
    assert any(
        p.startswith("spec.pytorchReplicaSpecs.Worker.template.spec.nodeSelectr: unknown field")
        for p in problems
    )
    assert any("limits.cpu: got 'two'; expected an integer or a quantity" in p for p in problems)

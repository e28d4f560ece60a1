"""The initial weights do not depend on the layout (gloo, fp32).

Models that say how each module is initialized (``init_module``: every built-in, and ``hf``
from a config) are built on the meta device, laid out by the strategy, and only then filled,
each rank its own part (``convoy.models.init``). The full state each layout starts from,
gathered whole, is the one ``single`` starts from, bit for bit: ``ddp``, ``fsdp`` (FSDP1,
filled unit by unit as it wraps) and ``fsdp2`` on 2 ranks; ``fsdp2`` on 4, ``hsdp`` 2 x 2 and
``fsdp2`` + tensor parallel 2. One launch per world size serves every layout and model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.models.init import InitialWeights, parameters_on_meta
from convoy.models.registry import build_initial, build_skeleton
from convoy.testing import initial_full_states, run_on_gloo
from hf_fixtures import LLAMA_TINY, hf_overrides

pytestmark = pytest.mark.distributed
SHAPE = {"vocab_size": 256}
MODELS = {
    "gpt": ["model.name=gpt_tiny", "model.kwargs.depth=2"],
    "llama": hf_overrides(LLAMA_TINY),
}
LAYOUTS = {
    2: [("ddp", ()), ("fsdp", ()), ("fsdp2", ())],
    4: [("fsdp2", ()), ("hsdp", ("strategy.shard_size=2",)), ("fsdp2", ("strategy.tp_size=2",))],
}


def layout_job(tmp: Path, model: str, strategy: str, workers: int, *extra: str) -> Job:
    return load_job(
        None,
        [
            *MODELS[model],
            "task.name=language_modeling",
            "data.name=text",
            "data.tokenizer=bytes",
            f"strategy.name={strategy}",
            f"scaling.num_workers={workers}",
            "run.seed=7",
            f"run.storage_dir={tmp}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def single_states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("single")
    jobs = {model: layout_job(tmp, model, "single", 1) for model in MODELS}
    states = initial_full_states(WorkerContext(), list(jobs.values()), SHAPE)
    return {model: found["state"] for model, found in zip(jobs, states, strict=True)}


@pytest.mark.parametrize("workers", sorted(LAYOUTS))
def test_every_layout_starts_from_singles_weights(
    workers: int, single_states: dict[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    cases = [(m, s, x) for m in MODELS for s, x in LAYOUTS[workers]]
    jobs = [layout_job(tmp_path, m, s, workers, *x) for m, s, x in cases]
    states = run_on_gloo(initial_full_states, workers, jobs, SHAPE)[0]
    for (model, strategy, extra), found in zip(cases, states, strict=True):
        state = found["state"]
        reference = single_states[model]
        assert state.keys() == reference.keys(), (model, strategy, extra)
        different = [k for k in reference if not torch.equal(state[k], reference[k])]
        assert not different, f"{model} {strategy} {extra}: {different[:5]}"


def test_a_sharded_rank_never_holds_the_whole_model() -> None:
    """The meta skeleton holds no parameter memory, and filling is done one unit at a time:
    for gpt (``init_unit = "module"``) one module's own parameters, each module once."""
    model, weights = build_skeleton("gpt_tiny", {"depth": 3}, SHAPE, seed=0)
    assert weights is not None and all(p.is_meta for p in model.parameters())
    made: list[int] = []
    original = InitialWeights._make_unit

    def recording(self: InitialWeights, unit: nn.Module) -> dict:
        made.append(sum(p.numel() for p in unit.parameters() if not p.is_meta))
        values = original(self, unit)
        made[-1] = sum(v.numel() for m in values.values() for v in m.values())
        return values

    InitialWeights._make_unit = recording  # type: ignore[method-assign]
    try:
        weights.materialize(model, torch.device("cpu"))
        weights.fill(model)
    finally:
        InitialWeights._make_unit = original  # type: ignore[method-assign]
    seen: set[int] = set()
    owners = []  # modules holding a parameter no module before them holds (not the tied head)
    for module in model.modules():
        own = {id(p) for p in module.parameters(recurse=False)}
        if own - seen:
            owners.append(module)
        seen |= own
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in owners)
    assert len(made) == len(owners)  # each once
    assert max(made) == largest


def test_the_seed_and_the_names_decide_the_values() -> None:
    """Another seed, other weights; the same seed, the same, also when a block is wrapped
    (activation checkpointing renames it, not its values)."""

    def filled(seed: int, wrap: bool = False) -> dict[str, torch.Tensor]:
        model, weights = build_skeleton("gpt_tiny", {"depth": 2}, SHAPE, seed=seed)
        assert weights is not None
        if wrap:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            model.blocks[0] = checkpoint_wrapper(model.blocks[0])
        weights.materialize(model, torch.device("cpu"))
        weights.fill(model)
        return {
            k.replace("._checkpoint_wrapped_module", ""): v for k, v in model.state_dict().items()
        }

    first, again, wrapped, other = filled(1), filled(1), filled(1, wrap=True), filled(2)
    assert all(torch.equal(first[k], again[k]) and torch.equal(first[k], wrapped[k]) for k in first)
    assert not torch.equal(first["blocks.0.attn.q.weight"], other["blocks.0.attn.q.weight"])


class Unset(nn.Module):
    """A module whose parameter no init sets."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def init_module(self, module: nn.Module) -> None:
        pass


def test_a_parameter_nobody_sets_is_named() -> None:
    with parameters_on_meta():
        model = Unset()
    weights = InitialWeights(model, seed=0)
    weights.materialize(model, torch.device("cpu"))
    with pytest.raises(Exception, match="'scale' is set neither by"):
        weights.fill(model)


class Tiny(nn.Module):
    """A user's model with its own init in ``__init__`` and no ``init_module``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        nn.init.constant_(self.linear.weight, 0.5)


class TinyWithInit(Tiny):
    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)


def tiny() -> Tiny:
    return Tiny()


def tiny_loaded() -> TinyWithInit:
    """A factory that loads weights into a model that has ``init_module``."""
    model = TinyWithInit()
    model.load_state_dict({"linear.weight": torch.full((4, 4), 3.0), "linear.bias": torch.ones(4)})
    return model


@pytest.mark.parametrize(
    ("factory", "on_meta", "weight"),
    [
        ("test_initial_weights:tiny", False, 0.5),  # its __init__'s init is kept
        ("test_initial_weights:Tiny", False, 0.5),  # a class says so before it is built
        ("test_initial_weights:TinyWithInit", True, 0.5),
        ("test_initial_weights:tiny_loaded", False, 3.0),  # loaded weights are not dropped
    ],
)
def test_a_users_factory_builds_on_meta_only_where_it_says_how(
    factory: str, on_meta: bool, weight: float
) -> None:
    model, weights = build_skeleton(factory, {}, {}, seed=0)
    assert (weights is not None) == on_meta
    if weights is not None:
        weights.materialize(model, torch.device("cpu"))
        weights.fill(model)
    assert torch.equal(model.linear.weight, torch.full((4, 4), weight))


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama saved by transformers in bf16, in shards with their index, as the Hub ships it."""
    pytest.importorskip("transformers")
    from hf_fixtures import saved_llama

    folder = saved_llama(
        tmp_path_factory.mktemp("llama"), dtype=torch.bfloat16, max_shard_size="20KB"
    )
    assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 3
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def folder_job(tmp: Path, folder: Path, strategy: str, workers: int) -> Job:
    return layout_job(
        tmp, "gpt", strategy, workers, "model.name=hf", f"model.kwargs={{path: {folder}}}"
    )


def test_a_sharded_bf16_folder_loads_by_slice_as_transformers_loads_it(
    sharded_folder: Path, tmp_path: Path
) -> None:
    """fsdp2 x 2: each rank reads only its rows (about half the bytes), in fp32; the state
    gathered whole is transformers' own from_pretrained's, and so are the logits."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(sharded_folder), dtype=torch.float32, local_files_only=True
    ).eval()
    expected = {f"model.{k}": v for k, v in reference.state_dict().items()}
    shape = {"vocab_size": 320}
    job = folder_job(tmp_path, sharded_folder, "fsdp2", 2)
    found = run_on_gloo(initial_full_states, 2, [job], shape)[0][0]
    state, read = found["state"], found["bytes_read_per_rank"]
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    stored = sum(p.numel() * 2 for p in reference.parameters())  # bf16 on disk
    assert all(0.4 * stored < r < 0.6 * stored for r in read), (read, stored)
    model = build_initial("hf", {"path": str(sharded_folder)}, shape, seed=0).eval()
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens), reference(input_ids=tokens).logits, rtol=0, atol=0
        )


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing_shard", "lists model-00002-of-"),
        ("wrong_shape", "with shape"),
        ("bin_only", "not safetensors"),
    ],
)
def test_a_broken_folder_is_named_in_one_line(
    sharded_folder: Path, tmp_path: Path, damage: str, message: str
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from convoy.errors import ConfigError

    folder = tmp_path / "llama"
    shutil.copytree(sharded_folder, folder)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    if damage == "missing_shard":
        shards[1].unlink()
    elif damage == "wrong_shape":
        tensors = load_file(shards[0])
        name = next(iter(tensors))
        tensors[name] = torch.zeros(3, 5, dtype=tensors[name].dtype)
        save_file(tensors, shards[0], metadata={"format": "pt"})
    else:
        for shard in shards:
            shard.unlink()
        (folder / "model.safetensors.index.json").unlink()
        (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=message) as caught:
        build_skeleton("hf", {"path": str(folder)}, {"vocab_size": 320}, seed=0)
    assert "\n" not in str(caught.value) and "model.kwargs.path" in str(caught.value)


class ReadsItsWeights(TinyWithInit):
    """Reads a parameter's value in ``__init__``: cannot be built on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = float(self.linear.weight.sum().item())


def test_a_factory_that_cannot_build_on_meta_is_named_before_any_worker() -> None:
    from convoy.errors import ConfigError
    from convoy.models.registry import check_builds_on_meta

    with pytest.raises(ConfigError, match="built with its parameters on the meta device") as caught:
        check_builds_on_meta("test_initial_weights:ReadsItsWeights", {}, {})
    assert "\n" not in str(caught.value) and "model.name" in str(caught.value)
    check_builds_on_meta("test_initial_weights:tiny", {}, {})  # built for real: nothing to say

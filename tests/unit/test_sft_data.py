"""``data.name: sft``: rows shaped as TRL shapes them, rendered with a chat template, the loss
on the assistant turns only (masks from rendered prefixes, token by token against spans derived
by hand, for a Llama-3 and a ChatML / Qwen template); prompt/completion and text rows; packed
and padded rows (positions, boundary targets); what is counted; the one-line errors of bad
input; and the ray_data loader's columns for dict inputs."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from convoy.config import DataConfig, load_job
from convoy.data.base import Splits, collate
from convoy.data.chat import ChatEncoder
from convoy.data.packing import IGNORE_INDEX, best_fit
from convoy.data.registry import check_dataset, check_loaded, load_splits
from convoy.errors import ConfigError
from sft_fixtures import (
    CHATML_TAGGED,
    CONVERSATION,
    FAMILIES,
    LLAMA3_TAGGED,
    chat_tokenizer,
    conversations,
    write_jsonl,
)

pytest.importorskip("transformers", reason="the 'hf' extra is not installed")

SEQ_LEN = 160


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tokenizer folder per template family, and one with no chat template."""
    root = tmp_path_factory.mktemp("sft")
    return {
        "llama3": chat_tokenizer(root / "llama3", "llama3"),
        "chatml": chat_tokenizer(root / "chatml", "chatml"),
        "bare": chat_tokenizer(root / "bare", "chatml", with_template=False),
    }


def sft_cfg(folder: Path, path: Path, **kwargs: Any) -> DataConfig:
    return DataConfig(
        name="sft", path=str(path), tokenizer_path=str(folder), seq_len=SEQ_LEN, **kwargs
    )


def spans(ids: list[int], trained: list[bool]) -> list[list[int]]:
    """The runs of trained tokens, in order."""
    runs: list[list[int]] = []
    for index, (token, on) in enumerate(zip(ids, trained, strict=True)):
        if on and (not index or not trained[index - 1]):
            runs.append([])
        if on:
            runs[-1].append(token)
    return runs


# --- the trained tokens of a conversation -----------------------------------------------------


def by_hand(family: str) -> list[tuple[str, bool]]:
    """``CONVERSATION`` as the family's template writes it, piece by piece, each piece with
    whether it is trained: an assistant turn's content and its end-of-turn token."""
    pieces: list[tuple[str, bool]] = []
    end = FAMILIES[family]["end"]
    if family == "llama3":
        pieces.append(("<|begin_of_text|>", False))
    for message in CONVERSATION:
        role, content = message["role"], message["content"]
        header = (
            f"<|start_header_id|>{role}<|end_header_id|>\n\n"
            if family == "llama3"
            else f"<|im_start|>{role}\n"
        )
        trained = role == "assistant"
        pieces += [(header, False), (content, trained), (end, trained)]
        if family == "chatml":
            pieces.append(("\n", False))
    return pieces


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_the_trained_tokens_are_exactly_the_assistant_turns(
    family: str, folders: dict[str, Path]
) -> None:
    encoder = ChatEncoder(folders[family], None, "assistant")
    encoded = encoder.encode({"messages": CONVERSATION}, "row 0")
    pieces = by_hand(family)
    text = "".join(piece for piece, _ in pieces)
    assert encoder.tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == text
    hand = encoder.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded.ids == hand["input_ids"]
    # A token is trained where its characters lie in a trained piece.
    trained_chars = np.zeros(len(text), dtype=bool)
    at = 0
    for piece, trained in pieces:
        trained_chars[at : at + len(piece)] = trained
        at += len(piece)
    expected = [bool(trained_chars[start:stop].all()) for start, stop in hand["offset_mapping"]]
    assert encoded.trained == expected  # token by token
    end = FAMILIES[family]["end"]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    end_id = encoder.tokenizer.convert_tokens_to_ids(end)
    tokenize = encoder.tokenizer
    assert spans(encoded.ids, encoded.trained) == [
        tokenize(answer, add_special_tokens=False)["input_ids"] + [end_id] for answer in answers
    ]
    decoded = [encoder.tokenizer.decode(s) for s in spans(encoded.ids, encoded.trained)]
    assert decoded == [answer + end for answer in answers]


@pytest.mark.parametrize(
    ("family", "tagged"), [("llama3", LLAMA3_TAGGED), ("chatml", CHATML_TAGGED)]
)
def test_the_mask_does_not_depend_on_generation_tags_and_the_options_narrow_or_widen_it(
    family: str, tagged: str, folders: dict[str, Path]
) -> None:
    row = {"messages": CONVERSATION}
    own = ChatEncoder(folders[family], None, "assistant").encode(row, "row 0")
    named = ChatEncoder(folders[family], tagged, "assistant").encode(row, "row 0")
    assert named == own
    last = ChatEncoder(folders[family], None, "last_assistant").encode(row, "row 0")
    assert last.ids == own.ids
    assert spans(last.ids, last.trained) == spans(own.ids, own.trained)[1:]
    every = ChatEncoder(folders[family], None, "all").encode(row, "row 0")
    assert every.ids == own.ids and all(every.trained)


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_prompt_and_completion_rows(family: str, folders: dict[str, Path]) -> None:
    encoder = ChatEncoder(folders[family], None, "assistant")
    tokenizer, end = encoder.tokenizer, FAMILIES[family]["end"]
    # Message lists: the completion's assistant turn, as in the whole conversation.
    conversational = encoder.encode(
        {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3]}, "row 0"
    )
    whole = encoder.encode({"messages": CONVERSATION[:3]}, "row 1")
    assert conversational == whole
    # Few-shot turns inside the prompt are not trained: only the completion's.
    later = encoder.encode({"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}, "row 2")
    assert [tokenizer.decode(s) for s in spans(later.ids, later.trained)] == [
        CONVERSATION[4]["content"] + end
    ]
    # Strings: tokenized as the tokenizer does (BOS for Llama 3), EOS appended, the
    # completion trained.
    strings = encoder.encode({"prompt": "Count to three:", "completion": " one, two, three."}, "r")
    expected = tokenizer("Count to three: one, two, three." + end)["input_ids"]
    assert strings.ids == expected
    assert (strings.ids[0] == tokenizer.bos_token_id) == (family == "llama3")
    assert tokenizer.decode(spans(strings.ids, strings.trained)[0]) == " one, two, three." + end
    assert sum(strings.trained) == len(
        tokenizer(" one, two, three." + end, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_text_rows_train_every_token_with_eos(family: str, folders: dict[str, Path]) -> None:
    encoder = ChatEncoder(folders[family], None, "assistant")
    end = FAMILIES[family]["end"]
    text = encoder.encode({"text": "Waves fold into foam."}, "row 0")
    assert text.ids == encoder.tokenizer("Waves fold into foam." + end)["input_ids"]
    assert all(text.trained)
    already = encoder.encode({"text": "Waves fold into foam." + end}, "row 1")
    assert already == text  # EOS is not doubled


# --- rows of tokens: targets, positions, packing ----------------------------------------------


def mixed_rows() -> list[dict[str, Any]]:
    """Conversations, prompt/completion pairs, texts, and rows that train nothing."""
    rows = conversations(12)
    rows += [{"prompt": f"Count to {n}:", "completion": " one, two, three."} for n in range(4)]
    rows += [{"text": "Waves fold into foam; the gulls keep time."} for _ in range(4)]
    rows += [{"messages": CONVERSATION[:2]} for _ in range(2)]  # no assistant turn
    return rows


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    rows = mixed_rows()
    write_jsonl(root / "train.jsonl", rows[:18] + rows[20:])
    write_jsonl(root / "validation.jsonl", rows[18:20] + rows[:2])
    write_jsonl(root / "test-00000.jsonl", rows[12:16] + rows[2:4])
    return root


def samples_of(ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> list[Any]:
    """The samples of one row (where positions restart), each (ids, targets) as lists."""
    starts = [int(i) for i in torch.nonzero(positions == 0).flatten()] + [len(ids)]
    return [(ids[a:b].tolist(), targets[a:b].tolist()) for a, b in itertools.pairwise(starts)]


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_packed_rows_restart_positions_and_never_predict_the_next_sample(
    family: str, folders: dict[str, Path], mixed: Path
) -> None:
    packed = load_splits(sft_cfg(folders[family], mixed))
    padded = load_splits(sft_cfg(folders[family], mixed, packing=False))
    assert packed.shape["seq_len"] == SEQ_LEN and len(packed.train) < len(padded.train)
    pad = packed.meta["pad_id"]
    samples = packed.train.samples  # type: ignore[attr-defined]
    expected = [
        (samples.ids[a:b].tolist(), samples.targets[a:b].tolist())
        for a, b in itertools.pairwise(samples.starts.tolist())
    ]
    found, tails = [], 0
    for index in range(len(packed.train)):
        inputs, targets = packed.train[index]
        ids, positions = inputs["input_ids"], inputs["position_ids"]
        assert set(inputs) == {"input_ids", "position_ids"}
        assert all(
            t.dtype == torch.long and t.shape == (SEQ_LEN,) for t in (ids, positions, targets)
        )
        assert positions[0] == 0
        step = torch.diff(positions)
        assert bool(((step == 1) | (positions[1:] == 0)).all())  # restarts only at 0
        *real, last = samples_of(ids, positions, targets)
        if set(last[0]) == {pad} and set(last[1]) == {IGNORE_INDEX}:
            tails += 1  # the tail: a dummy sample of padding, positions from 0
        else:
            real.append(last)
        for sample_ids, sample_targets in real:
            assert sample_targets[-1] == IGNORE_INDEX  # never the next sample's first token
            for j, target in enumerate(sample_targets[:-1]):
                assert target in (IGNORE_INDEX, sample_ids[j + 1])
            found.append((sample_ids, sample_targets))
    assert sorted(found) == sorted(expected) and tails
    # Unpacked: one sample a row, padded, positions 0..T-1 through the padding.
    assert len(padded.train) == len(expected)
    for index, (sample_ids, sample_targets) in enumerate(expected):
        inputs, targets = padded.train[index]
        length = len(sample_ids)
        assert inputs["position_ids"].tolist() == list(range(SEQ_LEN))
        assert inputs["input_ids"].tolist() == sample_ids + [pad] * (SEQ_LEN - length)
        assert targets.tolist() == sample_targets + [IGNORE_INDEX] * (SEQ_LEN - length)
    # A batch is built whole, the same as item by item.
    batch = collate(packed.train.__getitems__([0, 1]))
    stacked = collate([packed.train[0], packed.train[1]])
    assert torch.equal(batch[1], stacked[1])
    assert all(torch.equal(batch[0][k], stacked[0][k]) for k in ("input_ids", "position_ids"))


def test_best_fit_fills_rows_longest_first() -> None:
    assert best_fit(np.array([5, 3, 8, 2, 2]), 10) == [[2, 3], [0, 1, 4]]
    rows = best_fit(np.array([6, 6, 6, 4, 4, 4]), 10)
    assert sorted(sorted(r) for r in rows) == [[0, 3], [1, 4], [2, 5]]


# --- counts and the driver's check ------------------------------------------------------------


def test_rows_left_out_or_cut_are_counted_and_reported(
    folders: dict[str, Path], mixed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    splits = load_splits(sft_cfg(folders["chatml"], mixed))
    train = splits.meta["sft"]["train"]
    assert train["rows"] == 20 and train["untrained"] == 2 and train["samples"] == 18
    assert [s for s in splits.skipped if s.startswith("sft train")] == [
        "sft train: train.jsonl line 19: no trained token",
        "sft train: train.jsonl line 20: no trained token",
    ]
    check_loaded(splits_cfg := sft_cfg(folders["chatml"], mixed), splits)
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        "convoy: data sft: train 18 of 20 rows (2 with no trained token left out)"
    )
    assert "\n" not in line and "; val 4 of 4 rows in " in line
    # Longer than seq_len (the 6 five-turn conversations of train): cut or left out, counted.
    short = 110
    cut = load_splits(splits_cfg.model_copy(update={"seq_len": short}))
    skip = load_splits(splits_cfg.model_copy(update={"seq_len": short, "long_rows": "skip"}))
    assert (cut.meta["sft"]["train"]["cut"], cut.meta["sft"]["train"]["samples"]) == (6, 18)
    assert skip.meta["sft"]["train"]["too_long"] == 6 and skip.meta["sft"]["train"]["samples"] == 12
    too_long = r"^sft train: train.jsonl line \d+: 1\d\d tokens, over data.seq_len 110$"
    assert sum(bool(re.search(too_long, s)) for s in skip.skipped) == 6
    assert all(len(cut.train[i][1]) == short for i in range(len(cut.train)))
    # Cut before its first answer, a conversation has nothing left to train.
    shorter = load_splits(splits_cfg.model_copy(update={"seq_len": 70}))
    assert shorter.meta["sft"]["train"]["untrained"] == 2 + 12
    assert (
        "sft train: train.jsonl line 1: no trained token left after the cut to data.seq_len 70"
        in shorter.skipped
    )


def test_a_split_with_nothing_to_train_stops_the_run_in_one_line(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    write_jsonl(tmp_path / "train.jsonl", conversations(4))
    write_jsonl(tmp_path / "val.jsonl", [{"messages": CONVERSATION[:2]}] * 3)
    write_jsonl(tmp_path / "test.jsonl", conversations(2))
    job = load_job(
        None,
        [
            "task.name=language_modeling",
            "model.name=gpt_tiny",
            "data.name=sft",
            f"data.path={tmp_path}",
            f"data.tokenizer_path={folders['chatml']}",
            f"data.seq_len={SEQ_LEN}",
        ],
    )
    from convoy.preflight import preflight

    with pytest.raises(
        ConfigError, match=r"^data.train_on: got 'assistant'; no row of the val split"
    ) as caught:
        preflight(job)
    assert "\n" not in str(caught.value) and "3 with no trained token left out" in str(caught.value)


def test_the_counts_land_in_the_runs_summary(folders: dict[str, Path], tmp_path: Path) -> None:
    """A run of one step (a one-layer gpt, in this process) on a train split with one row longer
    than seq_len (cut, kept) and one with no assistant turn (left out): its summary.json
    has each split's counts."""
    from convoy.distributed import WorkerContext
    from convoy.engine.loop import train
    from convoy.outputs import read_summary

    long_answer = {"role": "assistant", "content": "Paris, in France. " * 40}
    rows = [*conversations(3), {"messages": [*CONVERSATION[:2], long_answer]}]
    write_jsonl(tmp_path / "data" / "train.jsonl", [*rows, {"messages": CONVERSATION[:2]}])
    write_jsonl(tmp_path / "data" / "val.jsonl", conversations(2))
    write_jsonl(tmp_path / "data" / "test.jsonl", conversations(2))
    job = load_job(
        None,
        [
            "task.name=language_modeling",
            "model.name=gpt",
            "model.kwargs={depth: 1, hidden: 32, heads: 2}",
            "data.name=sft",
            f"data.path={tmp_path / 'data'}",
            f"data.tokenizer_path={folders['chatml']}",
            f"data.seq_len={SEQ_LEN}",
            "data.batch_size=2",
            "data.packing=false",
            "run.max_steps=1",
            "run.progress=off",
            f"run.storage_dir={tmp_path / 'runs'}",
            "strategy.name=single",
            "scaling.launcher=local",
            "scaling.num_workers=1",
        ],
    )
    train(job, WorkerContext())
    counted = read_summary(job.run_dir)["sft_rows"]
    assert set(counted) == {"train", "val", "test"}
    kept = ("rows", "samples", "cut", "too_long", "untrained")
    assert [counted["train"][k] for k in kept] == [5, 4, 1, 0, 1]
    assert [counted["val"][k] for k in kept] == [2, 2, 0, 0, 0]
    assert counted["train"]["trained"] < counted["train"]["tokens"]


def test_the_driver_checks_a_packed_batch_against_a_model(
    folders: dict[str, Path], mixed: Path
) -> None:
    """The interface end to end in the driver: gpt takes the packed inputs, the task counts
    only trained targets."""
    from convoy.preflight import preflight, sample_batch

    job = load_job(
        None,
        [
            "task.name=language_modeling",
            "model.name=gpt_tiny",
            "data.name=sft",
            f"data.path={mixed}",
            f"data.tokenizer_path={folders['llama3']}",
            f"data.seq_len={SEQ_LEN}",
            "data.batch_size=4",
        ],
    )
    assert preflight(job) is not None
    inputs, targets = sample_batch(job, load_splits(job.data))
    assert (
        inputs["input_ids"].shape == inputs["position_ids"].shape == targets.shape == (2, SEQ_LEN)
    )


# --- bad input: one line each -----------------------------------------------------------------


def one_line(folder: Path, path: Path, match: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError, match=match) as caught:
        cfg = sft_cfg(folder, path, **kwargs)
        check_dataset(cfg)
        load_splits(cfg)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_bad_input_is_one_line_before_any_worker(folders: dict[str, Path], tmp_path: Path) -> None:
    rows = conversations(6)
    neither = write_jsonl(tmp_path / "neither.jsonl", [*rows, {"question": "q", "answer": "a"}])
    one_line(
        folders["chatml"],
        neither,
        r"neither.jsonl line 7: a row needs 'messages', 'prompt' \+ 'completion', or 'text'; "
        r"this one has 'question', 'answer'$",
    )
    tool = [*CONVERSATION, {"role": "tool", "content": "42"}]
    role = write_jsonl(tmp_path / "role.jsonl", [*rows, {"messages": tool}])
    message = one_line(folders["llama3"], role, r"role.jsonl line 7: the chat template refuses it")
    assert "Unknown role: tool" in message
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    message = one_line(folders["bare"], plain, r"^data.chat_template: got None; the tokenizer in ")
    assert "has no chat template" in message
    # The same folder with a template named: fine.
    named = load_splits(sft_cfg(folders["bare"], plain, chat_template=CHATML_TAGGED))
    assert len(named.train)
    one_line(
        folders["chatml"],
        plain,
        r"^data.chat_template: got 'no-such.jinja'; neither",
        chat_template="no-such.jinja",
    )
    mixed_kinds = write_jsonl(
        tmp_path / "kinds.jsonl", [*rows, {"prompt": "q", "completion": CONVERSATION[2:3]}]
    )
    one_line(
        folders["chatml"],
        mixed_kinds,
        r"kinds.jsonl line 7: 'prompt' and 'completion' must be two strings or two message lists",
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    one_line(folders["chatml"], broken, r"broken.jsonl line 2 is not JSON")


def test_a_template_whose_renders_are_not_prefixes_is_refused(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    # Drops every assistant turn but the last (as templates that drop earlier reasoning do).
    dropping = (
        "{%- for m in messages %}{%- if m['role'] != 'assistant' or loop.last %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    plain = write_jsonl(tmp_path / "plain.jsonl", conversations(6))
    message = one_line(
        folders["chatml"],
        plain,
        r"^data.chat_template: got .*; its renders are not prefixes of each other",
        chat_template=dropping,
    )
    assert "is not the start of the whole conversation" in message
    # Training every token needs no prefix.
    assert len(
        load_splits(sft_cfg(folders["chatml"], plain, chat_template=dropping, train_on="all")).train
    )


def test_the_config_fills_and_refuses_what_sft_reads() -> None:
    assert DataConfig(name="sft").tokenizer == "model"
    with pytest.raises(ConfigError, match=r"^data.tokenizer: got 'bpe'; sft renders rows"):
        DataConfig(name="sft", tokenizer="bpe")
    with pytest.raises(ConfigError, match=r"^data.packing: got False; read only by data.name: sft"):
        DataConfig(name="text", packing=False)
    with pytest.raises(ConfigError, match=r"^data.tokenizer: got 'model'; reads the tokenizer"):
        load_job(None, ["data.name=sft", "model.name=gpt_tiny"])


# --- datasets folders and the ray_data loader's columns ---------------------------------------


def test_a_saved_dataset_reads_as_its_jsonl(folders: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    import datasets

    rows = conversations(10)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    saved = load_splits(sft_cfg(folders["chatml"], tmp_path / "saved"))
    lines = load_splits(sft_cfg(folders["chatml"], jsonl))
    for split in ("train", "val", "test"):
        a, b = getattr(saved, split), getattr(lines, split)
        assert len(a) == len(b)
        assert all(torch.equal(a[i][1], b[i][1]) for i in range(len(a)))


def test_ray_data_carries_dict_inputs_as_columns(folders: dict[str, Path], mixed: Path) -> None:
    """What the pipeline does to a chunk (no Ray: ``Preprocess`` is what ``map_batches``
    calls), and how a worker turns the columns back into the torch loader's batch."""
    from convoy.data.ray_data import _raw_columns, sample_spec
    from convoy.data.ray_data_stages import Preprocess
    from convoy.data.ray_data_worker import RayEvalBatches, _as_batch, cut_windows

    splits: Splits = load_splits(sft_cfg(folders["llama3"], mixed))
    rows = np.array([2, 0, 1])
    columns = Preprocess("tensor")(_raw_columns(splits.train, rows))
    assert set(columns) == {"index", "x.input_ids", "x.position_ids", "y"}
    expected = collate([splits.train[int(i)] for i in rows])
    inputs, targets = _as_batch({k: torch.from_numpy(v) for k, v in columns.items()}, None)
    assert torch.equal(targets, expected[1])
    assert all(torch.equal(inputs[k], expected[0][k]) for k in ("input_ids", "position_ids"))
    names = ("x.input_ids", "x.position_ids", "y", "index")
    (window,) = cut_windows(iter([columns]), [3], names)
    assert torch.equal(window[0], expected[0]["input_ids"]) and window[3].tolist() == rows.tolist()
    spec = sample_spec(splits)
    assert spec[0] == {"input_ids": ([SEQ_LEN], "int64"), "position_ids": ([SEQ_LEN], "int64")}
    empty = RayEvalBatches(None, 4, [0, 0], 0, spec)._empty()
    assert empty[0]["input_ids"].shape == (1, SEQ_LEN) and empty[1].shape == (1, SEQ_LEN)

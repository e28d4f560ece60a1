"""Rows of fine-tuning data as token ids, and which of them are trained (``data.name: sft``).

A row has one of three shapes, as TRL reads them: ``messages`` (a list of ``{role,
content}``), ``prompt`` + ``completion`` (two strings, or two message lists: the completion
follows the prompt), or ``text``.

Messages are rendered with the chat template (the tokenizer's own, or ``data.chat_template``)
and tokenized without special tokens added (the template writes them), as
``apply_chat_template`` does. Which tokens are trained comes from rendered prefixes, not from
tags in the template (``{% generation %}``, which most templates lack): for assistant message
``i``, the conversation before it is rendered with the generation prompt, and the
conversation through it without; the trained span is what the longer adds, less whitespace
after its last special token (ChatML's newline after ``<|im_end|>``): the turn's content and
its end-of-turn token. Each render must be the start of the next and of the whole
conversation's; a template that renders a turn otherwise once another follows (one that drops
earlier reasoning) is refused in one line, since no prefix says what a turn added.

Strings are tokenized as the tokenizer does by default (BOS where it adds one), the EOS token
appended where a completion or a text does not end with it; the completion is what the
prompt and completion add to the prompt alone, and a text is trained whole: TRL's SFT
preparation.

``data.train_on``: ``assistant`` trains every assistant turn (of a completion, where the row
has a prompt), ``last_assistant`` the last one, ``all`` every token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convoy.errors import ConfigError, ConvoyError
from convoy.imports import describe, missing_extra

ROW_SHAPES = "'messages', 'prompt' + 'completion', or 'text'"
TEMPLATE_MARKS = ("{%", "{{")
"""What makes ``data.chat_template`` a template rather than the name of a file."""


@dataclass(frozen=True)
class Encoded:
    """One row's token ids and, for each, whether it is a trained target (predicted from the
    token before it)."""

    ids: list[int]
    trained: list[bool]


def read_chat_template(value: str | None) -> str | None:
    """``data.chat_template`` as template text: itself where it holds Jinja, else the file it
    names; a ``ConfigError`` for a name that is no file."""
    if value is None or any(mark in value for mark in TEMPLATE_MARKS):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(
            "data.chat_template",
            value,
            "neither a Jinja template (no '{%' or '{{' in it) nor a file; give the template "
            "itself or a file that holds it",
        )
    return path.read_text(encoding="utf-8")


def load_chat_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer as ``transformers`` loads it (offline), or a ``ConfigError``."""
    try:
        import transformers  # the hf extra
    except ImportError:
        raise ConvoyError(missing_extra("data.name 'sft'", "transformers", "hf")) from None
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # a missing converter (sentencepiece, protobuf) among others
        raise ConfigError(
            "data.tokenizer_path", str(folder), f"transformers could not load it: {describe(exc)}"
        ) from None


def row_shape(row: Mapping[str, Any], where: str, path: str | None) -> str:
    """``messages``, ``prompt`` or ``text``: what the row holds (in that order of precedence),
    checked; a ``ConfigError`` on ``data.path`` naming the row otherwise."""
    if row.get("messages") is not None:
        _check_messages(row["messages"], "messages", where, path)
        return "messages"
    if row.get("prompt") is not None:
        prompt, completion = row["prompt"], row.get("completion")
        both_text = isinstance(prompt, str) and isinstance(completion, str)
        if not both_text:
            if not (isinstance(prompt, list) and isinstance(completion, list)):
                raise _bad_row(
                    path,
                    where,
                    "'prompt' and 'completion' must be two strings or two message lists; got "
                    f"{type(prompt).__name__} and {type(completion).__name__}",
                )
            _check_messages(prompt, "prompt", where, path)
            _check_messages(completion, "completion", where, path)
        return "prompt"
    if isinstance(row.get("text"), str):
        return "text"
    keys = ", ".join(repr(k) for k in row) or "none"
    raise _bad_row(path, where, f"a row needs {ROW_SHAPES}; this one has {keys}")


def _check_messages(messages: Any, key: str, where: str, path: str | None) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad_row(path, where, f"{key!r} must be a non-empty list of {{role, content}}")
    for number, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)):
            raise _bad_row(
                path, where, f"{key}[{number}] is not a {{role, content}} message: {message!r}"
            )


def _bad_row(path: str | None, where: str, why: str) -> ConfigError:
    return ConfigError("data.path", path, f"{where}: {why}")


class ChatEncoder:
    """Rows in, ``Encoded`` out, with the tokenizer of a model folder (see the module
    docstring). ``template``: the recipe's (``read_chat_template``), else the tokenizer's."""

    def __init__(
        self, folder: Path, template: str | None, train_on: str, path: str | None = None
    ) -> None:
        self.folder = folder
        self.tokenizer = load_chat_tokenizer(folder)
        self.template = template
        self.train_on = train_on
        self.path = path
        self.special = {
            int(i) for i, token in self.tokenizer.added_tokens_decoder.items() if token.special
        }
        self._resolved: str | None = None

    @property
    def pad_id(self) -> int:
        """What pads a row: the pad token, else EOS, else 0."""
        for token_id in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if isinstance(token_id, int):
                return token_id
        return 0

    def encode(self, row: Mapping[str, Any], where: str) -> Encoded:
        """The row's ids and trained tokens."""
        shape = row_shape(row, where, self.path)
        if shape == "text":
            return self._encode_strings(None, row["text"])
        if shape == "prompt" and isinstance(row["prompt"], str):
            return self._encode_strings(row["prompt"], row["completion"])
        tools = _tools(row, where, self.path)
        if shape == "messages":
            return self._encode_messages(list(row["messages"]), 0, where, tools)
        prompt = list(row["prompt"])
        return self._encode_messages([*prompt, *row["completion"]], len(prompt), where, tools)

    # --- strings ------------------------------------------------------------------------------

    def _encode_strings(self, prompt: str | None, completion: str) -> Encoded:
        """A text (``prompt`` None), or a prompt and its completion, with EOS appended."""
        eos = self.tokenizer.eos_token
        if isinstance(eos, str) and eos and not completion.endswith(eos):
            completion += eos
        if prompt is None:
            (ids,) = self._tokenize([completion], special=True)
            return Encoded(ids, [True] * len(ids))
        prompt_ids, ids = self._tokenize([prompt, prompt + completion], special=True)
        start = 0 if self.train_on == "all" else common_prefix(prompt_ids, ids)
        return Encoded(ids, [j >= start for j in range(len(ids))])

    # --- messages -----------------------------------------------------------------------------

    def _encode_messages(self, messages: list[Any], first: int, where: str, tools: Any) -> Encoded:
        """A conversation whose assistant turns from message ``first`` on may be trained."""
        whole = self._render(messages, False, where, tools)
        if self.train_on == "all":
            (ids,) = self._tokenize([whole], special=False)
            return Encoded(ids, [True] * len(ids))
        turns = [i for i in range(first, len(messages)) if messages[i].get("role") == "assistant"]
        if self.train_on == "last_assistant":
            turns = turns[-1:]
        texts = [whole]
        for i in turns:
            before = self._render(messages[:i], True, where, tools)
            through = self._render(messages[: i + 1], False, where, tools)
            self._check_prefixes(before, through, whole, i, where)
            texts += [before, through]
        ids, *prefixes = self._tokenize(texts, special=False)
        trained = [False] * len(ids)
        for before_ids, through_ids in zip(prefixes[::2], prefixes[1::2], strict=True):
            start, end = common_prefix(before_ids, ids), common_prefix(through_ids, ids)
            for j in range(start, self._end_of_turn(ids, start, end)):
                trained[j] = True
        return Encoded(ids, trained)

    def _end_of_turn(self, ids: list[int], start: int, end: int) -> int:
        """``end``, less the whitespace after the span's last special token (the template's
        separator after the end-of-turn token, not part of the turn)."""
        last = next((j for j in range(end - 1, start - 1, -1) if ids[j] in self.special), None)
        if last is None or last == end - 1:
            return end
        tail = self.tokenizer.decode(ids[last + 1 : end])
        return last + 1 if not tail.strip() else end

    def _check_prefixes(self, before: str, through: str, whole: str, i: int, where: str) -> None:
        if through.startswith(before) and whole.startswith(through):
            return
        what = (
            f"messages[:{i}] with the generation prompt is not the start of messages[:{i + 1}]"
            if not through.startswith(before)
            else f"messages[:{i + 1}] is not the start of the whole conversation"
        )
        raise ConfigError(
            *self._template_field(),
            f"its renders are not prefixes of each other ({where}: {what}), so no prefix says "
            "which tokens a turn adds; use a template that renders each turn the same once "
            "another follows, or data.train_on: all",
        )

    def _template_field(self) -> tuple[str, str]:
        """The field and value that name the template in use, for an error."""
        if self.template is not None:
            return "data.chat_template", _short(self.template)
        return "data.tokenizer_path", f"{self.folder} (its chat template)"

    def _render(self, messages: list[Any], generation: bool, where: str, tools: Any) -> str:
        """The conversation as the template writes it (the generation prompt after it)."""
        template = self._chat_template()
        try:
            if not messages:  # only the generation prompt: apply_chat_template refuses []
                return self._generation_prompt(template, tools)
            return str(
                self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    chat_template=template,
                    add_generation_prompt=generation,
                    tokenize=False,
                )
            )
        except Exception as exc:  # the template's own raise_exception, or a type it cannot use
            raise ConfigError(
                "data.path",
                self.path,
                f"{where}: the chat template refuses it: {describe(exc)}",
            ) from None

    def _generation_prompt(self, template: str, tools: Any) -> str:
        """What the template writes for an empty conversation with the generation prompt."""
        from transformers.utils.chat_template_utils import render_jinja_template  # hf extra

        rendered: Any = render_jinja_template(
            [[]],
            tools=tools,
            chat_template=template,
            add_generation_prompt=True,
            **self.tokenizer.special_tokens_map,
        )
        return str(rendered[0][0])

    def _chat_template(self) -> str:
        """The template text in use, resolved once; a ``ConfigError`` where there is none."""
        if self._resolved is None:
            try:
                self._resolved = str(self.tokenizer.get_chat_template(self.template))
            except ValueError as exc:  # none, or several and none named the default
                why = f" ({describe(exc)})" if self.tokenizer.chat_template else ""
                raise ConfigError(
                    "data.chat_template",
                    self.template,
                    f"the tokenizer in {self.folder} has no chat template to render message "
                    f"rows with{why}; name one: a Jinja string or a file",
                ) from None
        return self._resolved

    def _tokenize(self, texts: list[str], special: bool) -> list[list[int]]:
        encoded = self.tokenizer(texts, add_special_tokens=special)["input_ids"]
        return [list(map(int, ids)) for ids in encoded]


def _tools(row: Mapping[str, Any], where: str, path: str | None) -> Any:
    """A row's ``tools`` for the template (a list, or JSON of one), as TRL passes them."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise _bad_row(path, where, f"'tools' is not JSON: {exc}") from None
    return tools or None


def common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share."""
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


def _short(text: str, most: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= most else flat[: most - 3] + "..."

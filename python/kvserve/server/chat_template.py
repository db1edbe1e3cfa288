"""Chat templates: the checkpoint's `chat_template` (tokenizer_config.json, or a
chat_template.jinja beside it) rendered with jinja2 the way transformers' apply_chat_template
does: a sandboxed environment with trim_blocks and lstrip_blocks, `raise_exception`,
`strftime_now` and a `tojson` filter, the special tokens as variables."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that cannot render these messages (it raised, or it is malformed), or options
    it cannot render with; `field` names the request field at fault."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e
        self.special_tokens = special_tokens or {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path,
                       override: str | Path | None = None) -> "ChatTemplate | None":
        """The model's template, or `override` instead: template text when it holds Jinja
        delimiters ({{, {% or {#), else a file, which must exist (FileNotFoundError: a mistyped
        path never becomes the template). None when neither has one."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if model_dir.suffix == ".gguf" and model_dir.is_file():  # llama.cpp: in the metadata
            config = _gguf_tokenizer_config(model_dir)
        tokens = {name: _token_text(config.get(name))
                  for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if override is not None:
            text = str(override)
            if any(d in text for d in ("{{", "{%", "{#")):
                return cls(text, tokens)
            path = Path(override)
            if not path.is_file():
                raise FileNotFoundError(f"--chat-template {text!r}: no such file (template text "
                                        "holds {{ }} or {% %})")
            return cls(path.read_text(), tokens)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default")
        if source is None and (model_dir / "chat_template.jinja").is_file():
            source = (model_dir / "chat_template.jinja").read_text()
        return cls(source, tokens) if source else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, variables: dict | None = None) -> str:
        """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]).

        add_generation_prompt: end with the template's cue for the assistant's turn.
        continue_final_message: end the text right after the last message's content, with no
            end-of-turn mark, so that the model continues that message (a prefilled answer);
            not with add_generation_prompt.
        variables: more template variables (chat_template_kwargs: enable_thinking, ...); they
            may override the special tokens but not `messages` or `add_generation_prompt`.
        Raises ChatTemplateError when the template rejects the messages, or when the last
        message's text is not in what it writes (it cannot be continued)."""
        variables = variables or {}
        reserved = sorted({"messages", "add_generation_prompt"} & variables.keys())
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                    "chat_template_kwargs")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude "
                                    "each other: set add_generation_prompt to false",
                                    "continue_final_message")
        try:
            text = self.template.render({**self.special_tokens, **variables}, messages=messages,
                                        add_generation_prompt=add_generation_prompt)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError,
                IndexError, RecursionError) as e:  # what messages can make a template do
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(e).__name__}: {e}") from e
        return _cut_after_final_message(text, messages) if continue_final_message else text


def message_text(content) -> str | None:
    """A message's content as templates read it: a string, None, or OpenAI's content parts, of
    which only text ones ({"type": "text", "text": ...}) are supported, joined. ValueError for
    anything else."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = {part.get("type") for part in content} - {"text"}
        if kinds:
            raise ValueError(f"only text content parts are supported, got {sorted(map(str, kinds))}")
        texts = [part.get("text", "") for part in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise ValueError(f"a message's content must be a string or a list of text parts, got "
                     f"{type(content).__name__}")


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """`text` up to the end of the last message's content (transformers' continue_final_message:
    templates may strip the content's outer whitespace, so the stripped text is looked for and
    the content's trailing whitespace kept only where the template kept it)."""
    final = message_text(messages[-1].get("content")) if messages else None
    if not final or not final.strip():
        raise ChatTemplateError("continue_final_message needs a last message with text")
    start = text.rfind(final.strip())
    if start < 0:
        raise ChatTemplateError("continue_final_message: the last message's text is not in "
                                "what the chat template writes, so it cannot be continued")
    kept = final.lstrip()
    end = start + (len(kept) if text.startswith(kept, start) else len(final.strip()))
    return text[:end]


def _gguf_tokenizer_config(path: Path) -> dict:
    """A GGUF file's chat template (tokenizer.chat_template) and special tokens, as the
    tokenizer_config.json fields they stand for."""
    from kvserve.loader.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    tokens = checkpoint.field("tokenizer.ggml.tokens")
    config = {}
    template = checkpoint.optional_field("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = checkpoint.special_token_id(name)
        if token_id is not None:
            key = {"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"
            config[key] = tokens[token_id]
    return config

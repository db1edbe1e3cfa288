"""The choices of one API call as the engine's outputs build them: stream deltas as they come,
the whole choices at the end, token usage, and logprobs in the completions API's and the chat
API's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.server.protocol import APIError


@dataclass
class _Choice:
    text_parts: list[str] = field(default_factory=list)  # a whole response's, not a stream's
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # _C.TokenLogprobs per token (whole response)
    error: str | None = None
    started: bool = False  # a delta has been streamed (chat: the role went out)


class Choices:
    """Choice i * n + j is sample j of prompt i. Takes the engine's delta outputs
    (output_kind "delta"): a stream turns each into its events and keeps only counts; a whole
    response keeps the text pieces and logprobs for final(). Nothing is copied per step.

    echo (completions): the prompts, whose text each of their choices starts with (a stream's
    first delta), and whose tokens' logprobs (the engine's prompt_logprobs) come before the
    generated tokens' when logprobs are asked for."""

    def __init__(self, tokenizer, n: int, num_prompts: int, chat: bool, stream: bool,
                 echo: list | None = None):
        self.tokenizer, self.n, self.chat, self.stream = tokenizer, n, chat, stream
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        self.prompt_tokens = [0] * num_prompts
        self.want_logprobs = False
        self.echo = echo
        self.prompt_logprobs: list[list | None] = [None] * num_prompts

    def add(self, prompt: int, out) -> list[dict]:
        """Takes one delta RequestOutput of prompt `prompt`; returns the stream deltas it makes
        (streams only), one per choice that gained text or finished."""
        self.prompt_tokens[prompt] = len(out.prompt_token_ids)
        if out.prompt_logprobs is not None and self.prompt_logprobs[prompt] is None:
            self.prompt_logprobs[prompt] = self._prompt_entries(out)
        deltas = []
        for sample in out.outputs:
            index = prompt * self.n + sample.index
            c = self.choices[index]
            if c.finish_reason is not None:
                continue
            echo_text, echo_logprobs = "", []
            if self.echo is not None and not c.started:
                c.started = not self.stream  # a stream's first delta sets it below
                echo_text, echo_logprobs = self._echo(prompt)
            c.num_tokens += len(sample.new_token_ids)
            c.finish_reason = sample.finish_reason
            if sample.logprobs is not None:
                self.want_logprobs = True
            if sample.finish_reason == "error":
                c.error = out.error or "the engine failed on this request"
            if not self.stream:
                c.text_parts.extend((echo_text, sample.delta_text))
                c.logprobs.extend(echo_logprobs)
                if sample.logprobs:
                    c.logprobs.extend(sample.logprobs)
                continue
            if not (echo_text or sample.delta_text or sample.new_token_ids or
                    sample.finish_reason):
                continue
            logprobs = echo_logprobs + (sample.logprobs or [])
            deltas.append(self._delta(index, c, echo_text + sample.delta_text,
                                      logprobs if self.want_logprobs else None))
            c.started = True
        return deltas

    def _echo(self, prompt: int) -> tuple[str, list]:
        """A choice's echo: its prompt's text and the logprobs of its tokens (known once the
        engine scored the prompt: they come with the first generated token)."""
        text = self.echo[prompt]
        if not isinstance(text, str):
            text = self.tokenizer.decode(text, skip_special_tokens=False)
        return text, list(self.prompt_logprobs[prompt] or [])

    def _prompt_entries(self, out) -> list:
        """The prompt's tokens as logprobs entries: the first one's (token id, None, None)
        (nothing precedes it), then the engine's."""
        return [(out.prompt_token_ids[0], None, None), *out.prompt_logprobs[1:]]

    def error(self) -> str | None:
        """Why the engine failed a sample (its other requests went on), or None."""
        return next((c.error for c in self.choices if c.error is not None), None)

    def _delta(self, index: int, c: _Choice, text: str, logprobs) -> dict:
        finish = c.finish_reason
        if self.chat:
            delta = {"content": text}
            if not c.started:
                delta = {"role": "assistant", **delta}
            return {"index": index, "delta": delta, "logprobs": self._chat_logprobs(logprobs),
                    "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": self._completion_logprobs(logprobs),
                "finish_reason": finish}

    def final(self) -> list[dict]:
        """The whole choices of a response that is not streamed."""
        out = []
        for index, c in enumerate(self.choices):
            logprobs = c.logprobs if self.want_logprobs else None
            finish = c.finish_reason
            text = "".join(c.text_parts)
            if self.chat:
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": self._chat_logprobs(logprobs), "finish_reason": finish})
            else:
                out.append({"index": index, "text": text,
                            "logprobs": self._completion_logprobs(logprobs),
                            "finish_reason": finish})
        return out

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def raise_errors(self) -> None:
        """An APIError(500) when the engine failed a sample (its other requests went on)."""
        error = self.error()
        if error is not None:
            raise APIError(500, error, type="internal_error")

    # -------------------------------------------------------------------------- logprobs
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, logprobs) -> dict | None:
        """The completions API's: tokens, token_logprobs, top_logprobs, text_offset."""
        if logprobs is None:
            return None
        entries = [lp if isinstance(lp, tuple) else (lp.token_id, lp.logprob, lp.top)
                   for lp in logprobs]
        tokens = [self._token(token_id) for token_id, _, _ in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in entries],
                "top_logprobs": [None if top is None else {self._token(t): p for t, p in top}
                                 for _, _, top in entries],
                "text_offset": offsets}

    def _chat_logprobs(self, logprobs) -> dict | None:
        """The chat API's: content, one entry per token with its top alternatives."""
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in logprobs]}

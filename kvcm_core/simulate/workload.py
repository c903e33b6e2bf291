"""The seeded workload of ``kvcm simulate``: a trace of requests whose reuse is realistic.

Four kinds of request, mixed by weight:

- ``chat``: a multi-turn session. Turn ``k``'s prompt is turn ``k - 1``'s whole token
  sequence (its prompt and its answer) followed by a new user message, so every later turn
  can reuse everything the session computed so far. Sessions open with one of the tenant's
  shared system prompts.
- ``system``: a single request that opens with a shared system prompt (an API product with
  a fixed instruction block): only the system prompt is reusable.
- ``agent``: an agent loop. Step ``k``'s prompt is step ``k - 1``'s whole sequence followed
  by a tool's output, so prompts grow by hundreds of tokens a step.
- ``oneoff``: a prompt with nothing in common with anything else.

Multimodal prompts (``multimodal`` > 0, off by default): that fraction of the requests
carries an image segment at the start of its new prompt part (after the system prompt of a
session's first request): ``image_tokens`` positions that all carry the image's 32-byte
content digest (docs/semantics.md, "Multimodal inputs"). Images come from a pool of
``images`` per tenant, each with its own length, so requests of a tenant share images (and
the blocks holding them) the way repeated uploads of one picture do; later turns of a chat
or agent session carry their predecessors' images in their history. The images are drawn
from a random stream of their own (seeded from the seed), so a trace without them is
exactly the trace of the same seed before this knob existed.

A request that continues a session waits for its predecessor to finish, then for a think
time (a user typing, a tool running) in steps; other requests arrive on a Poisson process.
Each tenant is its own reuse scope, so identical tokens of two tenants never match.
Everything follows from the seed: the same settings and seed give the same trace.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from kvcm_core.errors import ConfigError
from kvcm_core.types import ReuseScope

__all__ = ["KINDS", "TraceRequest", "WorkloadConfig", "generate_trace", "kinds_of",
           "trace_summary"]

KINDS = ("chat", "system", "agent", "oneoff")

#: Upper bounds of the workload knobs: a session's turns are all drawn when it starts, and
#: every tenant's system prompts before the first request, so a value beyond these would
#: take longer than any run (or all memory) before ``requests`` could cut it short.
MAX_TURNS = 10_000
MAX_SYSTEM_PROMPTS = 100_000
#: Tokens of one message (a prompt part or an answer) the generator draws.
MAX_TOKENS = 1 << 20
_MAX_RANGE = {"chat_turns": MAX_TURNS, "agent_steps": MAX_TURNS,
              "think_steps": 1 << 30, "tool_steps": 1 << 30}
_RANGE_WHY = {"chat_turns": "turns of one session", "agent_steps": "steps of one session",
              "think_steps": "steps", "tool_steps": "steps"}
_MAX_COUNT = {"tenants": MAX_SYSTEM_PROMPTS, "system_prompts": MAX_SYSTEM_PROMPTS}
_COUNT_WHY = {"tenants": "each tenant's system prompts are made before the first request",
              "system_prompts": "they are made before the first request"}


def _range(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    ok = (isinstance(value, tuple) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
          and 0 <= value[0] <= value[1])
    if not ok:
        raise ConfigError(f"simulate.workload.{attr.name}", list(value)
                          if isinstance(value, tuple) else value,
                          "must be [low, high] with 0 <= low <= high")
    if value[1] > _MAX_RANGE.get(attr.name, MAX_TOKENS):
        raise ConfigError(f"simulate.workload.{attr.name}", list(value),
                          f"the high end must be at most {_MAX_RANGE.get(attr.name, MAX_TOKENS)}"
                          f" ({_RANGE_WHY.get(attr.name, 'tokens of one message')})")


def _to_range(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    return value


def _positive_int(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"simulate.workload.{attr.name}", value, "must be an int >= 1")
    top = _MAX_COUNT.get(attr.name)
    if top is not None and value > top:
        raise ConfigError(f"simulate.workload.{attr.name}", value,
                          f"must be at most {top} ({_COUNT_WHY[attr.name]})")


def _vocab(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31:
        raise ConfigError(f"simulate.workload.{attr.name}", value,
                          "must be an int in [1, 2**31] (token ids are int32)")


def _to_mix(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def _mix(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError("simulate.workload.mix", value,
                          f"must be a table of weights for {', '.join(KINDS)}")
    for k, w in value.items():
        if k not in KINDS:
            raise ConfigError(f"simulate.workload.mix.{k}", w,
                              f"unknown kind; known: {', '.join(KINDS)}")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) \
                or w < 0:
            raise ConfigError(f"simulate.workload.mix.{k}", w, "must be a finite weight >= 0")
    if sum(value.values()) <= 0:
        raise ConfigError("simulate.workload.mix", dict(value),
                          "needs at least one positive weight")


@attrs.frozen(kw_only=True)
class WorkloadConfig:
    """Workload knobs (the ``[simulate.workload]`` table). Ranges are ``[low, high]``
    inclusive, drawn uniformly; token counts are in tokens, times in engine steps.

    Attributes:
        requests: requests in the trace (sessions are cut short at this count).
        mix: relative weight of each kind of session (``chat``, ``system``, ``agent``,
            ``oneoff``).
        tenants: reuse scopes; each has its own system prompts.
        system_prompts: shared system prompts per tenant.
        system_prompt_tokens: length of a system prompt.
        chat_turns: turns in a chat session.
        user_tokens: a user message.
        answer_tokens: the output of a chat or system request.
        think_steps: steps between a chat turn's end and the next turn's arrival.
        agent_steps: steps in an agent loop.
        task_tokens: an agent's task description (after the system prompt).
        tool_tokens: a tool's output appended at each agent step.
        action_tokens: the output of an agent step (the next tool call).
        tool_steps: steps a tool runs between two agent steps.
        oneoff_tokens: a one-off prompt.
        arrival_rate: new sessions per step (Poisson).
        vocab: token ids are drawn from ``[0, vocab)``.
        duration: if set, sessions start only during the first ``duration`` steps (the
            trace may then hold fewer than ``requests`` requests).
        multimodal: the fraction of requests whose new prompt part opens with an image
            (0: none; see the module docstring).
        image_tokens: the positions one image takes (each image of the pool draws its own).
        images: distinct images per tenant.
    """

    requests: int = attrs.field(default=300, validator=_positive_int)
    mix: Mapping[str, float] = attrs.field(
        factory=lambda: {"chat": 0.3, "system": 0.3, "agent": 0.15, "oneoff": 0.25},
        converter=_to_mix, validator=_mix)
    tenants: int = attrs.field(default=2, validator=_positive_int)
    system_prompts: int = attrs.field(default=3, validator=_positive_int)
    system_prompt_tokens: tuple[int, int] = attrs.field(default=(200, 500), converter=_to_range,
                                                        validator=_range)
    chat_turns: tuple[int, int] = attrs.field(default=(2, 6), converter=_to_range,
                                              validator=_range)
    user_tokens: tuple[int, int] = attrs.field(default=(20, 120), converter=_to_range,
                                               validator=_range)
    answer_tokens: tuple[int, int] = attrs.field(default=(10, 60), converter=_to_range,
                                                 validator=_range)
    think_steps: tuple[int, int] = attrs.field(default=(5, 60), converter=_to_range,
                                               validator=_range)
    agent_steps: tuple[int, int] = attrs.field(default=(3, 8), converter=_to_range,
                                               validator=_range)
    task_tokens: tuple[int, int] = attrs.field(default=(50, 200), converter=_to_range,
                                               validator=_range)
    tool_tokens: tuple[int, int] = attrs.field(default=(80, 300), converter=_to_range,
                                               validator=_range)
    action_tokens: tuple[int, int] = attrs.field(default=(10, 40), converter=_to_range,
                                                 validator=_range)
    tool_steps: tuple[int, int] = attrs.field(default=(1, 10), converter=_to_range,
                                              validator=_range)
    oneoff_tokens: tuple[int, int] = attrs.field(default=(100, 600), converter=_to_range,
                                                 validator=_range)
    arrival_rate: float = attrs.field(default=0.5)
    vocab: int = attrs.field(default=32000, validator=_vocab)
    duration: int | None = attrs.field(default=None)
    multimodal: float = attrs.field(default=0.0)
    image_tokens: tuple[int, int] = attrs.field(default=(16, 64), converter=_to_range,
                                                validator=_range)
    images: int = attrs.field(default=4, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        rate = self.arrival_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) \
                or not math.isfinite(rate) or rate <= 0:
            raise ConfigError("simulate.workload.arrival_rate", rate,
                              "must be a finite number > 0")
        if self.duration is not None and (isinstance(self.duration, bool) or not isinstance(
                self.duration, int) or self.duration < 1):
            raise ConfigError("simulate.workload.duration", self.duration,
                              "must be an int >= 1")
        mm = self.multimodal
        if isinstance(mm, bool) or not isinstance(mm, int | float) or not math.isfinite(mm) \
                or not 0 <= mm <= 1:
            raise ConfigError("simulate.workload.multimodal", mm,
                              "must be a fraction of the requests in [0, 1]")
        if self.image_tokens[0] < 1:
            raise ConfigError("simulate.workload.image_tokens", list(self.image_tokens),
                              "the low end must be at least 1 (an image takes a position)")
        for name in ("chat_turns", "agent_steps"):
            if getattr(self, name)[0] < 1:
                raise ConfigError(f"simulate.workload.{name}", list(getattr(self, name)),
                                  "the low end must be at least 1 (a session has a request)")
        prompts = self.tenants * self.system_prompts
        if prompts > MAX_SYSTEM_PROMPTS:
            raise ConfigError("simulate.workload.system_prompts", self.system_prompts,
                              f"tenants x system_prompts = {prompts} must be at most "
                              f"{MAX_SYSTEM_PROMPTS} (every system prompt is made before "
                              "the first request)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkloadConfig:
        """Build from a TOML table; unknown keys are refused, listing the known ones."""
        names = {a.name for a in attrs.fields(cls)}
        for key in data:
            if key not in names:
                raise ConfigError(f"simulate.workload.{key}", data[key],
                                  f"unknown key; allowed: {', '.join(sorted(names))}")
        return cls(**dict(data))


@attrs.frozen(eq=False)
class TraceRequest:
    """One request of the trace.

    Attributes:
        id: ``"<kind><session>.<turn>"``.
        kind: one of :data:`KINDS` (``"trace"`` for a request read from a trace file).
        session: the session number (unique across kinds).
        turn: 0 for the first request of a session.
        scope: the tenant's reuse scope.
        tokens: prompt then output (int32).
        prompt_len: prompt tokens.
        arrival: the step it arrives at (first requests of sessions only, else ``None``).
        after: the id of the request it continues (it arrives ``delay`` steps after that
            one finishes), or ``None``.
        delay: think or tool time in steps.
        images: the image segments of the whole sequence, ``(start, length, digest)``:
            positions ``[start, start + length)`` carry the 32-byte ``digest``; ``tokens``
            holds the digest's first 4 bytes there (a little-endian int32, the tree's
            compact form), so that its blocks stay apart from plain ones.
    """

    id: str
    kind: str
    session: int
    turn: int
    scope: ReuseScope
    tokens: np.ndarray
    prompt_len: int
    arrival: int | None
    after: str | None
    delay: int
    images: tuple[tuple[int, int, bytes], ...] = ()

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    def items(self) -> Any:
        """What the engine passes the manager: ``tokens`` as they are without images, else
        a list of int token ids with each image's digest at its positions."""
        if not self.images:
            return self.tokens
        out: list[Any] = self.tokens.tolist()
        for start, length, digest in self.images:
            out[start:start + length] = [digest] * length
        return out


def generate_trace(cfg: WorkloadConfig, seed: int) -> list[TraceRequest]:
    """The trace for ``cfg`` and ``seed``, in generation order (sessions by arrival).

    Deterministic: a pure function of ``cfg`` and ``seed``.
    """
    rng = np.random.default_rng(seed)
    kinds = [k for k in KINDS if cfg.mix.get(k, 0) > 0]
    weights = np.array([float(cfg.mix[k]) for k in kinds])
    weights /= weights.sum()

    def draw(r: tuple[int, int]) -> int:
        return int(rng.integers(r[0], r[1] + 1))

    def toks(n: int) -> np.ndarray:
        return rng.integers(0, cfg.vocab, n, dtype=np.int32)

    scopes = [ReuseScope(salt=f"tenant{t}") for t in range(cfg.tenants)]
    system = [[toks(draw(cfg.system_prompt_tokens)) for _ in range(cfg.system_prompts)]
              for _ in scopes]
    # Images: a stream of their own, so that the rest of the trace does not depend on them.
    mm_rng = np.random.default_rng([seed, 0x6D6D]) if cfg.multimodal > 0 else None
    pool: list[list[tuple[int, bytes]]] = [] if mm_rng is None else [
        [(int(mm_rng.integers(cfg.image_tokens[0], cfg.image_tokens[1] + 1)),
          mm_rng.bytes(32)) for _ in range(cfg.images)] for _ in scopes]

    def image(tenant: int) -> tuple[int, bytes] | None:
        if mm_rng is None or mm_rng.random() >= cfg.multimodal:
            return None
        return pool[tenant][int(mm_rng.integers(cfg.images))]
    out: list[TraceRequest] = []
    clock = 0.0
    session = 0
    while len(out) < cfg.requests:
        clock += rng.exponential(1.0 / cfg.arrival_rate)
        if cfg.duration is not None and clock >= cfg.duration:
            break
        kind = kinds[int(rng.choice(len(kinds), p=weights))]
        tenant = int(rng.integers(len(scopes)))
        scope = scopes[tenant]
        prompt_of_tenant = system[tenant][int(rng.integers(cfg.system_prompts))]
        arrival: int | None = int(clock)
        after: str | None = None
        if kind == "oneoff":
            turns = [(toks(draw(cfg.oneoff_tokens)), draw(cfg.answer_tokens), 0)]
        elif kind == "system":
            turns = [(np.concatenate([prompt_of_tenant, toks(draw(cfg.user_tokens))]),
                      draw(cfg.answer_tokens), 0)]
        elif kind == "chat":
            n = draw(cfg.chat_turns)
            turns = [(np.concatenate([prompt_of_tenant, toks(draw(cfg.user_tokens))])
                      if t == 0 else toks(draw(cfg.user_tokens)),
                      draw(cfg.answer_tokens), draw(cfg.think_steps)) for t in range(n)]
        else:  # agent
            n = draw(cfg.agent_steps)
            turns = [(np.concatenate([prompt_of_tenant, toks(draw(cfg.task_tokens))])
                      if t == 0 else toks(draw(cfg.tool_tokens)),
                      draw(cfg.action_tokens), draw(cfg.tool_steps)) for t in range(n)]
        history = np.zeros(0, dtype=np.int32)
        images: tuple[tuple[int, int, bytes], ...] = ()
        for t, (new, answer, think) in enumerate(turns):
            if len(out) >= cfg.requests:
                break
            img = image(tenant)
            if img is not None:  # at the start of the new part, after a system prompt
                at = len(prompt_of_tenant) if t == 0 and kind in ("chat", "system", "agent") \
                    else 0
                length, digest = img
                ids = np.full(length, np.frombuffer(digest[:4], dtype="<i4")[0],
                              dtype=np.int32)
                images = (*images, (len(history) + at, length, digest))
                new = np.concatenate([new[:at], ids, new[at:]])
            prompt = np.concatenate([history, new])
            tokens = np.concatenate([prompt, toks(max(1, answer))])
            rid = f"{kind}{session}.{t}"
            out.append(TraceRequest(
                id=rid, kind=kind, session=session, turn=t, scope=scope, tokens=tokens,
                prompt_len=len(prompt), arrival=arrival if t == 0 else None,
                after=after if t else None, delay=think if t else 0, images=images))
            history = tokens
            after = rid
        session += 1
    return out


def kinds_of(trace: list[TraceRequest]) -> tuple[str, ...]:
    """The kinds a report breaks ``trace`` down by: :data:`KINDS` for the seeded workload,
    else the kinds present in order of first appearance (``("trace",)`` for a trace file)."""
    present = tuple(dict.fromkeys(r.kind for r in trace))
    return KINDS if set(present) <= set(KINDS) else present


def trace_summary(trace: list[TraceRequest]) -> dict[str, Any]:
    """Counts of a trace: requests and tokens, overall and by kind."""
    by_kind = Counter(r.kind for r in trace)
    return {
        "requests": len(trace),
        "sessions": len({r.session for r in trace}),
        "by_kind": {k: by_kind.get(k, 0) for k in kinds_of(trace)},
        "prompt_tokens": int(sum(r.prompt_len for r in trace)),
        "output_tokens": int(sum(r.output_len for r in trace)),
        "last_arrival": max((r.arrival for r in trace if r.arrival is not None), default=0),
        **({"multimodal_requests": sum(1 for r in trace if r.images),
            "image_positions": int(sum(n for r in trace for _, n, _ in r.images))}
           if any(r.images for r in trace) else {}),
    }

"""Structured outputs: what a request constrains its output to, and the grammar the worker enforces.

Grammars are llguidance's (the library vLLM's `guidance` backend uses; chosen over xgrammar by the
measurements in docs/benchmarks-history.md: the same per-step cost with 64 constrained sequences, a
first mask for a new schema in ~1.5 ms instead of ~5 ms (250 ms the first time), and one 3 MB wheel
with no dependencies where xgrammar pulls triton). Admission compiles each kind to llguidance's
format once (`compile_grammar`), which also validates it; the compiled text travels with the sequence,
so a worker that learns the sequence again (recompute, takeover) rebuilds the same matcher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# The kinds a request may set, in the order they are named in messages.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one kind: json (a JSON schema as JSON text), json_object, regex, choice or grammar.

    disable_any_whitespace: JSON kinds only; the JSON text has no whitespace but the separators ", "
    and ": " (otherwise any whitespace may appear between its tokens, as vLLM's default).
    compiled: the llguidance grammar, set by admission (compile_grammar); "" before.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    compiled: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got {got}.")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string.")

    def kinds(self) -> list[str]:
        """The kinds set (exactly one once validated)."""
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`, validated; ValueError with llguidance's message when invalid."""
    import llguidance  # noqa: PLC0415 - only requests with structured outputs need it

    matcher = llguidance.LLMatcher
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else '{"type": "object"}'
        options: dict[str, object] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.disable_any_whitespace:
            options |= {"item_separator": ", ", "key_separator": ": "}
        try:
            grammar = matcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        except ValueError as exc:  # not JSON text
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {exc}") from exc
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
    elif kind == "choice":
        # Each choice as a Lark string literal (JSON string syntax is a subset Lark accepts).
        grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice or []))
    else:
        try:
            grammar = llguidance.grammar_from("grammar", params.grammar)  # type: ignore[arg-type]
        except ValueError as exc:  # GBNF that does not convert to Lark
            raise ValueError(f"structured_outputs.grammar: {exc}") from exc
    error = matcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured_outputs.{kind} is not valid: {error.strip()}")
    return grammar

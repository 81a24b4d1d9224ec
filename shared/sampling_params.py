"""Sampling parameters, validated at admission with vLLM's messages.

The same dataclass is built from the public API's protobuf at the scheduler and
from the step plan at the worker, so both sides agree on defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.structured_outputs import StructuredOutputsParams

# Temperatures below this are treated as greedy, as in vLLM: dividing logits by
# a tiny temperature overflows and the result is argmax anyway.
_GREEDY_EPS = 1e-5
# Top log-probabilities returned per token at most (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    max_tokens: number of tokens to generate at most (None = up to max_model_len).
    temperature: in [0, 2]; 0 means greedy decoding.
    top_p: nucleus sampling mass in (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 disables.
    seed: per-request seed; the request's samples are reproducible whatever shares the batch.
    stop: strings that end generation; they are not included in the output text.
    stop_token_ids: token ids that end generation (besides EOS).
    ignore_eos: keep generating after EOS (benchmarks).
    n: number of sequences returned for the prompt (parallel sampling).
    best_of: sequences generated, of which the n most likely (cumulative logprob) are returned; None = n.
    logprobs: number of most likely tokens whose log-probabilities come with each generated token.
    use_beam_search: beam search of width best_of (temperature 0); the n best finished beams are returned.
    length_penalty: beam scores are cumulative logprob / generated_length ** length_penalty.
    early_stopping: beam search stop rule, as in transformers: True stops once best_of beams finished,
        False stops when no running beam can beat the finished ones by a heuristic, "never" only
        when none can in the best case.
    min_p: keep tokens with probability >= min_p * the top token's probability; 0 disables.
    presence_penalty: subtracted from the logits of tokens present in the output, in [-2, 2].
    frequency_penalty: subtracted per occurrence in the output, in [-2, 2].
    repetition_penalty: tokens in prompt or output get positive logits divided by it, negative
        ones multiplied (transformers' rule); 1 disables.
    min_tokens: EOS, stop tokens and stop strings cannot end the sequence before this many tokens.
    prompt_logprobs: top log-probabilities returned for each prompt token (None: no prompt logprobs).
    include_stop_str_in_output: keep the stop string (or the EOS / stop token's text) in the text.
    skip_special_tokens: leave special tokens out of the output text.
    logit_bias: token id -> value added to its logit before sampling, in [-100, 100] (OpenAI's).
    allowed_token_ids: only these tokens may be sampled (vLLM's); empty allows every token.
    bad_words: words never generated (vLLM's): the token that would complete one is masked.
    bad_words_token_ids: the bad words as token sequences (set by admission with the model's tokenizer).
    structured_outputs: the grammar the output must follow (JSON schema, regex, choice, ...); None: free text.
    spaces_between_special_tokens: with a slow tokenizer that has added tokens, a space between each added
        token and the text around it in the output text (vLLM's); fast tokenizers decode as they do.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._verify_counts()
        self._verify_logit_processing()
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}.")
        if self.top_k == -1:
            self.top_k = 0
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()

    def _verify_counts(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of is None:
            self.best_of = self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        self.check_min_tokens()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}.")

    def _verify_logit_processing(self) -> None:
        # Range checks are written so that NaN (every comparison False) and inf are rejected too.
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not (0.0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:  # OpenAI's bound (vLLM accepts any non-negative value)
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (all tokens), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        bad_bias = {t: b for t, b in self.logit_bias.items() if t < 0 or not -100.0 <= b <= 100.0}
        if bad_bias:
            raise ValueError(f"logit_bias needs token ids >= 0 and values in [-100, 100], got {bad_bias}.")
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be non-negative, got {self.allowed_token_ids}.")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty words.")

    def _verify_beam_search(self) -> None:
        if self.best_of < 2:
            raise ValueError(f"best_of must be greater than 1 when using beam search. Got {self.best_of}.")
        if not self.greedy:
            raise ValueError("temperature must be 0 when using beam search.")
        if self.top_p < 1.0:
            raise ValueError("top_p must be 1 when using beam search.")
        if self.top_k != 0:
            raise ValueError("top_k must be 0 or -1 (all tokens) when using beam search.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False, or 'never', got {self.early_stopping}.")
        if not (-float("inf") < self.length_penalty < float("inf")):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}.")
        if self.stop:
            # Candidates would need detokenizing every step; token-level stops are supported.
            raise ValueError("stop strings are not supported with beam search; use stop_token_ids.")
        # Beams are scored with the raw distribution's candidates: these knobs would have no effect.
        if self.min_p != 0.0:
            raise ValueError("min_p must be 0 when using beam search.")
        if self.has_penalties:
            raise ValueError(
                "presence_penalty, frequency_penalty and repetition_penalty are not supported with beam search."
            )
        if self.min_tokens:
            raise ValueError("min_tokens is not supported with beam search.")
        if self.logit_bias or self.allowed_token_ids or self.bad_words:
            raise ValueError("logit_bias, allowed_token_ids and bad_words are not supported with beam search.")
        if self.structured_outputs is not None:
            raise ValueError("structured outputs are not supported with beam search.")

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError("early_stopping is not effective and must be False when not using beam search.")
        if self.length_penalty != 1.0:
            raise ValueError(
                "length_penalty is not effective and must be the default value of 1.0 when not using beam search."
            )
        if self.best_of > 1 and self.greedy:
            # Several greedy sequences would all be identical. Named as the caller set it: n (best_of defaults to n).
            name, value = ("n", self.n) if self.n > 1 else ("best_of", self.best_of)
            raise ValueError(f"{name} must be 1 when using greedy sampling (temperature 0), got {value}.")

    def check_min_tokens(self) -> None:
        """min_tokens <= max_tokens (admission calls it again once max_tokens=None is resolved)."""
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def shifts_logits(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad words change the logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def num_sequences(self) -> int:
        """Sequence ids a request needs: best_of, or with beam search 2 * best_of.

        A beam search holds at most best_of running beams and best_of finished
        hypotheses at once; ids of dropped beams are reused within the request.
        """
        width = self.best_of or self.n
        return 2 * width if self.use_beam_search else width

    @property
    def num_beam_candidates(self) -> int:
        """Candidates per beam the worker returns: (2 + number of stop tokens) * width, 0 without beam search.

        Enough that, after the candidates ending a beam are set aside, best_of
        running ones always remain (as transformers keeps (1 + #eos) * width).
        """
        if not self.use_beam_search:
            return 0
        return (2 + len(self.stop_token_ids)) * (self.best_of or self.n)

    @property
    def num_top_logprobs(self) -> int:
        """Most likely tokens the worker reports per sampled token (logprobs or beam candidates)."""
        return max(self.logprobs or 0, self.num_beam_candidates)

    @property
    def streams_outputs(self) -> bool:
        """Whether deltas stream as they are generated (not when the best n are chosen at the end)."""
        return self.num_sequences == self.n and not self.use_beam_search

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS


def seed_for_sequence(seed: int, index: int) -> int:
    """The seed of the request's `index`-th sequence: independent streams, the first keeps `seed`."""
    if index == 0:
        return seed
    # splitmix64-style mixing keeps the streams of nearby seeds and indices unrelated.
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF

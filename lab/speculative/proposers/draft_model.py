"""Draft-model drafting: a separate causal LM sharing the target's tokenizer drafts the chain (Leviathan et al. 2023).

`ModelProposer` drafts x_1..x_gamma autoregressively from any `LoadedModel`, with its own KV cache: each
proposal first rolls the cache back to the longest common prefix with the committed tokens (`lab.engine.runtime.crop`)
and feeds the missing tokens in one forward, then runs gamma - 1 decode steps. q_i = the draft's distribution
after the same logits processors as the target (`lab.engine.sampling.process_logits` and `target_distribution`), and
x_i is drawn from q_i with the run's generator (Leviathan et al. 2023, Alg. 1, lines 1-3); in greedy mode x_i is
the argmax, a deterministic draft, so q_draft is None (q one-hot at x_i). The last drafted token is never fed
to the drafter; the next proposal feeds it if kept. For SSD a context can ask for the top fanout + 1 tokens of
each q_i (`Draft.top_ids`, ranking the guessed outcomes) and stop early (`should_stop`, polled between forwards).
`load_draft_model` loads a drafter by id or path through `lab.engine.models.load_model`
on the target's device and dtype and refuses one whose tokenizer differs (`check_same_tokenizer`).
Not covered: drafters with another tokenizer (universal assisted generation).
"""

from __future__ import annotations

import torch

from lab.engine import runtime
from lab.engine.models import DTYPES, LoadedModel, load_model
from lab.engine.sampling import process_logits, sample, target_distribution
from lab.params import InputError
from lab.speculative.draft import Draft, DraftContext, Verified, common_prefix_length

SAMPLE_TEXT = "Speculative decoding, 2023: the quick brown fox (x=42) jumps! ¿Qué tal? 東京 ✓\n\tdef f(): return 1"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def _tokenizer_size(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    return len(tokenizer) if hasattr(tokenizer, "__len__") else loaded.vocab_size


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise InputError unless the drafter's tokenizer matches the target's: vocabulary size, special ids and
    the encoding of a sample text (speculative decoding compares token ids, so they must mean the same)."""
    problems = []
    if _tokenizer_size(target) != _tokenizer_size(draft):
        problems.append(f"vocabulary size {_tokenizer_size(draft)} vs {_tokenizer_size(target)}")
    for name in SPECIAL_IDS:
        mine, theirs = getattr(draft.tokenizer, name, None), getattr(target.tokenizer, name, None)
        if mine != theirs:
            problems.append(f"{name} {mine} vs {theirs}")
    if draft.tokenizer(SAMPLE_TEXT)["input_ids"] != target.tokenizer(SAMPLE_TEXT)["input_ids"]:
        problems.append("a sample text encodes to different token ids")
    if problems:
        raise InputError(
            f"The draft model {draft.spec!r} does not share the target {target.spec!r}'s tokenizer "
            f"({'; '.join(problems)}). Pick a drafter from the same model family (e.g. SmolLM2-135M for "
            f"SmolLM2-1.7B), or use drafter=prompt-lookup or self-draft."
        )


def load_draft_model(target: LoadedModel, spec: str) -> LoadedModel:
    """Load `spec` on the target's device and dtype (the model cache returns the target itself for its own
    spec) and check its tokenizer; raises InputError or ModelLoadError."""
    dtype = next((name for name, value in DTYPES.items() if value == target.dtype), "auto")
    draft = load_model(spec, device=target.device.type, dtype=dtype)
    check_same_tokenizer(target, draft)
    return draft


def _fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Cut or -inf-pad the drafter's logits [V_d] to the target's vocabulary size (padded LM heads differ)."""
    if logits.shape[-1] == size:
        return logits
    if logits.shape[-1] > size:
        return logits[..., :size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))


def _candidates(processed: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k most likely tokens of softmax(processed logits) [V] and their probabilities (in greedy mode the
    logits are unscaled, i.e. temperature 1: used for ranking SSD's outcomes only)."""
    top_logits, top_ids = torch.topk(processed, min(k, processed.shape[-1]))
    probs = (top_logits - torch.logsumexp(processed, dim=-1)).exp()
    return top_ids.tolist(), [round(p, 6) for p in probs.tolist()]


class ModelProposer:
    """Autoregressive drafting with a causal LM and its own KV cache (Leviathan et al. 2023, Alg. 1, M_q)."""

    feature_layers = ()

    def __init__(self, draft: LoadedModel, vocab_size: int, name: str = "model") -> None:
        self.draft = draft
        self.vocab_size = vocab_size
        self.name = name
        self.state = runtime.new_state(draft)
        self._kept_length = 0  # cache length before the tokens of the last draft were fed

    @property
    def forwards(self) -> int:
        return self.state.forwards

    def _sync(self, tokens: list[int]) -> torch.Tensor:
        """Roll the cache back to its common prefix with `tokens`, feed the rest, return the next logits [V]."""
        common = min(common_prefix_length(self.state.tokens, tokens), len(tokens) - 1)
        if common < self.state.length:
            runtime.crop(self.state, common)
        return runtime.forward(self.state, tokens[common:], last_only=True).logits[-1]

    def propose(self, context: DraftContext) -> Draft:
        """Draw x_i ~ q_i for i = 1..gamma (stopping after EOS or when `context.should_stop()`); q_i after the
        target's processors. With `context.fanout` the top fanout + 1 tokens of each q_i are reported (SSD)."""
        if context.gamma <= 0:
            self._kept_length = self.state.length
            return Draft([])
        logits = self._sync(context.tokens)  # [V_d]
        self._kept_length = self.state.length
        history, drafted, rows, top_ids, top_probs = list(context.tokens), [], [], [], []
        for i in range(context.gamma):
            processed = process_logits(_fit_vocab(logits, self.vocab_size), context.config, history)  # [V]
            if context.config.greedy:  # argmax drafting is deterministic: q = one-hot at x_i, i.e. q_draft None
                token = int(processed.argmax())
            else:
                rows.append(target_distribution(processed, context.config))  # q_i [V]
                token = sample(rows[-1], context.generator)
            if context.fanout:
                ids, probs = _candidates(processed, context.fanout + 1)
                top_ids.append(ids)
                top_probs.append(probs)
            drafted.append(token)
            history.append(token)
            stop = context.should_stop is not None and context.should_stop()
            if token in context.eos_token_ids or i + 1 == context.gamma or stop:
                break
            logits = runtime.decode_step(self.state, token).logits[-1]  # [V_d]
        q = torch.stack(rows) if rows else None  # q: [n, V] or None (greedy)
        return Draft(drafted, q=q, top_ids=top_ids or None, top_probs=top_probs or None)

    def accept(self, verified: Verified) -> None:
        """Keep the committed prefix and the accepted draft tokens; the rest of the cache is dropped."""
        keep = min(self._kept_length + verified.n_accepted, self.state.length)
        if keep < self.state.length:
            runtime.crop(self.state, keep)

    def close(self) -> None:
        self.state.cache.reset()
        self.state.tokens.clear()

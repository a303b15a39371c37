"""Speculative decoding: a small draft model proposes K tokens, the target checks all of them in one forward over K+1
positions, and the output follows exactly the target's distribution (greedy: exactly the target's greedy tokens).

One round: draft_steps() (K one-token draft forwards, proposals written on the device), verify()
(one target forward over [token, d_1..d_K], acceptance with fixed-shape ops, the next round's token
and position), then SpeculativeGenerator.generate()'s ONE host sync (`result.tolist()`). Both
functions take only static buffers and the models: each compiles with fullgraph=True, and mode
"graphs" captures each as one CUDA graph, so the draft's K steps replay as ONE graph.

The acceptance rule (Leviathan et al. 2023, Chen et al. 2023): with p the target's and q the
draft's distribution at a position (both from common.logits_to_probs, same temperature, top-k,
top-p), proposal d is accepted with probability min(1, p(d)/q(d)); at the first rejection the
token is drawn from normalize(max(0, p - q)); when all K are accepted a bonus token is drawn from
p at the last position. Every draw is argmax(probs / Exponential(1)), never torch.multinomial.
"""
import torch

from common import (Sampling, Step, UsageError, check_graphs, check_memory, draw, logits_to_probs, prefill_attention,
                    sample, synchronize)
from model import Transformer, read_config
from quantize import load
from tokenizer import load_tokenizer


# A verification of K + 1 tokens costs more than a step (on the CPU ~1.5 steps at K = 2, 1.3-1.4 for Llama-2-7B on
# an H100), and a proposal that follows a match of one token is rarely accepted (default model, CPU: 0.1-0.3 tokens
# a round in open-ended text; none at all without a match): prompt lookup proposes where the last LOOKUP_MIN_MATCH
# tokens occurred before, and otherwise runs a plain step.
LOOKUP_MIN_MATCH = 2


def draft_steps(draft: Transformer, token: torch.Tensor, pos: torch.Tensor, draft_tokens: torch.Tensor,
                draft_probs: torch.Tensor, s: Sampling) -> None:
    """K draft steps, in place on static buffers: token [1, 1] the token at pos [1]; writes the proposals into
    draft_tokens [1, K] (d_i at position pos + i) and, when sampling, their draft distributions into draft_probs
    [1, K, V]. K is draft_tokens' (static) width, so the Python loop unrolls when compiled: each step is a plain
    one-token decode step of the draft, and the loop costs what K of them do. (The draft's cache already holds every
    token before pos: verify feeds it d_K, the one proposal it never read.)"""
    K = draft_tokens.shape[1]
    for i in range(K):
        logits = draft(token if i == 0 else draft_tokens[:, i - 1:i], pos + i)[:, -1]  # [1, V]
        if s.temperature == 0:
            t = logits.argmax(-1)
        else:
            q = logits_to_probs(logits, s)  # [1, V]
            draft_probs[:, i].copy_(q)
            t = draw(q)
        draft_tokens[:, i].copy_(t)


def verify(target: Transformer, draft: Transformer, token: torch.Tensor, pos: torch.Tensor,
           draft_tokens: torch.Tensor, draft_probs: torch.Tensor, result: torch.Tensor, s: Sampling) -> None:
    """The target's check of K proposals in one forward over K+1 positions, in place: result [K+2] gets n (proposals
    accepted, 0..K) then K+1 tokens of which the first n+1 are the new ones (n accepted proposals, then the corrected
    or bonus token); token and pos are advanced to the last new token and its position.

    It also feeds the draft its last proposal d_K at pos + K: the draft produced d_K but never read
    it, and when all K are accepted the next round starts at pos + K + 1, so the draft's cache must
    hold it (otherwise the first draft step would have to read two tokens, a slower shape). When
    fewer are accepted, that cache entry lies beyond the next position and is written again."""
    K = draft_tokens.shape[1]
    logits = target(torch.cat([token, draft_tokens], dim=1), pos + torch.arange(K + 1, device=pos.device))[0]
    draft(draft_tokens[:, K - 1:], pos + K)  # (its logits unused)
    accept(logits, draft_tokens[0], draft_probs[0], token, pos, result, s)


def accept(logits: torch.Tensor, d: torch.Tensor, q: torch.Tensor, token: torch.Tensor, pos: torch.Tensor,
           result: torch.Tensor, s: Sampling) -> None:
    """The acceptance of proposals d [K] given the target's logits [K+1, V] at pos..pos+K and the proposals'
    distributions q [K, V] (one-hot for a deterministic draft); fills result, advances token and pos (verify)."""
    K = d.shape[0]
    offsets = torch.arange(K + 1, device=pos.device)
    if s.temperature == 0:
        best = logits.argmax(-1)  # [K+1]
        n = (d == best[:K]).long().cumprod(0).sum(0, keepdim=True)  # [1]: accepted before the first mismatch
        out = best  # accepted proposals equal the target's argmax; best[n] is the correction/bonus
    else:
        p = logits_to_probs(logits, s)  # [K+1, V]
        p_d = p[:K].gather(-1, d[:, None])[:, 0]
        q_d = q.gather(-1, d[:, None])[:, 0]
        # u < p/q without a division (q_d > 0: d was drawn from q); p >= q always accepts.
        n = (torch.rand(K, device=p.device) * q_d < p_d).long().cumprod(0).sum(0, keepdim=True)
        # Row i < K: the residual max(0, p - q) for a rejection at i; row K: the bonus from p.
        resid = torch.cat([(p[:K] - q).clamp_min(0), p[K:]], dim=0)
        # An all-zero residual means p == q there, when rejection has probability 0; guard against
        # rounding anyway by falling back to p.
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)
        drawn = draw(resid)  # [K+1]: a candidate at every row; only row n is used
        out = torch.where(offsets < n, torch.cat([d, drawn[K:]]), drawn)  # (K = 0: a plain step's draw)
    seq = torch.cat([token[0], out])  # [K+2]: the token at pos, then pos+1..pos+K+1
    token.copy_(seq.gather(0, n + 1).view(1, 1))
    pos.add_(n + 1)
    result.copy_(torch.cat([n, out]))


def match(history: torch.Tensor, pos: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup's match, on the device: history [L] the tokens so far (up to pos [1]) -> where what followed the
    latest earlier occurrence of the last n tokens starts, for the longest n <= N that occurs, and that n [1] (0:
    none, and the start 0)."""
    at, start, length = torch.arange(history.shape[0], device=pos.device), torch.zeros_like(pos), torch.zeros_like(pos)
    for n in range(1, N + 1):  # (a longer match, where there is one, overrides)
        last = history[(pos - n + 1 + at[:n]).clamp(min=0)]  # [n]
        hit = (history.unfold(0, n, 1) == last).all(-1) & (at[n - 1:] < pos) & (pos >= n - 1)  # [L-n+1]
        end = torch.where(hit, at[n - 1:], -1).amax()  # where the latest occurrence ends
        start, length = torch.where(end >= 0, end + 1, start), torch.where(end >= 0, n, length)
    return start, length


def propose(history: torch.Tensor, pos: torch.Tensor, K: int, N: int) -> torch.Tensor:
    """The K tokens [K] from match()'s start on, repeating from there past pos (no match: the first K)."""
    start = match(history, pos, N)[0]
    return history[start + torch.arange(K, device=pos.device) % (pos + 1 - start)]  # (a period of the pattern)


def lookup_verify(target: Transformer, token: torch.Tensor, pos: torch.Tensor, history: torch.Tensor,
                  result: torch.Tensor, s: Sampling, ngram: int) -> None:
    """A prompt-lookup round, in place: propose() from history [1, L], then verify's check of the K proposals
    (K + 3 = result's width; K = 0: a plain step) against a deterministic draft (accepted with the target's
    probability of each, else a draw from the target without it); the new tokens also go into history, and the
    next proposal's match length (match()) into result's last place."""
    K, start = result.shape[0] - 3, pos.clone()
    d = propose(history[0], pos, K, ngram) if K else token[0, :0]
    logits = target(torch.cat([token, d[None]], dim=1), pos + torch.arange(K + 1, device=pos.device))[0]
    q = None if s.temperature == 0 else torch.zeros_like(logits[:K], dtype=torch.float).scatter_(1, d[:, None], 1.0)
    accept(logits, d, q, token, pos, result[:K + 2], s)
    history[0].index_copy_(0, (start + 1 + torch.arange(K + 1, device=pos.device)).clamp(max=history.shape[1] - 1),
                           result[1:K + 2])
    result[K + 2:].copy_(match(history[0], pos, ngram)[1])


class SpeculativeGenerator:
    """Batch-1 speculative decoding of `target` with `draft`, on static device buffers; draft=None: prompt
    lookup (the proposals are n-grams of the prompt and output so far, up to `ngram` tokens long)."""

    def __init__(self, target: Transformer, draft: Transformer | None, sampling: Sampling, k: int,
                 mode: str = "eager", ngram: int = 3, ahead_of_time=None):
        if draft is target:
            raise ValueError("the draft must be a separate model (it has its own KV cache); "
                             "use copy.deepcopy to draft with the target itself")
        if draft is not None and draft.args.vocab_size != target.args.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.args.vocab_size}) differs from the "
                             f"target's ({target.args.vocab_size})")
        if k < 1 or ngram < 1:
            raise ValueError(f"k and ngram must be >= 1 (got {k}, {ngram})")
        self.target, self.draft, self.sampling, self.k, self.ngram = target, draft, sampling, k, ngram
        self.device, self.mode = target.tok_embeddings.weight.device, mode
        if mode.startswith("aot") and (draft is not None or ahead_of_time is None):
            raise ValueError("mode aot is prompt lookup's, with ahead_of_time (the CPU's gdkernels.aot.AotStep)")
        # graphs: one graph for the K draft steps, one for the verification (common.Step: warm-up timed apart); the
        # CPU's prompt lookup: built ahead of time, as plain decode is (the caller hands over the kernels' builder)
        step = lambda f, **kw: Step(ahead_of_time(f, build=mode == "aot") if mode.startswith("aot") else f, mode,
                                    self.device, **kw)
        self.draft_fn, self.verify_fn = step(draft_steps), step(verify if draft is not None else lookup_verify)
        self.plain_fn = step(lookup_verify, dynamic=False)  # prompt lookup proposing nothing
        new = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=self.device)  # noqa: E731
        self.token, self.pos, self.draft_tokens = new(1, 1), new(1), new(1, k)
        self.draft_probs = new(1, k, target.args.vocab_size, dtype=torch.float32)
        self.result, self.plain_result = new(k + 2 + (draft is None)), new(3)  # (prompt lookup's: the next match)
        self.history = new(1, 0)  # prompt lookup's tokens so far (reserve)
        self.draft_fn.static(self.token, self.pos, self.draft_tokens, self.draft_probs, self.result, self.plain_result)
        self.reset_stats()

    @property
    def warm(self) -> bool:
        return (self.draft_fn if self.draft is not None else self.plain_fn).warm() and self.verify_fn.warm()

    @property
    def compile_s(self) -> float:
        return self.draft_fn.compile_s + self.verify_fn.compile_s + self.plain_fn.compile_s

    def draft_loop(self) -> None:
        """The K draft steps of a round (one graph replay in mode graphs), on the static buffers."""
        self.draft_fn(self.draft, self.token, self.pos, self.draft_tokens, self.draft_probs, self.sampling)

    def verify_round(self) -> None:
        """The target's check of the proposals (one graph replay in mode graphs); prompt lookup: the proposal too."""
        if self.draft is None:
            return self.verify_fn(self.target, self.token, self.pos, self.history, self.result, self.sampling,
                                  self.ngram)
        self.verify_fn(self.target, self.draft, self.token, self.pos, self.draft_tokens, self.draft_probs,
                       self.result, self.sampling)

    def check_graphs(self, start: int) -> dict:
        """The draft loop (K steps) and the verification must each be one graph replay (common.check_graphs).
        Runs a round's worth of positions from `start`, which a later round rewrites."""
        while not self.warm:  # (warm, compiled and recorded, even after a short generation)
            self.pos.fill_(start)
            self.round()
            if self.draft is None:
                self.plain_step()
        self.pos.fill_(start)
        random = self.sampling.temperature > 0
        out = {"verify": check_graphs(self.verify_round, self.device, 1, "verification", random=random)}
        first, what = (self.draft_loop, "draft_loop") if self.draft is not None else (self.plain_step, "plain_step")
        out[what] = check_graphs(first, self.device, 4, what.replace("_", " "), random=random)
        return out

    def plain_step(self) -> list[int]:
        """Prompt lookup's step that proposes nothing -> [0, the new token, the next proposal's match length]."""
        self.plain_fn(self.target, self.token, self.pos, self.history, self.plain_result, self.sampling, self.ngram)
        return self.plain_result.tolist()

    def round(self) -> list[int]:
        """A round -> [n accepted, the n + 1 new tokens, ..., (prompt lookup:) the next proposal's match length]."""
        if self.draft is not None:
            self.draft_loop()
        self.verify_round()
        return self.result.tolist()

    def reset_stats(self) -> None:
        self.rounds = self.plain_steps = 0  # (plain steps: prompt lookup's rounds that proposed nothing)
        self.histogram = [0] * (self.k + 1)  # rounds that accepted 0..K proposals
        self.round_tokens = 0  # tokens the rounds produced (n + 1 each), before truncation

    @property
    def mean_tokens_per_round(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    def reserve(self, length: int) -> None:
        self.target.setup_caches(1, length)
        if self.draft is not None:
            self.draft.setup_caches(1, length)
        elif self.history.shape[1] < length:  # new buffers: the verification warms up (records) again
            self.history = self.verify_fn.static(torch.zeros(1, length, dtype=torch.long, device=self.device))[0]
            self.verify_fn.reset()
            self.plain_fn.reset()

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids=frozenset()):
        """Yield lists of new tokens (the first from prefill, then one list per round). Tokens
        after a stop token are dropped and at most max_new_tokens are yielded in all."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            return
        self.reset_stats()
        S = len(prompt)
        # The target writes up to pos + K with pos <= S + max_new_tokens - 2; one more for margin.
        self.reserve(S + max_new_tokens + self.k + 1)
        idx = torch.tensor([prompt], dtype=torch.long, device=self.device)
        positions = torch.arange(S, device=self.device)
        with prefill_attention():
            first = sample(self.target(idx, positions)[:, -1], self.sampling)  # [1]: the prefill
            if self.draft is not None:
                self.draft(idx, positions)  # fills the draft's cache
        if self.draft is None:
            self.history[0, :S + 1] = torch.cat([idx[0], first])
        self.token[0, 0] = first[0]
        self.pos.fill_(S)
        t = int(first[0])  # a sync outside the rounds
        yield [t]
        if t in stop_ids:
            return
        # matched: the n-gram the next proposal would follow (prompt lookup; 0: none); each step reads it back
        emitted, matched = 1, int(match(self.history[0], self.pos, self.ngram)[1]) if self.draft is None else 0
        while emitted < max_new_tokens:
            if self.draft is None and matched < min(LOOKUP_MIN_MATCH, self.ngram):
                _, t, matched = self.plain_step()  # (the sync: on the CPU free, on CUDA after one graph replay)
                new = [t]
                self.plain_steps += 1
            else:
                r = self.round()  # the one host sync of the round
                n, matched = r[0], r[-1]
                self.rounds += 1
                self.histogram[n] += 1
                self.round_tokens += n + 1
                new = r[1:n + 2][:max_new_tokens - emitted]
            stop = next((j for j, t in enumerate(new) if t in stop_ids), None)
            if stop is not None:
                yield new[:stop + 1]
                return
            emitted += len(new)
            yield new
        synchronize(self.device)


def load_draft(path, target: Transformer, tokenizer, device, dtype, length: int) -> Transformer:
    """The draft checkpoint at `path`, checked to share the target's tokenizer, loaded."""
    config, draft_tokenizer = read_config(path), load_tokenizer(path)
    probe = "Speculative decoding: 12345, naïve café, 東京, 🚀\n  def f(x): return x"
    if (config["args"].vocab_size != target.args.vocab_size or draft_tokenizer.eos_ids != tokenizer.eos_ids
            or draft_tokenizer.encode(probe) != tokenizer.encode(probe)):
        raise UsageError(f"the draft {path} does not share the target's tokenizer")
    check_memory(config, path, 1, length, dtype, device)
    return load(path, device=device, dtype=dtype)

"""Speculative decoding: a small draft model proposes K tokens, the target checks all of them in
one forward over K+1 positions, and the output follows exactly the target's distribution
(greedy: exactly the target's greedy tokens).

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

import gdkernels
from common import Sampling, Step, UsageError, check_graphs, check_memory, draw, logits_to_probs, sample, synchronize
from model import Transformer, read_config
from quantize import load
from tokenizer import load_tokenizer


def draft_steps(draft: Transformer, token: torch.Tensor, pos: torch.Tensor, draft_tokens: torch.Tensor,
                draft_probs: torch.Tensor, s: Sampling) -> None:
    """K draft steps, in place on static buffers: token [1, 1] the token at pos [1]; writes the
    proposals into draft_tokens [1, K] (d_i at position pos + i) and, when sampling, their draft
    distributions into draft_probs [1, K, V]. K is draft_tokens' (static) width, so the Python loop
    unrolls when compiled: each step is a plain one-token decode step of the draft, and the loop
    costs what K of them do. (The draft's cache already holds every token before pos: verify
    feeds it d_K, the one proposal it never read.)"""
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
    """The target's check of K proposals in one forward over K+1 positions, in place:
    result [K+2] gets n (proposals accepted, 0..K) then K+1 tokens of which the first n+1 are the
    new ones (n accepted proposals, then the corrected or bonus token); token and pos are advanced
    to the last new token and its position.

    It also feeds the draft its last proposal d_K at pos + K: the draft produced d_K but never read
    it, and when all K are accepted the next round starts at pos + K + 1, so the draft's cache must
    hold it (otherwise the first draft step would have to read two tokens, a slower shape). When
    fewer are accepted, that cache entry lies beyond the next position and is written again."""
    K = draft_tokens.shape[1]
    offsets = torch.arange(K + 1, device=pos.device)
    logits = target(torch.cat([token, draft_tokens], dim=1), pos + offsets)[0]  # [K+1, V]
    draft(draft_tokens[:, K - 1:], pos + K)  # (its logits unused)
    d = draft_tokens[0]  # [K]
    if s.temperature == 0:
        best = logits.argmax(-1)  # [K+1]
        accept = d == best[:K]
        n = accept.long().cumprod(0).sum(0, keepdim=True)  # [1]: accepted before the first mismatch
        out = best  # accepted proposals equal the target's argmax; best[n] is the correction/bonus
    else:
        p = logits_to_probs(logits, s)  # [K+1, V]
        q = draft_probs[0]  # [K, V]
        p_d = p[:K].gather(-1, d[:, None])[:, 0]
        q_d = q.gather(-1, d[:, None])[:, 0]
        # u < p/q without a division (q_d > 0: d was drawn from q); p >= q always accepts.
        accept = torch.rand(K, device=p.device) * q_d < p_d
        n = accept.long().cumprod(0).sum(0, keepdim=True)
        # Row i < K: the residual max(0, p - q) for a rejection at i; row K: the bonus from p.
        resid = torch.cat([(p[:K] - q).clamp_min(0), p[K:]], dim=0)
        # An all-zero residual means p == q there, when rejection has probability 0; guard against
        # rounding anyway by falling back to p.
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)
        drawn = draw(resid)  # [K+1]: a candidate at every row; only row n is used
        out = torch.where(offsets < n, torch.cat([d, d[:1]]), drawn)
    seq = torch.cat([token[0], out])  # [K+2]: the token at pos, then pos+1..pos+K+1
    token.copy_(seq.gather(0, n + 1).view(1, 1))
    pos.add_(n + 1)
    result.copy_(torch.cat([n, out]))


class SpeculativeGenerator:
    """Batch-1 speculative decoding of `target` with `draft`, on static device buffers."""

    def __init__(self, target: Transformer, draft: Transformer, sampling: Sampling, k: int,
                 mode: str = "eager"):
        if draft is target:
            raise ValueError("the draft must be a separate model (it has its own KV cache); "
                             "use copy.deepcopy to draft with the target itself")
        if draft.args.vocab_size != target.args.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.args.vocab_size}) differs from the "
                             f"target's ({target.args.vocab_size})")
        if k < 1:
            raise ValueError(f"k must be >= 1 (got {k})")
        self.target, self.draft, self.sampling, self.k = target, draft, sampling, k
        self.device = target.tok_embeddings.weight.device
        self.mode = mode
        if mode != "eager":
            gdkernels.register_fallbacks()
        # graphs: one graph for the K draft steps, one for the verification (common.Step: warm-up timed apart)
        self.draft_fn, self.verify_fn = (Step(f, mode, self.device) for f in (draft_steps, verify))
        dev, V = self.device, target.args.vocab_size
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.draft_tokens = torch.zeros(1, k, dtype=torch.long, device=dev)
        self.draft_probs = torch.zeros(1, k, V, dtype=torch.float32, device=dev)
        self.result = torch.zeros(k + 2, dtype=torch.long, device=dev)
        self.draft_fn.static(self.token, self.pos, self.draft_tokens, self.draft_probs, self.result)
        self.reset_stats()

    @property
    def warm(self) -> bool:
        return self.draft_fn.warm() and self.verify_fn.warm()

    @property
    def compile_s(self) -> float:
        return self.draft_fn.compile_s + self.verify_fn.compile_s

    def draft_loop(self) -> None:
        """The K draft steps of a round (one graph replay in mode graphs), on the static buffers."""
        self.draft_fn(self.draft, self.token, self.pos, self.draft_tokens, self.draft_probs,
                      self.sampling)

    def verify_round(self) -> None:
        """The target's verification of the proposals (one graph replay in mode graphs)."""
        self.verify_fn(self.target, self.draft, self.token, self.pos, self.draft_tokens, self.draft_probs,
                       self.result, self.sampling)

    def check_graphs(self, start: int) -> dict:
        """The draft loop (K steps) and the verification must each be one graph replay (common.check_graphs).
        Runs a round's worth of positions from `start`, which a later round rewrites."""
        while not self.warm:  # (warm, compiled and recorded, even after a short generation)
            self.pos.fill_(start)
            self.draft_loop()
            self.verify_round()
        self.pos.fill_(start)
        random = self.sampling.temperature > 0
        return {"draft_loop": check_graphs(self.draft_loop, self.device, 4, "the draft loop", random=random),
                "verify": check_graphs(self.verify_round, self.device, 1, "verification", random=random)}

    def reset_stats(self) -> None:
        self.rounds = 0
        self.histogram = [0] * (self.k + 1)  # rounds that accepted 0..K proposals
        self.round_tokens = 0  # tokens the rounds produced (n + 1 each), before truncation

    @property
    def mean_tokens_per_round(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    def reserve(self, length: int) -> None:
        self.target.setup_caches(1, length)
        self.draft.setup_caches(1, length)

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
        first = sample(self.target(idx, positions)[:, -1], self.sampling)  # [1]: the prefill
        self.draft(idx, positions)  # fills the draft's cache
        self.token[0, 0] = first[0]
        self.pos.fill_(S)
        t = int(first[0])  # a sync outside the rounds
        yield [t]
        if t in stop_ids:
            return
        emitted = 1
        while emitted < max_new_tokens:
            self.draft_loop()
            self.verify_round()
            r = self.result.tolist()  # the one host sync of the round
            n = r[0]
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


def load_draft(path, target: Transformer, tokenizer, device, dtype, length: int, use_kernels: bool) -> Transformer:
    """The draft checkpoint at `path`, checked to share the target's tokenizer, loaded (with the kernels)."""
    config, draft_tokenizer = read_config(path), load_tokenizer(path)
    probe = "Speculative decoding: 12345, naïve café, 東京, 🚀\n  def f(x): return x"
    if (config["args"].vocab_size != target.args.vocab_size or draft_tokenizer.eos_ids != tokenizer.eos_ids
            or draft_tokenizer.encode(probe) != tokenizer.encode(probe)):
        raise UsageError(f"the draft {path} does not share the target's tokenizer")
    check_memory(config, path, 1, length, dtype, device)
    draft = load(path, device=device, dtype=dtype)
    if use_kernels:
        gdkernels.apply(draft)
    return draft

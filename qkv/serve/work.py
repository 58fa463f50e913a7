"""What a request asks of ``qkv serve``'s decoder (``Settings``) and what it costs (``Work``), with the
prices of the units of work: one unit is one decoder step of one output token (``qkv.serve.batcher``
counts a request's units; the server refuses a request over ``--max-request-work``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from qkv.infer.glossary import Glossary
from qkv.infer.search import DecodeConfig

# Units of work per output token of sampling (a token of beam search costs the beam size). Each step
# draws from the whole vocabulary: top_k selects from it, top_p sorts it. benchmarks/sampling_cost.py
# timed each, per unit, against greedy search on one CPU thread: plain sampling 1.00-1.45x, top_k
# 1.06-2.40x, top_p 1.37-12.56x (the most: small models with large vocabularies); beam 16 0.90-1.17x.
SAMPLED_TOKEN_WORK = 1
TOP_K_TOKEN_WORK = 2
TOP_P_TOKEN_WORK = 12
# Units of work per source token, for each pass of the encoder over it. Timed on one thread against
# greedy steps in batches of 32, a source token took 0.3 to 0.6 of a step (d_model 32 to 128, sources
# of 100 to 1,000 tokens); counted in matrix-product FLOPs, 0.8 (the tiny preset): the encoder has
# no cross-attention and no output layer.
SOURCE_TOKEN_WORK = 1
# Attention weights computed per unit of work, with "attention": the pass that captures them
# materializes every weight of the encoder's self-attention (layers x heads x S x S), the decoder's
# (x T x T) and the cross-attention (x T x S). Timed as above (d_model 32 to 128, sources of 100 to
# 1,000 tokens), that pass took 56 to 2,300 units; charged S + T units and one per 1,000 weights, it
# pays 2.5 to 14 times that: on the dear side, which errs towards refusing.
ATTENTION_WEIGHTS_PER_UNIT = 1000
# Decomposed vector elements per unit, with "attention" or "confidence": that pass writes each
# attention block's output as one vector per input (qkv.inspect.contributions), layers x queries x
# keys x d_model elements, and each text costs CONTRIBUTION_TEXT_WORK more for its bookkeeping.
# Timed on one thread on the Multi30k preset's model (d_model 128) against greedy steps in batches of
# 32, the confidence of one text of 19, 73 and 217 tokens (translated into as many) took 86, 192 and
# 772 units; its decomposition alone is charged as below 91, 1,048 and 9,075 (the search's output
# limit, not the translation's length, makes the charge larger still): on the dear side, and in step
# with the pass's matrix-product FLOPs (tests/e2e/test_server_decoding.py).
CONTRIBUTION_ELEMENTS_PER_UNIT = 8_000
CONTRIBUTION_TEXT_WORK = 20
# A glossary's own work, charged from its size and the texts' before any of it is done (issue 72, #11):
# compiling its source terms as patterns (GLOSSARY_ENTRY_WORK an entry and 1 unit per
# GLOSSARY_CHARS_PER_UNIT characters of its source terms) and looking for each entry in each text twice,
# once for the charge of the constrained search and once by the translation (1 unit per
# GLOSSARY_MATCHES_PER_UNIT entries x text characters). benchmarks/glossary_cost.py timed them in units of
# greedy work on the random tiny model (32 texts), on this project's 2-core host while it was loaded:
# compiling an entry of one word 1.3 to 5 units, one of 190 characters 14 to 20 (about 1 unit per 10 of
# its characters); two looks 1 unit per 380 to 1,500 entries x text characters (near misses, entries that
# share all but their last word with the text, are the dearest). An earlier run of the same timings gave
# 3 to 4.6, about 26, and 1 per 295. Charged as below, 5 units an entry of one word, 28 one of 190
# characters and 1 per 250: the dear side. Issue 72's hostile request, 500 entries of 190 characters
# against 32 texts of 1,000 (138 KB; /health waited 6.5 s), comes to about 78,000 units: a 422.
GLOSSARY_ENTRY_WORK = 4
GLOSSARY_CHARS_PER_UNIT = 8
GLOSSARY_MATCHES_PER_UNIT = 250


@dataclass(frozen=True)
class Settings:
    """What a request asks of the decoder, as validated by the server."""

    beam_size: int = 5
    max_length: int | None = None
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    n_best: int | None = None  # None: the answer has no n-best lists (and no scores)
    attention: bool = False
    confidence: bool = False
    glossary: Glossary | None = None  # compared by identity: a request with a glossary shares its batch with no other

    def search(self) -> Settings:
        """Without what changes only the answer: requests with equal searches share a batch."""
        return replace(self, n_best=None, attention=False, confidence=False)

    def decode_config(self, n_best: int = 1) -> DecodeConfig:
        length = {} if self.max_length is None else {"max_len_a": 0.0, "max_len_b": self.max_length}
        return DecodeConfig(
            beam_size=self.beam_size, n_best=n_best, sampling=self.sampling, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, seed=self.seed, **length,
        )

    @property
    def scored_apart(self) -> bool:
        """Greedy search and sampling give no scores: asked for, they take one teacher-forced pass more."""
        return self.n_best is not None and self.beam_size == 1

    def work_per_token(self) -> int:
        if not self.sampling:
            per_token = self.beam_size
        elif self.top_p < 1:
            per_token = TOP_P_TOKEN_WORK
        else:
            per_token = TOP_K_TOKEN_WORK if self.top_k else SAMPLED_TOKEN_WORK
        return per_token + (1 if self.scored_apart else 0)


@dataclass(frozen=True)
class Work:
    """What a request costs, in units of one decoder step of one output token (module docstring)."""

    source: int  # source tokens x the encoder's passes over them
    output: int  # output tokens x their price, with the attention pass's tokens; 1 per empty text
    attention: int  # the attention weights the attention pass computes / ATTENTION_WEIGHTS_PER_UNIT
    contributions: int = 0  # the decomposed elements / CONTRIBUTION_ELEMENTS_PER_UNIT, and each text's share
    glossary: int = 0  # compiling the glossary's terms and looking for them in the texts (GLOSSARY_* above)

    @property
    def total(self) -> int:
        return self.source + self.output + self.attention + self.contributions + self.glossary
